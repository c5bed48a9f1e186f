"""The float64 token-loop oracle of the gated delta rule (docs/spec/kaczmarz.md), one token at a time.

Per sequence and head, with column vectors and a [K, V] state:

    S'_t = exp(g_t) S_{t-1}                    decay first
    e_t  = v_t - S'_t^T k_t                    residual read from the decayed state
    S_t  = S'_t + beta_t k_t e_t^T             write
    o_t  = scale * S_t^T q_t                   read after the write

Everything is computed in float64 from the inputs as given; nothing here is fused or chunked, so it
is the independent oracle every other path is compared with. It takes already-validated inputs.
"""
from __future__ import annotations

import torch


def kaczmarz_beta(k: torch.Tensor, eta: torch.Tensor, eps: float) -> torch.Tensor:
    """beta = eta / (||k||^2 + eps); a zero key (whose write is zero whatever beta is) gets beta = 0.

    The guard only matters for eps = 0, where 0/0 would otherwise poison the state with NaN.
    """
    n2 = (k * k).sum(-1)
    den = n2 + eps
    safe = torch.where(den > 0, den, torch.ones_like(den))
    return torch.where(den > 0, eta / safe, torch.zeros_like(eta))


def delta_rule_naive(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                     cu_seqlens=None):
    """(o [B,T,H,V] float64, final state [N,H,K,V] float64 or None) by the token loop above."""
    q, k, v, g, beta = (t.detach().to(torch.float64) for t in (q, k, v, g, beta))
    B, T, H, K = k.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        bounds = [(b, 0, T) for b in range(B)]
    else:
        cu = [int(c) for c in cu_seqlens]
        bounds = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    o = torch.zeros(B, T, H, V, dtype=torch.float64)
    finals = []
    for n, (b, start, end) in enumerate(bounds):
        if initial_state is None:
            S = torch.zeros(H, K, V, dtype=torch.float64)
        else:
            S = initial_state[n].detach().to(torch.float64).clone()
        for t in range(start, end):
            S = torch.exp(g[b, t])[:, None, None] * S
            e = v[b, t] - torch.einsum("hkv,hk->hv", S, k[b, t])
            S = S + beta[b, t][:, None, None] * k[b, t][:, :, None] * e[:, None, :]
            o[b, t] = scale * torch.einsum("hkv,hk->hv", S, q[b, t])
        finals.append(S)
    return o, (torch.stack(finals) if output_final_state else None)
