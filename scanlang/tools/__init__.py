"""Tools built on the library (benchmarks); the library imports none of them."""
