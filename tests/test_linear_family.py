"""The matrix-state family (spec/linear.md): the declaration, the DSL gates, every member on the
reference backend against an independent float64 token loop written here."""
import math

import pytest
import sympy
import torch
import torch.nn.functional as F

import scanlang as sl
from scanlang import expr as E
from scanlang.errors import UnsupportedOperationError
from scanlang.linear import DECODE_NAMES
from scanlang.recipes import kaczmarz
from scanlang.recipes import linear as L
from scanlang.recipes.linear.members import _OPS, DELTA_RULE, KACZMARZ
from scanlang.testing import assert_close

C = 16   # the reference's chunk in these tests
D64 = torch.float64

# the member nobody ships: Kaczmarz's step with KDA's per-key decay, both from raw gates
KACZMARZ_KDA = sl.matrix_state(
    "kaczmarz_kda", decay="per_key", correction="delta",
    inputs={"a": "token_key", "b": "token"}, constants={"eps": 1e-6},
    beta=lambda t: sl.sigmoid(t.b) / (t.n2 + t.eps), log_decay=lambda t: sl.logsigmoid(t.a))
KACZMARZ_KDA_OP = L.op(KACZMARZ_KDA)
# per-head parameters in a hook: Mamba2's gate g = -exp(A_log) softplus(a + dt_bias), a gated beta
MAMBA2_GDN = sl.matrix_state(
    "mamba2_gdn", decay="per_head", correction="delta",
    inputs={"a": "token", "A_log": "head", "dt_bias": "head", "b": "token"},
    beta=lambda t: sl.sigmoid(t.b), log_decay=lambda t: -sl.exp(t.A_log) * sl.softplus(t.a + t.dt_bias))
MAMBA2_GDN_OP = L.op(MAMBA2_GDN)


# --------------------------------------------------------------------------------------------------
# The oracle: the token recurrence, one token and one sub-step at a time, in float64.

def token_loop(q, k, v, g, beta, n=1, scale=None, h0=None, cu=None):
    """g None | [B,T,H] | [B,T,H,K]; beta None (plain write) | [B,T*n,H]; k, v carry T*n rows."""
    q, k, v = (t.to(D64) for t in (q, k, v))
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    bounds = [(b, 0, T) for b in range(B)] if cu is None else [(0, s, e) for s, e in zip(cu[:-1], cu[1:])]
    o = torch.zeros(B, T, H, V, dtype=D64)
    finals = []
    for i, (b, s, e) in enumerate(bounds):
        S = torch.zeros(H, K, V, dtype=D64) if h0 is None else h0[i].to(D64)
        for t in range(s, e):
            if g is not None:
                d = torch.exp(g[b, t].to(D64))
                S = (d[:, None, None] if g.dim() == 3 else d[:, :, None]) * S
            for j in range(n):
                kt, vt = k[b, t * n + j], v[b, t * n + j]
                if beta is None:
                    S = S + kt[:, :, None] * vt[:, None, :]
                else:
                    err = vt - torch.einsum("hkv,hk->hv", S, kt)
                    S = S + beta[b, t * n + j].to(D64)[:, None, None] * kt[:, :, None] * err[:, None, :]
            o[b, t] = scale * torch.einsum("hkv,hk->hv", S, q[b, t].to(D64))
        finals.append(S)
    return o, torch.stack(finals)


def kaczmarz_step(k, eta, eps):
    n2 = (k.to(D64) ** 2).sum(-1)
    return torch.where(n2 + eps > 0, eta.to(D64) / torch.where(n2 + eps > 0, n2 + eps, 1.0), 0.0)


# name -> (extra input shapes as "tok" [B,T,H] / "sub" [B,T*n,H] / "key" [B,T,H,K] with their
# domain, n, the member call, the oracle's (g, beta) from the inputs)
def _logdecay(shape, gen, dtype):
    return -(0.05 + torch.rand(shape, generator=gen, dtype=D64)).to(dtype)


