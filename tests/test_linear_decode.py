"""The recurrent decode kernel (backends/linear/decode.py) of every matrix-state member, in Triton's
interpreter: outputs and final states against an independent float64 token loop written here, and the
routing of backend='triton' (no gradients, every sequence <= tuning.decode_max_tokens tokens)."""
import pytest
import torch
import torch.nn.functional as F

import scanlang as sl
from scanlang.backends.linear import ops
from scanlang.recipes import linear as L
from scanlang.recipes.linear import members as M
from scanlang.testing import assert_close

D64 = torch.float64
H, K, V = 2, 6, 36     # K != V, K not a power of two, V over two value blocks of 32 (the second partial)

# name -> (declaration, Householder steps n)
MEMBERS = {
    "linear_attention": (M.LINEAR_ATTENTION, 1),
    "simple_gla": (M.SIMPLE_GLA, 1),
    "gla": (M.GLA, 1),
    "deltanet": (M.DELTANET, 1),
    "gated_delta_rule": (M.DELTA_RULE, 1),
    "kda": (M.KDA, 1),
    "kaczmarz": (M.KACZMARZ, 1),
    "gated_delta_product": (L.gated_delta_product_declaration(2), 2),
    # per-key decay with Householder steps: the one structure only the decode kernel runs (no chunk kernels)
    "per_key_product": (sl.matrix_state("per_key_product", decay="per_key", correction="householder", steps=2,
                                        inputs={"g": "token_key", "beta": "token"}, beta=lambda t: t.beta,
                                        log_decay=lambda t: t.g), 2),
}
OPS = {name: L.op(d) for name, (d, _) in MEMBERS.items()}


def token_loop(q, k, v, g, beta, n=1, scale=None, h0=None, cu=None):
    """float64, one token at a time: S <- D_t S, then n writes (plain when beta is None, else
    S <- S + beta k (v - S^T k)^T) on rows t*n .. t*n+n-1 of k, v, beta, then o_t = scale S^T q_t.
    g: None | [B,T,H] | [B,T,H,K]."""
    B, T, Hn, Kn = q.shape
    Vn = v.shape[-1]
    scale = Kn ** -0.5 if scale is None else scale
    bounds = [(b, 0, T) for b in range(B)] if cu is None else [(0, s, e) for s, e in zip(cu[:-1], cu[1:])]
    o = torch.zeros(B, T, Hn, Vn, dtype=D64)
    finals = []
    for i, (b, s, e) in enumerate(bounds):
        S = torch.zeros(Hn, Kn, Vn, dtype=D64) if h0 is None else h0[i].to(D64).clone()
        for t in range(s, e):
            if g is not None:
                d = torch.exp(g[b, t].to(D64))
                S = (d[:, None, None] if g.dim() == 3 else d[:, :, None]) * S
            for j in range(n):
                kr, vr = k[b, t * n + j].to(D64), v[b, t * n + j].to(D64)
                if beta is None:
                    S = S + kr[:, :, None] * vr[:, None, :]
                else:
                    err = vr - torch.einsum("hkv,hk->hv", S, kr)
                    S = S + beta[b, t * n + j].to(D64)[:, None, None] * kr[:, :, None] * err[:, None, :]
            o[b, t] = scale * torch.einsum("hkv,hk->hv", S, q[b, t].to(D64))
        finals.append(S)
    return o, torch.stack(finals)


def make(name, B, T, gen, g_min=None, zero_keys=()):
    """The op's arguments (q, k, v, inputs...) in fp32, random and non-zero (k rows `zero_keys` zero)."""
    decl, n = MEMBERS[name]
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T * n, H, K, generator=gen)
    v = torch.randn(B, T * n, H, V, generator=gen)
    for r in zero_keys:
        k[:, r] = 0.0
    per_head = -(0.05 + torch.rand(B, T, H, generator=gen))
    per_key = F.logsigmoid(torch.randn(B, T, H, K, generator=gen))
    if g_min is not None:
        per_head, per_key = torch.full_like(per_head, g_min), torch.full_like(per_key, g_min)
    values = {"g": per_key if decl.decay == "per_key" else per_head,
              "beta": torch.sigmoid(torch.randn(B, T * n, H, generator=gen)),
              "eta": torch.sigmoid(torch.randn(B, T, H, generator=gen))}
    return [q, k, v, *(values[x] for x in decl.inputs)]


