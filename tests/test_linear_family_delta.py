"""Family members of the delta structure (correction delta, one step, decay none / per head) on the delta-rule
kernels with backend="triton" (scanlang/delta_form.py; Triton's interpreter on CPU): outputs, final
states and the gradients of q, k, v, every hook input and the initial state against an independent float64
token loop written here, and against backend="reference"."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import scanlang as sl
from scanlang.backends.delta import ops as delta_ops
from scanlang.delta import GIVEN, KACZMARZ as KACZMARZ_RULE
from scanlang.recipes import linear as L
from scanlang.delta_form import default_backend, delta_form
from scanlang.recipes.linear.members import DELTA_RULE, DELTANET, KACZMARZ, KDA
from scanlang.testing import assert_close

C = 16            # the delta kernels' chunk in these tests (16, 32, 64 are theirs)
D64 = torch.float64
H, K, V = 2, 16, 8   # several heads, K != V

# a declaration of its own, rendered into the kernels: beta from one raw gate, ||k||^2, a run-time eps and a
# constant baked in as its number; Mamba2's gate with a per-head parameter as the decay hook
USER = sl.matrix_state("user_delta", decay="per_head", correction="delta",
                       inputs={"a": "token", "A_log": "head", "b": "token"}, constants={"eps": 1e-3, "c": 0.9},
                       beta=lambda t: t.c * sl.sigmoid(t.b) / (t.n2 + t.eps),
                       log_decay=lambda t: -sl.exp(t.A_log) * sl.softplus(t.a))
# and one whose hooks the kernels' two per-token slots cannot hold (beta reads a per-head input, g two per-token
# inputs, x is read by both): beta and g evaluated on the host, passed to the kernels as given
HOSTED = sl.matrix_state("hosted_delta", decay="per_head", correction="delta",
                         inputs={"x": "token", "y": "token", "w": "head"},
                         beta=lambda t: sl.sigmoid(t.x + t.w) / (1 + t.n2),
                         log_decay=lambda t: sl.logsigmoid(t.x) * sl.sigmoid(t.y))

# names the rule's own fields use (s, a, eps): a per-token input "s" read by the decay, "a" by the step, per-head
# inputs "eps" and "h" (the generated decay hook's head index: both parameters of the rule under other names) and a
# constant k2 as the kernels' eps
RENAMED = sl.matrix_state("renamed_delta", decay="per_head", correction="delta",
                          inputs={"s": "token", "a": "token", "eps": "head", "h": "head"}, constants={"k2": 0.5},
                          beta=lambda t: sl.sigmoid(t.a) / (t.n2 + t.k2),
                          log_decay=lambda t: -sl.exp(t.eps) * sl.softplus(t.s) * sl.sigmoid(t.h))
# hooks without a per-token input: beta from ||k||^2 and a constant, g from a per-head parameter and a constant
CONSTANT_STEP = sl.matrix_state("constant_step", decay="per_head", correction="delta",
                                inputs={"A_log": "head"}, constants={"c": 0.7, "d": 0.8},
                                beta=lambda t: t.c / (1 + t.n2), log_decay=lambda t: -t.d * sl.exp(t.A_log))


def _unit(shape, gen):
    return torch.rand(shape, generator=gen, dtype=D64) * 0.98 + 0.01


def _decay(shape, gen):
    return -(0.05 + torch.rand(shape, generator=gen, dtype=D64))


def _raw(shape, gen):
    return torch.randn(shape, generator=gen, dtype=D64)


# name -> (declaration, [(input, rows "tok" [B,T,H] / "head" [H], maker)], oracle (k, x) -> (g or None, beta),
#          raw key norms over [1e-2, 10] (Kaczmarz's keys are not normalised))
MEMBERS = {
    "deltanet": (DELTANET, [("beta", "tok", _unit)], lambda k, x: (None, x["beta"]), False),
    "gated_delta_rule": (DELTA_RULE, [("g", "tok", _decay), ("beta", "tok", _unit)],
                         lambda k, x: (x["g"], x["beta"]), False),
    "kaczmarz": (KACZMARZ, [("g", "tok", _decay), ("eta", "tok", _unit)],
                 lambda k, x: (x["g"], x["eta"] / ((k * k).sum(-1) + 1e-6)), True),
    "user": (USER, [("a", "tok", _raw), ("A_log", "head", lambda s, gen: 0.5 * _raw(s, gen)), ("b", "tok", _raw)],
             lambda k, x: (-torch.exp(x["A_log"]) * F.softplus(x["a"]),
                           0.9 * torch.sigmoid(x["b"]) / ((k * k).sum(-1) + 1e-3)), False),
    "hosted": (HOSTED, [("x", "tok", _raw), ("y", "tok", _raw), ("w", "head", _raw)],
               lambda k, x: (F.logsigmoid(x["x"]) * torch.sigmoid(x["y"]),
                             torch.sigmoid(x["x"] + x["w"]) / (1 + (k * k).sum(-1))), False),
    "renamed": (RENAMED, [("s", "tok", _raw), ("a", "tok", _raw), ("eps", "head", lambda s, gen: 0.5 * _raw(s, gen)),
                          ("h", "head", _raw)],
                lambda k, x: (-torch.exp(x["eps"]) * F.softplus(x["s"]) * torch.sigmoid(x["h"]),
                              torch.sigmoid(x["a"]) / ((k * k).sum(-1) + 0.5)), False),
    "constant_step": (CONSTANT_STEP, [("A_log", "head", lambda s, gen: _raw(s, gen) - 1)],
                      lambda k, x: (-0.8 * torch.exp(x["A_log"]).expand(k.shape[:3]), 0.7 / (1 + (k * k).sum(-1))),
                      False),
}
MAIN = ("deltanet", "gated_delta_rule", "kaczmarz", "user", "hosted")   # the rest: the translation's corner cases
OPS = {name: L.op(decl) for name, (decl, *_) in MEMBERS.items()}


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    """Every delta-kernel buffer starts as NaN (an integer one as -1), so an element left unwritten shows."""
    monkeypatch.setattr(delta_ops, "_empty", lambda *s, device, dtype: torch.full(
        s, float("nan") if dtype.is_floating_point else -1, device=device, dtype=dtype))


def token_loop(q, k, v, g, beta, scale, h0, bounds):
    """S_t = exp(g_t) S_{t-1}, then S_t += beta_t k_t (v_t - S_t^T k_t)^T, o_t = scale S_t^T q_t, one token at a
    time in float64; bounds: (batch row, first token, end) per sequence."""
    B, T = q.shape[:2]
    o = [[None] * T for _ in range(B)]
    finals = []
    for i, (b, s, e) in enumerate(bounds):
        S = h0[i]
        for t in range(s, e):
            if g is not None:
                S = torch.exp(g[b, t])[:, None, None] * S
            err = v[b, t] - torch.einsum("hkv,hk->hv", S, k[b, t])
            S = S + beta[b, t][:, None, None] * k[b, t][:, :, None] * err[:, None, :]
            o[b][t] = scale * torch.einsum("hkv,hk->hv", S, q[b, t])
        finals.append(S)
    zero = q.new_zeros(H, v.shape[-1])
    out = torch.stack([torch.stack([o[b][t] if o[b][t] is not None else zero for t in range(T)]) for b in range(B)])
    return out, torch.stack(finals)


def make(name, B, T, seed=0, N=None):
    """q, k, v, the member's inputs and h0, float64, random and non-zero."""
    _, specs, _, raw_keys = MEMBERS[name]
    gen = torch.Generator().manual_seed(seed)
    x = {"q": _raw((B, T, H, K), gen), "v": _raw((B, T, H, V), gen)}
    k = _raw((B, T, H, K), gen)
    if raw_keys:   # norms log-uniform over [1e-2, 10]
        norms = torch.exp(torch.empty(B, T, H, 1, dtype=D64).uniform_(math.log(1e-2), math.log(10), generator=gen))
        x["k"] = F.normalize(k, dim=-1) * norms
    else:
        x["k"] = k / math.sqrt(K)
    for arg, rows, maker in specs:
        x[arg] = maker((B, T, H) if rows == "tok" else (H,), gen)
    x["h0"] = _raw((N or B, H, K, V), gen)
    return x


