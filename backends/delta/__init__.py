"""The delta-rule chunk family on Triton: one template, hooks rendered per family member.

    template.py   the kernel module's source with two slots (hooks, unrolled prep kernel)
    template_bwd.py  the backward kernels' part of that source
    codegen.py    renders a `scanlang.delta.DeltaRule` into it, writes it to the cache dir, imports it
    ops.py        launches: torch.library ops `scanlang::delta_chunk_fwd/bwd` with autograd (and an eager path
                  without the dispatcher), per-shape plans, decode path

Its tools live in scanlang/tools (the library never imports them): bench_delta.py (GPU benchmark and
parity check against flash-linear-attention), offline_compile.py --workload delta (registers, spills,
shared memory and SASS per kernel, compiled offline with ptxas, no GPU), host_profile.py --workload
delta (host time per call).
"""