MEMBERS = {
    "linear_attention": ((), 1, lambda q, k, v, **kw: L.linear_attention(q, k, v, **kw), lambda k, x: (None, None)),
    "simple_gla": ((("g", "tok", "decay"),), 1, lambda q, k, v, g, **kw: L.simple_gla(q, k, v, g, **kw),
                   lambda k, x: (x["g"], None)),
    "gla": ((("g", "key", "decay"),), 1, lambda q, k, v, g, **kw: L.gla(q, k, v, g, **kw), lambda k, x: (x["g"], None)),
    "delta_rule": ((("g", "tok", "decay"), ("beta", "tok", "unit")), 1,
                   lambda q, k, v, g, beta, **kw: L.delta_rule(q, k, v, g, beta, **kw), lambda k, x: (x["g"], x["beta"])),
    "deltanet": ((("beta", "tok", "unit"),), 1, lambda q, k, v, beta, **kw: L.delta_rule(q, k, v, None, beta, **kw),
                 lambda k, x: (None, x["beta"])),
    "delta_rule_family": ((("g", "tok", "decay"), ("beta", "tok", "unit")), 1,
                          lambda q, k, v, g, beta, **kw: _OPS[DELTA_RULE.name](q, k, v, g, beta, **kw),
                          lambda k, x: (x["g"], x["beta"])),
    "kda": ((("g", "key", "decay"), ("beta", "tok", "unit")), 1,
            lambda q, k, v, g, beta, **kw: L.kda(q, k, v, g, beta, **kw), lambda k, x: (x["g"], x["beta"])),
    "gated_delta_product": ((("g", "tok", "decay"), ("beta", "sub", "unit")), 2,
                            lambda q, k, v, g, beta, **kw: L.gated_delta_product(q, k, v, g, beta, 2, **kw),
                            lambda k, x: (x["g"], x["beta"])),
    "delta_product_3": ((("beta", "sub", "unit"),), 3,
                        lambda q, k, v, beta, **kw: L.gated_delta_product(q, k, v, None, beta, 3, **kw),
                        lambda k, x: (None, x["beta"])),
    "kaczmarz_delta_rule": ((("g", "tok", "decay"), ("eta", "tok", "unit")), 1,
                            lambda q, k, v, g, eta, **kw: L.kaczmarz_delta_rule(q, k, v, g, eta, **kw),
                            lambda k, x: (x["g"], kaczmarz_step(k, x["eta"], 1e-6))),
    "kaczmarz_family": ((("g", "tok", "decay"), ("eta", "tok", "unit")), 1,
                        lambda q, k, v, g, eta, **kw: _OPS[KACZMARZ.name](q, k, v, g, eta, **kw),
                        lambda k, x: (x["g"], kaczmarz_step(k, x["eta"], 1e-6))),
    "kaczmarz_kda (new)": ((("a", "key", "raw"), ("b", "tok", "raw")), 1,
                           lambda q, k, v, a, b, **kw: KACZMARZ_KDA_OP(q, k, v, a, b, **kw),
                           lambda k, x: (F.logsigmoid(x["a"].to(D64)), kaczmarz_step(k, torch.sigmoid(x["b"].to(D64)), 1e-6))),
    "mamba2_gdn (declared)": ((("a", "tok", "raw"), ("A_log", "head", "raw"), ("dt_bias", "head", "raw"),
                               ("b", "tok", "raw")), 1,
                              lambda q, k, v, a, A_log, dt_bias, b, **kw: MAMBA2_GDN_OP(q, k, v, a, A_log, dt_bias, b, **kw),
                              lambda k, x: (-torch.exp(x["A_log"].to(D64)) * F.softplus(x["a"].to(D64) + x["dt_bias"].to(D64)),
                                            torch.sigmoid(x["b"].to(D64)).expand(k.shape[:3]))),
}
OLD_OPS = ("delta_rule", "deltanet", "kaczmarz_delta_rule")   # recipes/kaczmarz's own reference: chunk 16/32/64


def make(name, B, T, H, K, V, dtype=D64, seed=0, N=None):
    specs, n, _, _ = MEMBERS[name]
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=D64).to(dtype)  # noqa: E731
    x = {"q": rand(B, T, H, K), "k": rand(B, T * n, H, K) / math.sqrt(K), "v": rand(B, T * n, H, V)}
    for arg, rows, domain in specs:
        shape = {"tok": (B, T, H), "sub": (B, T * n, H), "key": (B, T, H, K), "head": (H,)}[rows]
        x[arg] = (_logdecay(shape, gen, dtype) if domain == "decay" else
                  torch.rand(shape, generator=gen, dtype=D64).to(dtype) if domain == "unit" else rand(*shape))
    x["h0"] = torch.randn(N or B, H, K, V, generator=gen, dtype=D64).to(torch.float32 if dtype != D64 else D64)
    return x


