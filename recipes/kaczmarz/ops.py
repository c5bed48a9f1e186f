"""The functional ops `delta_rule` and `kaczmarz_delta_rule` (public API contract, docs/spec/kaczmarz.md).

Both compute, per sequence and head, with a [K, V] fp32 state (decay first, read after write):

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = scale S_t^T q_t

`kaczmarz_delta_rule` uses the Kaczmarz step beta_t = eta_t / (||k_t||^2 + eps). Inputs may be
bf16, fp16 or fp32 (float64 on the reference backend, which then computes in float64); outputs are
fp32. Every input, and the initial state, gets a gradient.

>>> import torch
>>> from scanlang.recipes.kaczmarz import kaczmarz_delta_rule
>>> B, T, H, K, V = 1, 5, 2, 4, 3
>>> q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
>>> v, g, eta = torch.randn(B, T, H, V), -torch.rand(B, T, H), torch.rand(B, T, H)
>>> o, S = kaczmarz_delta_rule(q, k, v, g, eta, output_final_state=True, backend="reference")
>>> tuple(o.shape), tuple(S.shape), o.dtype
((1, 5, 2, 3), (1, 2, 4, 3), torch.float32)
"""
from __future__ import annotations

import numbers

import torch

from scanlang import backend as registry
from scanlang import context_parallel, settings
from scanlang._checks import check_log_decay, check_scale, packed_offsets
from scanlang.delta import CHUNK_SIZES, MAX_HEAD_DIM  # noqa: F401  (also read as ops.CHUNK_SIZES)

from .chunk_reference import chunk_delta_rule_reference, chunk_delta_rule_reference_varlen
from .context_parallel import delta_rule_sharded
from .naive import kaczmarz_beta

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_tensor(name, t, ndim, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {what}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have shape {what}, got {tuple(t.shape)}")
    if t.dtype not in _FLOATS:
        raise ValueError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")


def validate(q, k, v, g, step, step_name, scale, initial_state, cu_seqlens, backend, chunk_size):
    """Check shapes, dtypes, devices and options; return (backend, compute dtype, the offsets of cu_seqlens as a
    tuple of ints or None). (The offsets are read from the device once, here.)"""
    _check_tensor("k", k, 4, "[B, T, H, K]")
    B, T, H, K = k.shape
    _check_tensor("q", q, 4, f"[B, T, H, K] = {[B, T, H, K]} like k")
    if tuple(q.shape) != tuple(k.shape):
        raise ValueError(f"q must have the shape of k [B, T, H, K] = {list(k.shape)}, got {list(q.shape)}")
    _check_tensor("v", v, 4, f"[B, T, H, V] = [{B}, {T}, {H}, V]")
    if tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v must have shape [B, T, H, V] = [{B}, {T}, {H}, V] (B, T, H of k), got {list(v.shape)}")
    V = v.shape[3]
    for name, t in (("g", g), (step_name, step)):
        _check_tensor(name, t, 3, f"[B, T, H] = {[B, T, H]}")
        if tuple(t.shape) != (B, T, H):
            raise ValueError(f"{name} must have shape [B, T, H] = {[B, T, H]}, got {list(t.shape)}")
    if not (1 <= K <= MAX_HEAD_DIM):
        raise ValueError(f"k: head dim K = {K} must be in [1, {MAX_HEAD_DIM}]")
    if not (1 <= V <= MAX_HEAD_DIM):
        raise ValueError(f"v: head dim V = {V} must be in [1, {MAX_HEAD_DIM}]")
    device = k.device
    for name, t in (("q", q), ("v", v), ("g", g), (step_name, step)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but k is on {device}; all inputs must share a device")
    check_scale(scale)
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size!r}")

    offsets = packed_offsets(cu_seqlens, B, T, device)
    n_seq = B if offsets is None else len(offsets) - 1

    inputs = (q, k, v, g, step)
    compute = torch.float64 if any(t.dtype == torch.float64 for t in inputs) else torch.float32
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"initial_state must be a tensor [N, H, K, V] or None, got {type(initial_state).__name__}")
        want = [n_seq, H, K, V]
        if list(initial_state.shape) != want:
            raise ValueError(f"initial_state must have shape [N, H, K, V] = {want}, got {list(initial_state.shape)}")
        if initial_state.dtype not in (torch.float32, compute):
            raise ValueError(f"initial_state must be float32 (float64 allowed with float64 inputs), got {initial_state.dtype}")
        if initial_state.device != device:
            raise ValueError(f"initial_state is on {initial_state.device} but k is on {device}")

    if backend is None:   # the delta kernels compute in float32 only
        backend = registry.default(device, compute, triton_dtypes=(torch.float32,))
    if backend not in ("reference", "triton"):
        raise ValueError(f"backend must be None, 'reference' or 'triton', got {backend!r}")
    if backend == "triton":
        if device.type != "cuda" and not settings.triton_interpret():
            raise ValueError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 to run the kernels "
                             "in Triton's interpreter on CPU")
        if compute == torch.float64:
            raise ValueError("backend='triton' takes bf16/fp16/fp32 inputs; use backend='reference' for float64")
    return backend, compute, offsets


