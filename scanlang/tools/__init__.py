"""Tools built on the library; the library imports none of them (tests/test_layout.py checks it), and
`scanlang bench` imports bench_scan only when it runs.

    bench_scan.py        `scanlang bench`: the generated scans against the anchors on one GPU
    bench_delta.py       the delta-rule kernels against flash-linear-attention on one GPU
    bench_kalman.py      the Kalman filter implementations against the authors' code on one GPU
    cp_bench.py          context parallelism: time per rank over world sizes (torchrun)
    offline_compile.py   registers, spills, shared memory and SASS of the generated kernels (no GPU)
    host_profile.py      host (CPU) time per call of the scan and delta-rule ops

Each runs as `python -m scanlang.tools.NAME --help`; BENCHMARKS.md has the commands and the numbers.
"""
