"""The reference backend: the scan IR executed with plain PyTorch ops, on any device, float64-capable.

Two executors of the same law, `out_t = x_0 (+) ... (+) x_t`:
- `scan`: a vectorised log-depth Hillis-Steele scan over the traced combine expressions; ordinary
  torch autograd differentiates it. This is `sl.scan(..., backend="reference")`.
- `scan_sequential`: a plain loop over time that calls the user's own combine body on tensors (not
  the sympy trace), in float64. Tests use it as the independent oracle.
"""
from __future__ import annotations

from typing import Sequence

import torch

from scanlang.monoid import Monoid


def scan(monoid: Monoid, elems: Sequence[torch.Tensor], dim: int, reverse: bool,
         initial: Sequence[torch.Tensor] | None, out_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Hillis-Steele: after the round with offset d, position t holds x_{t-2d+1..t}; log2(T) rounds."""
    xs = tuple(e.to(out_dtype).movedim(dim, 0) for e in torch.broadcast_tensors(*elems))
    if reverse:
        xs = tuple(x.flip(0) for x in xs)
    length = xs[0].shape[0]
    if monoid.is_projective:
        xs = monoid.renormalise(xs)
    offset = 1
    while offset < length:
        combined = monoid.combine(tuple(x[:-offset] for x in xs), tuple(x[offset:] for x in xs))
        xs = tuple(torch.cat([x[:offset], c.expand_as(x[offset:])], 0) for x, c in zip(xs, combined))
        offset *= 2
    if initial is not None and length > 0:
        init = tuple(i.to(out_dtype).unsqueeze(0) for i in torch.broadcast_tensors(*initial))
        xs = tuple(c.expand_as(x) for c, x in zip(monoid.combine(init, xs), xs))
    if reverse:
        xs = tuple(x.flip(0) for x in xs)
    return tuple(x.movedim(0, dim).contiguous() for x in xs)


def scan_sequential(monoid: Monoid, elems: Sequence[torch.Tensor], dim: int, reverse: bool = False,
                    initial: Sequence[torch.Tensor] | None = None,
                    dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    """The oracle: step the user's combine body through time, one element at a time (float64)."""
    xs = torch.broadcast_tensors(*(torch.as_tensor(e).to(dtype) for e in elems))
    dim = dim % xs[0].dim()
    steps = list(range(xs[0].shape[dim]))
    if reverse:
        steps.reverse()
    prefix = None
    if initial is not None:
        shape = xs[0].shape[:dim] + xs[0].shape[dim + 1:]
        prefix = tuple(torch.as_tensor(i).to(dtype).expand(shape) for i in initial)
    outs: list = [None] * len(steps)
    for t in steps:
        x_t = tuple(x.select(dim, t) for x in xs)
        if prefix is None:
            prefix = monoid.renormalise(x_t, direct=True)
        else:
            prefix = monoid.combine_direct(prefix, x_t)
        outs[t] = tuple(torch.as_tensor(p).expand(x_t[0].shape) for p in prefix)
    if not steps:
        return tuple(x.clone() for x in xs)
    return tuple(torch.stack([o[i] for o in outs], dim) for i in range(len(xs)))