def _reference(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, compute, chunk_size):
    q, k, v, g, beta = (t.to(compute) for t in (q, k, v, g, beta))
    h0 = None if initial_state is None else initial_state.to(compute)
    if cu_seqlens is None:
        o, S = chunk_delta_rule_reference(q, k, v, g, beta, scale, h0, chunk_size)
    else:
        o, S = chunk_delta_rule_reference_varlen(q, k, v, g, beta, scale, h0, cu_seqlens, chunk_size)
    return o, (S if output_final_state else None)


def delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
               cu_seqlens=None, backend=None, chunk_size=64, cp_group=None):
    """Gated delta rule with a given step size beta [B,T,H]. Returns (o [B,T,H,V] fp32, S or None).

    Law, per batch row and head (docs/spec/kaczmarz.md), S the [K, V] state:
        S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = scale S_t^T q_t.

    q, k: [B,T,H,K]; v: [B,T,H,V]; g (log-decay, <= 0; -inf resets the state): [B,T,H] or None (no decay);
    initial_state [N,H,K,V] fp32 (N = B, or the number of packed sequences with cu_seqlens [N+1]
    and B == 1). `scale` defaults to K**-0.5. q and k are used as given (normalise them yourself
    for GDN). g > 0 or NaN raises a ValueError for CPU tensors (`check_log_decay`). A NaN or inf
    in token t reaches token t and later ones only, as in the token loop.
    `cp_group`: context parallelism over T (a ProcessGroup or 1-D DeviceMesh; every rank passes its
    shard, the same `initial_state` and the GLOBAL `cu_seqlens`; the final state is the global one on
    every rank; see `recipes/kaczmarz/context_parallel.py`).

    >>> import torch
    >>> from scanlang.recipes.kaczmarz import delta_rule
    >>> k = torch.tensor([1.0, 0.0]).expand(1, 2, 1, 2)        # the same unit key twice
    >>> v = torch.tensor([[[[3.0]]], [[[5.0]]]]).reshape(1, 2, 1, 1)
    >>> g, beta = torch.zeros(1, 2, 1), torch.ones(1, 2, 1)   # no decay, full step: overwrite
    >>> o, S = delta_rule(k, k, v, g, beta, scale=1.0, output_final_state=True, backend="reference")
    >>> o.flatten().tolist(), S.flatten().tolist()
    ([3.0, 5.0], [5.0, 0.0])
    """
    if g is None and isinstance(beta, torch.Tensor):   # DeltaNet: no decay (Contract v2)
        g = torch.zeros_like(beta)
    group = context_parallel.resolve_group(cp_group)
    if group is not None:
        return delta_rule_sharded(delta_rule, validate, MAX_HEAD_DIM, q, k, v, g, beta, "beta", scale, initial_state, output_final_state,
                                  cu_seqlens, backend, chunk_size, group)
    backend, compute, offsets = validate(q, k, v, g, beta, "beta", scale, initial_state, cu_seqlens, backend,
                                         chunk_size)
    check_log_decay(g)
    scale = k.shape[-1] ** -0.5 if scale is None else float(scale)
    if backend == "reference":
        return _reference(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, compute, chunk_size)
    return registry.get("delta").delta_rule(q, k, v, g, beta, "beta", scale=scale, initial_state=initial_state,
                                 output_final_state=output_final_state, cu_seqlens=offsets,
                                 chunk_size=chunk_size)


