"""Issue 18, class 2: proofs are not skipped under torch.compile. A monoid first scanned inside a
compiled function is proved at trace time, outside the graph (refused with its counterexample when
the law fails), and the first compiled call of a `fullgraph=True` function never meets sympy inside
the trace. A declaration built inside the compiled function (a monoid, a mixer, a delta rule, a
matrix state) is built at trace time outside the graph (scanlang/traced.py): proved ones give the
float64 loop's values, refuted or malformed ones raise the eager call's error. Dynamo alone
("eager" backend): on CPU the kernels run in Triton's interpreter, which cannot take the fake
tensors that AOT tracing would feed them."""
import pytest
import torch

import scanlang as sl
from scanlang.backends.reference import scan_sequential
from scanlang.testing import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="eager")


def _fresh_non_associative(name):
    @sl.monoid(fields=("s",), identity=(0,), name=name)
    def difference(x, y):
        return (x.s - y.s,)
    return difference


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_non_associative_monoid_first_scanned_compiled_is_refused(backend):
    m = _fresh_non_associative(f"difference_{backend}")

    def f(s):
        return sl.scan(m, (s,), dim=1, backend=backend).s

    with pytest.raises(sl.NotAssociativeError) as info:
        _compiled(f)(torch.randn(1, 5, device=DEVICE))
    x, y, z = info.value.counterexample
    assert (x[0] - y[0]) - z[0] != x[0] - (y[0] - z[0])


def test_clamp_refuted_only_by_sympy_is_refused_under_compile():
    @sl.monoid(fields=("s",), identity=(0,), name="clamp_compiled")
    def clamped(x, y):
        return (sl.minimum(x.s + y.s, 1e6),)

    with pytest.raises(sl.NotAssociativeError):
        _compiled(lambda s: sl.scan(clamped, (s,), dim=1, backend="reference").s)(torch.randn(1, 4))


def test_fresh_monoid_first_called_compiled_runs_on_the_reference_backend():
    @sl.monoid(fields=("a", "b"), identity=(1, 0), name="affine_compiled_ref")
    def affine(x, y):
        return y.a * x.a, y.a * x.b + y.b

    a = torch.rand(2, 7, 3, dtype=torch.float64) * 0.9 + 0.05
    b = torch.randn(2, 7, 3, dtype=torch.float64)
    got = _compiled(lambda a, b: sl.scan(affine, (a, b), dim=1, backend="reference").b)(a, b)
    assert affine._proof is not None and affine._proof.symbolic
    assert_close(got, scan_sequential(affine, (a, b), dim=1)[1], "scan", torch.float64)


def test_two_monoids_through_one_compiled_function_on_triton():
    """A recompile (a second monoid) used to fail converting the declaration's parts to constants."""
    def run(m, v):
        return sl.scan(m, (v,), dim=1, backend="triton")[0]

    compiled = _compiled(run)
    v = torch.randn(1, 5, 2, device=DEVICE)
    for m in (sl.Add, sl.Max):
        assert_close(compiled(m, v), scan_sequential(m, (v,), dim=1)[0], "scan", torch.float32)


def test_mixer_built_directly_is_proved():
    from scanlang.mixer import Mixer
    m = _fresh_non_associative("difference_mixer")
    with pytest.raises(sl.NotAssociativeError):
        Mixer(m, axes="b t d", inputs={"x": "b t d"}, lift=lambda u: (u.x,), readout=lambda p, u, q: p.s,
              outputs=("h",))


def test_kaczmarz_layer_compiles_fullgraph_on_the_generated_kernels():
    """The delta-rule program key and chunk table used cached_property, whose lock Dynamo cannot enter."""
    from scanlang.recipes.kaczmarz import KaczmarzLinearAttention
    layer = KaczmarzLinearAttention(32, 2, backend="triton", chunk_size=16).to(DEVICE)
    x = torch.randn(1, 5, 32, device=DEVICE)
    got = _compiled(layer)(x)
    assert_close(got, layer(x), "delta_ieee", torch.float32)