def run(name, x, **kw):
    _, _, call, _ = MEMBERS[name]
    args = [x[a] for a, *_ in MEMBERS[name][0]]
    kw.setdefault("chunk_size", C)
    return call(x["q"], x["k"], x["v"], *args, initial_state=x.get("h0"), output_final_state=True,
                backend="reference", **kw)


def oracle(name, x, cu=None):
    _, n, _, gb = MEMBERS[name]
    g, beta = gb(x["k"], x)
    return token_loop(x["q"], x["k"], x["v"], g, beta, n=n, h0=x.get("h0"), cu=cu)


# --------------------------------------------------------------------------------------------------
# The gates.

GATES = ((sl.sigmoid, torch.sigmoid), (sl.softplus, F.softplus), (sl.logsigmoid, F.logsigmoid))
EXTREME = torch.tensor([-100.0, -30.0, -1.5, -1e-3, 0.0, 1e-3, 0.7, 30.0, 100.0], dtype=D64)


@pytest.mark.parametrize("gate,ref", GATES, ids=lambda f: getattr(f, "__name__", ""))
def test_gates_match_torch_at_extreme_inputs_and_their_derivatives_match_finite_differences(gate, ref):
    x = E.symbol("x")
    expr = gate(E.Traced(x)).expr
    lines, outs = E.render([expr, sympy.diff(expr, x)], {x: "x"}, E.TORCH)
    ns = {"math": math, **{n: getattr(E, n) for n in ("exp", "log", "abs", "maximum", "minimum")}}
    exec("def f(x):\n" + "".join(f"    {ln}\n" for ln in lines) + f"    return {outs[0]}, {outs[1]}\n", ns)
    value, slope = ns["f"](EXTREME)
    want = ref(EXTREME)
    torch.testing.assert_close(value, want, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(gate(EXTREME), want, rtol=0, atol=0)      # tensors: torch's own
    for v, w in zip(EXTREME.tolist(), want.tolist()):                      # numbers: the safe form
        assert math.isclose(gate(v), w, rel_tol=1e-12, abs_tol=1e-15)
    h = 1e-6
    fd = (ref(EXTREME + h) - ref(EXTREME - h)) / (2 * h)
    assert torch.isfinite(slope).all()
    torch.testing.assert_close(slope, fd, rtol=1e-6, atol=1e-9)
    for dialect in (E.TRITON,):    # the kernels' spelling uses only exp/log/abs/min/max
        src = E.render([expr, sympy.diff(expr, x)], {x: "x"}, dialect)
        assert "tl.exp" in "".join(src[0] + src[1])


def test_gates_evaluate_numerically_and_stay_exact_symbolically():
    x = E.symbol("x")
    assert sympy.diff(sl.softplus(E.Traced(x)).expr, x) == sl.sigmoid(E.Traced(x)).expr
    assert E.Sigmoid(0) == sympy.Rational(1, 2)
    assert abs(float(sympy.N(E.LogSigmoid(3))) - F.logsigmoid(torch.tensor(3.0, dtype=D64)).item()) < 1e-14
    f = sympy.lambdify([x], E.Softplus(x) + E.Sigmoid(x), modules="numpy")
    assert abs(f(-100.0) - 0.0) < 1e-40 and abs(f(100.0) - 101.0) < 1e-12
    with pytest.raises(UnsupportedOperationError):
        sl.sigmoid("x")


# --------------------------------------------------------------------------------------------------
# The declaration.

def test_declarations_are_proved_and_expose_their_structure():
    for d in (*L.DECLARATIONS.values(), KACZMARZ_KDA, L.gated_delta_product_declaration(3)):
        assert "associative, identity (I, 0), action law, token element = recurrence step" in d.proof, d
    s = KACZMARZ_KDA.structure()
    assert (s["decay"], s["correction"], s["steps"], s["rows"]) == ("per_key", "delta", 1, {"a": "token", "b": "token"})
    b, n2, eps = E.symbol("b"), E.symbol("n2"), E.symbol("eps")
    assert sympy.simplify(KACZMARZ_KDA.beta.grads["n2"] + E.Sigmoid(b) / (n2 + eps) ** 2) == 0
    assert sympy.simplify(KACZMARZ_KDA.beta.grads["b"] - E.Sigmoid(b) * E.Sigmoid(-b) / (n2 + eps)) == 0
    assert L.gated_delta_product_declaration(2).rows == {"g": "token", "beta": "sub"}
    assert KACZMARZ_KDA.key != KACZMARZ.key and L.kda.declaration.key == L.DECLARATIONS["kda"].key


def test_the_proof_catches_a_wrong_token_element(monkeypatch):
    from scanlang import linear
    wrong = lambda decay, correction, S, ks, vs, g, betas: S + ks[0] * vs[0].T  # noqa: E731  (no decay, no correction)
    monkeypatch.setattr(linear, "recurrence", wrong)
    with pytest.raises(AssertionError, match="does not match the recurrence"):
        linear.prove_structure("per_key", "delta")


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(decay="per_token"), ValueError, "decay must be one of"),
    (dict(correction="newton"), ValueError, "correction must be one of"),
    (dict(correction="delta", steps=2, beta=lambda t: t.s, inputs=("s",)), ValueError, "needs correction='householder'"),
    (dict(correction="delta"), ValueError, "beta hook .* required"),
    (dict(beta=lambda t: 1), ValueError, "not used by"),
    (dict(correction="delta", inputs=("s",), beta=lambda t: t.s ** 2), UnsupportedOperationError, r"\*\*"),
    (dict(correction="delta", inputs=("s",), beta=lambda t: torch.sigmoid(t.s)), UnsupportedOperationError, "torch"),
    (dict(correction="delta", inputs=("s",), beta=lambda t: t.s * t.missing), ValueError, "does not declare"),
    (dict(correction="delta", inputs={"s": "token_key"}, beta=lambda t: t.s), ValueError, "per-key inputs"),
    (dict(decay="per_head", inputs={"a": "token_key"}, log_decay=lambda t: t.a), ValueError, "decay='per_key'"),
    (dict(decay="per_head", correction="householder", steps=2, inputs=("a",), beta=lambda t: sl.sigmoid(t.a),
          log_decay=lambda t: -t.a), ValueError, "read by both hooks"),
    (dict(inputs={"k": "token"}), ValueError, "not a usable input name"),
    (dict(inputs={"a": "matrix"}), ValueError, "has kind"),
    (dict(constants={"eps": "small"}), TypeError, "real number"),
])
def test_bad_declarations_raise_typed_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        sl.matrix_state("bad", **kwargs)


