"""The generated per-key delta-rule kernels (backends/linear/kernels_delta.py: KDA's structure) in Triton's
interpreter: every output, final state and gradient against an independent float64 token loop written here."""
import pytest
import torch
import torch.nn.functional as F

import scanlang as sl
from scanlang import tuning
from scanlang.backends.linear import kernels_delta, ops
from scanlang.recipes import linear as L
from scanlang.testing import assert_close

C = 16          # the chunk knob: T = 1, C - 1, C + 1 and 37 cover a partial, a full and a third chunk
D64 = torch.float64
H, K, V = 2, 16, 12

# the README's member no library has: Kaczmarz's step with KDA's per-key decay (examples/new_matrix_state_member.py)
KACZMARZ_KDA = sl.matrix_state("kaczmarz_kda_test", decay="per_key", correction="delta",
                               inputs={"a": "token_key", "b": "token"}, constants={"eps": 1e-6},
                               beta=lambda t: sl.sigmoid(t.b) / (t.n2 + t.eps),
                               log_decay=lambda t: sl.logsigmoid(t.a))
KACZMARZ_KDA_OP = L.op(KACZMARZ_KDA)
# one per-token input read by both hooks (broadcast over K by the per-key decay) and a per-head parameter in beta
SHARED = sl.matrix_state("shared_kda_test", decay="per_key", correction="delta",
                         inputs={"a": "token_key", "b": "token", "w": "head"}, constants={"c": 0.5},
                         beta=lambda t: sl.sigmoid(t.b * t.w),
                         log_decay=lambda t: sl.logsigmoid(t.a) * sl.sigmoid(t.b) * t.c)
SHARED_OP = L.op(SHARED)


def token_loop(q, k, v, g, beta, scale=None, h0=None, cu=None):
    """S <- diag(exp(g_t)) S; S <- S + beta_t k_t (v_t - S^T k_t)^T; o_t = scale S^T q_t, float64, one token
    at a time; g [B,T,H,K], beta [B,T,H]."""
    B, T, Hn, Kn = q.shape
    scale = Kn ** -0.5 if scale is None else scale
    bounds = [(b, 0, T) for b in range(B)] if cu is None else [(0, s, e) for s, e in zip(cu[:-1], cu[1:])]
    outs, finals = [[torch.zeros(Hn, v.shape[-1], dtype=D64)] * T for _ in range(B)], []
    for i, (b, s, e) in enumerate(bounds):
        S = torch.zeros(Hn, Kn, v.shape[-1], dtype=D64) if h0 is None else h0[i]
        for t in range(s, e):
            kt = k[b, t]
            S = torch.exp(g[b, t])[:, :, None] * S
            err = v[b, t] - torch.einsum("hkv,hk->hv", S, kt)
            S = S + beta[b, t][:, None, None] * kt[:, :, None] * err[:, None, :]
            outs[b][t] = scale * torch.einsum("hkv,hk->hv", S, q[b, t])
        finals.append(S)
    return torch.stack([torch.stack(row) for row in outs]), torch.stack(finals)


def _kaczmarz_beta(b, k, eps):
    n2 = (k * k).sum(-1)
    beta = torch.sigmoid(b) / (n2 + eps)
    if eps == 0:   # a zero key writes nothing: its beta is 0 where the hook is 0/0
        dead = n2 == 0
        beta = torch.sigmoid(b) / torch.where(dead, torch.ones_like(n2), n2)
        beta = torch.where(dead, torch.zeros_like(beta), beta)
    return beta


def _inputs(B, T, gen, g_min=None, N=None):
    q, k = torch.randn(B, T, H, K, generator=gen, dtype=D64), torch.randn(B, T, H, K, generator=gen, dtype=D64)
    k = F.normalize(k, dim=-1) * (0.5 + torch.rand(B, T, H, 1, generator=gen, dtype=D64))
    v = torch.randn(B, T, H, V, generator=gen, dtype=D64)
    g = (F.logsigmoid(torch.randn(B, T, H, K, generator=gen, dtype=D64)) if g_min is None
         else g_min * (0.5 + 0.5 * torch.rand(B, T, H, K, generator=gen, dtype=D64)))
    beta = 0.1 + 0.9 * torch.rand(B, T, H, generator=gen, dtype=D64)
    h0 = torch.randn(B if N is None else N, H, K, V, generator=gen, dtype=D64)
    return q, k, v, g, beta, h0


