"""`sl.scan` and `sl.mixer` calls with `cp_group=`: the sharded paths (`scanlang.context_parallel`).

sl.scan: each rank scans its shard from the identity (the backend's own scan and gradient), its
summary is the last local prefix (`reverse`: the first), and after the exchange every output is
corrected in closed form, `out_t = (initial (+) carry) (+) local_t`, one elementwise combine
(exact by associativity; renormalised for projective monoids).

sl.mixer: the readout is an arbitrary function of the prefix, so a closed-form correction does not
exist in general: pass 1 runs the shard from the identity for its summary (the mixer's `final`),
pass 2 re-runs it from the true carry as `initial`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import context_parallel as cp


def scan_sharded(group, monoid, elems, dim: int, reverse: bool, initial, out_dtype, run, result_cls):
    """The shard of `sl.scan`; `elems`, `initial` as `_prepare` returns them, `run` the backend's scan."""
    shape = torch.broadcast_shapes(*(e.shape for e in elems))
    same = {"monoid": monoid.key, "dim": (dim, len(shape)), "reverse": reverse, "out_dtype": str(out_dtype)}
    for f, e in zip(monoid.fields, elems):
        same[f"elems[{f!r}]"] = (str(e.dtype), e.device.type, tuple(n for i, n in enumerate(e.shape) if i != dim),
                                 e.requires_grad)
    same["initial"] = None if initial is None else tuple(cp.describe(i) for i in initial)
    lengths = cp.agree(group, shape[dim], same)
    plan = cp.make_plan(lengths, dist.get_rank(group), reverse)
    lane_shape = shape[:dim] + shape[dim + 1:]
    device = elems[0].device
    if plan.length:
        local = run(monoid, elems, dim, reverse, None, out_dtype)
        at = 0 if reverse else plan.length - 1
        summary = torch.stack([x.select(dim, at).expand(lane_shape) for x in local])
    else:
        local = tuple(torch.empty(shape, dtype=out_dtype, device=device) for _ in monoid.fields)
        summary = torch.stack([torch.full(lane_shape, v, dtype=out_dtype, device=device) for v in monoid.identity])
        summary = cp.tie(summary, *elems)
    grad = cp.needs_grad(*elems, *(initial or ()))
    carry, _ = cp.exchange(group, summary, cp.monoid_fold(monoid, plan, summary), grad)
    prefix = tuple(carry[i] for i in range(len(monoid.fields)))
    if initial is not None:
        prefix = monoid.combine(tuple(i.to(out_dtype) for i in initial), prefix)
    prefix = tuple(p.unsqueeze(dim) for p in prefix)
    out = monoid.combine(prefix, local)
    out = tuple(o.expand(shape) if o.shape != shape else o for o in out)
    if not plan.length:
        out = tuple(cp.keep_in_graph(o, carry) for o in out)
    return result_cls(*out)