# what the generated kernels (backends/linear) make of a declared name n: locals and pointer parameters
_FROM_A_NAME = ("x_{}", "dx_{}", "y_{}", "dy_{}", "{}_ptr", "d{}_ptr", "c_{}")


def _bound_names(source: str) -> set:
    """Every name a generated module's functions read, bind or take as a parameter."""
    import ast
    return {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)} | {
        n.arg for n in ast.walk(ast.parse(source)) if isinstance(n, ast.arg)}


def _derived(taken: set) -> set:
    """Each n whose x_n, n_ptr, dn_ptr, ... is among the names `taken`."""
    out = set()
    for t in _FROM_A_NAME:
        pre, post = t.split("{}")
        out |= {b[len(pre):len(b) - len(post)] for b in taken
                if b.startswith(pre) and b.endswith(post) and b[len(pre):len(b) - len(post)].isidentifier()}
    return out


def test_the_names_a_declaration_may_not_take_are_the_ones_the_generated_kernels_use():
    """linear.DECODE_NAMES and CHUNK_NAMES, derived: render the decode and chunk modules of declarations of
    every structure (with every input kind and a constant), take the names that are the kernels' own (not made
    from the declaration's names), and collect each n whose x_n, n_ptr, dn_ptr, ... is among them."""
    from scanlang.backends.linear import decode, ops
    from scanlang.linear import CHUNK_NAMES, DECODE_NAMES, has_chunk_kernels
    from scanlang.recipes.linear import members as M
    gate = dict(inputs={"a": "token", "A": "head", "u": "token_key", "b": "token"}, constants={"eps": 1.0})
    decls = [getattr(M, n) for n in ("LINEAR_ATTENTION", "SIMPLE_GLA", "GLA", "DELTANET", "DELTA_RULE", "KDA",
                                     "KACZMARZ")]
    decls += [M.gated_delta_product_declaration(2, True), KACZMARZ_KDA, MAMBA2_GDN]
    decls += [sl.matrix_state(f"names_{decay}_{correction}", decay=decay, correction=correction, **gate,
                              beta=(lambda t: t.b / (t.n2 + t.eps)) if correction == "delta" else None,
                              log_decay=lambda t: -sl.exp(t.A) * sl.softplus(t.u + t.a))
              for decay, correction in (("per_key", "plain"), ("per_key", "delta"))]
    decoded, chunked = set(), set()
    for d in decls:
        own = {t.format(n) for n in [*d.inputs, *d.constants] for t in _FROM_A_NAME}
        sources = ops.sources(d)
        assert ("chunk" in sources) == has_chunk_kernels(d.decay, d.correction, d.steps), d.name
        decoded |= _bound_names(decode.render(d)) - own
        chunked |= _bound_names(sources.get("chunk", "")) - own
    assert _derived(decoded) == set(DECODE_NAMES)
    assert _derived(chunked) == set(CHUNK_NAMES)


