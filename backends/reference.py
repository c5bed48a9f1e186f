"""The reference backend: the scan IR executed with plain PyTorch ops, on any device, float64-capable.

Two executors of the same law, `out_t = x_0 (+) ... (+) x_t`:
- `scan`: a work-efficient blocked scan over the traced combine expressions; ordinary torch
  autograd differentiates it (any number of times). This is `sl.scan(..., backend="reference")`.
- `scan_sequential`: a plain loop over time that calls the user's own combine body on tensors (not
  the sympy trace), in float64. Tests use it as the independent oracle.

The blocked schedule (scan the chunks, carry across them, fix them up): cut time into N chunks of
C steps (`layout`: N about sqrt(T), and few enough that one step of all chunks is a serial op, see
SERIAL; C at most CHUNK; the last T mod N steps are a tail, and a longer rest is scanned in further
passes, each from the last output before it, see `passes`);
1. every chunk's own scan, all chunks side by side: local_i = local_{i-1} (+) x_i, written straight
   into the output (C - 1 combines, each over one step of every chunk);
2. the carries, one chunk after the other: carry_n = carry_{n-1} (+) total_{n-1}, a chunk's total
   being its last local prefix (N combines of one time step's size);
3. every chunk but the first from its carry, in place: out = carry_n (+) local, over blocks of
   contiguous output (`block_sizes`); the tail continues step by step from the last output.
That is about C + N + T * step / SERIAL combine calls (BLOCK in place of SERIAL with one torch thread),
against T for a loop over time. The time goes to memory traffic, most of it in phase 1: "step i of
every chunk" is N * (rows before `dim`) short strided runs, read (inputs) and written (outputs, not
yet in any cache) once; phase 3 reads and writes contiguous blocks, which streams faster. (Measured
and dropped: reduce-then-scan, which writes each output once but reads the inputs twice; a
Brent-Kung scan inside chunks, few large strided ops; superblocks of time sized for the cache;
touching inputs or outputs in one streaming pass first; two Python threads for two halves of the
batch, with two torch threads. None was faster.) Without autograd every combine writes into
preallocated outputs (no copies), all fields in one allocation: see `_in_place`.

Each combine is `combiner(monoid)`: the traced expressions printed as torch calls whose last op per
field writes into a given output (`out=`), with `a + b * c` as one `addcmul` (one rounding, a fused
multiply-add, as Triton also emits). The autograd path calls the same function without outputs
(fresh tensors), so the two paths round alike and agree bit for bit. Under torch.compile the scan
runs the recorded path on `monoid.combine` (a trace cannot build the combiner, and the compiler
fuses elementwise ops itself).

Why not a log-depth tree over the whole sequence: its later operands are products of up to T / 2
elements, which overflow where the loop's never do (Affine with a = 2: 2^150 is inf in float32, and
b = inf * 0 is NaN where the answer is 0). Here the later operand of every combine is one element
(phase 1, the tail) or a product of at most C consecutive elements (a chunk's total or local prefix,
phases 2 and 3), so an Affine b meets an overflowed product only for |a| > 2^(128 / C) in float32,
C <= CHUNK: |a| > 4 at the least.
"""
from __future__ import annotations

import ast
import math
import sys
from typing import Callable, Sequence

import torch

from scanlang import backend
from scanlang import expr as E
from scanlang.monoid import Monoid

# torch runs an elementwise op over at most this many elements in the calling thread; above it the op
# is split over torch's thread pool, whose threads on a busy machine wait for the other processes
# (the loop over time, all ops of one step, never does). Every op of the schedule stays at or below,
# where one time step is not already larger.
SERIAL = 32768
# The most steps per chunk: the later operand of a combine is at most a chunk's product (see the end of
# the module docstring), and 2^(128 / CHUNK) bounds the |a| of an Affine scan whose float32 products of
# one chunk stay finite (an overflowed product times b = 0 is NaN where the loop's answer is 0).
CHUNK = 64
# Without a thread pool (one torch thread) no op is split, and the fix-up's blocks may be larger: fewer
# Python-level calls, while a combine's temporaries (a block's size each) still stay about an L2 cache.
BLOCK = 1 << 18
_FUSED = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div"}
_COMBINERS: dict[str, Callable] = {}   # by monoid digest (the traced expressions' hash)


