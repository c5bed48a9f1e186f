"""The chunked matrix-state reference in plain PyTorch: the family's `backend="reference"`.

One routine for every point of the grid (docs/spec/linear.md, "Chunked form"), written with torch ops so
autograd differentiates it and it runs in float64. Per chunk of C rows, with start state S0,
cumulative log-decays G ([C, 1] per head or none, [C, K] per key) and the pairwise decays
Dec_ijk = exp(G_ik - G_jk) for i >= j (else 0):

    M_ij = sum_k q_ik k_jk Dec_ijk  (i >= j),   KK_ij = sum_k k_ik k_jk Dec_ijk  (i > j)
    plain:  U = V
    delta:  Tm = (I + diag(beta) KK)^-1,  W = Tm diag(beta) (K * e^G),  U = Tm diag(beta) V - W S0
    O = scale ((Q * e^G) S0 + M U),    S_end = e^{G_C} S0 + (K * e^{G_C - G})^T U

Every exponent is a difference G_i - G_j with i >= j, or G itself, so with log-decays <= 0 none is
positive: g = -20 per token cannot overflow, at any chunk size, per head or per key (the pairwise
[C, C, K] decay tensor is the price, which a reference can pay). g = -inf is a hard reset, kept
exact by counting resets (no exp(-inf - (-inf))). n Householder steps run as the delta form on the
T*n sub-token rows, the decay on each token's first sub-row and the readout at its last.

Padding rows (k = v = 0, g = 0, beta = 0) are the identity element. A NaN or inf in row t (k, v, g
or beta) must not reach earlier rows, but the chunk's products multiply later rows by exact zeros
(0 * NaN = NaN); so when an input is not finite, rows before each (sequence, head)'s first such
row come from a pass with those values replaced by 0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """[B, L, H, ...] (L a multiple of C) -> [B, H, L/C, C, ...]."""
    B, L, H = x.shape[:3]
    return x.reshape(B, L // C, C, H, *x.shape[3:]).movedim(3, 1)


def _chunked(q, k, v, g, beta, scale: float, S, C: int):
    """q, k [B,L,H,K]; v [B,L,H,V]; g [B,L,H,Kd] (Kd = 1 or K); beta [B,L,H] or None (plain write);
    S [B,H,K,V]. Returns (o [B,L,H,V], S_end)."""
    B, L, H, K = k.shape
    V = v.shape[-1]
    pad = (-L) % C
    if pad:
        q, k, v, g = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v, g))
        beta = None if beta is None else F.pad(beta, (0, 0, 0, pad))
    qc, kc, vc, gc = (_chunks(t, C) for t in (q, k, v, g))
    bc = None if beta is None else _chunks(beta, C)
    idx = torch.arange(C, device=k.device)
    lower, strict = idx[:, None] >= idx[None, :], idx[:, None] > idx[None, :]
    eye = torch.eye(C, dtype=k.dtype, device=k.device)
    outs = []
    for c in range(qc.shape[2]):
        qi, ki, vi, gi = qc[:, :, c], kc[:, :, c], vc[:, :, c], gc[:, :, c]     # [B,H,C,*]
        reset = gi == float("-inf")
        G = torch.cumsum(torch.where(reset, torch.zeros_like(gi), gi), dim=-2)   # finite log-decays
        R = torch.cumsum(reset.to(torch.int32), dim=-2)                           # resets so far
        gamma = torch.where(R == 0, torch.exp(G), torch.zeros_like(G))
        diff = G[..., :, None, :] - G[..., None, :, :]                            # [B,H,C,C,Kd]
        live = lower[..., None] & (R[..., :, None, :] == R[..., None, :, :])
        dec = torch.exp(torch.where(live, diff, torch.full_like(diff, float("-inf"))))
        if dec.shape[-1] == 1:
            M = (qi @ ki.transpose(-1, -2)) * dec[..., 0]
        else:
            M = torch.einsum("bhik,bhjk,bhijk->bhij", qi, ki, dec)
        if bc is None:
            U = vi
        else:
            bi = bc[:, :, c]
            if dec.shape[-1] == 1:
                KK = (ki @ ki.transpose(-1, -2)) * dec[..., 0]
            else:
                KK = torch.einsum("bhik,bhjk,bhijk->bhij", ki, ki, dec)
            A = (bi[..., :, None] * KK).masked_fill(~strict, 0)
            Tm = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
            W = Tm @ (bi[..., None] * ki * gamma)
            U = Tm @ (bi[..., None] * vi) - W @ S
        outs.append(scale * ((qi * gamma) @ S + M @ U))
        tail = torch.where(R[..., -1:, :] == R, torch.exp(G[..., -1:, :] - G), torch.zeros_like(G))
        S = gamma[..., -1, :, None] * S + (ki * tail).transpose(-1, -2) @ U
    o = torch.stack(outs, dim=2).movedim(1, 3).reshape(B, -1, H, V)[:, :L]
    return o, S


def _causal(q, k, v, g, beta, scale, S0, C):
    """`_chunked`, with non-finite rows kept from reaching earlier rows (module docstring)."""
    bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1)
            & (torch.isfinite(g) | (g == float("-inf"))).all(-1))
    if beta is not None:
        bad = bad | ~torch.isfinite(beta)
    if torch.compiler.is_compiling() or not bool(bad.any()):
        return _chunked(q, k, v, g, beta, scale, S0, C)
    o_raw, S_raw = _chunked(q, k, v, g, beta, scale, S0, C)
    clean = lambda x: torch.where(torch.isfinite(x), x, torch.zeros_like(x))  # noqa: E731
    g_clean = torch.where(torch.isfinite(g) | (g == float("-inf")), g, torch.zeros_like(g))
    o_clean, S_clean = _chunked(q, clean(k), clean(v), g_clean, None if beta is None else clean(beta),
                                scale, S0, C)
    before = torch.cumsum(bad.to(torch.int32), 1) == 0          # [B, L, H]: no poisoned row yet
    o = torch.where(before[..., None], o_clean, o_raw)
    S = torch.where(before[:, -1, :, None, None], S_clean, S_raw)
    return o, S


def matrix_state_reference(q, k, v, g, beta, *, steps: int = 1, scale: float, initial_state=None,
                           chunk_size: int = 32, cu_seqlens=None):
    """The family on validated inputs of one float dtype.

    q [B,T,H,K]; k [B,T*n,H,K], v [B,T*n,H,V] (n = steps); g: None (no decay), [B,T,H] (per head)
    or [B,T,H,K] (per key), log-decays; beta: None (plain write) or [B,T*n,H]; initial_state
    [N,H,K,V]; cu_seqlens: None or offsets (ints) over the T tokens. Returns (o [B,T,H,V], final
    state [N,H,K,V]), differentiable in every input.
    """
    B, T, H, K = q.shape
    V, n = v.shape[-1], steps
    g = q.new_zeros(B, T, H, 1) if g is None else (g[..., None] if g.dim() == 3 else g)
    if n > 1:   # interleave: the decay at each token's first sub-row, the readout at its last
        g = torch.cat([g[:, :, None], g.new_zeros(B, T, n - 1, H, g.shape[-1])], 2).reshape(B, T * n, H, -1)
        q = torch.cat([q.new_zeros(B, T, n - 1, H, K), q[:, :, None]], 2).reshape(B, T * n, H, K)
    bounds = [(b, 0, T) for b in range(B)] if cu_seqlens is None else \
        [(0, s, e) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    outs, finals = [], []
    for i, (b, s, e) in enumerate(bounds):
        S0 = (q.new_zeros(1, H, K, V) if initial_state is None else initial_state[i:i + 1]).to(q.dtype)
        rows = slice(s * n, e * n)
        part = lambda x: None if x is None else x[b:b + 1, rows]  # noqa: E731
        if e == s:
            o, S = v.new_zeros(1, 0, H, V), S0
        else:
            o, S = _causal(part(q), part(k), part(v), part(g), part(beta), scale, S0, chunk_size)
        outs.append(o[:, n - 1::n])
        finals.append(S)
    o = torch.cat(outs, dim=0 if cu_seqlens is None else 1)
    return o, torch.cat(finals, dim=0)
