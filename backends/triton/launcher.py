"""Relaunching a compiled kernel without Triton's per-call binding (the eager path's host time).

`kernel[grid](*args, **meta)` re-derives on every call what Triton specialises a kernel on: each
argument's type, each integer's size class (== 1, divisible by 16, 32/64-bit) and each tensor's
alignment (data pointer divisible by 16), then hashes them to find the compiled kernel. For our
~40-argument kernels that binding is a large share of a mixer call's host time (`python -m
scanlang.tools.host_profile`; the figures: BENCHMARKS_HISTORY.md, "Notes moved from code comments").

Within one launch plan (`plan.ForwardPlan` / `plan.BackwardPlan`) every integer argument and every
dtype is fixed by the plan's key (shapes, strides, dtypes, config), and the constexprs by `meta`. The
only thing left that can change Triton's choice is the alignment of the tensors' data pointers. So
the compiled kernel of a launch whose pointers were all 16-byte aligned is cached per (plan,
config) and, while they stay aligned, called through its launcher directly:
`CompiledKernel.run(grid, stream, function, metadata, hooks, *all arguments)`, what
`JITFunction.run` itself calls after binding. The first launch of each entry goes through
`kernel[grid]` (compiling if needed) and returns the compiled kernel that is kept. Triton's launch
hooks go along only when one is set (see `_hooks`).

Not used under Triton's interpreter (no compiled kernel) nor while tracing (the registered ops
launch through `wrap_triton`).
"""
from __future__ import annotations

import functools
import operator

import torch
from triton import knobs

# Kept on the plan object itself (a plain attribute: cheaper per launch than a weak-keyed table, and
# gone with the plan): {config: (compiled kernel of an all-aligned launch, a getter of the tensor
# arguments, argument values to append from meta, the 3-d grid)}
_ATTRIBUTE = "_launcher_compiled"


def _bound_tail(kernel, n_positional: int, meta: dict) -> tuple | None:
    """The values of the kernel's parameters after the positional ones, in signature order (meta
    or the parameter's default); None when one is missing (then the slow path decides)."""
    tail = []
    for param in kernel.params[n_positional:]:
        if param.name in meta:
            tail.append(meta[param.name])
        elif param.has_default:
            tail.append(param.default)
        else:
            return None
    return tuple(tail)


def launch(plan, cfg, kernel, grid, args, meta: dict) -> None:
    """`kernel[grid](*args, **meta)`, relaunching the compiled kernel directly when this plan and
    config launched it before with every pointer 16-byte aligned (the common case; other alignments
    always take Triton's path, which specialises on them)."""
    per_plan = getattr(plan, _ATTRIBUTE, None)
    if per_plan is None:
        per_plan = {}
        setattr(plan, _ATTRIBUTE, per_plan)
    hit = per_plan.get(cfg)
    if hit is not None:
        compiled, tensors_of, tail, grid3 = hit
        if _aligned(tensors_of(args)):
            stream = _stream(args[0].device)
            values = (*args, *tail)
            enter, exit_ = _hooks()
            metadata = None if enter is None else compiled.launch_metadata(grid3, stream, *values)
            compiled.run(grid3[0], grid3[1], grid3[2], stream, compiled.function, compiled.packed_metadata,
                         metadata, enter, exit_, *values)
            return
    compiled = kernel[grid](*args, **meta)
    if hit is not None or compiled is None or not hasattr(compiled, "packed_metadata"):
        return   # misaligned, or the interpreter (no compiled-kernel handle): Triton's path every time
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    if not positions:
        return
    # the tensor arguments as a tuple (the first one twice: itemgetter of one position returns the item)
    tensors_of = operator.itemgetter(*positions, positions[0])
    tail = _bound_tail(kernel, len(args), meta)
    if tail is not None and _aligned(tensors_of(args)):
        per_plan[cfg] = (compiled, tensors_of, tail, (*grid, 1, 1)[:3])


def _aligned(tensors) -> bool:
    """Whether every tensor's data pointer is 16-byte aligned (one pass in C: or of the pointers)."""
    return not functools.reduce(operator.or_, map(torch.Tensor.data_ptr, tensors)) & 15


def _stream(device: torch.device) -> int:
    """The current raw CUDA stream of `device`, as Triton's driver reads it (0 off CUDA)."""
    return torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0


def _hooks():
    """Triton's launch enter and exit hooks, each None when no hook is set. Triton >= 3.5 holds them
    as hook chains that are never None; passing empty ones would still build launch metadata (a
    dict) and make two Python calls per launch, which `kernel[grid]` pays but a relaunch need not."""
    enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return (enter if getattr(enter, "calls", enter) else None), (exit_ if getattr(exit_, "calls", exit_) else None)