@pytest.mark.parametrize("arg", ["inputs", "constants"])
@pytest.mark.parametrize("name", ["h0", "dq", "o", "G", "chunk_tok", "h"])
def test_a_name_that_would_shadow_a_generated_one_is_refused(arg, name):
    kwargs = {"inputs": {name: "token"}} if arg == "inputs" else {"constants": {name: 1.0}}
    with pytest.raises(ValueError, match=rf"{arg}: '{name}' would shadow a name of the generated kernels"):
        sl.matrix_state("shadowing", decay="per_head", **kwargs)   # plain writes: chunk kernels generated
    # on the delta-rule kernels only the decode module sees the name: "h" is free there (its own x_h, h_ptr)
    delta = dict(correction="delta", beta=lambda t: t.n2)
    if name in DECODE_NAMES:
        with pytest.raises(ValueError, match=rf"{arg}: '{name}'"):
            sl.matrix_state("shadowing", **delta, **kwargs)
    else:
        sl.matrix_state("not_shadowing", **delta, **kwargs)


# --------------------------------------------------------------------------------------------------
# Every member against the token loop.

@pytest.mark.parametrize("T", [1, 37, C - 1, C + 1])
@pytest.mark.parametrize("name", list(MEMBERS))
def test_member_matches_the_token_loop(name, T):
    x = make(name, B=2, T=T, H=3, K=5, V=4, seed=T)
    o, S = run(name, x)
    o_ref, S_ref = oracle(name, x)
    assert o.dtype == D64 and S.shape == (2, 3, 5, 4)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(S, S_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(MEMBERS))
def test_member_packed_sequences_with_length_one_and_zero(name):
    cu = [0, 5, 6, 6, 6 + 2 * C + 3]
    x = make(name, B=1, T=cu[-1], H=2, K=4, V=3, seed=3, N=len(cu) - 1)
    o, S = run(name, x, cu_seqlens=torch.tensor(cu))
    o_ref, S_ref = oracle(name, x, cu=cu)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(S, S_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(S[2], x["h0"][2])          # the empty sequence keeps its initial state


@pytest.mark.parametrize("fast", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["fast", "full"])
@pytest.mark.parametrize("name", list(MEMBERS))
def test_member_gradcheck_float64_every_input_and_the_initial_state(name, fast):
    """fast: gradcheck's random projections of the Jacobian (default tier); full: every entry (slow)."""
    x = make(name, B=1, T=5, H=1, K=3, V=2, seed=1)
    keys = list(x)
    leaves = [x[kk].clone().requires_grad_(True) for kk in keys]

    def f(*vals):
        o, S = run(name, dict(zip(keys, vals)), chunk_size=2 if name not in OLD_OPS else 16)
        return o, S
    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=fast)


GRAD_ROWS = {"q": "delta_grad", "k": "delta_grad", "v": "delta_grad", "h0": "delta_grad"}


@pytest.mark.parametrize("name", list(MEMBERS))
def test_member_fp32_outputs_and_gradients_within_the_table(name):
    x64 = make(name, B=2, T=40, H=2, K=16, V=8, seed=5)
    x32 = {kk: t.to(torch.float32).requires_grad_(True) for kk, t in x64.items()}
    x64 = {kk: t.clone().requires_grad_(True) for kk, t in x64.items()}
    o, S = run(name, x32, chunk_size=32)
    o_ref, S_ref = oracle(name, x64)
    assert o.dtype == torch.float32
    assert_close(o, o_ref, "delta_out", torch.float32, name=f"{name} o")
    assert_close(S, S_ref, "delta_out", torch.float32, name=f"{name} S")
    wo, wS = torch.randn_like(o_ref), torch.randn_like(S_ref)
    g32 = torch.autograd.grad((o * wo.float()).sum() + (S * wS.float()).sum(), list(x32.values()))
    g64 = torch.autograd.grad((o_ref * wo).sum() + (S_ref * wS).sum(), list(x64.values()))
    for kk, a, b in zip(x32, g32, g64):
        assert_close(a, b, GRAD_ROWS.get(kk, "delta_gate_grad"), torch.float32, name=f"{name} d{kk}")