def _check(T, B=1, cu=None, dtype=torch.float32, g_min=None, seed=0, chunk=C, grads=True):
    gen = torch.Generator().manual_seed(seed)
    N = None if cu is None else len(cu) - 1
    ins = _inputs(B, T, gen, g_min, N)
    x = [t.to(dtype).requires_grad_(grads) for t in ins[:5]] + [ins[5].float().requires_grad_(grads)]
    cu_t = None if cu is None else torch.tensor(cu)
    o, S = L.kda(*x[:5], initial_state=x[5], output_final_state=True, cu_seqlens=cu_t, backend="triton",
                 chunk_size=chunk)
    ref = [t.detach().to(D64).requires_grad_(grads) for t in x]
    o_ref, S_ref = token_loop(*ref[:5], h0=ref[5], cu=cu)
    assert_close(o, o_ref, "delta_out", dtype, name="o")
    assert_close(S, S_ref, "delta_out", dtype, name="S")
    if not grads:
        return
    gen = torch.Generator().manual_seed(seed + 1)
    do, dS = torch.randn(o.shape, generator=gen, dtype=D64), torch.randn(S.shape, generator=gen, dtype=D64)
    got = torch.autograd.grad((o * do.float()).sum() + (S * dS.float()).sum(), x)
    want = torch.autograd.grad((o_ref * do).sum() + (S_ref * dS).sum(), ref)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        assert torch.isfinite(a).all(), name
        what = "delta_gate_grad" if name in ("dg", "dbeta") else "delta_grad"
        assert_close(a, b, what, dtype, name=name)


def test_kda_forward_and_every_gradient_equal_the_token_loop():
    _check(37)


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, C - 1, C + 1])
def test_kda_awkward_lengths(T):
    _check(T, B=2, seed=T)


def test_kda_packed_sequences_with_a_length_one_and_an_empty_one():
    _check(25, cu=[0, 17, 18, 18, 25], seed=3)


@pytest.mark.slow
def test_kda_chunk_32_and_bf16():
    _check(37, chunk=32, seed=5)
    _check(C + 1, dtype=torch.bfloat16, seed=6)


@pytest.mark.slow
def test_kda_strong_decay_stays_finite():
    """g down to -20 per token: every exponent the kernels take is <= 0."""
    _check(C + 5, g_min=-20.0, seed=7)


def test_kda_bf16_forward():
    _check(C + 1, dtype=torch.bfloat16, seed=6, grads=False)


def _kaczmarz(T, eps, zero_rows=(), seed=0, cu=None, Kn=K, key_block=64):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, T, H, n, generator=gen, dtype=D64) for n in (Kn, Kn, V))
    for r in zero_rows:
        k[0, r] = 0.0
    a, b = torch.randn(1, T, H, Kn, generator=gen, dtype=D64), torch.randn(1, T, H, generator=gen, dtype=D64)
    x = [t.float().requires_grad_() for t in (q, k, v, a, b)]
    with tuning.override(linear_delta_key_block=key_block):
        o, S = KACZMARZ_KDA_OP(*x, output_final_state=True, backend="triton", chunk_size=C, eps=eps,
                               cu_seqlens=None if cu is None else torch.tensor(cu))
        do = torch.randn(o.shape, generator=gen, dtype=D64)
        got = torch.autograd.grad((o * do.float()).sum() + S.sum(), x)
    ref = [t.detach().to(D64).requires_grad_() for t in x]
    beta = _kaczmarz_beta(ref[4], ref[1], eps)
    o_ref, S_ref = token_loop(ref[0], ref[1], ref[2], F.logsigmoid(ref[3]), beta, cu=cu)
    assert_close(o, o_ref, "delta_out", torch.float32, name="o")
    assert_close(S, S_ref, "delta_out", torch.float32, name="S")
    want = torch.autograd.grad((o_ref * do).sum() + S_ref.sum(), ref)
    for name, g1, g2 in zip(("dq", "dk", "dv", "da", "db"), got, want):
        assert torch.isfinite(g1).all(), name
        assert_close(g1, g2, "delta_gate_grad" if name in ("da", "db") else "delta_grad", torch.float32, name=name)


def test_kaczmarz_with_per_key_decay_and_zero_keys():
    """beta = sigmoid(b) / (||k||^2 + eps) in the kernels (dk gets beta's share through n2); a zero key is never
    NaN, with eps > 0 (beta finite) and eps = 0 (beta 0: the key writes nothing)."""
    _kaczmarz(C + 3, 1e-6, zero_rows=(2, C + 1))


def test_kaczmarz_kda_in_key_blocks():
    """K = 32 in two key blocks of 16 (`{name}_bwd`'s programs): dk's share through n2 reaches both blocks."""
    _kaczmarz(C + 3, 1e-6, zero_rows=(4,), seed=2, Kn=32, key_block=16)


@pytest.mark.slow
def test_kaczmarz_eps_zero_zero_keys():
    _kaczmarz(C + 3, 0.0, zero_rows=(0, 5, C), seed=1, cu=[0, 6, C + 3])


