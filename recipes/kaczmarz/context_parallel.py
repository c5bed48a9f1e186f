"""`delta_rule` / `kaczmarz_delta_rule` with `cp_group=`: the state itself is the summary.

A shard maps the state entering it linearly (per sequence and head, S [K, V]):

    S_out = A S_in + R,      A = prod_t exp(g_t) (I - beta_t k_t k_t^T)   [K, K],   R = S_out(S_in = 0)

and so does every output inside it: o_t = scale (A_t S_in + R_t)^T q_t = o_t(0) + S_in^T u_t with
u_t = scale A_t^T q_t. Both come from ONE run of the op itself on an augmented problem: values
[v | 0_K] and initial state [0 | I_K] give the state [R_t | A_t] and the output [o_t(0) | u_t]
(the step beta and the decay do not read v, so the extra K columns carry the transition matrices
through the same chunked kernels and their gradients). So each rank runs its shard once with V + K
value columns, all-gathers (A, R) of its last piece ([H, K, K + V] per sequence crossing a
boundary), folds (A2, R2) o (A1, R1) = (A2 A1, A2 R1 + R2) in fp32 (float64 for float64 inputs), and
adds the closed-form correction S_in^T u_t to the outputs of the piece the carry enters (and of the
exit piece, whose start state `initial_state` then applies). No second pass over the shard.
"""
from __future__ import annotations

import numbers

import torch
import torch.distributed as dist

from scanlang import context_parallel as cp
from scanlang._checks import check_log_decay


def _affine_fold(plan, like: torch.Tensor):
    K = like.shape[-2]

    def identity():
        eye = torch.eye(K, dtype=like.dtype, device=like.device).expand(*like.shape[:-1], K)
        return torch.cat([eye, torch.zeros_like(like[..., K:])], -1)

    def combine(x, y):   # x earlier, y later: S -> A_y (A_x S + R_x) + R_y
        ax, rx, ay, ry = x[..., :K], x[..., K:], y[..., :K], y[..., K:]
        return torch.cat([ay @ ax, ay @ rx + ry], -1)

    return lambda gathered: cp.fold_carries(plan, gathered, combine, identity)


