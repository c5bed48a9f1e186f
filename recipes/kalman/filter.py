"""`kalman_filter`: Kalman linear attention's scan, built from scanlang scans, with an exact backward.

Per entry (b, m, s), t = 1..T (docs/spec/kalman.md), with `a = a_bar[m, s]`, `p = p_bar[m, s]`:

    den_t = a^2 + p lam_{t-1}
    lam_t = lam_{t-1} / den_t + prec_t k_t^2                    precision
    eta_t = (a / den_t) eta_{t-1} + prec_t v_t k_t              information mean
    y_t     = sum_s q_t eta_t / lam_t                           posterior mean read out by q
    y_var_t = sum_s q_t^2 / lam_t                               posterior variance read out by q^2

Three ways to run it (`form=`):
- "fused" / "fused_two" (recipes/kalman/fused.py): generated `sl.mixer` kernels that fuse lift, scan
  and readout — the 3x3 monoid as one mixer, or a Möbius mixer then an affine mixer; their backward
  is the generator's adjoint of the same program.
- "two_scans": one Möbius `sl.scan` for `lam` (trace-normalised 2x2 products, never differentiated),
  then one affine `sl.scan` for `eta` whose gates read `lam_{t-1}` from the previous prefix; "joint":
  one `sl.scan` of the 3x3 monoid. Both use the spec's exact adjoint (`_KalmanScan`): two reverse
  affine scans that each carry one scalar per entry, also run by `sl.scan` (generated kernels on
  CUDA), with the lift and readout in PyTorch.
The gates read `lam_{t-1}` rather than recovering it locally as `a^2 (lam_t - phi_t) / (1 - p (lam_t -
phi_t))`: that recovery cancels when the observation dominates the prior (measured in fp32 at
T = 3000, precisions up to 1e3: 1.6e-4 relative error in lam_{t-1} and in the gate, 0 for the read).
"""
from __future__ import annotations

import torch

import scanlang as sl
from scanlang import backend as registry
from scanlang import context_parallel

from . import fused
from . import monoids as K
from .context_parallel import kalman_filter_sharded
from .reference import expand_heads

SCAN_FORMS = ("two_scans", "joint")
FUSED_FORMS = ("fused", "fused_two")
FORMS = FUSED_FORMS + SCAN_FORMS
DEFAULT_FORM = "two_scans"