def oracle(name, args):
    """(q, k, v, g, beta) of the token loop, in float64, from the op's arguments."""
    decl = MEMBERS[name][0]
    x = dict(zip(("q", "k", "v", *decl.inputs), (t.to(D64) for t in args)))
    beta = x.get("beta")
    if name == "kaczmarz":   # eta / (||k||^2 + eps); a zero key writes nothing
        n2 = (x["k"] * x["k"]).sum(-1)
        beta = torch.where(n2 > 0, x["eta"] / (n2 + 1e-6), torch.zeros_like(n2))
    return x["q"], x["k"], x["v"], x.get("g"), beta


def check(name, B, T, cu=None, g_min=None, zero_keys=(), seed=0, scale=None):
    gen = torch.Generator().manual_seed(seed)
    args = make(name, B, T, gen, g_min, zero_keys)
    N = B if cu is None else len(cu) - 1
    h0 = torch.randn(N, H, K, V, generator=gen)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    o, S = OPS[name](*args, initial_state=h0, output_final_state=True, cu_seqlens=cu_t, scale=scale,
                     backend="triton")
    o_ref, S_ref = token_loop(*oracle(name, args), MEMBERS[name][1], scale, h0, cu)
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert_close(o, o_ref, "delta_out", torch.float32, name=f"{name} o")
    assert_close(S, S_ref, "delta_out", torch.float32, name=f"{name} S")
    return args, h0, o, S


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("name", list(MEMBERS))
def test_member_against_token_loop(name, T):
    """B = 2, H = 2, initial and final state, every member on the decode kernel."""
    check(name, 2, T)


@pytest.mark.parametrize("name", list(MEMBERS))
def test_cu_seqlens_with_empty_and_single_token_sequences(name):
    cu = [0, 1, 1, 6, 9]
    _, h0, o, S = check(name, 1, cu[-1], cu=cu, scale=0.7)
    torch.testing.assert_close(S[1], h0[1], rtol=0, atol=0)   # the empty sequence keeps its initial state


@pytest.mark.parametrize("name", ["gla", "kda"])
def test_per_key_decay_of_minus_20_stays_finite(name):
    check(name, 1, 5, g_min=-20.0)


@pytest.mark.parametrize("name", ["kaczmarz", "deltanet", "gated_delta_product", "gla"])
def test_zero_keys_never_nan(name):
    """A zero key writes nothing (Kaczmarz: beta = eta / (0 + eps) is taken as 0, as the reference does)."""
    check(name, 1, 5, zero_keys=(0, 3))


@pytest.mark.parametrize("name", ["kda", "gated_delta_product", "kaczmarz", "simple_gla"])
def test_token_by_token_equals_the_full_pass(name):
    """Decoding one token at a time, each call starting from the previous call's final state, gives the
    full pass's outputs and final state (the same token steps on the same fp32 state)."""
    gen = torch.Generator().manual_seed(3)
    n = MEMBERS[name][1]
    decl, n = MEMBERS[name]
    args = make(name, 1, 5, gen)
    h0 = torch.randn(1, H, K, V, generator=gen)
    o, S = OPS[name](*args, initial_state=h0, output_final_state=True, backend="triton")
    per_row = [1, n, n] + [n if decl.rows.get(x) == "sub" else 1 for x in decl.inputs]
    state, outs = h0, []
    for t in range(5):
        step = [x[:, t * m:(t + 1) * m] for x, m in zip(args, per_row)]
        o_t, state = OPS[name](*step, initial_state=state, output_final_state=True, backend="triton")
        outs.append(o_t)
    torch.testing.assert_close(torch.cat(outs, 1), o, rtol=0, atol=0)
    torch.testing.assert_close(state, S, rtol=0, atol=0)