def test_kaczmarz_decode_compiles_fullgraph():
    """Short inputs without gradients (decoding) take the token-loop kernel eagerly, which launches
    directly; compiled, they take the traceable chunk ops and give the same outputs and state."""
    from scanlang.recipes.kaczmarz import kaczmarz_delta_rule
    B, T, H, K, V = 1, 3, 2, 16, 16
    q, k, v = (torch.randn(B, T, H, d, device=DEVICE) for d in (K, K, V))
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=DEVICE))
    eta = torch.rand(B, T, H, device=DEVICE)
    h0 = torch.randn(B, H, K, V, device=DEVICE)

    def f(q, k, v, g, eta, h0):
        return kaczmarz_delta_rule(q, k, v, g, eta, initial_state=h0, output_final_state=True, backend="triton",
                                   chunk_size=16)
    with torch.no_grad():
        o, S = _compiled(f)(q, k, v, g, eta, h0)
        ref_o, ref_S = f(q, k, v, g, eta, h0)   # eager: the token-loop kernel
    assert_close(o, ref_o, "delta_ieee", torch.float32, name="o")
    assert_close(S, ref_S, "delta_ieee", torch.float32, name="S")

# ---- declarations built inside the compiled function: traced, proved and built at trace time ----

def _affine_loop(a, b):
    """h_t = a_t h_{t-1} + b_t, h_{-1} = 0, in float64: the sequential reference."""
    a, b = a.double(), b.double()
    h, out = torch.zeros_like(b[:, 0]), []
    for t in range(a.shape[1]):
        h = a[:, t] * h + b[:, t]
        out.append(h)
    return torch.stack(out, 1)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_affine_like_monoid_declared_inside_the_compiled_function(backend):
    def f(a, b):
        @sl.monoid(fields=("a", "b"), identity=(1, 0), name=f"affine_declared_inside_{backend}")
        def affine(x, y):   # h -> y.a (x.a h + x.b) + y.b
            return y.a * x.a, y.a * x.b + y.b
        return sl.scan(affine, (a, b), dim=1, backend=backend).b

    dtype = torch.float64 if backend == "reference" else torch.float32
    for T in (1, 7):
        a = (torch.rand(2, T, 3, dtype=dtype) * 0.9 + 0.05).to(DEVICE)
        b = torch.randn(2, T, 3, dtype=dtype).to(DEVICE)
        got = _compiled(f)(a, b)
        assert_close(got, _affine_loop(a, b).to(dtype), "scan", dtype)
    from scanlang.monoid import DECLARED
    declared = [m for (_, name), m in DECLARED.items() if name == f"affine_declared_inside_{backend}"]
    assert len(declared) == 1 and declared[0]._proof is not None and declared[0]._proof.symbolic


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_refuted_monoid_declared_inside_the_compiled_function_is_refused(backend):
    def f(s):
        @sl.monoid(fields=("s",), identity=(0,), name=f"difference_declared_inside_{backend}")
        def difference(x, y):
            return (x.s - y.s,)
        return sl.scan(difference, (s,), dim=1, backend=backend).s

    with pytest.raises(sl.NotAssociativeError, match=f"difference_declared_inside_{backend}") as info:
        _compiled(f)(torch.randn(1, 5, device=DEVICE))
    x, y, z = info.value.counterexample
    assert (x[0] - y[0]) - z[0] != x[0] - (y[0] - z[0])
    assert "Observed exception" not in str(info.value)


def test_a_body_reading_an_undeclared_field_inside_the_compiled_function_is_the_eager_error():
    def f(s):
        @sl.monoid(fields=("s",), identity=(0,), name="typo_declared_inside")
        def typo(x, y):
            return (x.s + y.t,)
        return sl.scan(typo, (s,), dim=1, backend="reference").s

    with pytest.raises(AttributeError, match="no field 't'"):
        _compiled(f)(torch.randn(1, 3))


def test_mixer_declared_inside_the_compiled_function():
    def f(x, decay):
        @sl.monoid(fields=("a", "b"), identity=(1, 0), name="affine_for_mixer_inside")
        def affine(p, q):
            return q.a * p.a, q.a * p.b + q.b
        ema = sl.mixer(affine, axes="b t d", inputs={"x": "b t d", "decay": "d"},
                       lift=lambda u: (u.decay, (1 - u.decay) * u.x), readout=lambda p, u, q: p.b, outputs=("h",))
        return ema(x=x, decay=decay).h

    compiled = _compiled(f)
    decay = (torch.rand(3) * 0.9 + 0.05).to(DEVICE)
    for T in (1, 6):
        x = torch.randn(2, T, 3, device=DEVICE)
        a = decay.expand(2, T, 3)
        want = _affine_loop(a, (1 - a) * x).float()
        assert_close(compiled(x, decay), want, "scan", torch.float32)


