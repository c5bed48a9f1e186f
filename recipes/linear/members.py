"""The shipped members of the matrix-state family, each a declaration of a few lines plus fla's
signature (Contract v2; math in docs/spec/linear.md).

    linear_attention(q, k, v, ...)                       no decay, plain write
    simple_gla(q, k, v, g, ...)                          g [B,T,H]: per-head decay, plain write
    gla(q, k, v, g, ...)                                 g [B,T,H,K]: per-key decay, plain write
    kda(q, k, v, g, beta, ...)                           g [B,T,H,K], beta [B,T,H]: per-key decay, delta
    gated_delta_product(q, k, v, g, beta, num_householder, ...)   k, v, beta [B,T*n,...]: n steps
    delta_rule, kaczmarz_delta_rule                      scanlang.recipes.kaczmarz's ops, re-exported

Each takes `scale=None, initial_state=None, output_final_state=False, cu_seqlens=None` as fla does,
then `backend=None` and `chunk_size=32` (the reference's chunk; gated_delta_product: None, its
backend's own). Outputs are fp32 (float64 for
float64 inputs); the final state is [N, H, K, V] or None. Log-decays must be <= 0 (-inf resets);
a positive one raises a ValueError for CPU tensors.

>>> import torch
>>> q, k, v = torch.randn(1, 5, 2, 4), torch.randn(1, 5, 2, 4), torch.randn(1, 5, 2, 3)
>>> o, S = gla(q, k, v, torch.nn.functional.logsigmoid(torch.randn(1, 5, 2, 4)), output_final_state=True)
>>> tuple(o.shape), tuple(S.shape)
((1, 5, 2, 3), (1, 2, 4, 3))
"""
from __future__ import annotations

from scanlang.linear import matrix_state
from scanlang.recipes.kaczmarz.ops import delta_rule, kaczmarz_delta_rule

from .family import op

LINEAR_ATTENTION = matrix_state("linear_attention")
SIMPLE_GLA = matrix_state("simple_gla", decay="per_head", inputs={"g": "token"}, log_decay=lambda t: t.g)
GLA = matrix_state("gla", decay="per_key", inputs={"g": "token_key"}, log_decay=lambda t: t.g)
DELTANET = matrix_state("deltanet", correction="delta", inputs={"beta": "token"}, beta=lambda t: t.beta)
DELTA_RULE = matrix_state("gated_delta_rule", decay="per_head", correction="delta",
                          inputs={"g": "token", "beta": "token"}, beta=lambda t: t.beta, log_decay=lambda t: t.g)
KDA = matrix_state("kda", decay="per_key", correction="delta", inputs={"g": "token_key", "beta": "token"},
                   beta=lambda t: t.beta, log_decay=lambda t: t.g)
KACZMARZ = matrix_state("kaczmarz", decay="per_head", correction="delta", inputs={"g": "token", "eta": "token"},
                        constants={"eps": 1e-6}, beta=lambda t: t.eta / (t.n2 + t.eps), log_decay=lambda t: t.g)
_PRODUCTS: dict = {}
_PRODUCT_OPS: dict = {}   # declaration key -> its op, built once (the hooks compiled once)


def gated_delta_product_declaration(num_householder: int, gated: bool = True):
    """The DeltaProduct member with n = num_householder Householder steps per token (declared once per n).

    Law: P_t = H_t,n ... H_t,1 exp(g_t), H_t,j = I - beta_t,j k_t,j k_t,j^T (see gated_delta_product).

    >>> from scanlang.recipes.linear import gated_delta_product_declaration
    >>> d = gated_delta_product_declaration(3)
    >>> d.correction, d.steps, d.decay
    ('householder', 3, 'per_head')
    """
    if isinstance(num_householder, bool) or not isinstance(num_householder, int) or num_householder < 1:
        raise ValueError(f"num_householder must be an int >= 1, got {num_householder!r}")
    key = (num_householder, gated)
    if key not in _PRODUCTS:
        inputs = {"g": "token", "beta": "token"} if gated else {"beta": "token"}
        _PRODUCTS[key] = matrix_state(f"gated_delta_product_{num_householder}" if gated else
                                      f"delta_product_{num_householder}", decay="per_head" if gated else "none",
                                      correction="householder", steps=num_householder, inputs=inputs,
                                      beta=lambda t: t.beta, log_decay=(lambda t: t.g) if gated else None)
    return _PRODUCTS[key]


_OPS = {d.name: op(d) for d in (LINEAR_ATTENTION, SIMPLE_GLA, GLA, DELTANET, DELTA_RULE, KDA, KACZMARZ)}


def linear_attention(q, k, v, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                     backend=None, chunk_size=32):
    """Law: S_t = S_{t-1} + k_t v_t^T, o_t = scale S_t^T q_t (linear attention; fla's chunk_linear_attn).

    >>> import torch
    >>> from scanlang.recipes.linear import linear_attention
    >>> q = k = torch.tensor([1.0, 0.0]).expand(1, 2, 1, 2)   # [B,T,H,K]: one unit key, twice
    >>> v = torch.tensor([3.0, 5.0]).reshape(1, 2, 1, 1)
    >>> o, S = linear_attention(q, k, v, scale=1.0, output_final_state=True)
    >>> o.flatten().tolist()
    [3.0, 8.0]
    """
    return _OPS["linear_attention"](q, k, v, scale=scale, initial_state=initial_state,
                                    output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                    backend=backend, chunk_size=chunk_size)