def test_routing_follows_gradients_and_the_length_knob():
    gen = torch.Generator().manual_seed(5)
    args = make("gla", 1, 5, gen)
    with ops.recording() as launches:
        OPS["gla"](*args, backend="triton")
    assert [name for name, *_ in launches] == ["gla_decode"]
    with sl.tuning.override(decode_max_tokens=4), ops.recording() as launches:
        OPS["gla"](*args, backend="triton")
    assert [name for name, *_ in launches] == ["gla_decay_cumsum", "gla_fwd", "gla_fwd_o"]   # per key: split
    with sl.tuning.override(decode_max_tokens=4, linear_forward="fused"), ops.recording() as launches:
        OPS["gla"](*args, backend="triton")
    assert [name for name, *_ in launches] == ["gla_decay_cumsum", "gla_fwd"]
    kda = make("kda", 1, 5, gen)
    leaves = [t.clone().requires_grad_() for t in kda]
    with ops.recording() as launches:   # with gradients: the per-key delta chunk kernels
        OPS["kda"](*leaves, backend="triton")
    assert [name for name, *_ in launches] == ["kda_decay_cumsum", "kda_prep", "kda_fwd", "kda_fwd_o"]
    with torch.no_grad():   # the same tensors without gradients: the decode kernel
        o, _ = OPS["kda"](*leaves, backend="triton")
    assert torch.isfinite(o).all()
    with sl.tuning.override(decode_max_tokens=4), ops.recording() as launches:
        OPS["kda"](*kda, backend="triton")
    assert [name for name, *_ in launches] == ["kda_decay_cumsum", "kda_prep", "kda_fwd", "kda_fwd_o"]
    gdp = make("per_key_product", 1, 5, gen)   # per-key decay with Householder steps: no chunk kernels yet
    with pytest.raises(ValueError, match="gradients are needed.*use backend='reference'"):
        OPS["per_key_product"](*[t.clone().requires_grad_() for t in gdp], backend="triton")
    with sl.tuning.override(decode_max_tokens=4):
        with pytest.raises(ValueError, match="longer than decode_max_tokens = 4.*use backend='reference'"):
            OPS["per_key_product"](*gdp, backend="triton")
    with pytest.raises(ValueError, match="decode_max_tokens"):
        with sl.tuning.override(decode_max_tokens=-1):
            pass


@pytest.mark.parametrize("name", ["kda", "gated_delta_product"])
def test_bad_input_gives_the_reference_paths_error(name):
    gen = torch.Generator().manual_seed(6)
    args = make(name, 1, 3, gen)
    bad = list(args)
    bad[3] = bad[3][..., :1] if name == "kda" else bad[3][:, :2]   # g of the wrong shape
    messages = []
    for backend in ("reference", "triton"):
        with pytest.raises(ValueError, match="g must have shape") as info:
            OPS[name](*bad, backend=backend)
        messages.append(str(info.value))
    assert messages[0] == messages[1]


# hooks evaluated in the kernel: per-key decay from a per-key and a per-token input (the latter read by both
# hooks), a per-head parameter and constants in beta, ||k||^2; per-head decay from a per-head parameter with two
# Householder steps whose beta input carries T*n rows
HOOKED_KEY = sl.matrix_state("decode_hooked_key", decay="per_key", correction="delta",
                             inputs={"a": "token_key", "b": "token", "w": "head"}, constants={"c": 0.5, "eps": 1e-3},
                             beta=lambda t: sl.sigmoid(t.b) * t.w / (t.n2 + t.eps),
                             log_decay=lambda t: sl.logsigmoid(t.a) * sl.sigmoid(t.b) * t.c)
HOOKED_PRODUCT = sl.matrix_state("decode_hooked_product", decay="per_head", correction="householder", steps=2,
                                 inputs={"a": "token", "A_log": "head", "s": "token"},
                                 beta=lambda t: sl.sigmoid(t.s),
                                 log_decay=lambda t: -sl.exp(t.A_log) * sl.softplus(t.a))


@pytest.mark.parametrize("decl", [HOOKED_KEY, HOOKED_PRODUCT], ids=lambda d: d.name)
def test_hooks_from_the_declared_inputs(decl):
    gen = torch.Generator().manual_seed(9)
    B, T, n = 1, 5, decl.steps
    q = torch.randn(B, T, H, K, generator=gen)
    k, v = torch.randn(B, T * n, H, K, generator=gen), torch.randn(B, T * n, H, V, generator=gen)
    k[:, 2] = 0.0   # a zero key: n2 = 0 in beta's denominator
    h0 = torch.randn(B, H, K, V, generator=gen)
    if decl is HOOKED_KEY:
        a, b, w = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, generator=gen), 0.5 + torch.rand(H)
        o, S = L.op(decl)(q, k, v, a, b, w, initial_state=h0, output_final_state=True, c=0.25, backend="triton")
        a, b, w, kd = a.to(D64), b.to(D64), w.to(D64), k.to(D64)
        g = F.logsigmoid(a) * torch.sigmoid(b)[..., None] * 0.25
        n2 = (kd * kd).sum(-1)
        beta = torch.where(n2 > 0, torch.sigmoid(b) * w / (n2 + 1e-3), torch.zeros_like(n2))
    else:
        a, A_log = torch.randn(B, T, H, generator=gen), torch.randn(H, generator=gen)
        s = torch.randn(B, T * n, H, generator=gen)
        o, S = L.op(decl)(q, k, v, a, A_log, s, initial_state=h0, output_final_state=True, backend="triton")
        g = -torch.exp(A_log.to(D64)) * F.softplus(a.to(D64))
        beta = torch.sigmoid(s.to(D64))
    o_ref, S_ref = token_loop(q.to(D64), k.to(D64), v.to(D64), g, beta, n, None, h0)
    assert_close(o, o_ref, "delta_out", torch.float32, name=f"{decl.name} o")
    assert_close(S, S_ref, "delta_out", torch.float32, name=f"{decl.name} S")