@pytest.mark.parametrize("name", list(MEMBERS))
def test_decode_token_by_token_equals_the_full_pass(name):
    x = make(name, B=2, T=6, H=2, K=4, V=3, seed=7)
    o_full, S_full = run(name, x)
    _, n, _, _ = MEMBERS[name]
    S, outs = x["h0"], []
    for t in range(6):
        step = {kk: (val[:, t * n:(t + 1) * n] if kk in ("k", "v") or _rows(name, kk) == "sub" else
                     val if _rows(name, kk) == "head" else val[:, t:t + 1]) for kk, val in x.items() if kk != "h0"}
        o, S = run(name, {**step, "h0": S})
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), o_full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S, S_full, rtol=1e-12, atol=1e-12)


def _rows(name, arg):
    return next((rows for a, rows, _ in MEMBERS[name][0] if a == arg), "tok")


PER_KEY = ("gla", "kda", "kaczmarz_kda (new)")


@pytest.mark.parametrize("name", PER_KEY + ("simple_gla", "gated_delta_product"))
def test_log_decay_minus_20_per_token_stays_finite(name):
    x = make(name, B=1, T=70, H=2, K=4, V=3, seed=2)
    for arg, _, domain in MEMBERS[name][0]:
        if domain == "decay":
            x[arg] = torch.full_like(x[arg], -20.0)
        elif arg == "a":
            x[arg] = torch.full_like(x[arg], -20.0)    # logsigmoid(-20) ~ -20
    leaves = {kk: t.clone().requires_grad_(True) for kk, t in x.items()}
    o, S = run(name, leaves, chunk_size=64)
    o_ref, S_ref = oracle(name, x)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-12)
    (o.sum() + S.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in leaves.values())


@pytest.mark.parametrize("name", ["kaczmarz_delta_rule", "kaczmarz_family", "kaczmarz_kda (new)", "kda", "gla"])
def test_zero_keys_never_nan(name):
    x = make(name, B=1, T=20, H=2, K=4, V=3, seed=4)
    x["k"][:, 3:9] = 0.0
    leaves = {kk: t.clone().requires_grad_(True) for kk, t in x.items()}
    eps = {"eps": 0.0} if "kaczmarz" in name else {}
    o, S = run(name, leaves, **eps)
    (o.sum() + S.sum()).backward()
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert all(torch.isfinite(t.grad).all() for t in leaves.values())


@pytest.mark.parametrize("name", ["gla", "kda", "kaczmarz_kda (new)", "gated_delta_product", "linear_attention"])
def test_a_nan_in_one_token_never_reaches_earlier_tokens(name):
    x = make(name, B=1, T=40, H=2, K=4, V=3, seed=6)
    o_clean, _ = run(name, x)
    x["v"][:, 21] = float("nan")
    o, _ = run(name, x)
    t0 = 21 // MEMBERS[name][1]
    torch.testing.assert_close(o[:, :t0], o_clean[:, :t0], rtol=0, atol=0)
    assert torch.isnan(o[:, t0]).any()


# --------------------------------------------------------------------------------------------------
# The ops' contract.

def test_delta_rule_and_kaczmarz_are_the_recipes_kaczmarz_functions():
    assert L.delta_rule is kaczmarz.delta_rule and L.kaczmarz_delta_rule is kaczmarz.kaczmarz_delta_rule
    assert L.delta_rule.declaration.key == DELTA_RULE.key and L.kaczmarz_delta_rule.declaration.key == KACZMARZ.key