def kaczmarz_delta_rule(q, k, v, g, eta, eps=1e-6, scale=None, initial_state=None, output_final_state=False,
                        cu_seqlens=None, backend=None, chunk_size=64, cp_group=None):
    """Delta rule with the Kaczmarz step beta = eta / (||k||^2 + eps), eta [B,T,H] in [0, 1].

    Keys are used raw (not normalised). A zero key or eta = 0 writes nothing. The squared norm is
    taken in fp32 (float64 for float64 inputs). Same shapes, returns and `cp_group` as `delta_rule`.

    Law: `delta_rule` with beta_t = eta_t / (||k_t||^2 + eps): eta = 1 projects S onto k_t^T S = v_t.

    >>> import torch
    >>> from scanlang.recipes.kaczmarz import kaczmarz_delta_rule
    >>> k = torch.tensor([[[[2.0, 0.0]]]])                    # a raw key of norm 2
    >>> v, g, eta = torch.tensor([[[[3.0]]]]), torch.zeros(1, 1, 1), torch.ones(1, 1, 1)
    >>> o, _ = kaczmarz_delta_rule(k, k, v, g, eta, eps=0.0, scale=1.0, backend="reference")
    >>> o.flatten().tolist()                                   # read with q = k: k^T S = v
    [3.0]
    """
    group = context_parallel.resolve_group(cp_group)
    if group is not None:
        def run(q, k, v, g, eta, **kwargs):
            return kaczmarz_delta_rule(q, k, v, g, eta, eps=eps, **kwargs)
        return delta_rule_sharded(run, validate, MAX_HEAD_DIM, q, k, v, g, eta, "eta", scale, initial_state, output_final_state,
                                  cu_seqlens, backend, chunk_size, group, eps=eps)
    backend, compute, offsets = validate(q, k, v, g, eta, "eta", scale, initial_state, cu_seqlens, backend,
                                         chunk_size)
    check_log_decay(g)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"eps must be a real number >= 0, got {eps!r}")
    scale = k.shape[-1] ** -0.5 if scale is None else float(scale)
    if backend == "reference":
        beta = kaczmarz_beta(k.to(compute), eta.to(compute), float(eps))
        return _reference(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, compute, chunk_size)
    return registry.get("delta").delta_rule(q, k, v, g, eta, "kaczmarz", scale=scale, initial_state=initial_state,
                                 output_final_state=output_final_state, cu_seqlens=offsets,
                                 chunk_size=chunk_size, eps=float(eps))


def delta_rule_with_decay(q, k, v, a, eta, rule, decay_params, scale, initial_state=None, output_final_state=False,
                          chunk_size=64, eps=1e-6):
    """The generated kernels of `rule` (a `scanlang.delta.DeltaRule` with a decay hook) on validated
    inputs: the hook turns `a` and the per-head `decay_params` into the log-decay inside the kernels
    (the layer's Mamba2 gate). Returns (o, S or None) as `delta_rule`."""
    return registry.get("delta").delta_rule(q, k, v, a, eta, rule, scale=scale, initial_state=initial_state,
                                            output_final_state=output_final_state, chunk_size=chunk_size, eps=eps,
                                            decay_params=decay_params)
