"""`kalman_filter` with `cp_group=`: the 3x3 `KalmanJoint` element is the summary.

Per entry (b, m, s) a shard maps the state entering it, (lam, eta), through the product of its 3x3
leaves (docs/spec/kalman.md, `monoids.KalmanJoint`: a Möbius map on lam and an affine map on eta whose
gate depends on lam), so a rank's summary is that product: 7 numbers per entry, renormalised by the
trace of its 2x2 block. The readout (eta / lam read by q, q^2 / lam) and the gates are nonlinear in
lam, so there is no closed-form correction of the outputs: each rank

1. reduces its shard to the 3x3 product (one `sl.scan` of `KalmanJoint` from the identity, keeping
   the last prefix),
2. all-gathers the [7, B, M, S] summaries and folds the ones before it with the same combine,
3. re-runs its shard with `kalman_filter` itself from the true state (lam, eta) = the carry applied
   to the user's (or the default) initial state.
The final state (output_final_state) is the fold of every summary applied to the initial state, the
same on every rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import scanlang as sl
from scanlang import context_parallel as cp

from . import monoids as K
from .reference import expand_heads


def kalman_filter_sharded(run, check_shapes, check_values, v, prec, k, q, a_bar, p_bar, initial_state,
                          output_final_state, backend, validate, form, group):
    """The shard of `kalman_filter` on `group`; `run` is the op itself (called with cp_group=None),
    `check_shapes` / `check_values` its input checks."""
    try:
        batch, length, channels, state_size = check_shapes(v, prec, k, q, a_bar, p_bar, initial_state)
        if validate is None:
            validate = v.device.type == "cpu"
        if validate:
            check_values(prec, a_bar, p_bar, initial_state)
    except (TypeError, ValueError) as exc:
        cp.agree(group, 0, {}, exc)
        raise
    drop_t = lambda t: (str(t.dtype), t.device.type, (t.shape[0],) + tuple(t.shape[2:]), t.requires_grad)  # noqa: E731
    same = {"v": drop_t(v), "prec": drop_t(prec), "k": drop_t(k), "q": drop_t(q), "a_bar": cp.describe(a_bar),
            "p_bar": cp.describe(p_bar), "initial_state": None if initial_state is None else
            tuple(cp.describe(s) for s in initial_state), "backend": backend, "form": form,
            "output_final_state": bool(output_final_state)}
    lengths = cp.agree(group, length, same)
    plan = cp.make_plan(lengths, dist.get_rank(group))
    dtype = torch.float64 if any(x.dtype == torch.float64 for x in (v, prec, k, q, a_bar, p_bar)) else torch.float32
    if initial_state is None:
        lam0 = torch.ones(batch, channels, state_size, dtype=dtype, device=v.device)
        eta0 = torch.zeros_like(lam0)
    else:
        lam0, eta0 = (s.to(dtype) for s in initial_state)
    lanes = (batch, channels, state_size)
    if length:
        phi, r = K.increments(v.to(dtype).unsqueeze(-1), prec.to(dtype).unsqueeze(-1),
                              expand_heads(k.to(dtype), channels))
        a, a2, p = K.floored_dynamics(a_bar.to(dtype), p_bar.to(dtype))
        prefix = sl.scan(K.KalmanJoint, K.joint_leaf(phi, r, a, a2, p), dim=1, backend=backend)
        summary = torch.stack([f[:, -1] for f in prefix])
    else:
        summary = torch.stack([torch.full(lanes, x, dtype=dtype, device=v.device) for x in K.KalmanJoint.identity])
        summary = cp.tie(summary, v, prec, k, q)
    grad = cp.needs_grad(v, prec, k, q, a_bar, p_bar, *(initial_state or ()))
    carry, total = cp.exchange(group, summary, cp.monoid_fold(K.KalmanJoint, plan, summary), grad)
    lam_in, eta_in = K.apply_joint(tuple(carry), lam0, eta0)
    if length:
        y, y_var, _ = run(v, prec, k, q, a_bar, p_bar, initial_state=(lam_in, eta_in), output_final_state=False,
                          backend=backend, validate=False, form=form)
    else:   # nothing to filter (kalman_filter's own backward does not take T = 0)
        y = cp.keep_in_graph(torch.zeros(batch, 0, channels, dtype=dtype, device=v.device), carry)
        y_var = y.clone()
    state = K.apply_joint(tuple(total), lam0, eta0) if output_final_state else None
    return y, y_var, state


def conv_halo(group, layer, x, z, window, state):
    """`KalmanLinearAttention` under context parallelism: its conv window before this shard and the
    global last one, [B, M, d_conv - 1] each, from one halo exchange of z [B, T, M]; the carried
    `state.conv` fills in before token 0."""
    same = {"state": tuple(cp.describe(t) for t in state),
            "layer": (layer.d_model, layer.d_state, layer.d_inner, layer.d_conv, layer.sensor, layer.backend)}
    plan = cp.layer_plan(group, x, same)
    width = layer.d_conv - 1
    if width == 0:
        return window, window
    before, last = cp.halo(group, plan, z, width, cp.needs_grad(z, window), window.transpose(1, 2))
    return before.transpose(1, 2), last.transpose(1, 2)