@pytest.mark.parametrize("name", ["kda", "kaczmarz_kda (new)"])
def test_triton_backend_runs_corrections_on_the_kernels_that_exist(name):
    """Plain writes and the delta correction with per-key decay run on generated chunk kernels
    (tests/test_linear_family_triton.py, tests/test_linear_family_kda.py); every correction on the recurrent
    decode kernel without gradients for short sequences (tests/test_linear_decode.py); Householder steps and
    the delta correction with decay none / per head run on the delta-rule kernels
    (tests/test_linear_family_householder.py, tests/test_linear_family_delta.py)."""
    x = make(name, B=1, T=3, H=1, K=2, V=2, dtype=torch.float32)
    args = [x["q"], x["k"], x["v"], *[x[a] for a, *_ in MEMBERS[name][0]]]
    o, S = MEMBERS[name][2](*args, initial_state=x["h0"], output_final_state=True, backend="triton")
    o_ref, S_ref = oracle(name, {n: t.to(D64) for n, t in x.items()})
    assert_close(o, o_ref, "delta_out", torch.float32, name="o")
    assert_close(S, S_ref, "delta_out", torch.float32, name="S")
    needs_grad = [t.clone().requires_grad_() for t in args]   # the per-key delta chunk kernels (kernels_delta.py)
    o, S = MEMBERS[name][2](*needs_grad, initial_state=x["h0"], output_final_state=True, backend="triton")
    assert o.requires_grad
    assert_close(o, o_ref, "delta_out", torch.float32, name="o (chunk kernels)")
    assert_close(S, S_ref, "delta_out", torch.float32, name="S (chunk kernels)")
    with pytest.raises(ValueError, match="backend must be"):
        MEMBERS[name][2](*args, backend="cuda")


def test_bad_inputs_are_refused_naming_the_argument():
    x = make("gated_delta_product", B=1, T=4, H=2, K=4, V=3)
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    with pytest.raises(ValueError, match="not a multiple of num_householder = 3"):
        L.gated_delta_product(q, k[:, :7], v, g, beta, 3)
    with pytest.raises(ValueError, match="k must have shape"):
        L.gated_delta_product(q, k[:, :6], v, g, beta, 3)
    with pytest.raises(ValueError, match="num_householder must be"):
        L.gated_delta_product(q, k, v, g, beta, 0)
    with pytest.raises(ValueError, match="beta must have shape"):
        L.gated_delta_product(q, k, v, g, beta[:, :4], 2)
    y = make("kda", B=1, T=4, H=2, K=4, V=3)
    with pytest.raises(ValueError, match="g must have shape"):
        L.kda(y["q"], y["k"], y["v"], y["g"][..., 0], y["beta"])
    with pytest.raises(ValueError, match="g: log-decays must be <= 0"):
        L.kda(y["q"], y["k"], y["v"], -y["g"], y["beta"])
    with pytest.raises(ValueError, match="g: log-decays must be <= 0"):
        L.simple_gla(y["q"], y["k"], y["v"], -y["g"][..., 0])
    with pytest.raises(ValueError, match="q must be float16"):
        L.linear_attention(y["q"].to(torch.int64), y["k"], y["v"])
    with pytest.raises(ValueError, match="v must have shape"):
        L.linear_attention(y["q"], y["k"], y["v"][:, :3])
    with pytest.raises(ValueError, match="initial_state must have shape"):
        L.gla(y["q"], y["k"], y["v"], y["g"], initial_state=torch.zeros(2, 2, 4, 4))
    with pytest.raises(ValueError, match="cu_seqlens"):
        L.gla(y["q"], y["k"], y["v"], y["g"], cu_seqlens=torch.tensor([0, 2, 3]))
    with pytest.raises(TypeError, match="unexpected argument"):
        KACZMARZ_KDA_OP(y["q"], y["k"], y["v"], y["g"], y["beta"], epsilon=0.1)
    with pytest.raises(TypeError, match="missing inputs"):
        KACZMARZ_KDA_OP(y["q"], y["k"], y["v"], y["g"])
    with pytest.raises(TypeError, match="scale must be"):
        L.linear_attention(y["q"], y["k"], y["v"], scale="big")


def test_delta_rule_without_decay_on_the_generated_kernels():
    """g=None (DeltaNet) reaches today's Triton delta-rule kernels as g = 0 (interpreter on CPU)."""
    x = make("deltanet", B=1, T=5, H=1, K=16, V=16, dtype=torch.float32, seed=8)
    o, S = L.delta_rule(x["q"], x["k"], x["v"], None, x["beta"], initial_state=x["h0"], output_final_state=True,
                        backend="triton", chunk_size=16)
    o_ref, S_ref = oracle("deltanet", x)
    assert_close(o, o_ref, "delta_out", torch.float32, name="o")
    assert_close(S, S_ref, "delta_out", torch.float32, name="S")
