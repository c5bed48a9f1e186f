"""The delta-rule chunk family on Triton: one kernel module per family member, built on the kernel IR.

    parts.py        small statement builders and the helper functions every module holds (mm, rnd, guards)
    kernels_fwd.py  the forward kernels (delta_prep unrolled per chunk size, w/u, the state pass, the token loop)
    kernels_bwd.py  the backward kernels
    codegen.py      the hooks of a `scanlang.delta.DeltaRule` from its sympy expressions, the module assembled
                    and printed, written to the cache dir and imported
    ops.py        launches: torch.library ops `scanlang::delta_chunk_fwd/bwd` with autograd (and an eager path
                  without the dispatcher), per-shape plans, decode path

Its tools live in scanlang/tools (the library never imports them): bench_delta.py (GPU benchmark and
parity check against flash-linear-attention), offline_compile.py --workload delta (registers, spills,
shared memory and SASS per kernel, compiled offline with ptxas, no GPU), host_profile.py --workload
delta (host time per call).
"""
