"""lower / differentiate / render: structure of the IR, the adjoint and the generated source (no kernels run)."""
import ast

import pytest
import sympy

import scanlang as sl
from scanlang.autodiff import differentiate
from scanlang.backends.triton.codegen_module import render
from scanlang.ir import lower


def test_plain_scan_lowers_to_identity_lift_and_readout():
    ir = lower(sl.Affine)
    assert ir.is_plain and not ir.uses_previous and ir.inputs == ("a", "b")
    assert lower(sl.Affine).key == ir.key != lower(sl.Mobius).key


def test_affine_adjoint_is_one_scalar_per_step():
    adj = differentiate(lower(sl.Affine))
    assert adj.scalar and len(adj.b_entries) == 1
    assert adj.b_entries[0] == sl.Affine.y_symbols[0]          # B_t = a_t (the later element's gate)
    q_a, q_b = lower(sl.Affine).previous_symbols
    g_a, g_b = adj.gbar
    assert sympy.simplify(adj.dx[0] - (g_a * q_a + g_b * q_b)) == 0
    assert adj.dx[1] == g_b


def test_projective_adjoint_keeps_the_block_sparsity_of_the_matrix_product():
    """Möbius: the transition is (dm/dq)^T / s(m), two 2x2 blocks (8 entries), not a dense 4x4."""
    ir = lower(sl.Mobius)
    adj = differentiate(ir)
    assert not adj.scalar and len(adj.pattern) == 8
    assert set(adj.pattern) == {(i, j) for block in ((0, 2), (1, 3)) for i in block for j in block}
    # the direct gradient goes through the Jacobian of m -> m / s(m); it annihilates the scale direction
    p = ir.prefix_symbols
    along_p = [e.subs(dict(zip(adj.d, p))) for e in adj.direct]
    assert sympy.simplify(sum(along_p[j] * p[j] for j in range(4))) == 0
    # a non-projective 4-field monoid keeps the general (renormalisation-free) Jacobian
    assert len(differentiate(lower(sl.library.Matrix2)).pattern) == 8


def test_rendered_module_parses_and_has_the_stages():
    ir = lower(sl.Mobius)
    src = render(ir, differentiate(ir))
    tree = ast.parse(src)
    names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert names == ["combine", "combine_rcp", "adjoint_combine", "sum_fields", "reciprocal", "leaf_scale", "to_acc",
                     "lane_offsets", "scan_forward", "scan_backward", "scan_forward_lanes", "scan_backward_lanes"]
    assert "inv_scale = 1.0 / scale" in src       # projective: renormalised after each combine
    assert "inv_leaf = leaf_scale(" in src        # and each leaf before any product
    # that the render is deterministic is checked across processes (test_triton_scan's byte-identical
    # test renders this module twice) and against the record (test_replay's scan_Mobius)


def test_mixer_readout_with_previous_prefix_and_reduction():
    ir = lower(sl.Affine, inputs=("v", "a"), lift=lambda u: (u.a, u.v), outputs=("y",),
               readout=lambda p, u, q: p.b * q.b, reduce_state=True)
    assert ir.uses_previous and ir.reduce_state and not ir.is_plain
    adj = differentiate(ir)
    assert any(c != 0 for c in adj.c)             # the previous prefix receives a gradient
    src = render(ir, adj)
    assert "tl.gather" in src and "STATE" in src


def test_specialize_carry_keeps_only_the_constants_every_step_preserves():
    from scanlang.ir import specialize_carry
    ir = lower(sl.Affine)
    spec = specialize_carry(ir, {"a": 0.0, "b": 0.0})   # a' = y.a * 0 = 0 stays; b' = y.b does not
    assert spec.constants == (("a", 0.0),) and spec.sequential_only and spec.key != ir.key
    assert spec.combine[0] == 0 and spec.combine[1] == ir.combine[1]
    assert specialize_carry(ir, {"b": 0.0}) is ir      # nothing preserved: the general program
    mob = specialize_carry(lower(sl.Mobius), {"a": 0.0, "c": 0.0, "d": 1.0})
    assert dict(mob.constants) == {"a": 0.0, "c": 0.0, "d": 1.0}
    x_b = mob.earlier[1]
    y_a, y_b, y_c, y_d = mob.later
    assert sympy.simplify(mob.combine[1] - (y_a * x_b + y_b) / (y_c * x_b + y_d)) == 0   # the Möbius action
    assert mob.scale is None
    with pytest.raises(ValueError, match="constants: \\['z'\\] are not fields"):
        specialize_carry(ir, {"z": 1.0})
