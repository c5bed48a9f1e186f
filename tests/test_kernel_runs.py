"""The run-based tile bodies on the kernel IR (backends/triton/kernel/runs.py) and the statement
builders they share with the other tile bodies (kernel/builders.py)."""

import pytest

import scanlang as sl
from scanlang import pipeline
from scanlang.backends.triton.kernel import builders
from scanlang.backends.triton.kernel import ir as K
from scanlang.backends.triton.kernel import runs
from scanlang.backends.triton.kernel.printer import render_kernel

STMTS = (K.Comment, K.Assign, K.AugAssign, K.Load, K.Store, K.AtomicAdd, K.If, K.For, K.Return)


def _walk(stmts):
    for s in stmts:
        assert isinstance(s, STMTS), f"{s!r} is not a kernel IR statement"
        yield s
        if isinstance(s, K.If):
            yield from _walk(s.body)
            yield from _walk(s.orelse)


@pytest.mark.parametrize("monoid", [sl.Affine, sl.Mobius, sl.Welford], ids=lambda m: m.name)
def test_bodies_are_ir_statements(monoid):
    ir = pipeline.lower(monoid)
    adj = pipeline.differentiate(ir)
    fwd, bwd = list(_walk(runs.forward_loop(ir))), list(_walk(runs.backward_loop(ir, adj)))
    assert any(isinstance(s, K.Store) for s in fwd) and any(isinstance(s, K.Load) for s in fwd)
    sums = [s.target for s in bwd if isinstance(s, K.AugAssign)]   # DU == 2: one sum per step of the run (RUN 8)
    assert sorted(sums) == sorted(f"acc{i}" for i in range(len(ir.inputs)) for _ in range(8))
    assert fwd[0] == K.assign("ts", "k * BLOCK_T + run * 8") and len(bwd) > len(fwd)


def test_kernels_of_the_runs():
    affine = pipeline.lower(sl.Affine)   # a scale-invariant projective readout: the combine without the rescale
    mobius = pipeline.lower(sl.Mobius, inputs=tuple("abcd"), lift=lambda u: (u.a, u.b, u.c, u.d), outputs=("lam",),
                            readout=lambda p, u, q: (p.a + p.b) / (p.c + p.d))
    assert [k.name for k in runs.raw_kernels(mobius)] == ["combine_raw", "normalise"]
    assert runs.raw_kernels(affine) == ()
    raw = [render_kernel(k) for k in runs.raw_kernels(mobius)]
    assert all(r.startswith("@triton.jit") and r.splitlines()[-1].lstrip().startswith("return ") for r in raw)
    assert "def normalise(m_a, m_b, m_c, m_d, HW: tl.constexpr):" in raw[1]
    assert runs.raw_kernels(pipeline.lower(sl.Mobius)) == ()   # the plain readout is not scale invariant
    k = runs.sum_fields_kernel(affine)
    assert k.name == "sum_fields" and [p.name for p in k.params] == ["x_a", "x_b", "y_a", "y_b"]
    assert render_kernel(k).splitlines()[-1] == "    return (x_a + y_a, x_b + y_b)"


def test_shared_builders_are_ir_statements():
    mobius = pipeline.lower(sl.Mobius)   # projective: the combine by combine_rcp under RCP_APPROX
    (branch,) = builders.combine_call(mobius, ["p_a", "p_b"], "x_a, x_b, y_a, y_b")
    assert isinstance(branch, K.If) and branch.cond.text == "RCP_APPROX"
    assert branch.body == (K.Assign(("p_a", "p_b"), K.expr("combine_rcp(x_a, x_b, y_a, y_b)")),)
    assert branch.orelse == (K.Assign(("p_a", "p_b"), K.expr("combine(x_a, x_b, y_a, y_b)")),)
    # another function of the module (runs.py's combine_raw) is called as it is, under any RCP_APPROX
    assert builders.combine_call(mobius, ["p_a", "p_b"], "x_a, x_b, y_a, y_b", fn="combine_raw") == (
        K.Assign(("p_a", "p_b"), K.expr("combine_raw(x_a, x_b, y_a, y_b)")),)
    (one,) = builders.scan_call(pipeline.lower(sl.Add), ["p_s"], "e_s")   # one field: `p_s, = ...`
    assert one == K.Assign(("p_s",), K.expr("tl.associative_scan((e_s,), 0, combine)"), unpack=True)
    stores = [s for s in _walk(builders.tile_start_checkpoints(mobius, "c", "lane", "lane_ok"))
              if isinstance(s, K.Store)]
    assert len(stores) == 2 * len(mobius.fields) and all(s.mask.text == "lane_ok" for s in stores)
    assert [s.value.text for s in stores] == [f"c_{f}" for f in mobius.fields] * 2