def names_of(name):
    return ["q", "k", "v"] + [a for a, *_ in MEMBERS[name][1]] + ["h0"]


def run(name, x, backend="triton", cu=None, grad=True, dtype=torch.float32, device="cpu", **kw):
    """The member on `dtype` copies of x (h0 fp32) on `device`; with grad, backprop fixed float64 cotangents.
    Returns (o, S, grads)."""
    ts = {n: x[n].to(device, torch.float32 if n == "h0" else dtype).clone().requires_grad_(grad)
          for n in names_of(name)}
    args = [ts[a] for a, *_ in MEMBERS[name][1]]
    o, S = OPS[name](ts["q"], ts["k"], ts["v"], *args, initial_state=ts["h0"], output_final_state=True,
                     cu_seqlens=None if cu is None else torch.tensor(cu, device=device), backend=backend,
                     chunk_size=kw.pop("chunk_size", C), **kw)
    if not grad:
        return o, S, {}
    do, dS = cotangents(o.shape, S.shape)
    ((o.double() * do.to(o.device)).sum() + (S.double() * dS.to(o.device)).sum()).backward()
    return o, S, {n: t.grad for n, t in ts.items()}


def cotangents(o_shape, S_shape):
    gen = torch.Generator().manual_seed(99)
    return torch.randn(o_shape, generator=gen, dtype=D64), torch.randn(S_shape, generator=gen, dtype=D64)