def layout(length: int, step_numel: int) -> tuple[int, int]:
    """(chunks N, steps per chunk C) of the blocked schedule for `length` steps of `step_numel` elements.

    N is about sqrt(length), so that C + N sequential combines stay few, and at most SERIAL /
    step_numel, so that one combine over a step of all chunks is a serial op (see SERIAL); C is at most
    CHUNK. Lengths past N * C are the tail when that is fewer than N steps, else more passes (`passes`).
    """
    if length < 1:
        return 0, 0
    n_chunks = max(1, min(math.isqrt(length), SERIAL // max(step_numel, 1)))
    return n_chunks, min(length // n_chunks, CHUNK)


def passes(length: int, step_numel: int) -> list[tuple[int, int, tuple[int, int]]]:
    """(first step, steps, layout) of each pass of the blocked schedule over `length` steps: one, unless
    C was held at CHUNK and the rest would be a tail of N steps or more; then passes of N * C steps, each
    starting from the last output of the one before (as from an `initial`), and a last one for the rest."""
    out, first = [], 0
    while first < length:
        n_chunks, chunk = layout(length - first, step_numel)
        steps = length - first if length - first - n_chunks * chunk < n_chunks else n_chunks * chunk
        out.append((first, steps, (n_chunks, chunk)))
        first += steps
    return out


def block_sizes(outer: int, n: int, c: int, inner: int, limit: int = SERIAL) -> tuple[int, int, int]:
    """(rows, chunks, steps) of the fix-up's blocks of an [outer, n, c, inner] tensor: each block at most
    `limit` elements (one step's `inner` if that is more), as few blocks as that allows: whole chunks,
    several side by side when they fit (and several rows when all chunks do), else pieces of one."""
    if c * inner > limit:
        return 1, 1, max(1, limit // max(inner, 1))
    per = max(1, limit // max(c * inner, 1))
    if per < n:
        return 1, per, c
    return max(1, min(outer, limit // max(n * c * inner, 1))), n, c


def _put(value, out):
    """The last op of a field that has no `out=` form: copy (broadcasting) into `out`, if given."""
    if out is None:
        return value
    return out.copy_(value) if isinstance(value, torch.Tensor) else out.fill_(value)


def combiner(monoid: Monoid) -> Callable:
    """`combine(x, y, out)` for `monoid`: combine(x, y) written into the tensors `out` (one per field,
    shaped like the later operand `y`; None entries get fresh tensors), returned as a tuple.

    `out` may be `y` itself (the fix-up phase updates the output in place): each field is written only
    after every other field has read that field of `y`.
    """
    fn = _COMBINERS.get(monoid.digest)
    if fn is None:
        fn = _COMBINERS[monoid.digest] = _build_combiner(monoid)
    return fn


def _build_combiner(m: Monoid) -> Callable:
    names = {s: f"x[{i}]" for i, s in enumerate(m.x_symbols)}
    names.update({s: f"y[{i}]" for i, s in enumerate(m.y_symbols)})
    lines, outs = E.render(m.exprs, names, E.TORCH)
    body = [ast.parse(line).body[0] for line in lines]
    full = set()   # temporaries shaped like y (they read y): an op over them has y's shape, `out=` fits

    def reads(node, of):
        return any(isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == of
                   for n in ast.walk(node))

    def is_full(node):
        return reads(node, "y") or any(isinstance(n, ast.Name) and n.id in full for n in ast.walk(node))

    def is_tensor(node):
        return reads(node, "x") or is_full(node) or any(isinstance(n, ast.Name) and n.id.startswith("_t")
                                                      for n in ast.walk(node))
    for stmt in body:
        if is_full(stmt.value):
            full.add(stmt.targets[0].id)

    def call(fn, args, out, **kw):
        keywords = [ast.keyword(k, ast.Constant(v)) for k, v in kw.items()] + [ast.keyword("out", out)]
        return ast.Call(ast.Attribute(ast.Name("torch"), fn), list(args), keywords)

    def last_op(node, out):
        """The field's value with its last op writing into `out` where torch has that form."""
        if isinstance(node, ast.BinOp) and type(node.op) in _FUSED and is_full(node):
            left, right, op = node.left, node.right, type(node.op)
            mul = lambda n: isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult) \
                and is_tensor(n.left) and is_tensor(n.right)  # noqa: E731
            if op is ast.Add and is_tensor(left) and mul(right):
                return call("addcmul", (left, right.left, right.right), out)
            if op is ast.Add and is_tensor(right) and mul(left):
                return call("addcmul", (right, left.left, left.right), out)
            if op is ast.Sub and is_tensor(left) and mul(right):
                return call("addcmul", (left, right.left, right.right), out, value=-1)
            if is_tensor(left):
                return call(_FUSED[op], (left, right), out)
            if op in (ast.Add, ast.Mult) and is_tensor(right):   # exactly commutative in IEEE arithmetic
                return call(_FUSED[op], (right, left), out)
        return ast.Call(ast.Name("_put"), [node, out], [])

    fields = [ast.parse(src, mode="eval").body for src in outs]
    out_k = lambda k: ast.Subscript(ast.Name("out"), ast.Constant(k))  # noqa: E731
    y_reads = [{k for k in range(len(fields)) if f"y[{k}]" in ast.unparse(f)} for f in fields]
    pending, tail = list(range(len(fields))), []
    while pending:   # write a field only once no other pending field still reads that field of y
        ready = [k for k in pending if not any(k in y_reads[j] for j in pending if j != k)]
        k = ready[0] if ready else pending[0]
        if ready:
            body.append(ast.Assign([ast.Name(f"_r{k}")], last_op(fields[k], out_k(k))))
        else:   # a cycle: evaluate now into a fresh tensor (a bare field is copied), write it after the others read
            value = last_op(fields[k], ast.Constant(None))
            if isinstance(fields[k], ast.Subscript):
                value = ast.Call(ast.Attribute(fields[k], "clone"), [], [])
            body.append(ast.Assign([ast.Name(f"_r{k}")], value))
            tail.append(ast.Assign([ast.Name(f"_r{k}")], ast.Call(ast.Name("_put"), [ast.Name(f"_r{k}"), out_k(k)], [])))
        pending.remove(k)
    body += tail
    body.append(ast.Return(ast.Tuple([ast.Name(f"_r{k}") for k in range(len(fields))])))
    fn = ast.parse("def combine(x, y, out):\n    pass").body[0]
    fn.body = body
    source = ast.unparse(ast.fix_missing_locations(ast.Module([fn], type_ignores=[])))
    namespace = {"math": math, "torch": torch, "_put": _put, "exp": E.exp, "log": E.log, "sqrt": E.sqrt,
                 "abs": E.abs, "maximum": E.maximum, "minimum": E.minimum}
    exec(compile(source, f"<scanlang reference combine {m.name}>", "exec"), namespace)  # noqa: S102
    raw = namespace["combine"]
    if not m.is_projective:
        raw.source = source
        return raw

    def projective(x, y, out):   # renormalised: every field divided by scale(m), then written
        return tuple(_put(v, o) for v, o in zip(m.renormalise(raw(x, y, (None,) * len(x))), out))
    projective.source = source
    return projective


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
    start = None
    if initial is not None:   # shaped like one time step: the broadcast shape without `dim`
        start = tuple(i.to(out_dtype).unsqueeze(dim) for i in torch.broadcast_tensors(*initial))
    if torch.compiler.is_compiling():
        # a trace cannot build (exec) the combiner, and the compiler fuses elementwise ops itself
        combine = lambda x, y, out: monoid.combine(x, y)  # noqa: E731
    else:
        combine = combiner(monoid)
    record = (torch.is_grad_enabled() and any(t.requires_grad for t in (*xs, *(start or ())))) \
        or torch.compiler.is_compiling()
    cut = passes(length, xs[0].numel() // length)
    part = lambda ts, first, steps: tuple(t.narrow(dim, first, steps) for t in ts)  # noqa: E731
    if record:
        pieces = []
        for first, steps, grid in cut:
            pieces.append(_recorded(combine, part(xs, first, steps), dim, start, grid))
            start = part(pieces[-1], steps - 1, 1)
        outs = pieces[0] if len(pieces) == 1 else tuple(torch.cat(f, dim) for f in zip(*pieces))
    else:
        # every field in one block: glibc's allocator often handed two large blocks, freed together, back
        # to the system, and the next call faulted them in again page by page (slower than the scan
        # itself); one block raises its reuse threshold past that size and is mostly kept (not always)
        outs = tuple(torch.empty((len(xs), *xs[0].shape), dtype=xs[0].dtype, device=xs[0].device).unbind(0))
        for first, steps, grid in cut:
            _in_place(combine, part(xs, first, steps), dim, start, grid, part(outs, first, steps))
            start = part(outs, first + steps - 1, 1)
    if reverse:
        outs = tuple(x.flip(dim) for x in outs)
    return tuple(x.contiguous() for x in outs)


def _in_place(combine, xs, dim, start, grid, outs):
    """The schedule without autograd, laid out as `grid`: every step written once into `outs`."""
    length, shape = xs[0].shape[dim], xs[0].shape
    n_chunks, chunk = grid
    main = n_chunks * chunk
    split = lambda ts: list(zip(*(t.narrow(dim, 0, main).unflatten(dim, (n_chunks, chunk)).unbind(dim + 1)  # noqa: E731
                                  for t in ts)))
    rows, views = split(xs), split(outs)
    for v, r in zip(views[0], rows[0]):
        v.copy_(r)
    prev = rows[0]
    for row, view in zip(rows[1:], views[1:]):   # 1. every chunk's own scan
        prev = combine(prev, row, view)
    totals = views[-1]   # [.., n_chunks, ..]: each chunk's local total
    outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1:])
    if n_chunks > 1 or start is not None:   # 2. carry_n: the prefix before chunk n (n >= 1, or n >= 0 with start)
        carry = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in totals)
        # per chunk, views without `dim` (one unbind each: this phase is all small ops, and view calls count)
        total_n, carry_n = (list(zip(*(t.unbind(dim) for t in ts))) for ts in (totals, carry))
        first = 0 if start is not None else 1
        c = tuple(d.copy_(s.squeeze(dim)) for d, s in zip(carry_n[0], start)) if first == 0 else None
        for n in range(1, n_chunks):
            c = tuple(d.copy_(t) for d, t in zip(carry_n[1], total_n[0])) if c is None else \
                combine(c, total_n[n - 1], carry_n[n])
        # 3. chunks first.. from their carries, in place, block by block (views made by split, in bulk)
        limit = SERIAL if torch.get_num_threads() > 1 else BLOCK
        rows, per, piece = block_sizes(outer, n_chunks - first, chunk, inner, limit)
        pieces = -(-chunk // piece)
        out4 = [_grid(o.narrow(dim, 0, main).view(outer, n_chunks, chunk, inner).narrow(1, first, n_chunks - first),
                      (rows, per, piece)) for o in outs]
        carry4 = [[v for v in _grid(t.view(outer, n_chunks, 1, inner).narrow(1, first, n_chunks - first), (rows, per))
                   for _ in range(pieces)] for t in carry]
        for x, y in zip(zip(*carry4), zip(*out4)):
            combine(x, y, y)
    last = tuple(o.narrow(dim, main - 1, 1) for o in outs)
    for t in range(main, length):   # the tail: fewer than n_chunks steps, each from the previous output
        last = combine(last, tuple(x.narrow(dim, t, 1) for x in xs), tuple(o.narrow(dim, t, 1) for o in outs))


def _grid(t: torch.Tensor, sizes: Sequence[int]) -> list:
    """`t` cut into blocks of sizes[d] along each leading dim d, in row-major block order; a dim that one
    block spans is not split (each split is a Python-level call, and the fix-up makes few blocks)."""
    blocks = [t]
    for d, size in enumerate(sizes):
        if size < t.shape[d]:
            blocks = [b for u in blocks for b in u.split(size, d)]
    return blocks


def _recorded(combine, xs, dim, start, grid):
    """The same schedule for autograd: the same combines on fresh tensors, stacked into the outputs."""
    length = xs[0].shape[dim]
    n_chunks, chunk = grid
    main, nf, fresh = n_chunks * chunk, len(xs), (None,) * len(xs)
    rows = list(zip(*(x.narrow(dim, 0, main).unflatten(dim, (n_chunks, chunk)).unbind(dim + 1) for x in xs)))
    prefixes = [rows[0]]
    for row in rows[1:]:
        prefixes.append(combine(prefixes[-1], row, fresh))
    # stacked along a new leading dim, then moved: torch.stack along an inner dim is several times slower
    local = [torch.stack([p[f] for p in prefixes]).movedim(0, dim + 1) for f in range(nf)]   # [.., N, C, ..]
    totals = prefixes[-1]
    at = lambda ts, n: tuple(t.narrow(dim, n, 1) for t in ts)  # noqa: E731
    carries = [] if start is None else [tuple(s.expand_as(t) for s, t in zip(start, at(totals, 0)))]
    c = carries[0] if carries else None
    for n in range(n_chunks - 1):
        c = at(totals, 0) if c is None else combine(c, at(totals, n), fresh)
        carries.append(c)
    first = 0 if start is not None else 1
    if carries:
        before = tuple(torch.cat([c[f] for c in carries], dim).unsqueeze(dim + 1) for f in range(nf))
        fixed = combine(before, tuple(v.narrow(dim, first, n_chunks - first) for v in local), fresh)
        local = [torch.cat([v.narrow(dim, 0, first), w], dim) if first else w for v, w in zip(local, fixed)]
    pieces = [tuple(v.flatten(dim, dim + 1) for v in local)]
    last = tuple(v.narrow(dim, main - 1, 1) for v in pieces[0])
    for t in range(main, length):
        last = combine(last, tuple(x.narrow(dim, t, 1) for x in xs), fresh)
        pieces.append(last)
    return tuple(torch.cat([p[f] for p in pieces], dim) if len(pieces) > 1 else pieces[0][f] for f in range(nf))


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
