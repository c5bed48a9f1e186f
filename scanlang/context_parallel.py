"""Context parallelism: a sequence split into contiguous shards over the ranks of a `torch.distributed`
group, derived from the monoid (`cp_group=`; docs/context_parallel.md).

Rank r holds global positions [o_r, o_r + T_r) (o_r = T_0 + ... + T_{r-1}; any T_r may be 0). For
an associative combine (+) the global inclusive prefix at a position t of shard r is

    out_t = initial (+) c_r (+) local_t,        c_r = s_0 (+) s_1 (+) ... (+) s_{r-1}

where local_t is the shard's own prefix and s_j the total of shard j (its summary; the identity for
an empty shard). So each rank reduces its shard to ONE element, the ranks all-gather those fixed-size
summaries, and every rank folds the ones before it (`reverse=True`: the ones after it, last first)
with the same combine. With packed sequences (`cu_seqlens`, global offsets, equal on every rank) the
fold restarts where a sequence starts: a rank's summary is the total of its last piece (the part of
the shard in the sequence of its last token) and only ranks in the sequence of a shard's first token
feed its carry. The op applies `initial` (per sequence) to the carry itself, so a gradient of
`initial` is each rank's own use of it: the sum over ranks is the single-process gradient.

What is in this module (the ops call it; none of it runs with `cp_group=None`):
- `resolve_group`: a ProcessGroup or a 1-D DeviceMesh -> its group; anything else a TypeError.
- `agree`: ONE `all_gather_object` per call of every rank's metadata (shard length, dtypes,
  devices, the non-scanned shapes, `cu_seqlens`, flags) and of any error its local validation
  raised; every rank then decides identically, so a bad input raises the same error on every rank
  and no rank is left waiting in a collective.
- `ShardPlan`: who feeds whom (pure Python, from the lengths and `cu_seqlens`).
- `exchange`: the differentiable all-gather + fold. Forward: one `all_gather` of the summary.
  Backward: one `all_gather` of the gradients of the carries; each rank then differentiates the
  (small, fixed-size, T-independent) fold itself and keeps the part for its own summary.
- `all_reduce_sum`: a differentiable sum over ranks (packed sequences' final states).
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Callable, Sequence

import torch
import torch.distributed as dist


def resolve_group(cp_group):
    """`cp_group` as a ProcessGroup: a ProcessGroup as it is, a 1-D DeviceMesh's group; None stays None."""
    if cp_group is None:
        return None
    if isinstance(cp_group, dist.ProcessGroup):
        group = cp_group
    else:
        try:
            from torch.distributed.device_mesh import DeviceMesh
        except ImportError:   # a torch built without distributed support has no meshes
            DeviceMesh = None
        if DeviceMesh is None or not isinstance(cp_group, DeviceMesh):
            raise TypeError(f"cp_group: expected a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, "
                            f"got {type(cp_group).__name__}")
        if cp_group.ndim != 1:
            raise ValueError(f"cp_group: a DeviceMesh must be 1-D (the context-parallel dimension), "
                             f"got {cp_group.ndim} dimensions {tuple(cp_group.shape)}")
        group = cp_group.get_group()
    if not dist.is_initialized():
        raise ValueError("cp_group: torch.distributed is not initialised (call dist.init_process_group first)")
    return group


# ---- metadata agreement ------------------------------------------------------------------------

_ERROR_TYPES = {"ValueError": ValueError, "TypeError": TypeError}


def describe(t) -> tuple | None:
    """What must agree across ranks about one input: (dtype, device type, shape, requires_grad)."""
    if not isinstance(t, torch.Tensor):
        return None if t is None else (type(t).__name__,)
    return (str(t.dtype), t.device.type, tuple(t.shape), bool(t.requires_grad))


