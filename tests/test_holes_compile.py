"""Issue 18, class 2: proofs are not skipped under torch.compile. A monoid first scanned inside a
compiled function is proved at trace time, outside the graph (refused with its counterexample when
the law fails), and the first compiled call of a `fullgraph=True` function never meets sympy inside
the trace. Dynamo alone ("eager" backend): on CPU the kernels run in Triton's interpreter, which
cannot take the fake tensors that AOT tracing would feed them."""
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