def oracle(name, x, cu=None):
    """The float64 token loop on x (leaves requiring grad) with autograd: (o, S, grads)."""
    ts = {n: x[n].clone().requires_grad_() for n in names_of(name)}
    g, beta = MEMBERS[name][2](ts["k"], ts)
    B, T = ts["q"].shape[:2]
    bounds = [(b, 0, T) for b in range(B)] if cu is None else [(0, s, e) for s, e in zip(cu[:-1], cu[1:])]
    o, S = token_loop(ts["q"], ts["k"], ts["v"], g, beta.expand(B, T, H), K ** -0.5, ts["h0"], bounds)
    do, dS = cotangents(o.shape, S.shape)
    ((o * do).sum() + (S * dS).sum()).backward()
    return o.detach(), S.detach(), {n: t.grad for n, t in ts.items()}


def row(name, arg):
    """The tolerance row of a compared tensor: outputs and states, q k v h0, hook inputs per token, per head."""
    if arg in ("o", "S"):
        return "delta_out"
    if arg in ("q", "k", "v", "h0"):
        return "delta_grad"
    kind = next(rows for a, rows, _ in MEMBERS[name][1] if a == arg)
    return "delta_param_grad" if kind == "head" else "delta_gate_grad"


def check(name, got, want, what="", dtype=torch.float32):
    (o, S, grads), (o_ref, S_ref, grads_ref) = got, want
    assert_close(o, o_ref, "delta_out", dtype, name=f"{name}{what} o")
    assert_close(S, S_ref, "delta_out", dtype, name=f"{name}{what} S")
    for n, g in grads.items():
        assert g is not None, f"{name}: {n} got no gradient"
        assert_close(g, grads_ref[n], row(name, n), dtype, name=f"{name}{what} d{n}")


# --------------------------------------------------------------------------------------------------
# The translation.