@pytest.mark.parametrize("Kn, key_block", [(K, 64), (48, 16)], ids=["one-key-block", "three-key-blocks"])
def test_an_input_read_by_both_hooks_and_a_per_head_parameter_in_beta(Kn, key_block):
    """b's gradient sums its share through g (over K, every key block adding its part) and through beta; w's
    (per head) sums over every token."""
    gen = torch.Generator().manual_seed(12)
    T = C + 3
    q, k, v = (torch.randn(1, T, H, n, generator=gen, dtype=D64) for n in (Kn, Kn, V))
    k = F.normalize(k, dim=-1)
    a, b = torch.randn(1, T, H, Kn, generator=gen, dtype=D64), torch.randn(1, T, H, generator=gen, dtype=D64)
    w, h0 = torch.randn(H, generator=gen, dtype=D64), torch.randn(1, H, Kn, V, generator=gen, dtype=D64)
    x = [t.float().requires_grad_() for t in (q, k, v, a, b, w, h0)]
    with tuning.override(linear_delta_key_block=key_block):
        o, S = SHARED_OP(*x[:6], initial_state=x[6], output_final_state=True, backend="triton", chunk_size=C, c=0.7)
        do = torch.randn(o.shape, generator=gen, dtype=D64)
        got = torch.autograd.grad((o * do.float()).sum() + S.sum(), x)
    ref = [t.detach().to(D64).requires_grad_() for t in x]
    g = F.logsigmoid(ref[3]) * torch.sigmoid(ref[4])[..., None] * 0.7
    o_ref, S_ref = token_loop(*ref[:3], g, torch.sigmoid(ref[4] * ref[5]), h0=ref[6])
    assert_close(o, o_ref, "delta_out", torch.float32, name="o")
    assert_close(S, S_ref, "delta_out", torch.float32, name="S")
    want = torch.autograd.grad((o_ref * do).sum() + S_ref.sum(), ref)
    for name, g1, g2 in zip(("dq", "dk", "dv", "da", "db", "dw", "dh0"), got, want):
        what = {"da": "delta_gate_grad", "db": "delta_gate_grad", "dw": "delta_param_grad"}.get(name, "delta_grad")
        assert_close(g1, g2, what, torch.float32, name=name)


def test_a_later_non_finite_value_does_not_reach_earlier_outputs():
    gen = torch.Generator().manual_seed(9)
    q, k, v, g, beta, h0 = _inputs(1, C + 4, gen)
    # (a non-finite log-decay is refused on the host: recipes/linear/family.py)
    for name, r, value in (("v", 5, float("nan")), ("k", 9, float("nan")), ("beta", 3, float("nan")),
                           ("v", C + 1, float("inf")), ("q", 7, float("nan"))):
        bad = [x.clone() for x in (q, k, v, g, beta)]
        bad[("q", "k", "v", "g", "beta").index(name)][0, r] = value
        with torch.no_grad(), tuning.override(decode_max_tokens=0):
            o, _ = L.kda(*(x.float() for x in bad), initial_state=h0.float(), backend="triton", chunk_size=C)
        o_ref, _ = token_loop(*bad, h0=h0)
        assert not torch.isfinite(o[0, r]).all(), name
        assert_close(o[0, :r], o_ref[0, :r], "delta_out", torch.float32, name=f"o before the NaN {name}")


def test_routing_and_sources():
    """The KDA structure takes these kernels (ops.sources names them "chunk"); Householder steps have none."""
    assert kernels_delta.supports(L.kda.declaration) and not kernels_delta.supports(L.gla.declaration)
    src = ops.sources(L.kda.declaration)["chunk"]
    assert "def kda_prep(" in src and "def kda_bwd(" in src
    with pytest.raises(ValueError, match="not the per-key delta structure"):
        kernels_delta.module(L.gla.declaration)
    decl = L.gated_delta_product_declaration(2)
    assert "chunk" not in ops.sources(decl)


def test_deterministic_algorithms_and_the_key_blocks():
    """The per-key delta backward's key blocks add a per-token log-decay input's gradient atomically: with beta's
    share already in it (SHARED's b), one block under torch.use_deterministic_algorithms(True), else at most two."""
    q = torch.empty(1, 1, 40)
    meta = ops._meta(40, 8, C, torch.float32, q.device, SHARED)
    before = torch.are_deterministic_algorithms_enabled()
    with tuning.override(linear_delta_key_block=16):
        assert ops._per_chunk_meta(SHARED, meta, q)[1] == 3
        torch.use_deterministic_algorithms(True)
        try:
            shared, kda = ops._per_chunk_meta(SHARED, meta, q)[1], ops._per_chunk_meta(L.kda.declaration, meta, q)[1]
        finally:
            torch.use_deterministic_algorithms(before)
    assert kernels_delta.beta_adds_first(SHARED) and not kernels_delta.beta_adds_first(L.kda.declaration)
    assert (shared, kda) == (1, 2)



@pytest.mark.parametrize("check,block", [("kda", 16), ("both_hooks", 4), ("kda", 4)])
def test_pairwise_block_variants(check, block):
    """tuning.linear_pairwise_block > 1: pairs inside blocks of that many rows formed exactly, below the tree's
    levels; everything against the token loop as above (SHARED: an input read by both hooks)."""
    with tuning.override(linear_pairwise_block=block):
        if check == "kda":
            _check(C + 5, B=2, seed=11)
        else:
            test_an_input_read_by_both_hooks_and_a_per_head_parameter_in_beta(K, 64)
