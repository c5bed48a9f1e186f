"""The float64 oracle: the spec's information-form recursion stepped one token at a time.

A plain loop, differentiable by ordinary autograd (so its gradients are the oracle for the exact
backward), taking the same arguments as `kalman_filter`. Slow on purpose: tests and benchmarks only.
"""
from __future__ import annotations

import torch

from .monoids import A2_FLOOR, DEN_FLOOR, LAM_FLOOR, P_FLOOR


def expand_heads(x: torch.Tensor, channels: int) -> torch.Tensor:
    """[B,T,S] or [B,T,H,S] -> a [B,T,M,S] view: head h serves the contiguous channels h*M/H .. (h+1)*M/H - 1."""
    if x.dim() == 3:
        return x.unsqueeze(2)
    b, t, h, s = x.shape
    return x.unsqueeze(3).expand(b, t, h, channels // h, s).reshape(b, t, channels, s)


def kalman_filter_loop(v, prec, k, q, a_bar, p_bar, initial_state=None, dtype=torch.float64):
    """(y [B,T,M], y_var [B,T,M], (lam, eta) [B,M,S] each) by the per-token recursion in `dtype`."""
    v, prec, k, q, a_bar, p_bar = (x.to(dtype) for x in (v, prec, k, q, a_bar, p_bar))
    batch, length, channels = v.shape
    k, q = expand_heads(k, channels), expand_heads(q, channels)
    if initial_state is None:
        lam = torch.ones(batch, channels, a_bar.shape[-1], dtype=dtype, device=v.device)
        eta = torch.zeros_like(lam)
    else:
        lam, eta = (s.to(dtype) for s in initial_state)
    a = a_bar
    a2 = (a * a).clamp_min(A2_FLOOR)
    p = p_bar.clamp_min(P_FLOOR)
    ys, y_vars = [], []
    for t in range(length):
        phi = prec[:, t, :, None] * k[:, t] ** 2
        r = prec[:, t, :, None] * v[:, t, :, None] * k[:, t]
        den = (a2 + p * lam).clamp_min(DEN_FLOOR)
        eta = a / den * eta + r
        lam = lam / den + phi
        inv = 1 / lam.clamp_min(LAM_FLOOR)
        ys.append((q[:, t] * eta * inv).sum(-1))
        y_vars.append((q[:, t] ** 2 * inv).sum(-1))
    empty = v.new_zeros(batch, 0, channels)
    y = torch.stack(ys, 1) if ys else empty
    y_var = torch.stack(y_vars, 1) if y_vars else empty
    return y, y_var, (lam, eta)