def kalman_filter(v, prec, k, q, a_bar, p_bar, initial_state=None, output_final_state=False,
                  backend=None, validate=None, form=None, cp_group=None):
    """Run the information-form Kalman filter over time and read it out.

    Law, per entry (b, m, s) with a = a_bar[m, s], p = p_bar[m, s] (docs/spec/kalman.md):
        lam_t = lam_{t-1} / (a^2 + p lam_{t-1}) + prec_t k_t^2,
        eta_t = a / (a^2 + p lam_{t-1}) * eta_{t-1} + prec_t v_t k_t,
        y_t = sum_s q_t eta_t / lam_t,  y_var_t = sum_s q_t^2 / lam_t.

    Args:
        v, prec: [B,T,M] observed values and their precisions (finite, > 0; huge ones such as 1e30
            are fine: the precision scan renormalises its leaves).
        k, q: [B,T,S] keys and queries shared by all M channels, or [B,T,H,S] with the channels
            split into H contiguous groups of M/H (head h serves channels h*M/H .. (h+1)*M/H - 1).
        a_bar: [M,S] discrete decay in (0, 1]; p_bar: [M,S] discrete process noise (> 0).
        initial_state: (lam, eta), each [B,M,S] float32/float64; default lam = 1, eta = 0.
        output_final_state: also return (lam_T, eta_T).
        backend: as in `sl.scan` ("reference", "triton", or None for triton on CUDA).
        validate: check values (prec and p_bar finite and > 0, 0 < a_bar <= 1, lam0 finite and > 0,
            eta0 finite); None checks CPU tensors only (a check on GPU tensors costs a
            synchronisation), True always, False never. Unchecked values outside that domain (an
            infinite or negative precision) give NaN, not an error.
        form: how to scan. "fused": the 3x3 monoid as one `sl.mixer` (one generated forward and one
            backward kernel; needs backend "triton" and S a power of two); "fused_two": a Möbius
            mixer then an affine mixer (same needs); "two_scans": Möbius then
            affine `sl.scan`s with the spec's exact adjoint; "joint": one `sl.scan` of the 3x3 monoid
            with that adjoint. None: `choose_form` (measured: "fused" for generated kernels
            without gradients, else "two_scans").
        cp_group: context parallelism over T (a ProcessGroup or 1-D DeviceMesh): each rank passes
            its shard and the same `initial_state`; the state is exchanged as the 3x3 summary and
            each shard re-run from the true state (`recipes/kalman/context_parallel.py`); the final
            state is the global one on every rank.

    Returns:
        (y, y_var, state): y and y_var [B,T,M] in float32 (float64 when an input is float64);
        state = (lam, eta) each [B,M,S], or None unless `output_final_state`.

    >>> import torch
    >>> B, T, M, S = 1, 5, 3, 2
    >>> v, prec = torch.randn(B, T, M), torch.rand(B, T, M) + 0.5
    >>> k, q = torch.randn(B, T, S), torch.randn(B, T, S)
    >>> a_bar, p_bar = torch.full((M, S), 0.9), torch.full((M, S), 0.1)
    >>> y, y_var, (lam, eta) = kalman_filter(v, prec, k, q, a_bar, p_bar, output_final_state=True)
    >>> y.shape, lam.shape
    (torch.Size([1, 5, 3]), torch.Size([1, 3, 2]))
    """
    group = context_parallel.resolve_group(cp_group)
    if group is not None:
        return kalman_filter_sharded(kalman_filter, _check_shapes, _check_values, v, prec, k, q, a_bar, p_bar,
                                     initial_state, output_final_state, backend, validate, form, group)
    batch, length, channels, state_size = _check_shapes(v, prec, k, q, a_bar, p_bar, initial_state)
    if form is not None and form not in FORMS:
        raise ValueError(f"form: expected one of {FORMS} or None, got {form!r}")
    resolved = backend if backend is not None else registry.default(v.device)
    if form is None:
        tensors = [v, prec, k, q, a_bar, p_bar, *(initial_state or ())]
        form = choose_form(resolved, state_size, torch.is_grad_enabled() and any(x.requires_grad for x in tensors),
                           lanes=batch * channels * state_size)
    elif form in FUSED_FORMS and (resolved != "triton" or not fused.supports(state_size)):
        raise ValueError(f"form: {form!r} runs the generated mixer kernels: it needs backend='triton' (got "
                         f"{resolved!r}) and a power-of-two state size S (got {state_size})")
    if validate is None:
        validate = v.device.type == "cpu"
    if validate:
        _check_values(prec, a_bar, p_bar, initial_state)
    dtype = torch.float64 if any(x.dtype == torch.float64 for x in (v, prec, k, q, a_bar, p_bar)) else torch.float32
    v, prec, k, q, a_bar, p_bar = (x.to(dtype) for x in (v, prec, k, q, a_bar, p_bar))
    if initial_state is None:
        lam0 = torch.ones(batch, channels, state_size, dtype=dtype, device=v.device)
        eta0 = torch.zeros_like(lam0)
    else:
        lam0, eta0 = (s.to(dtype) for s in initial_state)

    if form in FUSED_FORMS:
        if length == 0:
            y = v.new_zeros(batch, 0, channels)
            return y, y.clone(), ((lam0, eta0) if output_final_state else None)
        return fused.fused_filter(v, prec, k, q, a_bar, p_bar, lam0, eta0, output_final_state,
                                  two_scans=form == "fused_two")

    k_full, q_full = expand_heads(k, channels), expand_heads(q, channels)
    phi, r = K.increments(v.unsqueeze(-1), prec.unsqueeze(-1), k_full)
    a, a2, p = K.floored_dynamics(a_bar, p_bar)
    lam, eta = _KalmanScan.apply(phi, r, a, a2, p, lam0, eta0, backend, form)

    inv_lam = 1 / lam.clamp_min(K.LAM_FLOOR)
    y = (q_full * eta * inv_lam).sum(-1)
    y_var = (q_full * q_full * inv_lam).sum(-1)
    state = None
    if output_final_state:
        state = (lam[:, -1], eta[:, -1]) if length else (lam0, eta0)
    return y, y_var, state


def choose_form(backend: str, state_size: int, needs_grad: bool, lanes: int = 0) -> str:
    """The default `form`, from the GPU measurements at B8 T4096 M1536 S16 (BENCHMARKS_HISTORY.md,
    "Kalman linear attention").

    Generated kernels with enough lanes (B M S) for the lane-sequential schedule: the fused 3x3
    mixer, forward and backward (several times faster than the sl.scan path on that schedule).
    Fewer lanes (tile schedule), no gradient: the fused mixer; with a gradient: the sl.scan path
    with the spec's adjoint (the fused mixer's generated tile backward is about ten times slower).
    The reference backend: two scans.
    """
    if backend != "triton":   # the reference backend never needs Triton imported
        return DEFAULT_FORM
    if fused.supports(state_size) and (registry.get("triton").prefers_lanes(lanes) or not needs_grad):
        return "fused"
    return DEFAULT_FORM