def test_shipped_members_run_the_shipped_rules_and_a_declaration_gets_its_own():
    for decl, rule, step, decay in ((DELTANET, GIVEN, "beta", None), (DELTA_RULE, GIVEN, "beta", "g"),
                                    (KACZMARZ, KACZMARZ_RULE, "eta", "g")):
        form = delta_form(decl, decl.constants)
        assert form.rule is rule and (form.step, form.decay) == (step, decay), decl.name
        assert not form.host_beta and not form.host_decay
    assert delta_form(KACZMARZ, KACZMARZ.constants).eps == "eps"
    form = delta_form(USER, USER.constants)
    assert (form.step, form.decay, form.params, form.eps) == ("b", "a", ("A_log",), "eps")
    assert form.rule.head_params == ("A_log",) and form.rule.uses_key_norm
    assert {s.name for s in form.rule.step.expr.free_symbols} == {"s", "n2", "eps"}   # c = 0.9 is a number
    assert delta_form(USER, USER.constants) is form                                  # built once
    assert delta_form(USER, {**USER.constants, "eps": 0.5}) is form                  # eps is passed at run time
    other = delta_form(USER, {**USER.constants, "c": 0.5})                           # c is rendered
    assert other is not form and other.rule.key != form.rule.key
    hosted = delta_form(HOSTED, {})
    assert hosted.host_beta and hosted.host_decay and hosted.rule is GIVEN


def test_default_backend_is_the_delta_kernels_on_cuda_for_their_structures():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def pick(d, dev, dt=torch.float32, c=32, k=64):
        return default_backend(d, dev, dt, c, k, 64, (16, 32, 64), 256)
    for d in (DELTANET, DELTA_RULE, KACZMARZ, USER, HOSTED):
        assert pick(d, cuda) == "triton" and pick(d, cpu) == "reference", d.name
        assert pick(d, cuda, torch.float64) == "reference" and pick(d, cuda, c=8) == "reference"
        assert pick(d, cuda, k=512) == "reference"
    for d in (KDA, L.DECLARATIONS["gla"], L.DECLARATIONS["linear_attention"]):
        assert pick(d, cuda) == "reference", d.name
    assert pick(L.gated_delta_product_declaration(2), cuda) == "triton"   # tests/test_linear_family_householder.py
    x = make("kaczmarz", B=1, T=5)
    o, S, _ = run("kaczmarz", x, backend=None, grad=False)          # CPU: the reference, bit for bit
    o_ref, S_ref, _ = run("kaczmarz", x, backend="reference", grad=False)
    assert torch.equal(o, o_ref) and torch.equal(S, S_ref)
    o_auto, _, _ = run("kaczmarz", x, backend="auto", grad=False)
    assert torch.equal(o_auto, o_ref)


def test_without_a_chunk_size_the_delta_kernels_take_their_tuned_64():
    x = make("user", B=1, T=C + 3, seed=14)
    o, S, _ = run("user", x, grad=False, chunk_size=None)
    rule = delta_form(USER, USER.constants).rule
    assert f"{rule.name}_{rule.key}_c64" in delta_ops.PROGRAMS
    o_ref, S_ref, _ = oracle("user", x)
    assert_close(o, o_ref, "delta_out", torch.float32, name="o")
    assert_close(S, S_ref, "delta_out", torch.float32, name="S")


# --------------------------------------------------------------------------------------------------
# Against the float64 token loop.

