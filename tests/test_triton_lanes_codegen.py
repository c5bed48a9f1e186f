"""The lane-sequential generator's source-level guarantees (kernel/lanes.py, kernel/lanes_adjoint.py): the composed adjoint equals
the generic one, memory is accessed through 1-D tensors, and the warp-summed key gradients are right
when a warp holds fewer groups than lanes per slot (STATE > 32).
"""
import re

import pytest
import sympy
import torch

from scanlang import tuning
from scanlang.autodiff import differentiate
from scanlang.backends.triton import runtime
from scanlang.backends.triton.kernel import lanes, lanes_adjoint, printer
from scanlang.ir import specialize_carry
from scanlang.testing import assert_close

from test_triton_scan import DEVICE

# the constant map the fused Kalman filter starts from
KALMAN_CARRY = {"a": 0.0, "c": 0.0, "d": 1.0, "e": 0.0, "g": 0.0}


def _programs():
    """(name, ir) of the fused Kalman programs whose steps compose with their lifts."""
    from scanlang.recipes.kalman import fused
    return [("kalman_joint", specialize_carry(fused.joint_mixer().ir, KALMAN_CARRY)),
            ("kalman_information", fused.information_mixer().ir)]


@pytest.mark.parametrize("name,ir", _programs(), ids=lambda x: x if isinstance(x, str) else "")
def test_composed_adjoint_equals_the_generic_one(name, ir):
    """du = (dF/du)^T gbar + (d readout/du)^T g and B over the inputs (`composed_adjoint`) against the
    generic adjoint's du (through dx = J2^T gbar and d lift/du) and B with the lift substituted."""
    adj = differentiate(ir)
    composed = lanes_adjoint.composed_adjoint(ir, adj)
    assert composed.dx == () and composed is not adj
    lift = dict(zip(ir.later, ir.lift))
    dx = dict(zip(adj.dx_symbols, adj.dx))
    for u, generic, got in zip(ir.inputs, adj.du, composed.du):
        want = sympy.sympify(generic).xreplace(dx).xreplace(lift)
        assert sympy.simplify(want - got) == 0, f"{name}: du_{u}"
        assert sympy.count_ops(got) <= sympy.count_ops(want), f"{name}: du_{u} not simpler"
    for generic, got in zip(adj.b_entries, composed.b_entries):
        assert sympy.simplify(sympy.sympify(generic).xreplace(lift) - got) == 0, name


def test_projective_programs_keep_the_generic_adjoint():
    from scanlang.recipes.kalman import fused
    ir = fused.precision_mixer().ir
    adj = differentiate(ir)
    assert lanes_adjoint.composed_adjoint(ir, adj) is adj


def test_memory_goes_through_flat_tensors():
    """Every load, store and atomic of the time loops takes a pointer tensor reshaped to 1-D (so
    Triton 3.6 keeps the [R, G] layout; module docstring, "Memory"). The exceptions: the sequence
    bounds (scalars) and the initial carry (builders.initial_carry, once per program)."""
    ir = _programs()[0][1]
    source = "\n".join(printer.render_kernel(k) for k in (lanes.render_forward_lanes(ir),
                                                          lanes_adjoint.render_backward_lanes(ir, differentiate(ir))))
    ops = re.findall(r"tl\.(?:load|store|atomic_add)\((.{0,40})", source)
    assert len(ops) > 50
    loose = [o for o in ops if not o.startswith("tl.reshape(") and not o.startswith(("cu_ptr", "init"))]
    assert not loose, loose[:5]


def test_warp_summed_key_gradients_with_wide_state(knobs):
    """STATE = 64 > 32 (a warp holds 2 groups, fewer than the 4 lanes per slot): mode 6 adds the first
    group's registers (the other branch of `_du_store_lanes`); every gradient against the float64 loop."""
    from scanlang.backends.triton import plan
    from scanlang.recipes.kalman import kalman_filter
    from scanlang.recipes.kalman.reference import kalman_filter_loop
    from test_kalman import NAMES, _loss_and_grads, make_inputs, make_state
    cfg = runtime.Config(block_t=4, block_l=128, num_warps=1, chunk=4, schedule="lanes", unroll=2)
    assert runtime.lanes_per_thread(cfg, 64) == 4
    knobs(sum_groups_before_atomics=False, sum_warp_groups_before_atomics=True,
          forced={(c, b): cfg for c in (False, True) for b in (False, True)})
    assert plan._lanes_mode(5, (1, 1, 2, 64), cfg, 64) == 6
    ins = make_inputs(1, 5, 2, 64)
    state = make_state(1, 2, 64)
    got = _loss_and_grads(kalman_filter, {n: x.to(DEVICE) for n, x in ins.items()},
                          tuple(s.to(DEVICE) for s in state), seed=5, output_final_state=True, backend="triton",
                          form="fused")
    ref = _loss_and_grads(kalman_filter_loop, {n: x.to(torch.float64) for n, x in ins.items()},
                          tuple(s.to(torch.float64) for s in state), seed=5)
    for name, g, r in zip(NAMES, got, ref):
        assert_close(g, r, "kalman_grad", torch.float32, name=f"d{name}")


def test_loop_stages_pipeline_the_block_loops():
    """tuning.loop_stages_forward / loop_stages_backward: plain loops by default; with N > 1 stages the forward's, the replay's
    and the walk's loops over full blocks become tl.range(..., num_stages=N), per pass, and the
    module still renders (parsed) and imports."""
    from scanlang.backends.triton import codegen_module as codegen
    ir = _programs()[0][1]
    adj = differentiate(ir)
    default = codegen.render(ir, adj)
    assert "tl.range(" not in default and "num_stages" not in default
    with tuning.override(loop_stages_forward=2, loop_stages_backward=3):
        source = codegen.render(ir, adj)
    loops = re.findall(r"for (\w+) in tl\.range\(0, n_steps - \(UNROLL - 1\), UNROLL, num_stages=(\d)\):", source)
    assert loops == [("s0", "2"), ("s0", "3"), ("ss0", "3")]
    assert source != default and runtime.load(source).scan_backward_lanes is not None