class _KalmanScan(torch.autograd.Function):
    """(phi, r, a, a^2, p, lam0, eta0) -> (lam, eta), both [B,T,M,S], with the spec's exact adjoint."""

    @staticmethod
    def forward(ctx, phi, r, a, a2, p, lam0, eta0, backend, form):
        lam, eta = filter_states(phi, r, a, a2, p, lam0, eta0, backend, form)
        ctx.save_for_backward(lam, eta, a, a2, p, lam0, eta0)
        ctx.backend = backend
        return lam, eta

    @staticmethod
    def backward(ctx, g_lam, g_eta):
        # Plain differentiable ops and sl.scans: under create_graph=True autograd records them, and a
        # second derivative goes through them and, for lam and eta, back through this Function, so
        # it is exact wherever the scans are differentiable (the generated ones once: third
        # derivatives on the Triton backend are refused by its scans).
        lam, eta, a, a2, p, lam0, eta0 = ctx.saved_tensors
        grads = filter_adjoint(lam, eta, a, a2, p, lam0, eta0, g_lam, g_eta, ctx.backend)
        return (*grads, None, None)


def filter_states(phi, r, a, a2, p, lam0, eta0, backend=None, form=DEFAULT_FORM):
    """The forward recursion's states (lam_t, eta_t) for t = 1..T, by scans along dim 1."""
    if phi.shape[1] == 0:
        return phi.clone(), r.clone()
    if form == "joint":
        prefix = sl.scan(K.KalmanJoint, K.joint_leaf(phi, r, a, a2, p), dim=1, backend=backend)
        return K.apply_joint(prefix, lam0.unsqueeze(1), eta0.unsqueeze(1))
    prefix = sl.scan(K.PRECISION, K.precision_leaf(phi, a2, p), dim=1, backend=backend)
    lam = K.apply_precision(prefix, lam0.unsqueeze(1))
    lam_prev = torch.cat([lam0.unsqueeze(1), lam[:, :-1]], 1)
    gate, _ = K.information_leaf(lam_prev, r, a, a2, p)
    eta = sl.scan(K.INFORMATION, (gate, r), dim=1, initial=(0.0, eta0), backend=backend).b
    return lam, eta


def filter_adjoint(lam, eta, a, a2, p, lam0, eta0, g_lam, g_eta, backend=None):
    """Gradients (phi, r, a, a^2, p, lam0, eta0) from the upstream (g_lam, g_eta), per docs/spec/kalman.md.

    With den_{t+1} = a^2 + p lam_t and f_{t+1} = a / den_{t+1} (both 0 past the end):

        nuE_t = g_eta_t + f_{t+1} nuE_{t+1}
        nuL_t = g_lam_t - eta_t (p / den_{t+1}) f_{t+1} nuE_{t+1} + (a^2 / den_{t+1}^2) nuL_{t+1}

    are two reverse affine scans; dL/dphi_t = nuL_t, dL/dr_t = nuE_t, and the parameters collect
    the partials of den_t and f_t. The den floor is inactive whenever lam_{t-1} >= 0 (a^2 is
    already floored), so the formulas are exact for every valid input.
    """
    zero_step = torch.zeros_like(lam[:, :1])
    if g_lam is None:
        g_lam = torch.zeros_like(lam)
    if g_eta is None:
        g_eta = torch.zeros_like(eta)
    lam_prev = torch.cat([lam0.unsqueeze(1), lam[:, :-1]], 1)
    eta_prev = torch.cat([eta0.unsqueeze(1), eta[:, :-1]], 1)
    den = (a2 + p * lam_prev).clamp_min(K.DEN_FLOOR)
    inv_den = 1 / den
    gate = a * inv_den
    # coefficients of step t+1 seen from step t; nothing follows the last step
    gate_next = torch.cat([gate[:, 1:], zero_step], 1)
    carry_lam_next = torch.cat([(a2 * inv_den * inv_den)[:, 1:], zero_step], 1)
    cross_next = torch.cat([(p * inv_den * gate)[:, 1:], zero_step], 1)

    nu_eta = sl.scan(K.INFORMATION, (gate_next, g_eta), dim=1, reverse=True, backend=backend).b
    nu_eta_next = torch.cat([nu_eta[:, 1:], zero_step], 1)
    source_lam = g_lam - eta * cross_next * nu_eta_next
    nu_lam = sl.scan(K.INFORMATION, (carry_lam_next, source_lam), dim=1, reverse=True, backend=backend).b

    # step 1 seen from the initial state
    g_lam0 = a2 * inv_den[:, 0] ** 2 * nu_lam[:, 0] - eta0 * p * inv_den[:, 0] * gate[:, 0] * nu_eta[:, 0]
    g_eta0 = gate[:, 0] * nu_eta[:, 0]
    # d L / d den_t through lam_t = lam_{t-1}/den_t + phi_t and eta_t = (a/den_t) eta_{t-1} + r_t
    g_den = -(nu_lam * lam_prev + nu_eta * eta_prev * a) * inv_den * inv_den
    g_a = _sum_to(nu_eta * eta_prev * inv_den, a)
    g_a2 = _sum_to(g_den, a2)
    g_p = _sum_to(g_den * lam_prev, p)
    return nu_lam, nu_eta, g_a, g_a2, g_p, g_lam0, g_eta0


