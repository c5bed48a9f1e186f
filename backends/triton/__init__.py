"""The Triton backend: generated fused scan kernels and their generated backward.

    scan(monoid, elems, dim, reverse, initial, out_dtype) -> tuple[Tensor]   (sl.scan's backend call)
    show(monoid) -> str                                                      (`scanlang show`)

The kernels come from `scanlang.pipeline` (lower -> differentiate -> render -> load) and run as the
`torch.library` ops `scanlang::scan_fwd` / `scanlang::scan_bwd` (see `ops.py`), so autograd and
`torch.compile(fullgraph=True)` see them as ordinary ops; plain eager calls run the same code without
the dispatcher, with their launch plans cached (`plan.py`).
"""
from __future__ import annotations

import torch

from scanlang import settings


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


def program_for(monoid):
    """The compiled plain-scan program of `monoid` (generated and loaded once)."""
    from scanlang import pipeline
    return pipeline.build(pipeline.lower(monoid))


_KEYS: dict = {}   # (monoid key, name) -> the key of its plain-scan program in PROGRAMS


@torch.compiler.assume_constant_result
def program_key(key: str, name: str) -> str:
    """Build (once) and name the plain-scan program of the declaration `(monoid.key, monoid.name)`.

    torch.compile runs this at trace time and keeps only the string. It takes two strings (constants
    to Dynamo in every torch version, also when a recompile turns numbers dynamic) rather than the
    Monoid object or its parts; the object is found in `scanlang.monoid.DECLARED`.
    """
    from scanlang.monoid import DECLARED
    if (key, name) not in _KEYS:
        _KEYS[(key, name)] = program_for(DECLARED[(key, name)]).key
    return _KEYS[(key, name)]


def scan(monoid, elems, dim: int, reverse: bool, initial, out_dtype) -> tuple[torch.Tensor, ...]:
    """Inclusive scan of broadcastable `elems` along `dim` (>= 0) with the generated kernels.

    `initial` (one tensor per field, broadcastable to the shape without `dim`) or None. Outputs are
    `out_dtype` (float32 or float64; the accumulation dtype too). Differentiable in every element and
    in `initial` through the generated backward kernel.
    """
    from .ops import PROGRAMS, launch
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
    prog = PROGRAMS[program_key(monoid.key, monoid.name)]
    outs, _ = launch(prog, elems, init, dim, reverse, out_dtype == torch.float64)
    return tuple(outs)


def show(monoid, shape=None, layout: str = "time") -> str:
    """The generated Triton module (forward and backward kernels) of `monoid`'s plain scan; with a
    `shape` (B, T, D) the configs chosen for it and the kernels they run (`show_shape.py`)."""
    if shape is None:
        return program_for(monoid).source
    from .show_shape import show as show_for_shape
    return show_for_shape(program_for(monoid), shape, layout)