def mixer_sharded(mix, group, initial, output_final_state: bool, reverse: bool, cu_seqlens, tensors: dict):
    """The shard of a `sl.mixer` call (see the module docstring)."""
    monoid = mix.monoid
    n_fields = len(monoid.fields)
    try:
        if tensors.keys() != mix.input_axes.keys():
            names = list(mix.input_axes)
            raise ValueError(f"inputs: expected exactly {names}; unknown {[n for n in tensors if n not in names]}, "
                             f"missing {[n for n in names if n not in tensors]}")
        values = [tensors[n] for n in mix.input_axes]
        _, fp64, lane_shape, length = mix._validate(values)
        if cu_seqlens is not None and (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1
                                       or cu_seqlens.dtype not in (torch.int32, torch.int64)):
            raise ValueError("cu_seqlens: expected a 1-d int32/int64 tensor [N + 1] of global sequence offsets")
    except (TypeError, ValueError) as exc:
        cp.agree(group, 0, {}, exc)
        raise
    device = values[0].device
    dtype = torch.float64 if fp64 else torch.float32
    same = {"mixer": mix.key, "reverse": reverse, "output_final_state": output_final_state,
            "cu_seqlens": cp.cu_signature(cu_seqlens)}
    for n, t in zip(mix.input_axes, values):
        ax = mix.input_axes[n]
        kept = tuple(s for a, s in zip(ax, t.shape) if a != "t")
        same[n] = (str(t.dtype), t.device.type, kept, "t" in ax, t.requires_grad)
    same["initial"] = None if initial is None else repr([cp.describe(v) if isinstance(v, torch.Tensor) else float(v)
                                                         for v in (initial.values() if isinstance(initial, dict)
                                                                   else initial)])
    lengths = cp.agree(group, length, same)
    cu = None if cu_seqlens is None else cp.check_global_cu_seqlens(cu_seqlens, sum(lengths))
    plan = cp.make_plan(lengths, dist.get_rank(group), reverse, cu)
    n_seq = None if cu is None else len(cu) - 1
    state_shape = list(lane_shape) if cu is None else [n_seq] + list(lane_shape)
    if initial is None:
        init = [torch.full(state_shape, v, dtype=dtype, device=device) for v in monoid.identity]
    else:
        init, _ = mix._initial(initial, state_shape, fp64, device)
    init = torch.stack(init)                                        # [F, (N,) *lanes]
    local_cu = None if cu is None else torch.tensor(plan.local_cu, dtype=torch.int64, device=device)

    if plan.length:
        first = mix(output_final_state=True, reverse=reverse, cu_seqlens=local_cu, **tensors).final
        summary = torch.stack([f if cu is None else f[plan.exit] for f in first])
    else:
        summary = torch.stack([torch.full(lane_shape, v, dtype=dtype, device=device) for v in monoid.identity])
        summary = cp.tie(summary, *values)
    grad = cp.needs_grad(*values, *(initial.values() if isinstance(initial, dict) else (initial or ())))
    carry, total = cp.exchange(group, summary, cp.monoid_fold(monoid, plan, summary), grad)

    def enter(start):   # the state entering a piece from `start` [F, *lanes] and the carry
        return torch.stack(monoid.combine(tuple(start[i] for i in range(n_fields)),
                                          tuple(carry[i] for i in range(n_fields))))

    if plan.length:
        if cu is None:
            starts = enter(init)
        else:
            per_piece = init[:, list(plan.piece_seq)]                # [F, pieces, *lanes]
            entry = enter(per_piece[:, plan.entry])
            starts = torch.cat([per_piece[:, :plan.entry], entry.unsqueeze(1), per_piece[:, plan.entry + 1:]], 1)
        out = mix(initial=tuple(starts[i] for i in range(n_fields)), output_final_state=output_final_state,
                  reverse=reverse, cu_seqlens=local_cu, **tensors)
        outputs = tuple(getattr(out, name) for name in mix.outputs)
    else:
        outputs = tuple(cp.keep_in_graph(_empty_output(mix, values, dtype), carry) for _ in mix.outputs)
    final = None
    if output_final_state:
        if cu is None:
            final = torch.stack(monoid.combine(tuple(init[i] for i in range(n_fields)),
                                               tuple(total[i] for i in range(n_fields))))
        else:
            mine = torch.zeros_like(init).movedim(1, 0)            # [N, F, *lanes]: sequences first
            ends = plan.sequence_ends_here()
            if ends:
                pieces, seqs = zip(*ends)
                mine = mine.index_put((torch.tensor(seqs, device=device),),
                                      torch.stack(out.final)[:, list(pieces)].movedim(1, 0))
            if plan.rank == 0 and plan.empty_sequences():   # nothing scanned: the final is the initial
                empty = torch.tensor(plan.empty_sequences(), device=device)
                mine = mine.index_put((empty,), init[:, empty].movedim(1, 0))
            mine = mine.movedim(0, 1)
            final = cp.all_reduce_sum(group, cp.keep_in_graph(mine, carry))
        final = tuple(final[i] for i in range(n_fields))
    return mix.result(*outputs, final)


def _empty_output(mix, values, dtype) -> torch.Tensor:
    sizes = {}
    for n, t in zip(mix.input_axes, values):
        sizes.update(zip(mix.input_axes[n], t.shape))
    sizes["t"] = 0
    return torch.zeros([sizes[a] for a in mix.axes if a != mix.reduce], dtype=dtype, device=values[0].device)
