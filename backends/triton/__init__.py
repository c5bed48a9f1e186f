"""The Triton backend: generated fused scan kernels and their generated backward.

    scan(monoid, elems, dim, reverse, initial, out_dtype) -> tuple[Tensor]   (sl.scan's backend call)
    render(ir, adjoint) -> str, load(source) -> module                       (pipeline.render / load)
    launch(program, inputs, initial, dim, reverse, fp64, cu_seqlens, is_eager) (pipeline.launch)
    check(tensors, arg), eager(tensors), prefers_lanes(lanes)                 (sl.mixer, recipes)

Registered as "triton" (`scanlang.backend`); the core reaches it only by that name. `scan` takes
the pipeline's route (program_key -> build -> launch); the kernels run as the `torch.library` ops
`scanlang::scan_fwd` / `scanlang::scan_bwd` (see `ops.py`), so autograd and
`torch.compile(fullgraph=True)` see them as ordinary ops; plain eager calls run the same code
without the dispatcher, with their launch plans cached (`plan.py`).
"""
from __future__ import annotations

import sys

import torch

from scanlang import backend, pipeline, settings

from . import ops, runtime
from .codegen_module import render
from .runtime import load


def eager(tensors) -> bool:
    """Whether these tensors may skip the registered ops (`ops.eager`: plain tensors, no tracing)."""
    return ops.eager(tensors)


def launch(program, inputs, initial, dim: int, reverse: bool, fp64: bool, cu_seqlens=None, is_eager=None):
    """Run `program`'s forward with autograd attached (`ops.launch`)."""
    return ops.launch(program, inputs, initial, dim, reverse, fp64, cu_seqlens, is_eager=is_eager)


def check(tensors, arg: str = "inputs") -> None:
    """The backend's device and dtype checks: floating tensors on one device, CUDA (or the interpreter)."""
    _check(tensors, None, arg=arg)


def _check(elems, initial, arg="elems"):
    tensors = list(elems) + list(initial or ())
    device = None
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{arg}: expected tensors, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{arg}: dtype {t.dtype} is not supported by the Triton backend; use float16, "
                            "bfloat16, float32 or float64")
        if device is None:
            device = t.device
        elif t.device != device:
            devices = sorted({str(t.device) for t in tensors})
            raise ValueError(f"{arg}: tensors are on different devices {devices}; use one device")
    if device.type != "cuda" and not settings.triton_interpret():
        raise ValueError(f"{arg}: the Triton backend needs CUDA tensors (got {device.type}), or TRITON_INTERPRET=1 "
                         "to run the generated kernels in Triton's interpreter")


def scan(monoid, elems, dim: int, reverse: bool, initial, out_dtype) -> tuple[torch.Tensor, ...]:
    """Inclusive scan of broadcastable `elems` along `dim` (>= 0) with the generated kernels.

    `initial` (one tensor per field, broadcastable to the shape without `dim`) or None. Outputs are
    `out_dtype` (float32 or float64; the accumulation dtype too). Differentiable in every element and
    in `initial` through the generated backward kernel.
    """
    if out_dtype not in (torch.float32, torch.float64):
        raise TypeError(f"out_dtype: expected torch.float32 or torch.float64, got {out_dtype}")
    elems = tuple(elems)
    if len(elems) != len(monoid.fields):
        raise ValueError(f"elems: expected {len(monoid.fields)} tensors (fields {monoid.fields}), got {len(elems)}")
    _check(elems, initial)
    ndim = elems[0].dim()
    if any(e.dim() != ndim for e in elems):
        raise ValueError(f"elems: expected tensors of one ndim (broadcast views), got shapes {[tuple(e.shape) for e in elems]}")
    if not 0 <= dim < ndim:
        raise ValueError(f"dim: expected 0 <= dim < {ndim}, got {dim}")
    init = list(initial) if initial is not None else None
    prog = pipeline.PROGRAMS[pipeline.program_key(monoid.key, monoid.name)]
    outs, _ = pipeline.launch(prog, elems, init, dim, reverse, out_dtype == torch.float64)
    return tuple(outs)


def show_for_shape(program, shape, layout: str = "time") -> str:
    """The configs chosen for `shape` (B, T, D) in `layout` and the kernels they run (`show_shape.py`)."""
    from .show_shape import show as show_shape
    return show_shape(program, shape, layout)


prefers_lanes = runtime.prefers_lanes   # lanes -> whether choose_config picks the lane-sequential schedule
forces_lanes = runtime.forces_lanes     # () -> whether a forced config runs the lane-sequential schedule

backend.register("triton", sys.modules[__name__])
