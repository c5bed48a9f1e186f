"""The reference backend: the scan IR executed with plain PyTorch ops, on any device, float64-capable.

Two executors of the same law, `out_t = x_0 (+) ... (+) x_t`:
- `scan`: a work-efficient blocked scan over the traced combine expressions; ordinary torch
  autograd differentiates it (any number of times). This is `sl.scan(..., backend="reference")`.
- `scan_sequential`: a plain loop over time that calls the user's own combine body on tensors (not
  the sympy trace), in float64. Tests use it as the independent oracle.

The blocked schedule (reduce, scan the totals, rescan): cut time into N chunks of C steps (`layout`:
C about sqrt(T), at least `CHUNK`; the last T mod N steps are a tail);
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
consecutive elements (Affine overflows there only for |a| > 2^(128 / C): 16 in float32 at C = 32).
"""
from __future__ import annotations

import math
import sys
from typing import Sequence

import torch

from scanlang import backend
from scanlang.monoid import Monoid

CHUNK = 32      # the least steps per chunk; chunks grow to about sqrt(T) on long sequences
SERIAL = 32768  # torch runs an elementwise op over fewer elements than this in the calling thread


def layout(length: int, step_numel: int) -> tuple[int, int]:
    """(chunks N, steps per chunk C) of the blocked schedule for `length` steps of `step_numel` elements.

    C is at least `CHUNK` and about sqrt(length), so that 2 C + N sequential combines stay few. N is
    also capped so that one combine over all chunks (N * step_numel elements) stays below `SERIAL`:
    above it torch splits every op over its thread pool, and a pool whose threads must wait for a busy
    machine's other processes makes each of the ~2 C ops wait with it, where the loop over time
    (ops of one step) never does. Lengths past N * C (fewer than N steps) are the tail.
    """
    if length < 1:
        return 0, 0
    shortest = max(CHUNK, math.isqrt(length))
    n_chunks = max(1, min(length // shortest, (SERIAL - 1) // max(step_numel, 1)))
    return n_chunks, length // n_chunks


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
    combine = monoid.combine
    carry = None
    if initial is not None:   # shaped like one time step: the broadcast shape without `dim`
        carry = tuple(i.to(out_dtype).unsqueeze(dim) for i in torch.broadcast_tensors(*initial))
    n_chunks, chunk = layout(length, xs[0].numel() // length)
    main = n_chunks * chunk
    # without autograd the steps are copied into the outputs as they come; with it they are stacked
    record = torch.is_grad_enabled() and any(t.requires_grad for t in (*xs, *(carry or ())))
    outs = None if record else tuple(torch.empty(xs[0].shape, dtype=out_dtype, device=xs[0].device) for _ in xs)
    pieces = []

    def steps(n):   # [(element i of each of the first n chunks, [.., n, ..]) for i < C]: views, one unbind
        return list(zip(*(x.narrow(dim, 0, n * chunk).unflatten(dim, (n, chunk)).unbind(dim + 1) for x in xs)))
    total = None
    if n_chunks > 1:   # the totals of all chunks but the last (whose total no carry needs)
        rows = steps(n_chunks - 1)
        total = rows[0]
        for row in rows[1:]:
            total = combine(total, row)
    starts = [carry]   # the prefix before each chunk, [.., 1, ..] (None: nothing before chunk 0)
    for n in range(n_chunks - 1):
        total_n = tuple(v.narrow(dim, n, 1) for v in total)
        carry = total_n if carry is None else combine(carry, total_n)
        starts.append(carry)
    rows = steps(n_chunks)
    first = rows[0]
    if starts[0] is not None:
        before = tuple(torch.cat([s[f] for s in starts], dim) for f in range(len(xs)))
        prefix = combine(before, first)
    elif n_chunks > 1:
        before = tuple(torch.cat([s[f] for s in starts[1:]], dim) for f in range(len(xs)))
        later = combine(before, tuple(v.narrow(dim, 1, n_chunks - 1) for v in first))
        prefix = tuple(torch.cat([v.narrow(dim, 0, 1), w.expand_as(v.narrow(dim, 1, n_chunks - 1))], dim)
                       for v, w in zip(first, later))
    else:
        prefix = first
    shape = first[0].shape
    if record:
        prefixes = [prefix]
        for row in rows[1:]:
            prefix = combine(prefix, row)
            prefixes.append(prefix)
        # stacked along a new leading dim, then moved: torch.stack along an inner dim is several times slower
        pieces.append(tuple(torch.stack([p[f].expand(shape) for p in prefixes]).movedim(0, dim + 1)
                            .flatten(dim, dim + 1) for f in range(len(xs))))
    else:
        views = list(zip(*(o.narrow(dim, 0, main).unflatten(dim, (n_chunks, chunk)).unbind(dim + 1)
                           for o in outs)))
        for i, (row, view) in enumerate(zip(rows, views)):
            if i:
                prefix = combine(prefix, row)
            for v, p in zip(view, prefix):
                v.copy_(p)
    carry = tuple(p.narrow(dim, p.shape[dim] - 1, 1) for p in prefix)   # the prefix at the last chunk's end
    tail = []
    for t in range(main, length):   # fewer than `chunk` steps, each from the previous prefix
        x_t = tuple(x.narrow(dim, t, 1) for x in xs)
        carry = x_t if carry is None else combine(carry, x_t)
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