def _sum_to(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Sum a broadcast gradient back to the shape of `like` (a static [M,S] parameter)."""
    lead = grad.dim() - like.dim()
    grad = grad.sum(dim=tuple(range(lead))) if lead else grad
    dims = tuple(i for i, n in enumerate(like.shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(dim=dims, keepdim=True) if dims else grad


# ---- input checks ---------------------------------------------------------------------------------

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_shapes(v, prec, k, q, a_bar, p_bar, initial_state):
    named = {"v": v, "prec": prec, "k": k, "q": q, "a_bar": a_bar, "p_bar": p_bar}
    for name, x in named.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(x).__name__}")
        if x.dtype not in _FLOATS:
            raise TypeError(f"{name}: dtype {x.dtype} is not supported; use float16, bfloat16, float32 or float64")
        if x.device != v.device:
            raise ValueError(f"{name}: on {x.device}, but v is on {v.device}; put every input on one device")
    if v.dim() != 3:
        raise ValueError(f"v: expected shape [B,T,M], got {tuple(v.shape)}")
    batch, length, channels = v.shape
    if prec.shape != v.shape:
        raise ValueError(f"prec: expected shape [B,T,M] = {tuple(v.shape)} like v, got {tuple(prec.shape)}")
    if k.dim() not in (3, 4) or tuple(k.shape[:2]) != (batch, length):
        raise ValueError(f"k: expected shape [B,T,S] or [B,T,H,S] with B,T = {batch},{length}, got {tuple(k.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q: expected the shape of k, {tuple(k.shape)}, got {tuple(q.shape)}")
    state_size = k.shape[-1]
    if k.dim() == 4 and (k.shape[2] == 0 or channels % k.shape[2]):
        raise ValueError(f"k: {k.shape[2]} heads do not divide the M = {channels} channels of v")
    for name in ("a_bar", "p_bar"):
        if tuple(named[name].shape) != (channels, state_size):
            raise ValueError(f"{name}: expected shape [M,S] = ({channels}, {state_size}) (M from v, S from k), "
                             f"got {tuple(named[name].shape)}")
    if initial_state is not None:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            raise ValueError("initial_state: expected a pair (lam, eta) of [B,M,S] tensors")
        for name, s in zip(("lam", "eta"), initial_state):
            if not isinstance(s, torch.Tensor):
                raise ValueError(f"initial_state {name}: expected a tensor, got {type(s).__name__}")
            if tuple(s.shape) != (batch, channels, state_size):
                raise ValueError(f"initial_state {name}: expected shape [B,M,S] = ({batch}, {channels}, "
                                 f"{state_size}), got {tuple(s.shape)}")
            if s.dtype not in (torch.float32, torch.float64):
                raise ValueError(f"initial_state {name}: dtype {s.dtype}; the state is float32 (or float64)")
            if s.device != v.device:
                raise ValueError(f"initial_state {name}: on {s.device}, but v is on {v.device}")
    return batch, length, channels, state_size


def _check_values(prec, a_bar, p_bar, initial_state):
    """The documented domain. +inf is refused with the rest: an infinite precision or noise makes the
    recursion inf / inf (NaN), never a limit the filter could take."""
    def positive(x):
        return bool(((x > 0) & torch.isfinite(x)).all())
    if not positive(prec):
        raise ValueError("prec: observation precisions must be > 0 and finite (not NaN or inf)")
    if not bool(((a_bar > 0) & (a_bar <= 1)).all()):
        raise ValueError("a_bar: the discrete decay must lie in (0, 1]")
    if not positive(p_bar):
        raise ValueError("p_bar: the discrete process noise must be > 0 and finite")
    if initial_state is not None:
        if not positive(initial_state[0]):
            raise ValueError("initial_state lam: precisions must be > 0 and finite")
        if not bool(torch.isfinite(initial_state[1]).all()):
            raise ValueError("initial_state eta: information means must be finite")
