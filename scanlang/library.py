"""A small library of declared monoids. Each one is proved in tests/test_library.py."""
from __future__ import annotations

from .monoid import monoid


@monoid(fields=("a", "b"), identity=(1, 0), name="Affine")
def Affine(x, y):
    """h -> a*h + b maps; combine = y after x: (y.a*x.a, y.a*x.b + y.b). Linear recurrences h_t = a_t h_{t-1} + b_t."""
    return y.a * x.a, y.a * x.b + y.b


@monoid(fields=("a", "b", "c", "d"), identity=(1, 0, 0, 1), scale=lambda m: m.a + m.d, name="Mobius")
def Mobius(x, y):
    """2x2 matrices [[a, b], [c, d]] acting as s -> (a s + b)/(c s + d); combine = Y @ X, trace-normalised."""
    return (y.a * x.a + y.b * x.c, y.a * x.b + y.b * x.d,
            y.c * x.a + y.d * x.c, y.c * x.b + y.d * x.d)