def agree(group, length: int, same: dict, error: Exception | None = None) -> list[int]:
    """Gather every rank's shard length, the metadata `same` (name -> value that must be equal on every
    rank) and its local validation error; raise identically on every rank; return all the lengths.

    `same` maps an argument's name to what must agree (shapes without the scanned dimension, dtypes,
    devices, `cu_seqlens` as a tuple, flags); the first mismatch, in the dict's order, is named."""
    same = {**same, "grad mode": torch.is_grad_enabled()}
    payload = {"length": int(length), "same": same,
               "error": None if error is None else (type(error).__name__, str(error))}
    world = dist.get_world_size(group)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, payload, group=group)
    for r, p in enumerate(gathered):
        if p["error"] is not None:
            kind, message = p["error"]
            raise _ERROR_TYPES.get(kind, ValueError)(f"{message} (on rank {r} of cp_group)")
    for name in same:
        values = [p["same"].get(name) for p in gathered]
        if any(v != values[0] for v in values[1:]):
            shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ValueError(f"{name}: must agree on every rank of cp_group (dtype, device, the shape without "
                             f"the sequence dimension, the same values for cu_seqlens); got {shown}")
    return [p["length"] for p in gathered]


def check_global_cu_seqlens(cu_seqlens, total: int) -> tuple[int, ...]:
    """The global offsets as ints; they must increase from 0 to the global length (every rank checks the
    same gathered values, so every rank raises together)."""
    cu = tuple(int(x) for x in cu_seqlens.tolist())
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens: under cp_group every rank passes the GLOBAL offsets [N + 1], increasing "
                         f"from 0 to the global length {total} (the sum of the shards), got {list(cu)}")
    return cu