@pytest.mark.parametrize("T", [C + 1, 1, pytest.param(37, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", MAIN)
def test_member_on_the_delta_kernels_matches_the_token_loop(name, T):
    """B = 2 rows, H = 2 heads, K = 16, V = 8: outputs, final states and every gradient (chunked path); the
    forward without gradients too (T <= 16 takes the token-loop kernel)."""
    x = make(name, B=2, T=T, seed=T)
    want = oracle(name, x)
    check(name, run(name, x), want)
    rule = delta_form(MEMBERS[name][0], MEMBERS[name][0].constants).rule
    assert f"{rule.name}_{rule.key}_c{C}" in delta_ops.PROGRAMS    # the delta backend's generated kernels ran
    o, S, _ = run(name, x, grad=False)
    assert_close(o, want[0], "delta_out", torch.float32, name=f"{name} o (no grad)")
    assert_close(S, want[1], "delta_out", torch.float32, name=f"{name} S (no grad)")


@pytest.mark.parametrize("name", ["kaczmarz", "hosted"] + [
    pytest.param(n, marks=pytest.mark.slow) for n in MAIN if n not in ("kaczmarz", "hosted")])
def test_packed_sequences_with_length_one_and_zero(name):
    cu = [0, 1, 1, C + 2, C + 7]          # lengths 1, 0, C + 1, 5
    x = make(name, B=1, T=cu[-1], seed=3, N=len(cu) - 1)
    got, want = run(name, x, cu=cu), oracle(name, x, cu=cu)
    check(name, got, want, " (packed)")
    assert torch.equal(got[1][1], x["h0"][1].float())     # the empty sequence keeps its initial state


def test_constants_of_a_call_reach_the_kernels():
    """eps (a run-time argument of the kernels) and c (rendered as a number: another rule) overridden per call."""
    x = make("user", B=1, T=C + 1, seed=5)
    ts = {n: x[n].float() for n in names_of("user")}
    o, S = OPS["user"](ts["q"], ts["k"], ts["v"], ts["a"], ts["A_log"], ts["b"], initial_state=ts["h0"],
                       output_final_state=True, backend="triton", chunk_size=C, eps=0.05, c=0.5)
    k = x["k"]
    beta = 0.5 * torch.sigmoid(x["b"]) / ((k * k).sum(-1) + 0.05)
    g = -torch.exp(x["A_log"]) * F.softplus(x["a"])
    o_ref, S_ref = token_loop(x["q"], k, x["v"], g, beta, K ** -0.5, x["h0"], [(0, 0, C + 1)])
    assert_close(o, o_ref, "delta_out", torch.float32, name="o")
    assert_close(S, S_ref, "delta_out", torch.float32, name="S")


# --------------------------------------------------------------------------------------------------
# Against the reference backend, and the limits.

@pytest.mark.parametrize("name", ["gated_delta_rule", "hosted"] + [
    pytest.param(n, marks=pytest.mark.slow) for n in MAIN if n not in ("gated_delta_rule", "hosted")])
def test_triton_equals_the_reference_backend(name):
    x = make(name, B=2, T=C + 5, seed=11)
    check(name, run(name, x), run(name, x, backend="reference"), " (vs reference)")


def test_structures_and_inputs_the_delta_kernels_do_not_take_say_so():
    x = make("gated_delta_rule", B=1, T=4)
    q, k, v, g, beta = (x[n].float() for n in ("q", "k", "v", "g", "beta"))
    qg = q.clone().requires_grad_()   # without gradients a short input takes the decode kernel (every structure)
    # per-key decay with the delta correction: the generated chunk kernels (tests/test_linear_family_kda.py)
    gk = g[..., None].expand(1, 4, H, K)
    o, _ = L.kda(qg, k, v, gk, beta, backend="triton", chunk_size=C)
    assert o.requires_grad
    assert_close(o, L.kda(q, k, v, gk, beta, backend="reference", chunk_size=C)[0], "delta_out", torch.float32)
    gdn = OPS["gated_delta_rule"]
    with pytest.raises(ValueError, match="float64"):
        gdn(x["q"], x["k"], x["v"], x["g"], x["beta"], backend="triton", chunk_size=C)
    with pytest.raises(ValueError, match="chunk_size must be one of"):
        gdn(q, k, v, g, beta, backend="triton", chunk_size=8)
    with pytest.raises(ValueError, match="v: head dim 300"):
        gdn(q, k, torch.zeros(1, 4, H, 300), g, beta, backend="triton", chunk_size=C)
    with pytest.raises(ValueError, match="log-decay"):
        gdn(q, k, v, -g, beta, backend="triton", chunk_size=C)


@pytest.mark.parametrize("name", ["renamed", "constant_step"])
def test_hooks_reading_the_rule_field_names_or_no_token_input(name):
    form = delta_form(MEMBERS[name][0], MEMBERS[name][0].constants)
    assert not form.host_beta and not form.host_decay
    if name == "renamed":   # s <- a, a <- s, the per-head eps as the rule's eps_, the constant k2 as its eps
        assert (form.step, form.decay, form.params, form.eps, form.rule.head_params) == (
            "a", "s", ("eps", "h"), "k2", ("eps_", "h_"))
    else:                   # s and a are zeros; c is the kernels' eps, d a number in the rule
        assert (form.step, form.decay, form.eps, form.baked) == (None, None, "c", (("d", 0.8),))
    x = make(name, B=2, T=C + 1, seed=12)
    check(name, run(name, x), oracle(name, x))
    y = make(name, B=2, T=5, seed=13)
    o, S, _ = run(name, y, grad=False)     # short, no gradients: the token-loop kernel
    o_ref, S_ref, _ = oracle(name, y)
    assert_close(o, o_ref, "delta_out", torch.float32, name=f"{name} o (token-loop kernel)")
    assert_close(S, S_ref, "delta_out", torch.float32, name=f"{name} S (token-loop kernel)")


@pytest.mark.parametrize("name", ["kaczmarz", "hosted", pytest.param("user", marks=pytest.mark.slow)])
def test_zero_keys_write_nothing_and_keep_their_slope(name):
    """A zero key writes nothing (beta k = 0), but its dk is beta(0) times the residual: the kernels' in-kernel
    step and the host's beta both keep it (eps > 0 makes beta finite there)."""
    x = make(name, B=1, T=C + 1, seed=2)
    x["k"][:, 2] = 0
    x["k"][0, 9, 1] = 0
    check(name, run(name, x), oracle(name, x), " (zero keys)")


def test_a_hard_reset_clears_the_state():
    """g = -inf (a reset) is taken by the delta kernels (the plain-write kernels refuse it)."""
    x = make("gated_delta_rule", B=1, T=C + 3, seed=4)
    x["g"][0, 7, 1] = float("-inf")
    o, S, _ = run("gated_delta_rule", x, grad=False)
    o_ref, S_ref = token_loop(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, x["h0"], [(0, 0, C + 3)])
    assert_close(o, o_ref, "delta_out", torch.float32, name="o")
    assert_close(S, S_ref, "delta_out", torch.float32, name="S")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["gated_delta_rule", "kaczmarz"])
def test_low_precision_inputs_within_the_table(name, dtype):
    """bf16 / fp16 q, k, v and hook inputs against the loop on the same rounded inputs (the table's rows)."""
    x = make(name, B=1, T=C + 5, seed=6)
    x = {n: t if n == "h0" else t.to(dtype).double() for n, t in x.items()}
    check(name, run(name, x, dtype=dtype), oracle(name, x), f" ({dtype})", dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", MAIN)
def test_on_cuda_the_default_backend_is_the_delta_kernels(name):
    """backend=None on CUDA runs the delta kernels (GPU rows of the table), equal-length and packed."""
    x = make(name, B=2, T=3 * 64 + 7, seed=7)
    check(name, run(name, x, backend=None, device="cuda", chunk_size=64), oracle(name, x), " (cuda)")
    rule = delta_form(MEMBERS[name][0], MEMBERS[name][0].constants).rule
    assert f"{rule.name}_{rule.key}_c64" in delta_ops.PROGRAMS
    cu = [0, 1, 1, 70, 200]
    x = make(name, B=1, T=cu[-1], seed=8, N=len(cu) - 1)
    check(name, run(name, x, backend=None, device="cuda", cu=cu, chunk_size=64), oracle(name, x, cu=cu),
          " (cuda, packed)")


@pytest.mark.parametrize("name", ["kaczmarz", "user"])
def test_compiles_fullgraph_on_the_delta_kernels(name):
    """The form is built with the op, outside any trace: Dynamo (fullgraph, "eager" backend: the interpreter
    cannot take AOT's fake tensors) traces the call into the delta backend's torch.library ops. (A beta or
    log-decay evaluated on the host, `hosted`, does not trace yet, on either backend.)"""
    x = make(name, B=1, T=C + 4, seed=9)
    ts = [x[n].float() for n in names_of(name)]

    def f(q, k, v, *rest):
        return OPS[name](q, k, v, *rest[:-1], initial_state=rest[-1], output_final_state=True, backend="triton",
                         chunk_size=C)
    torch._dynamo.reset()
    o, S = torch.compile(f, fullgraph=True, backend="eager")(*ts)
    o_ref, S_ref = f(*ts)
    assert_close(o, o_ref, "delta_ieee", torch.float32, name="o")
    assert_close(S, S_ref, "delta_ieee", torch.float32, name="S")