def simple_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
               backend=None, chunk_size=32):
    """Law: S_t = exp(g_t) S_{t-1} + k_t v_t^T, o_t = scale S_t^T q_t; g [B,T,H] (per-head gated linear
    attention; chunk_simple_gla).

    >>> import torch
    >>> from scanlang.recipes.linear import simple_gla
    >>> q = k = torch.tensor([1.0, 0.0]).expand(1, 2, 1, 2)   # [B,T,H,K]: one unit key, twice
    >>> v = torch.tensor([3.0, 5.0]).reshape(1, 2, 1, 1)
    >>> o, S = simple_gla(q, k, v, torch.full((1, 2, 1), -0.6931471805599453), scale=1.0, output_final_state=True)
    >>> o.flatten().tolist()
    [3.0, 6.5]
    """
    return _OPS["simple_gla"](q, k, v, g, scale=scale, initial_state=initial_state,
                              output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                              backend=backend, chunk_size=chunk_size)


def gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
        backend=None, chunk_size=32):
    """Law: S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T, o_t = scale S_t^T q_t; g [B,T,H,K] (gated linear
    attention; chunk_gla).

    >>> import torch
    >>> from scanlang.recipes.linear import gla
    >>> q = k = torch.tensor([1.0, 0.0]).expand(1, 2, 1, 2)   # [B,T,H,K]: one unit key, twice
    >>> v = torch.tensor([3.0, 5.0]).reshape(1, 2, 1, 1)
    >>> o, S = gla(q, k, v, torch.full((1, 2, 1, 2), -0.6931471805599453), scale=1.0, output_final_state=True)
    >>> o.flatten().tolist()
    [3.0, 6.5]
    """
    return _OPS["gla"](q, k, v, g, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                       backend=backend, chunk_size=chunk_size)


def kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
        backend=None, chunk_size=32):
    """Law: S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T, o_t = scale S_t^T q_t;
    g [B,T,H,K], beta [B,T,H] (Kimi delta attention; chunk_kda; q and k used as given).

    >>> import torch
    >>> from scanlang.recipes.linear import kda
    >>> q = k = torch.tensor([1.0, 0.0]).expand(1, 2, 1, 2)   # [B,T,H,K]: one unit key, twice
    >>> v = torch.tensor([3.0, 5.0]).reshape(1, 2, 1, 1)
    >>> o, S = kda(q, k, v, torch.zeros(1, 2, 1, 2), torch.ones(1, 2, 1), scale=1.0, output_final_state=True)
    >>> o.flatten().tolist()
    [3.0, 5.0]
    """
    return _OPS["kda"](q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                       backend=backend, chunk_size=chunk_size)


def gated_delta_product(q, k, v, g, beta, num_householder, scale=None, initial_state=None,
                        output_final_state=False, cu_seqlens=None, backend=None, chunk_size=None):
    """DeltaProduct: per token, decay exp(g_t) once, then n delta writes (k, v, beta rows t*n ..
    t*n+n-1), then the readout. q, g [.., T, ..]; k, v, beta [.., T*n, ..]; g may be None (no
    decay); cu_seqlens counts tokens of q (chunk_gated_delta_product). It is a delta rule over the
    interleaved T*n rows (scanlang/delta_form.py), run on the delta-rule kernels with
    backend="triton" (and backend=None on CUDA), else on the reference; chunk_size counts those rows on
    both (C/n tokens a chunk), None: 64 on the delta-rule kernels, 32 on the reference.

    Law: S_t = H_t,n ... H_t,1 exp(g_t) S_{t-1} + sum_j (H_t,n ... H_t,j+1) beta_t,j k_t,j v_t,j^T with
    H_t,j = I - beta_t,j k_t,j k_t,j^T; o_t = scale S_t^T q_t.

    >>> import torch
    >>> from scanlang.recipes.linear import gated_delta_product
    >>> q = torch.tensor([1.0, 0.0]).reshape(1, 1, 1, 2)                 # one token ...
    >>> k = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).reshape(1, 2, 1, 2)   # ... two writes
    >>> v = torch.tensor([3.0, 5.0]).reshape(1, 2, 1, 1)
    >>> o, S = gated_delta_product(q, k, v, None, torch.ones(1, 2, 1), 2, scale=1.0, output_final_state=True)
    >>> o.flatten().tolist(), S.flatten().tolist()
    ([3.0], [3.0, 5.0])
    """
    decl = gated_delta_product_declaration(num_householder, gated=g is not None)
    run = _PRODUCT_OPS.get(decl.key)
    if run is None:
        run = _PRODUCT_OPS[decl.key] = op(decl, "gated_delta_product")
    args = (g, beta) if g is not None else (beta,)
    return run(q, k, v, *args, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
               cu_seqlens=cu_seqlens, backend=backend, chunk_size=chunk_size)


for _fn, _decl in ((linear_attention, LINEAR_ATTENTION), (simple_gla, SIMPLE_GLA), (gla, GLA), (kda, KDA),
                   (delta_rule, DELTA_RULE), (kaczmarz_delta_rule, KACZMARZ)):
    _fn.declaration = _decl   # the structure a kernel generator reads; delta_rule's g=None is DELTANET
gated_delta_product.declaration = gated_delta_product_declaration
DECLARATIONS = {"linear_attention": LINEAR_ATTENTION, "simple_gla": SIMPLE_GLA, "gla": GLA, "deltanet": DELTANET,
                "delta_rule": DELTA_RULE, "kda": KDA, "kaczmarz_delta_rule": KACZMARZ}