def test_ungated_delta_product_of_three_steps():
    gen = torch.Generator().manual_seed(10)
    q, k = torch.randn(2, 5, H, K, generator=gen), torch.randn(2, 15, H, K, generator=gen)
    v, beta = torch.randn(2, 15, H, V, generator=gen), torch.rand(2, 15, H, generator=gen)
    o, S = L.gated_delta_product(q, k, v, None, beta, 3, output_final_state=True, backend="triton")
    o_ref, S_ref = token_loop(q.to(D64), k.to(D64), v.to(D64), None, beta.to(D64), 3)
    assert_close(o, o_ref, "delta_out", torch.float32, name="o")
    assert_close(S, S_ref, "delta_out", torch.float32, name="S")


def test_bf16_inputs():
    gen = torch.Generator().manual_seed(11)
    args = [t.to(torch.bfloat16) for t in make("kda", 1, 5, gen)]
    o, S = OPS["kda"](*args, output_final_state=True, backend="triton")
    o_ref, S_ref = token_loop(*oracle("kda", args))
    assert_close(o, o_ref, "delta_out", torch.bfloat16, name="o")
    assert_close(S, S_ref, "delta_out", torch.bfloat16, name="S")


def test_non_finite_token_never_reaches_earlier_outputs():
    gen = torch.Generator().manual_seed(12)
    args = make("gated_delta_rule", 1, 5, gen)
    clean, _ = OPS["gated_delta_rule"](*args, backend="triton")
    args[2][0, 3, 1] = float("nan")
    o, _ = OPS["gated_delta_rule"](*args, backend="triton")
    torch.testing.assert_close(o[:, :3], clean[:, :3], rtol=0, atol=0)
    assert torch.isnan(o[0, 3:, 1]).all()


def test_generated_source_follows_the_structure():
    """none: no exponent; per head: one scalar decay; per key: a column; plain: no beta and no read of S
    before the write; n steps: a static loop of n writes; ||k||^2 only where beta reads it."""
    from scanlang.backends.linear import decode
    src = {name: decode.render(d) for name, (d, _) in MEMBERS.items()}
    assert "tl.exp" not in src["linear_attention"] and "beta" not in src["linear_attention"]
    assert "S = S * tl.exp(g)\n" in src["simple_gla"] and "e = b_v" not in src["simple_gla"]
    assert "S = S * tl.exp(g)[:, None]" in src["gla"] and "e = b_v" not in src["gla"]
    assert "e = b_v - tl.sum(S * b_k[:, None], 0)" in src["deltanet"] and "n2" not in src["deltanet"]
    assert "n2_safe = tl.where(n2 > 0, n2, 1.0)" in src["kaczmarz"]
    assert "tl.static_range(0, 2)" in src["gated_delta_product"] and "static_range" not in src["kda"]
    assert "log_decay = g" in src["kda"]   # the declaration, cited in the kernel
    assert decode.render(M.KDA) == src["kda"]   # deterministic


@pytest.mark.parametrize("name", ["simple_gla", "kda"])
def test_hard_reset_matches_the_reference(name):
    """A log-decay of -inf (a hard reset, which the chunk kernels refuse) on the decode kernel: the state
    before it is forgotten, as in the token loop (and on the reference path)."""
    gen = torch.Generator().manual_seed(13)
    args = make(name, 1, 5, gen)
    args[3][0, 2, 1] = float("-inf")   # token 2, head 1 (every key for per-key decay)
    h0 = torch.randn(1, H, K, V, generator=gen)
    o, S = OPS[name](*args, initial_state=h0, output_final_state=True, backend="triton")
    o_ref, S_ref = token_loop(*oracle(name, args), 1, None, h0)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert_close(o, o_ref, "delta_out", torch.float32, name=f"{name} o")
    assert_close(S, S_ref, "delta_out", torch.float32, name=f"{name} S")


def test_no_tokens_keeps_the_initial_state():
    gen = torch.Generator().manual_seed(14)
    args = make("kda", 1, 0, gen)
    h0 = torch.randn(2, H, K, V, generator=gen)
    o, S = OPS["kda"](*args, initial_state=h0, output_final_state=True, cu_seqlens=torch.tensor([0, 0, 0]),
                      backend="triton")
    assert o.shape == (1, 0, H, V) and o.dtype == torch.float32
    torch.testing.assert_close(S, h0, rtol=0, atol=0)