def cu_signature(cu_seqlens):
    """What `agree` compares of cu_seqlens: its values (a short tuple), or the type when it is no tensor."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1:
        return (str(cu_seqlens.dtype), tuple(int(x) for x in cu_seqlens.tolist()))
    return (type(cu_seqlens).__name__,)


# ---- the plan: who feeds whom ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """The shards of one call, seen from `rank`, in scan order (`reverse`: mirrored positions).

    Pieces are the parts of this shard in one sequence each, in POSITION order; `local_cu` are their
    local offsets (what a varlen op runs on). `entry` is the piece the scan enters first (it receives
    the carry), `exit` the one it leaves last (its total is this rank's summary); `-1` when empty."""

    rank: int
    world: int
    lengths: tuple[int, ...]
    reverse: bool
    cu: tuple[int, ...] | None          # global offsets, None: one sequence per lane
    local_cu: tuple[int, ...]           # local piece offsets (0 .. T_rank)
    piece_seq: tuple[int, ...]          # the global sequence of each piece
    entry: int
    exit: int
    passes_on: tuple[bool, ...]         # per rank in scan order: its carry goes on to the next rank
    resets: tuple[bool, ...]            # per rank in scan order: a sequence starts at its first token

    @property
    def offset(self) -> int:
        return sum(self.lengths[:self.rank])

    @property
    def length(self) -> int:
        return self.lengths[self.rank]

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def order(self) -> list[int]:
        return list(range(self.world))[::-1] if self.reverse else list(range(self.world))

    def sequence_ends_here(self) -> list[tuple[int, int]]:
        """(piece, sequence) for each piece whose sequence ends in this shard (in scan order)."""
        out = []
        for i, n in enumerate(self.piece_seq):
            start, end = self.cu[n], self.cu[n + 1]
            last = start if self.reverse else end - 1
            if self.offset <= last < self.offset + self.length:
                out.append((i, n))
        return out

    def empty_sequences(self) -> list[int]:
        return [n for n in range(len(self.cu) - 1) if self.cu[n] == self.cu[n + 1]]


def make_plan(lengths: Sequence[int], rank: int, reverse: bool = False, cu: Sequence[int] | None = None) -> ShardPlan:
    """The plan of `rank` from every rank's shard length and the global `cu_seqlens` (None: one
    sequence per lane). Pure Python: every rank computes the same plan from the same gathered data."""
    lengths = tuple(int(n) for n in lengths)
    world = len(lengths)
    offsets = [sum(lengths[:r]) for r in range(world)]
    if cu is None:
        cu_t = None
        bounds = [0, lengths[rank]] if lengths[rank] else [0]
        piece_seq = (0,) if lengths[rank] else ()
        passes_on = tuple(True for _ in range(world))
        resets = tuple(False for _ in range(world))
    else:
        cu_t = tuple(int(c) for c in cu)
        # where a non-empty sequence begins in scan order: its start (forward) or its end (reverse)
        begins = {cu_t[n + 1] if reverse else cu_t[n] for n in range(len(cu_t) - 1) if cu_t[n] < cu_t[n + 1]}
        o, n = offsets[rank], lengths[rank]
        cuts = sorted({cu_t[j] for j in range(len(cu_t)) if o < cu_t[j] < o + n})
        bounds = ([0] + [c - o for c in cuts] + [n]) if n else [0]
        piece_seq = tuple(_sequence_at(cu_t, o + b) for b in bounds[:-1])
        order = list(range(world))[::-1] if reverse else list(range(world))
        # the scan enters rank r at o_r (forward) or o_r + T_r (reverse); a sequence beginning there resets
        # the carry, and the carry passes through r iff no sequence begins strictly inside it
        resets = [(offsets[r] + lengths[r] if reverse else offsets[r]) in begins for r in order]
        passes_on = [not any(offsets[r] < b < offsets[r] + lengths[r] for b in begins) for r in order]
        passes_on, resets = tuple(passes_on), tuple(resets)
    n_pieces = len(bounds) - 1
    if n_pieces == 0:
        entry = exit_ = -1
    elif reverse:
        entry, exit_ = n_pieces - 1, 0
    else:
        entry, exit_ = 0, n_pieces - 1
    return ShardPlan(rank, world, lengths, bool(reverse), cu_t, tuple(bounds), piece_seq, entry, exit_,
                     passes_on, resets)


def _sequence_at(cu: tuple[int, ...], position: int) -> int:
    """The non-empty sequence n with cu[n] <= position < cu[n + 1]."""
    return bisect.bisect_right(cu, position) - 1


def fold_carries(plan: ShardPlan, summaries: torch.Tensor, combine: Callable, identity: Callable) -> list:
    """Carries into each rank (indexed by rank) plus, last, the fold of every summary in the final
    segment (the global total when there is one sequence): the segmented exclusive scan of the
    gathered summaries [W, ...] in scan order."""
    carries: list = [None] * (plan.world + 1)
    carry = identity()
    for i, r in enumerate(plan.order):
        if plan.resets[i]:
            carry = identity()
        carries[r] = carry
        if plan.lengths[r] == 0:
            continue
        base = carry if plan.passes_on[i] else identity()
        carry = combine(base, summaries[r])
    carries[plan.world] = carry
    return carries


# ---- differentiable collectives ----------------------------------------------------------------

def _all_gather(group, x: torch.Tensor) -> torch.Tensor:
    world = dist.get_world_size(group)
    x = x.contiguous()
    out = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(out, x, group=group)
    return torch.stack(out)


class _Exchange(torch.autograd.Function):
    """summary (this rank's element, [F, ...]) -> (carry into this rank, fold of the final segment)."""

    @staticmethod
    def forward(ctx, summary, group, build):
        gathered = _all_gather(group, summary.detach())
        with torch.no_grad():
            carries = build(gathered)
        rank = dist.get_rank(group)
        ctx.group, ctx.build, ctx.rank = group, build, rank
        ctx.save_for_backward(gathered)
        return carries[rank].clone(), carries[-1].clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_carry, grad_total):
        (gathered,) = ctx.saved_tensors
        # one collective: every rank's upstream gradients, then each rank differentiates the small fold
        grads = _all_gather(ctx.group, torch.stack([grad_carry, grad_total]))
        world = grads.shape[0]
        with torch.enable_grad():
            leaf = gathered.detach().requires_grad_(True)
            carries = ctx.build(leaf)
            objective = sum((carries[r] * grads[r, 0]).sum() for r in range(world))
            objective = objective + (carries[-1] * grads[:, 1].sum(0)).sum()
            (g_leaf,) = torch.autograd.grad(objective, leaf, allow_unused=True)
        g = torch.zeros_like(gathered[ctx.rank]) if g_leaf is None else g_leaf[ctx.rank]
        return g, None, None


