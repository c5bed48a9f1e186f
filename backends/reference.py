"""The reference backend: the scan IR executed with plain PyTorch ops, on any device, float64-capable.

Two executors of the same law, `out_t = x_0 (+) ... (+) x_t`:
- `scan`: a work-efficient blocked scan over the traced combine expressions; ordinary torch
  autograd differentiates it (any number of times). This is `sl.scan(..., backend="reference")`.
- `scan_sequential`: a plain loop over time that calls the user's own combine body on tensors (not
  the sympy trace), in float64. Tests use it as the independent oracle.

The blocked schedule (reduce, scan the totals, rescan): cut time into N chunks of C = `CHUNK`
steps (the last T mod C steps are a tail);
1. the chunks' totals, all chunks side by side: C - 1 combines, each over every chunk at once;
2. the carries, one chunk after the other: carry_n = carry_{n-1} (+) total_n (N combines of one
   time step's size);
3. every chunk again from its carry, all chunks side by side: prefix_i = prefix_{i-1} (+) x_i, the
   steps stacked straight into the output's layout (C combines); the tail continues step by step.
About 2 C + T / C combines, each but the carries over many elements, against T for a loop over time;
the inputs are read twice and the outputs written once, in place of log2(T) full passes.

Why not a log-depth tree over the whole sequence: its later operands are products of up to T / 2
elements, which overflow where the loop's never do (Affine with a = 2: 2^150 is inf in float32, and
b = inf * 0 is NaN where the answer is 0). Here the later operand of every combine that makes an
output is one element, as in the loop; only the carries combine chunk totals, products of C
consecutive elements (Affine overflows there only for |a| > 2^(128 / C) = 16 in float32).
"""
from __future__ import annotations

import sys
from typing import Sequence

import torch

from scanlang import backend
from scanlang.monoid import Monoid

CHUNK = 32   # steps per chunk: 2 C + T / C combines is least at C = sqrt(T / 2), 32 at T = 2048


def scan(monoid: Monoid, elems: Sequence[torch.Tensor], dim: int, reverse: bool,
         initial: Sequence[torch.Tensor] | None, out_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Inclusive scan along `dim` of broadcastable `elems` (see `sl.scan`), blocked as described above."""
    xs = tuple(e.to(out_dtype) for e in torch.broadcast_tensors(*elems))
    if reverse:
        xs = tuple(x.flip(dim) for x in xs)
    length = xs[0].shape[dim]
    if length == 0:
        return tuple(x.contiguous() for x in xs)
    if monoid.is_projective:
        xs = monoid.renormalise(xs)
    carry = None
    if initial is not None:   # shaped like one time step: the broadcast shape without `dim`
        carry = tuple(i.to(out_dtype).unsqueeze(dim) for i in torch.broadcast_tensors(*initial))
    chunk = min(CHUNK, length)
    n_chunks = length // chunk
    main = n_chunks * chunk
    # without autograd the steps are copied into the outputs as they come; with it they are stacked
    record = torch.is_grad_enabled() and any(t.requires_grad for t in (*xs, *(carry or ())))
    outs = None if record else tuple(torch.empty(xs[0].shape, dtype=out_dtype, device=xs[0].device) for _ in xs)
    pieces = []
    if n_chunks:
        blocks = tuple(x.narrow(dim, 0, main).unflatten(dim, (n_chunks, chunk)) for x in xs)  # [.., N, C, ..]

        def step(i):   # element i of every chunk: [.., N, ..]
            return tuple(b.select(dim + 1, i) for b in blocks)
        total = step(0)
        for i in range(1, chunk):
            total = monoid.combine(total, step(i))
        starts = []   # the prefix before each chunk, [.., 1, ..] (None: nothing before chunk 0)
        for n in range(n_chunks):
            starts.append(carry)
            total_n = tuple(v.narrow(dim, n, 1) for v in total)
            carry = total_n if carry is None else monoid.combine(carry, total_n)
        first = step(0)
        if starts[0] is not None:
            before = tuple(torch.cat([s[f] for s in starts], dim) for f in range(len(xs)))
            prefix = monoid.combine(before, first)
        elif n_chunks > 1:
            before = tuple(torch.cat([s[f] for s in starts[1:]], dim) for f in range(len(xs)))
            later = monoid.combine(before, tuple(v.narrow(dim, 1, n_chunks - 1) for v in first))
            prefix = tuple(torch.cat([v.narrow(dim, 0, 1), w.expand_as(v.narrow(dim, 1, n_chunks - 1))], dim)
                           for v, w in zip(first, later))
        else:
            prefix = first
        shape = first[0].shape
        if record:
            steps = [prefix]
            for i in range(1, chunk):
                prefix = monoid.combine(prefix, step(i))
                steps.append(prefix)
            # stacked along a new leading dim, then moved: torch.stack along an inner dim is several times slower
            pieces.append(tuple(torch.stack([p[f].expand(shape) for p in steps]).movedim(0, dim + 1)
                                .flatten(dim, dim + 1) for f in range(len(xs))))
        else:
            views = tuple(o.narrow(dim, 0, main).unflatten(dim, (n_chunks, chunk)) for o in outs)
            for i in range(chunk):
                if i:
                    prefix = monoid.combine(prefix, step(i))
                for view, p in zip(views, prefix):
                    view.select(dim + 1, i).copy_(p)
    tail = []
    for t in range(main, length):   # fewer than `chunk` steps, each from the previous prefix
        x_t = tuple(x.narrow(dim, t, 1) for x in xs)
        carry = x_t if carry is None else monoid.combine(carry, x_t)
        if record:
            tail.append(tuple(c.expand_as(x) for c, x in zip(carry, x_t)))
        else:
            for o, c in zip(outs, carry):
                o.narrow(dim, t, 1).copy_(c)
    if record:
        if tail:
            pieces.append(tuple(torch.cat([c[f] for c in tail], dim) for f in range(len(xs))))
        outs = tuple(torch.cat([p[f] for p in pieces], dim) if len(pieces) > 1 else pieces[0][f]
                     for f in range(len(xs)))
    if reverse:
        outs = tuple(x.flip(dim) for x in outs)
    return tuple(x.contiguous() for x in outs)


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


backend.register("reference", sys.modules[__name__])