def delta_rule_sharded(run, validate, max_head_dim, q, k, v, g, step, step_name, scale, initial_state,
                       output_final_state, cu_seqlens, backend, chunk_size, group, eps=None):
    """The shard of `delta_rule` on `group`: `run` is the op itself (called with cp_group=None),
    `validate` its input check (`ops.validate`), `max_head_dim` the kernels' limit on V + K."""
    try:
        backend_name, compute, _ = validate(q, k, v, g, step, step_name, scale, None, None, backend, chunk_size)
        check_log_decay(g)
        B, T, H, K = k.shape
        V = v.shape[-1]
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0):
            raise ValueError(f"eps must be a real number >= 0, got {eps!r}")
        if V + K > max_head_dim and backend_name == "triton":
            raise ValueError(f"v: under cp_group the Triton kernels carry V + K = {V + K} value columns (the "
                             f"transition matrix rides along); that must be <= {max_head_dim}")
        if cu_seqlens is not None:
            if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (
                    torch.int32, torch.int64):
                raise ValueError("cu_seqlens must be a 1-D int32/int64 tensor [N + 1] of GLOBAL sequence offsets")
            if B != 1:
                raise ValueError(f"cu_seqlens packs sequences along T and needs B == 1, got B = {B}")
        if initial_state is not None and not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"initial_state must be a tensor [N, H, K, V] or None, got {type(initial_state).__name__}")
    except (TypeError, ValueError) as exc:
        cp.agree(group, 0, {}, exc)
        raise
    drop_t = lambda t: (str(t.dtype), t.device.type, (t.shape[0],) + tuple(t.shape[2:]), t.requires_grad)  # noqa: E731
    same = {"q": drop_t(q), "k": drop_t(k), "v": drop_t(v), "g": drop_t(g), step_name: drop_t(step),
            "initial_state": cp.describe(initial_state), "cu_seqlens": cp.cu_signature(cu_seqlens),
            "scale": scale, "eps": eps, "backend": backend_name, "chunk_size": chunk_size,
            "output_final_state": bool(output_final_state)}
    lengths = cp.agree(group, T, same)
    cu = None if cu_seqlens is None else cp.check_global_cu_seqlens(cu_seqlens, sum(lengths))
    n_seq = B if cu is None else len(cu) - 1
    if initial_state is not None:   # the same shape on every rank (agreed): every rank raises alike
        want = [n_seq, H, K, V]
        if list(initial_state.shape) != want:
            raise ValueError(f"initial_state must have shape [N, H, K, V] = {want}, got {list(initial_state.shape)}")
        if initial_state.dtype not in (torch.float32, compute) or initial_state.device != k.device:
            raise ValueError(f"initial_state must be float32 (float64 with float64 inputs) on {k.device}, "
                             f"got {initial_state.dtype} on {initial_state.device}")
    plan = cp.make_plan(lengths, dist.get_rank(group), False, cu)
    state_dtype = torch.float64 if compute == torch.float64 else torch.float32
    dev = k.device
    h0 = None if initial_state is None else initial_state.to(state_dtype)
    eye = torch.eye(K, dtype=state_dtype, device=dev)
    lanes = B if cu is None else 1                       # summaries: one per batch row, or the exit piece

    if T:
        pieces = B if cu is None else len(plan.local_cu) - 1
        ends = {plan.entry, plan.exit} if cu is not None else set(range(B))
        zero_state = torch.zeros(H, K, V, dtype=state_dtype, device=dev)
        starts = []
        for i in range(pieces):
            if i in ends:
                starts.append(torch.cat([zero_state, eye.expand(H, K, K)], -1))
            else:
                own = h0[plan.piece_seq[i]] if h0 is not None else zero_state
                starts.append(torch.cat([own, torch.zeros(H, K, K, dtype=state_dtype, device=dev)], -1))
        v_aug = torch.cat([v, v.new_zeros(B, T, H, K)], -1)
        local_cu = None if cu is None else torch.tensor(plan.local_cu, dtype=torch.int64, device=dev)
        o_aug, s_aug = run(q, k, v_aug, g, step, scale=scale, initial_state=torch.stack(starts),
                           output_final_state=True, cu_seqlens=local_cu, backend=backend, chunk_size=chunk_size)
        o0, u = o_aug[..., :V], o_aug[..., V:].to(state_dtype)
        maps = torch.cat([s_aug[..., V:], s_aug[..., :V]], -1).to(state_dtype)   # [pieces, H, K, K + V] = [A | R]
        summary = maps if cu is None else maps[plan.exit].unsqueeze(0)
    else:
        summary = torch.cat([eye.expand(lanes, H, K, K), torch.zeros(lanes, H, K, V, dtype=state_dtype, device=dev)],
                            -1)
        summary = cp.tie(summary, q, k, v, g, step)
    grad = cp.needs_grad(q, k, v, g, step, initial_state)
    carry, total = cp.exchange(group, summary, _affine_fold(plan, summary), grad)

    def apply(m, s):   # the affine map m = [A | R] applied to a state s
        return m[..., :K] @ s + m[..., K:]

    def start_of(n):   # the state entering sequence n at its first token: initial_state or zero
        return h0[n] if h0 is not None else torch.zeros(H, K, V, dtype=state_dtype, device=dev)

    if T and cu is None:
        s_in = apply(carry, h0) if h0 is not None else carry[..., K:]                 # [B, H, K, V]
        o = o0 + torch.einsum("bthk,bhkv->bthv", u, s_in).to(o0.dtype)
        piece_finals = apply(maps, s_in)
    elif T:
        s_in = apply(carry[0], start_of(plan.piece_seq[plan.entry]))
        bounds = plan.local_cu
        segments, piece_finals = [], []
        for i in range(len(bounds) - 1):
            lo, hi = bounds[i], bounds[i + 1]
            if i == plan.entry or i == plan.exit:
                start = s_in if i == plan.entry else start_of(plan.piece_seq[i])
                segments.append(o0[:, lo:hi] + torch.einsum("bthk,hkv->bthv", u[:, lo:hi], start).to(o0.dtype))
                piece_finals.append(apply(maps[i], start))
            else:
                segments.append(o0[:, lo:hi])
                piece_finals.append(s_aug[i, ..., :V].to(state_dtype))
        o = torch.cat(segments, 1)
        piece_finals = torch.stack(piece_finals)
    else:
        o = cp.keep_in_graph(torch.zeros(B, 0, H, V, dtype=torch.float32 if compute != torch.float64 else compute,
                                         device=dev), carry)
    if not output_final_state:
        return o, None
    if cu is None:
        final = apply(total, h0) if h0 is not None else total[..., K:]
        return o, final.to(torch.float32 if state_dtype == torch.float32 else state_dtype)
    mine = torch.zeros(n_seq, H, K, V, dtype=state_dtype, device=dev)
    for piece, n in (plan.sequence_ends_here() if T else []):
        mine = mine.index_put((torch.tensor([n], device=dev),), piece_finals[piece].unsqueeze(0))
    if plan.rank == 0:
        for n in plan.empty_sequences():
            mine = mine.index_put((torch.tensor([n], device=dev),), start_of(n).unsqueeze(0))
    return o, cp.all_reduce_sum(group, cp.keep_in_graph(mine, carry))


def conv_halos(group, layer, x, projected, windows, state):
    """`KaczmarzLinearAttention` under context parallelism: the q, k, v convolutions' windows before
    this shard and the global last ones (for `return_state`), from ONE halo exchange of the three
    projections side by side (conv_size - 1 tokens each); `state`'s windows fill in before token 0."""
    same = {"state": None if state is None else tuple(cp.describe(t) for t in state),
            "layer": (layer.hidden_size, layer.num_heads, layer.mode, layer.conv_size, layer.backend)}
    plan = cp.layer_plan(group, x, same)
    width = layer.conv_size - 1
    sizes = [p.shape[-1] for p in projected]
    joint = torch.cat(projected, -1)
    if width == 0:
        empty = joint.new_zeros(joint.shape[0], 0, joint.shape[-1]).split(sizes, -1)
        return empty, empty
    initial = None if state is None else torch.cat([w.to(joint.dtype) for w in windows], -1)
    before, last = cp.halo(group, plan, joint, width, cp.needs_grad(joint, initial), initial)
    return before.split(sizes, -1), last.split(sizes, -1)
