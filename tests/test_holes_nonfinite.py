"""Class 5 of issue 18: no NaN where the math is finite; non-finite inputs stay causal.

Every case is compared with a float64 sequential loop written here.
"""
import pytest
import torch

import scanlang as sl
from scanlang.backends import reference
from scanlang import tuning
from scanlang.backends.triton import runtime
from scanlang.recipes.kaczmarz import delta_rule
from scanlang.recipes.kalman import kalman_filter
from scanlang.recipes.kalman.reference import kalman_filter_loop
from scanlang.testing import assert_close, ratio, tolerance

INF = float("inf")
F64 = torch.float64
BACKENDS = ["reference", "triton"]
# interpreter-mode runs whose kernels no fast test builds: the slow tier
SLOW_TRITON = ["reference", pytest.param("triton", marks=pytest.mark.slow)]


def affine_loop(a, b, initial=None):
    """(prod a, h) along dim 1 in float64: h_t = a_t h_{t-1} + b_t, h_{-1} = initial or 0."""
    a, b = a.to(F64), b.to(F64)
    p = torch.ones_like(a[:, 0])
    h = torch.zeros_like(b[:, 0]) if initial is None else initial.to(F64)
    ps, hs = [], []
    for t in range(a.shape[1]):
        p, h = a[:, t] * p, a[:, t] * h + b[:, t]
        ps.append(p), hs.append(h)
    return torch.stack(ps, 1), torch.stack(hs, 1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("a_value, T", [(2.0, 300), (4.0, 77), (-3.0, 129)])
def test_affine_products_that_overflow_never_make_nan(backend, a_value, T):
    """The issue's instance (a = 2, b = 0, T = 300: 172 NaN) and others: h = 0 exactly, a overflows to +-inf."""
    a = torch.full((2, T), a_value)
    b = torch.zeros(2, T)
    out = sl.scan(sl.Affine, (a, b), dim=1, backend=backend)
    prod, h = affine_loop(a, b)
    assert not torch.isnan(out.b).any() and torch.equal(out.b, torch.zeros_like(out.b))
    assert torch.equal(torch.isinf(out.a), torch.isinf(prod.float()))


@pytest.mark.parametrize("T", [1, 31, 32, 33, 97])
@pytest.mark.parametrize("reverse", [False, True])
def test_blocked_reference_schedule_equals_the_loop(T, reverse):
    """Lengths around the chunk size, with and without `initial`, forward and reverse, and gradients."""
    a = (0.5 + 0.5 * torch.rand(3, T, 2, dtype=F64)).requires_grad_()
    b = torch.randn(3, T, 2, dtype=F64, requires_grad=True)
    h0 = torch.randn(3, 2, dtype=F64, requires_grad=True)
    out = sl.scan(sl.Affine, (a, b), dim=1, reverse=reverse, initial=(1.0, h0), backend="reference").b
    flip = (lambda x: x.flip(1)) if reverse else (lambda x: x)
    want = flip(affine_loop(flip(a), flip(b), h0)[1])
    assert_close(out, want, "scan")
    w = torch.randn_like(want)
    got = torch.autograd.grad((out * w).sum(), (a, b, h0))
    ref = torch.autograd.grad((want * w).sum(), (a, b, h0))
    for g, r in zip(got, ref):
        assert_close(g, r, "scan_grad")
    with torch.no_grad():   # the path that writes steps in place agrees with the recorded one
        assert torch.equal(sl.scan(sl.Affine, (a, b), dim=1, reverse=reverse, initial=(1.0, h0),
                                   backend="reference").b, out.detach())


def masked_scores(T):
    v = torch.randn(2, T, dtype=F64)
    v[:, 0] = -INF                 # a masked first token: the prefix is the empty sum
    v[0, 1:3] = -INF
    v[1, T // 2] = -INF
    return v


@pytest.mark.parametrize("backend", BACKENDS)
def test_logsumexp_on_minus_inf(backend):
    v = masked_scores(9)
    out = sl.scan(sl.LogSumExp, (v.float(),), dim=1, backend=backend).l
    want = torch.stack([torch.logsumexp(v[:, :t + 1], 1) for t in range(9)], 1)   # -inf for the empty sums
    assert torch.equal(torch.isneginf(out), torch.isneginf(want)) and not torch.isnan(out).any()
    assert_close(out, want, "scan", dtype=torch.float32)
    ident = sl.scan(sl.LogSumExp, (torch.full((1, 4), -INF),), dim=1, backend=backend).l   # its own identity
    assert torch.equal(ident, torch.full((1, 4), -INF))


@pytest.mark.parametrize("backend", SLOW_TRITON)
def test_online_softmax_on_minus_inf(backend):
    v = masked_scores(9)
    ones = torch.ones_like(v)
    out = sl.scan(sl.OnlineSoftmax, (v.float(), ones.float()), dim=1, backend=backend)
    m_want, s_want = [], []
    for t in range(9):   # running max, and the sum of exp(v_i - max) (the count while every score is -inf)
        m = v[:, :t + 1].max(1).values
        finite = torch.isfinite(m)
        s = torch.where(finite, torch.exp(v[:, :t + 1] - torch.where(finite, m, 0)[:, None]).sum(1),
                        torch.full_like(m, t + 1.0))
        m_want.append(m), s_want.append(s)
    m_want, s_want = torch.stack(m_want, 1), torch.stack(s_want, 1)
    assert torch.equal(out.m.double(), m_want.float().double())
    assert not torch.isnan(out.s).any()
    assert_close(out.s, s_want, "scan", dtype=torch.float32)
    e = sl.scan(sl.OnlineSoftmax, (torch.full((1, 3), -INF), torch.zeros(1, 3)), dim=1, backend=backend)
    assert torch.equal(e.s, torch.zeros(1, 3))


@pytest.mark.parametrize("backend", SLOW_TRITON)
def test_log_affine_with_zero_offsets(backend):
    """lb = -inf (b = 0) is a valid element: h_t = a_t h_{t-1} + b_t with some b = 0, in log space."""
    la = torch.randn(2, 8, dtype=F64) * 0.3
    b = torch.rand(2, 8, dtype=F64) + 0.1
    b[:, :2] = 0
    b[1, 5] = 0
    out = sl.scan(sl.LogAffine, (la.float(), b.log().float()), dim=1, backend=backend).lb
    _, h = affine_loop(la.exp(), b)
    assert torch.equal(torch.isneginf(out), torch.isneginf(h.log())) and not torch.isnan(out).any()
    assert_close(out, h.log(), "scan", dtype=torch.float32)


def test_reference_renormalises_large_projective_leaves():
    """Möbius leaves near 1e20: the reference renormalises each leaf before any product."""
    x = [torch.rand(3, 9, dtype=F64) * 1e20 + 1e19 for _ in range(4)]
    out = sl.scan(sl.Mobius, [t.float() for t in x], dim=1, backend="reference")
    lam, want = torch.ones(3, dtype=F64), []
    for t in range(9):
        lam = (x[0][:, t] * lam + x[1][:, t]) / (x[2][:, t] * lam + x[3][:, t])
        want.append(lam)
    assert_close((out.a + out.b) / (out.c + out.d), torch.stack(want, 1), "scan", dtype=torch.float32)


def mobius_loop(x, reverse=False, initial=None):
    """Möbius prefixes M_t = X_t ... X_0 M_init (X = [[a, b], [c, d]], M_init the unit matrix unless
    `initial`) along dim 1 in float64, each divided by its trace a + d as the monoid renormalises."""
    x = [t.to(F64) for t in x]
    one, zero = torch.ones_like(x[0][:, 0]), torch.zeros_like(x[0][:, 0])
    m = [one, zero, zero, one] if initial is None else [i.to(F64) for i in initial]
    steps = range(x[0].shape[1] - 1, -1, -1) if reverse else range(x[0].shape[1])
    outs = [None] * x[0].shape[1]
    for t in steps:
        a, b, c, d = (f[:, t] for f in x)
        m = [a * m[0] + b * m[2], a * m[1] + b * m[3], c * m[0] + d * m[2], c * m[1] + d * m[3]]
        m = [f / (m[0] + m[3]) for f in m]
        outs[t] = m
    return [torch.stack([o[f] for o in outs], 1) for f in range(4)]


# forward and backward launch configs forcing each generated schedule (small tiles for the interpreter)
SCHEDULES = {
    "tile": runtime.Config(block_t=8, block_l=4, num_warps=1, chunk=8),
    "lanes": runtime.Config(block_t=4, block_l=8, num_warps=1, chunk=4, schedule="lanes", unroll=4),
    "runs": runtime.Config(block_t=tuning.current().run_tile, block_l=2, num_warps=1, chunk=tuning.current().run_tile),
}


@pytest.mark.parametrize("schedule, T, reverse, with_initial, grad", [
    ("tile", 9, False, False, False),
    pytest.param("tile", 19, True, True, True, marks=pytest.mark.slow),
    pytest.param("lanes", 9, False, False, True, marks=pytest.mark.slow),
    pytest.param("lanes", 11, True, True, True, marks=pytest.mark.slow),
    pytest.param("runs", 139, False, True, False, marks=pytest.mark.slow),
    pytest.param("runs", 133, True, False, True, marks=pytest.mark.slow),
])
def test_triton_renormalises_large_projective_leaves(knobs, schedule, T, reverse, with_initial, grad):
    """Möbius leaves near 1e20 (a product of two overflows float32) on every generated schedule: the
    outputs, their projective ratio, and the gradients of the leaves and of the initial element equal
    the float64 loop's (where the leaves' products are finite)."""
    knobs(forced={(contiguous, backward): SCHEDULES[schedule] for contiguous in (False, True)
                  for backward in (False, True)})
    gen = torch.Generator().manual_seed(T)
    x64 = [(torch.rand(3, T, generator=gen, dtype=F64) * 1e20 + 1e19).float().double() for _ in range(4)]
    init64 = [torch.rand(3, generator=gen, dtype=F64) + 0.5 for _ in range(4)] if with_initial else []
    x = [t.float().requires_grad_(grad) for t in x64]
    initial = [i.float().requires_grad_(grad) for i in init64] or None
    out = sl.scan(sl.Mobius, x, dim=1, reverse=reverse, initial=initial, backend="triton")
    ins64 = [t.requires_grad_(grad) for t in x64 + init64]
    want = mobius_loop(ins64[:4], reverse, ins64[4:] or None)
    for f, o, w in zip("abcd", out, want):
        assert_close(o, w, "scan", name=f, dtype=torch.float32)
    assert_close((out.a + out.b) / (out.c + out.d), (want[0] + want[1]) / (want[2] + want[3]), "scan",
                 dtype=torch.float32)
    if grad:
        w = [torch.randn(3, T, generator=gen, dtype=F64) for _ in range(4)]
        got = torch.autograd.grad(sum((o * v.float()).sum() for o, v in zip(out, w)), x + (initial or []))
        ref = torch.autograd.grad(sum((o * v).sum() for o, v in zip(want, w)), ins64)
        for name, g, r in zip(["da", "db", "dc", "dd", "dinit_a", "dinit_b", "dinit_c", "dinit_d"], got, ref):
            assert_close(g, r, "scan_grad", name=name, dtype=torch.float32)


@pytest.mark.parametrize("backend, form", [("reference", "two_scans"), ("triton", "two_scans"),
                                           pytest.param("triton", "fused", marks=pytest.mark.slow)])
def test_kalman_filter_with_huge_precisions(backend, form):
    """prec = 1e30 is valid (an observation trusted completely): finite and equal to the loop."""
    B, T, M, S = 1, 9, 2, 2
    v, prec = torch.randn(B, T, M), torch.rand(B, T, M) + 0.5
    prec[:, ::3] = 1e30
    k, q = torch.randn(B, T, S), torch.randn(B, T, S)
    a_bar, p_bar = torch.rand(M, S) * 0.5 + 0.4, torch.rand(M, S) * 0.2 + 0.05
    y, y_var, _ = kalman_filter(v, prec, k, q, a_bar, p_bar, backend=backend, form=form)
    want, want_var, _ = kalman_filter_loop(v, prec, k, q, a_bar, p_bar)
    assert_close(y, want, "kalman_out")
    assert_close(y_var, want_var, "kalman_out")


def delta_loop(q, k, v, g, beta, h0=None, final_state=False):
    """The token loop of docs/spec/kaczmarz.md in float64 (NaN and inf propagate as IEEE arithmetic does), from h0
    [B, H, K, V] (or zeros): o, and with `final_state` (o, S). Differentiable (autograd of the loop)."""
    q, k, v, g, beta = (t.to(F64) for t in (q, k, v, g, beta))
    B, T, H, K = k.shape
    outs, finals = [], []
    for b in range(B):
        S = torch.zeros(H, K, v.shape[-1], dtype=F64) if h0 is None else h0[b].to(F64)
        for t in range(T):
            S = torch.exp(g[b, t])[:, None, None] * S
            e = v[b, t] - torch.einsum("hkv,hk->hv", S, k[b, t])
            S = S + beta[b, t][:, None, None] * k[b, t][:, :, None] * e[:, None, :]
            outs.append(K ** -0.5 * torch.einsum("hkv,hk->hv", S, q[b, t]))
        finals.append(S)
    o = torch.stack(outs).reshape(B, T, H, v.shape[-1])
    return (o, torch.stack(finals)) if final_state else o


def delta_inputs(T=40, H=2, K=8, V=4):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, H, V, generator=gen)
    g = -torch.rand(1, T, H, generator=gen) * 0.2
    beta = torch.rand(1, T, H, generator=gen)
    return q, k, v, g, beta


def poison(case, q, k, v, g, beta):
    q, k, v, g, beta = (t.clone() for t in (q, k, v, g, beta))
    if case == "v nan":
        v[0, 20, 0, 3] = float("nan")
    elif case == "k inf":
        k[0, 21, 1, 2] = INF
    elif case == "beta nan":
        beta[0, 19, 0] = float("nan")
    elif case == "v nan (right padding)":
        v[0, 35:] = float("nan")
    elif case == "v inf (a chunk's first token)":
        v[0, 16, 1, 0] = INF
    elif case == "v nan (a chunk's last token)":
        v[0, 31, 0, 2] = float("nan")
    elif case == "g = -inf resets":
        g[0, 5, 0] = -INF
        g[0, 17:19, 1] = -INF
    return q, k, v, g, beta


CASES = ["v nan", "k inf", "beta nan", "v nan (right padding)", "v inf (a chunk's first token)",
         "v nan (a chunk's last token)", "g = -inf resets"]
# a non-finite value keeps the token loop's gradients of the earlier tokens finite (its state's backward depends on
# the keys, steps and decays only); a non-finite key or step makes all of them NaN there (CASES' others)
VALUE_CASES = ["v nan", "v nan (right padding)", "v inf (a chunk's first token)", "v nan (a chunk's last token)"]
PLANTED_FROM = {"v nan": 20, "v nan (right padding)": 35, "v inf (a chunk's first token)": 16,
                "v nan (a chunk's last token)": 31}


def check_causal(o, want, dtype=torch.float32):
    """Same NaN pattern and finiteness as the loop, and equal where the loop is finite."""
    assert torch.equal(torch.isnan(o), torch.isnan(want)), "NaN pattern differs from the loop"
    assert torch.equal(torch.isfinite(o), torch.isfinite(want))
    fin = torch.isfinite(want)
    assert ratio(o[fin], want[fin]) <= tolerance("delta_out", dtype)


@pytest.mark.parametrize("case", CASES)
def test_delta_reference_keeps_non_finite_tokens_causal(case):
    ins = poison(case, *delta_inputs())
    o, _ = delta_rule(*ins, backend="reference", chunk_size=16)
    check_causal(o, delta_loop(*ins))


@pytest.mark.slow
def test_delta_triton_hard_resets_are_exact_forward_and_backward():
    """g = -inf on the generated kernels (log-decays floored where they are summed): the loop's outputs,
    and the reference path's gradients."""
    ins = poison("g = -inf resets", *delta_inputs())
    o, _ = delta_rule(*ins, backend="triton", chunk_size=16)
    check_causal(o, delta_loop(*ins))
    w = torch.randn_like(o)
    grads = {}
    for backend in BACKENDS:
        xs = [t.clone().requires_grad_() for t in ins]
        out, _ = delta_rule(*xs, backend=backend, chunk_size=16)
        grads[backend] = torch.autograd.grad((out * w).sum(), xs)
    for name, got, want in zip("q k v g beta".split(), grads["triton"], grads["reference"]):
        assert torch.isfinite(got).all()
        assert ratio(got, want) <= tolerance("delta_grad", torch.float32), name


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_triton_keeps_non_finite_tokens_causal(dtype):
    """The chunk kernels' causal products (Tm = (I + A)^-1, w, u, (Q K^T * Dec) U) keep a NaN or inf token out of
    the earlier tokens of its chunk: the loop's outputs and NaN pattern (bf16 takes the split w / u products)."""
    for case in CASES[:-1]:
        ins = [t.to(dtype) for t in poison(case, *delta_inputs())]
        o, _ = delta_rule(*ins, backend="triton", chunk_size=16)
        check_causal(o, delta_loop(*ins), dtype)


# bwd_dqk doing bwd_wy's work too; w and u recomputed by delta_wu one column block per program (not kept)
WY = dict(delta_configs={"bwd_dqk": dict(WY=True, BKS=16, BV=16, num_warps=4, num_stages=1, DG_SUMS=False)})
WU = dict(delta_save_wu=False, delta_configs={"wu": dict(BV=16, num_warps=4, num_stages=1, PER_CHUNK=False)})


@pytest.mark.slow
@pytest.mark.parametrize("case, config, dtype", [(c, {}, torch.float32) for c in VALUE_CASES]
                         + [("v nan", WY, torch.float32), ("v nan (a chunk's last token)", WU, torch.float32),
                            ("v nan (right padding)", {}, torch.bfloat16)])
def test_delta_triton_gradients_stay_causal(case, config, dtype, knobs):
    """A NaN or inf value: every gradient (q, k, v, g, beta, initial state) has the float64 token loop's NaN pattern
    and values (the outputs' and final state's NaNs masked out of the loss), so the tokens before it keep finite
    gradients: U's and V's non-finite entries stay out of dM, dTm and the chunk-end sums."""
    knobs(**config)
    ins = [t.to(dtype) for t in poison(case, *delta_inputs())]
    gen = torch.Generator().manual_seed(3)
    h0 = torch.randn(1, 2, 8, 4, generator=gen)
    xs = [t.to(F64).requires_grad_() for t in [*ins, h0]]
    o, S = delta_loop(*xs[:5], xs[5], final_state=True)
    w, wS = torch.randn(o.shape, generator=gen, dtype=F64), torch.randn(S.shape, generator=gen, dtype=F64)
    want = torch.autograd.grad((o.nan_to_num(0) * w).sum() + (S.nan_to_num(0) * wS).sum(), xs)
    ts = [t.clone().requires_grad_() for t in [*ins, h0]]
    o, S = delta_rule(*ts[:5], initial_state=ts[5], output_final_state=True, backend="triton", chunk_size=16)
    got = torch.autograd.grad((o.nan_to_num(0) * w.float()).sum() + (S.nan_to_num(0) * wS.float()).sum(), ts)
    t0 = PLANTED_FROM[case]
    for name, g, ref in zip("q k v g beta h0".split(), got, want):
        early = ref if name == "h0" else ref[:, :t0]
        assert torch.isfinite(early).all(), f"the loop's d{name} before the planted token"   # what is tested
        assert torch.equal(torch.isnan(g), torch.isnan(ref)), f"d{name}: NaN pattern differs from the loop"
        assert torch.equal(torch.isfinite(g), torch.isfinite(ref)), f"d{name}: finiteness differs from the loop"
        fin = torch.isfinite(ref)
        kind = "delta_gate_grad" if name in ("g", "beta") else "delta_grad"
        assert ratio(g[fin], ref[fin]) <= tolerance(kind, dtype), name
