"""The delta-rule chunk family on Triton: one template, hooks rendered per family member.

    template.py   the kernel module's source with two slots (hooks, unrolled prep kernel)
    template_bwd.py  the backward kernels' part of that source
    codegen.py    renders a `scanlang.delta.DeltaRule` into it, writes it to the cache dir, imports it
    ops.py        launches: torch.library ops `scanlang::delta_chunk_fwd/bwd` with autograd (and an eager path
                  without the dispatcher), per-shape plans, decode path
    bench.py      GPU benchmark and parity check against flash-linear-attention
    spills.py     offline registers / spills / shared memory per kernel (ptxas, no GPU)
    host.py       host (CPU) time per call with the launches no-op'd (Triton's interpreter, no GPU)
"""