def test_mixer_of_a_refuted_monoid_declared_inside_the_compiled_function_is_refused():
    def f(x):
        @sl.monoid(fields=("s",), identity=(0,), name="difference_for_mixer_inside")
        def difference(p, q):
            return (p.s - q.s,)
        m = sl.mixer(difference, axes="b t d", inputs={"x": "b t d"}, lift=lambda u: (u.x,),
                     readout=lambda p, u, q: p.s, outputs=("h",))
        return m(x=x).h

    with pytest.raises(sl.NotAssociativeError, match="difference_for_mixer_inside") as info:
        _compiled(f)(torch.randn(1, 4, 2, device=DEVICE))
    x, y, z = info.value.counterexample
    assert (x[0] - y[0]) - z[0] != x[0] - (y[0] - z[0])


def _delta_loop(q, k, v, g, beta, scale):
    """S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = scale S_t^T q_t (float64)."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    B, T, H, K = k.shape
    S = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64, device=k.device)
    out = []
    for t in range(T):
        kt, bt = k[:, t], beta[:, t, :, None, None]
        S = torch.exp(g[:, t, :, None, None]) * S
        S = S + bt * kt[..., :, None] * (v[:, t, :, None, :] - torch.einsum("bhk,bhkv->bhv", kt, S)[..., None, :])
        out.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(out, 1)


def test_delta_rule_declared_inside_the_compiled_function():
    from scanlang import backend as registry
    from scanlang.delta import DeltaRule

    def f(q, k, v, g, s):
        rule = DeltaRule("half_kaczmarz_inside", step=lambda t: 0.5 * t.s / (t.n2 + t.eps))
        return registry.get("delta").delta_rule(q, k, v, g, s, rule, scale=0.5, eps=1e-3, chunk_size=16)[0]

    B, T, H, K, V = 1, 5, 2, 16, 16
    q, k, v = (torch.randn(B, T, H, n, device=DEVICE) for n in (K, K, V))
    g = -torch.rand(B, T, H, device=DEVICE) * 0.5 - 0.01
    s = torch.rand(B, T, H, device=DEVICE) + 0.1
    beta = 0.5 * s / ((k.double() ** 2).sum(-1) + 1e-3)
    v.requires_grad_(True)   # the chunk path (the no-grad decode path launches its kernel directly)
    got = _compiled(f)(q, k, v, g, s)
    assert_close(got.detach(), _delta_loop(q, k, v.detach(), g, beta, 0.5).float(), "delta_ieee", torch.float32)


def test_bad_delta_rule_and_matrix_state_declared_inside_the_compiled_function_are_the_eager_errors():
    from scanlang.delta import DeltaRule

    def rule_reads_beta(x):
        DeltaRule("reads_beta_inside", step=lambda t: t.beta)
        return x + 1

    with pytest.raises(AttributeError, match="beta"):
        _compiled(rule_reads_beta)(torch.randn(2))

    def squared_step(x):
        DeltaRule("squared_inside", step=lambda t: t.s ** 2)
        return x + 1

    with pytest.raises(sl.UnsupportedOperationError):
        _compiled(squared_step)(torch.randn(2))

    def state_without_beta(x):
        sl.matrix_state("no_beta_inside", correction="delta", inputs={"eta": "token"})
        return x + 1

    with pytest.raises(ValueError, match="beta hook of matrix state 'no_beta_inside': required"):
        _compiled(state_without_beta)(torch.randn(2))


def test_matrix_state_declared_inside_the_compiled_function_is_the_eager_declaration():
    def f(x):
        decl = sl.matrix_state("kaczmarz_state_inside", correction="delta", inputs={"eta": "token"},
                               constants={"eps": 1e-6}, beta=lambda t: t.eta / (t.n2 + t.eps))
        return x * len(decl.key), decl

    out, decl = _compiled(f)(torch.ones(2))
    eager = f(torch.ones(2))[1]
    assert decl.key == eager.key and decl.proof == eager.proof and "symbolic" in decl.proof
    assert torch.equal(out, torch.full((2,), 16.0))
