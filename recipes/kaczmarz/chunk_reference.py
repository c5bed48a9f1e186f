"""The chunkwise gated delta rule in plain PyTorch: the `backend="reference"` path.

Same math as the Triton kernels (docs/spec/kaczmarz.md, "Chunkwise algorithm"), written with torch ops so
that autograd differentiates it and it runs in float64. For one chunk of C tokens with start state S0:

    G = cumsum(g);  gamma_i = exp(G_i);  Dec_ij = exp(G_i - G_j) for i >= j, else 0
    A = strictly_lower(diag(beta) K K^T * Dec);  Tm = (I + A)^-1
    w = Tm diag(beta gamma) K;  u = Tm diag(beta) V;  U = u - w S0
    O = scale (diag(gamma) Q S0 + (Q K^T * Dec) U)
    S_end = gamma_C S0 + (K * exp(G_C - G))^T U

Chunks are composed by a sequential loop over the state. The tail chunk is padded with tokens that
have g = 0 and beta = 0, which are the identity element (P, R) = (I, 0), so padding changes nothing.

Non-finite values are causal, as in the token loop:
- g = -inf (a hard reset, exp(g) = 0) is exact: the decays come from the cumsum G' of the finite
  log-decays and the count R of resets so far, Dec_ij = exp(G'_i - G'_j) where no reset lies in
  (j, i] (R_i = R_j), else 0; never exp(-inf - (-inf)).
- A NaN or inf in token t (k, v, g or beta) must not reach tokens before t, but the chunk's products
  (Tm, Q K^T * Dec against U) multiply later rows by exact zeros, and 0 * NaN is NaN. So when an input
  is not finite, the outputs before each (sequence, head)'s first such token come from a pass with
  those values replaced by 0 (which only changes later tokens), the rest from the pass as given.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """[B, T, H, ...] (T a multiple of C) -> [B, H, T/C, C, ...]."""
    B, T, H = x.shape[:3]
    x = x.reshape(B, T // C, C, H, *x.shape[3:])
    return x.movedim(3, 1)


def _poisoned(k, v, g, beta) -> torch.Tensor:
    """[B, T, H]: tokens whose k, v, g or beta holds a NaN or inf (g = -inf, a reset, is finite math)."""
    return ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1) & torch.isfinite(beta)
             & (torch.isfinite(g) | (g == float("-inf"))))


def chunk_delta_rule_reference(q, k, v, g, beta, scale: float, initial_state=None, chunk_size: int = 64):
    """Equal-length batch. q, k [B,T,H,K], v [B,T,H,V], g, beta [B,T,H], all of one float dtype.

    Returns (o [B,T,H,V], final state [B,H,K,V]) in that dtype, differentiable in every input.
    Non-finite inputs stay causal (module docstring); checking for them reads the inputs once.
    """
    bad = _poisoned(k, v, g, beta)
    if torch.compiler.is_compiling() or not bool(bad.any()):
        return _chunked(q, k, v, g, beta, scale, initial_state, chunk_size)
    o_raw, S_raw = _chunked(q, k, v, g, beta, scale, initial_state, chunk_size)
    clean = lambda x: torch.where(torch.isfinite(x), x, torch.zeros_like(x))  # noqa: E731
    g_clean = torch.where(torch.isfinite(g) | (g == float("-inf")), g, torch.zeros_like(g))
    o_clean, S_clean = _chunked(q, clean(k), clean(v), g_clean, clean(beta), scale, initial_state, chunk_size)
    before = torch.cumsum(bad.to(torch.int32), 1) == 0          # [B, T, H]: no poisoned token yet
    o = torch.where(before[..., None], o_clean, o_raw)
    S = torch.where(before[:, -1, :, None, None], S_clean, S_raw)
    return o, S


def _chunked(q, k, v, g, beta, scale: float, initial_state, chunk_size: int):
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    dtype = k.dtype
    if initial_state is None:
        S = torch.zeros(B, H, K, V, dtype=dtype, device=k.device)
    else:
        S = initial_state.to(dtype)
    if T == 0:
        return v.new_zeros(B, 0, H, V), S
    pad = (-T) % C
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
    qc, kc, vc = _chunks(q, C), _chunks(k, C), _chunks(v, C)
    gc, bc = _chunks(g, C), _chunks(beta, C)
    idx = torch.arange(C, device=k.device)
    lower = idx[:, None] >= idx[None, :]
    strict = idx[:, None] > idx[None, :]
    eye = torch.eye(C, dtype=dtype, device=k.device)
    outs = []
    for c in range(qc.shape[2]):
        qi, ki, vi, bi = qc[:, :, c], kc[:, :, c], vc[:, :, c], bc[:, :, c]
        gi = gc[:, :, c]
        reset = gi == float("-inf")
        G = torch.cumsum(torch.where(reset, torch.zeros_like(gi), gi), dim=-1)   # finite log-decays
        R = torch.cumsum(reset.to(torch.int32), dim=-1)                            # resets so far
        gamma = torch.where(R == 0, torch.exp(G), torch.zeros_like(G))
        diff = G[..., :, None] - G[..., None, :]
        # exp only where i >= j with no reset in (j, i]: above the diagonal the difference may be huge
        live = lower & (R[..., :, None] == R[..., None, :])
        dec = torch.exp(torch.where(live, diff, torch.full_like(diff, float("-inf"))))
        A = (bi[..., :, None] * (ki @ ki.transpose(-1, -2)) * dec).masked_fill(~strict, 0)
        Tm = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
        w = Tm @ ((bi * gamma)[..., None] * ki)
        u = Tm @ (bi[..., None] * vi)
        U = u - w @ S
        M = (qi @ ki.transpose(-1, -2)) * dec
        outs.append(scale * (gamma[..., None] * (qi @ S) + M @ U))
        tail = torch.where(R[..., -1:] == R, torch.exp(G[..., -1:] - G), torch.zeros_like(G))
        S = gamma[..., -1, None, None] * S + (ki * tail[..., None]).transpose(-1, -2) @ U
    o = torch.stack(outs, dim=2)                      # [B, H, NT, C, V]
    o = o.movedim(1, 3).reshape(B, -1, H, V)[:, :T]
    return o, S


def chunk_delta_rule_reference_varlen(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size=64):
    """Packed sequences (B == 1): each [cu[n], cu[n+1]) runs from its own initial state."""
    bounds = [int(c) for c in cu_seqlens.tolist()]
    H, K, V = k.shape[2], k.shape[3], v.shape[3]
    outs, finals = [], []
    for n in range(len(bounds) - 1):
        s, e = bounds[n], bounds[n + 1]
        h0 = None if initial_state is None else initial_state[n:n + 1]
        o, S = chunk_delta_rule_reference(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
                                          scale, h0, chunk_size)
        outs.append(o)
        finals.append(S)
    o = torch.cat(outs, dim=1) if outs else v.new_zeros(1, 0, H, V)
    S = torch.cat(finals, dim=0) if finals else v.new_zeros(0, H, K, V)
    return o, S