def exchange(group, summary: torch.Tensor, build: Callable, needs_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather `summary` ([F, ...], same shape on every rank) and return (carry into this rank, the
    fold of the final segment) from `build(gathered [W, F, ...]) -> list of W + 1 tensors [F, ...]`.

    Differentiable: the backward sends one all-gather of the gradients of both results. `needs_grad`
    (decided alike on every rank, from the agreed metadata) puts the exchange in every rank's graph,
    also where this rank's summary is a constant (an empty shard), so every rank joins the backward's
    collective."""
    if needs_grad and torch.is_grad_enabled() and not summary.requires_grad:
        summary = summary.detach().requires_grad_(True)
    return _Exchange.apply(summary, group, build)


def needs_grad(*tensors) -> bool:
    """Whether a call builds a backward (the same on every rank once `agree` has compared the flags)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def tie(summary: torch.Tensor, *inputs) -> torch.Tensor:
    """An empty shard's (constant) summary made to depend on the shard's (empty) inputs, adding zero,
    so asking autograd for this rank's input gradients also runs the exchange's backward, which
    the other ranks wait on."""
    tied = [t.sum() for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return summary + (sum(tied) * 0).to(summary.dtype) if tied and torch.is_grad_enabled() else summary


def keep_in_graph(t: torch.Tensor, carry: torch.Tensor) -> torch.Tensor:
    """`t` made to depend on `carry` (adding zero), so a rank whose result does not otherwise use the
    exchange (an empty shard, no sequence ending here) still joins the backward's collectives."""
    return t + (carry.sum() * 0).to(t.dtype) if carry.requires_grad else t


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.detach().clone().contiguous()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_sum(group, x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the ranks (differentiable: each rank's loss reaches every contribution)."""
    return _AllReduceSum.apply(x, group)


# ---- monoid helpers ----------------------------------------------------------------------------

def monoid_fold(monoid, plan: ShardPlan, like: torch.Tensor) -> Callable:
    """`build` for `exchange` over a declared monoid's elements stacked as [F, ...]."""
    n = len(monoid.fields)

    def identity():
        return torch.stack([torch.full_like(like[0], v) for v in monoid.identity])

    def combine(x, y):
        return torch.stack(monoid.combine(tuple(x[i] for i in range(n)), tuple(y[i] for i in range(n))))

    return lambda gathered: fold_carries(plan, gathered, combine, identity)


def halo(group, plan: ShardPlan, x: torch.Tensor, width: int, needs_grad: bool, initial: torch.Tensor | None = None):
    """A causal convolution's halo under context parallelism: x [B, T_rank, D] -> (the `width` inputs
    before this shard, the global last `width` inputs), each [B, width, D].

    Where the global sequence has fewer than `width` earlier inputs, the older ones come from `initial`
    [B, width, D] (a carried conv window; zeros when None). Exchanged like a summary: each rank sends
    its last `width` inputs (zero-padded on the left), so a shard shorter than the halo works too."""
    B, T, D = x.shape
    pad = lambda t: torch.cat([t.new_zeros(B, width - t.shape[1], D), t], 1)   # noqa: E731
    tail = pad(x[:, max(0, T - width):])

    def build(gathered):
        windows, real = [], gathered.new_zeros(B, 0, D)
        for r in range(plan.world):
            windows.append(pad(real[:, max(0, real.shape[1] - width):]))
            n = min(width, plan.lengths[r])
            real = torch.cat([real, gathered[r][:, width - n:]], 1)
        windows.append(pad(real[:, max(0, real.shape[1] - width):]))
        return windows

    before, last = exchange(group, tail, build, needs_grad)
    if initial is None:
        return before, last
    older = lambda available: torch.cat([initial[:, available:], x.new_zeros(B, available, D)], 1)  # noqa: E731
    return (before + older(min(width, plan.offset)).to(before.dtype),
            last + older(min(width, plan.total)).to(last.dtype))


def validated(group, check: Callable):
    """`check()`'s result; if it raises a ValueError/TypeError, the same error is raised on every rank
    (the failing rank joins `agree` with it, where the others are waiting)."""
    try:
        return check()
    except (TypeError, ValueError) as exc:
        agree(group, 0, {}, exc)
        raise


def layer_plan(group, x: torch.Tensor, same: dict) -> ShardPlan:
    """The plan of a layer call on x [B, T_rank, D] (one `agree` of x and the layer's `same`)."""
    same = {"x": (str(x.dtype), x.device.type, (x.shape[0],) + tuple(x.shape[2:]), x.requires_grad), **same}
    return make_plan(agree(group, x.shape[1], same), dist.get_rank(group))
