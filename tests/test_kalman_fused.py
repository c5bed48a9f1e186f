"""The fused Kalman paths (generated `sl.mixer` kernels: the 3x3 monoid as one mixer, "fused", or a
Möbius mixer then an affine mixer, "fused_two") against float64.

On CPU the generated kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1),
so shapes stay tiny; the GPU test runs a long sequence.
"""
import pytest
import torch

from scanlang.recipes.kalman import kalman_filter
from scanlang.recipes.kalman.filter import FUSED_FORMS
from scanlang.recipes.kalman.fused import information_mixer, joint_mixer, precision_mixer
from scanlang.recipes.kalman.reference import kalman_filter_loop
from scanlang.testing import assert_close
from test_kalman import NAMES, _loss_and_grads, covariance_filter, make_inputs, make_state

F64 = torch.float64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=["tiles", "lanes"])
def schedule(request, knobs):
    """Both schedules: "lanes" lowers the lane threshold so these tiny shapes run lane-sequentially,
    with the carry specialised to the constant fields (ir.specialize_carry)."""
    if request.param == "lanes":
        knobs(lanes_min=1)
    return request.param


def on(ins, state=None):
    moved = {n: x.to(DEVICE) for n, x in ins.items()}
    return moved if state is None else (moved, tuple(s.to(DEVICE) for s in state))


@pytest.mark.parametrize("form", FUSED_FORMS)
@pytest.mark.parametrize("length", [1, 13])
@pytest.mark.parametrize("heads", [None, 2])
def test_fused_matches_covariance_filter(form, length, heads, schedule):
    """Both forms on both schedules, per-channel or per-head parameters, T = 1 (one partial tile or
    chunk) and T = 13 (several, the last partial), outputs and final state against the covariance filter."""
    ins = make_inputs(2, length, 4, 2, heads=heads)
    state = make_state(2, 4, 2)
    dev_ins, dev_state = on(ins, state)
    y, y_var, (lam, eta) = kalman_filter(**dev_ins, initial_state=dev_state, output_final_state=True,
                                         backend="triton", form=form)
    assert y.shape == y_var.shape == (2, length, 4) and lam.shape == eta.shape == (2, 4, 2)
    ref_y, ref_var, (ref_lam, ref_eta) = covariance_filter(**ins, initial_state=state)
    for name, out, ref in (("y", y, ref_y), ("y_var", y_var, ref_var), ("lam", lam, ref_lam), ("eta", eta, ref_eta)):
        assert_close(out, ref, "kalman_out", torch.float32, name=name)


@pytest.mark.parametrize("form", FUSED_FORMS)
def test_fused_in_float64(form):
    ins = make_inputs(1, 9, 4, 4, dtype=F64)
    y, y_var, _ = kalman_filter(**on(ins), backend="triton", form=form)
    assert y.dtype == F64
    ref_y, ref_var, _ = covariance_filter(**ins)
    assert_close(y, ref_y, "kalman_out", F64, name="y")
    assert_close(y_var, ref_var, "kalman_out", F64, name="y_var")


@pytest.mark.parametrize("schedule,heads,form", [("tiles", None, "fused"), ("tiles", 2, "fused_two"),
                                                 ("lanes", None, "fused_two"), ("lanes", 2, "fused")],
                         indirect=["schedule"])
def test_fused_gradients_match_float64_autograd_of_the_loop(form, heads, schedule):
    """Every gradient against float64 autograd of the loop: each form on each schedule, each schedule
    with per-channel and per-head parameters, each form with both (four cases, not the eight products:
    the forms' backward kernels do not depend on the parameters' layout beyond their strides)."""
    ins = make_inputs(2, 11, 4, 2, heads=heads)
    state = make_state(2, 4, 2)
    dev_ins, dev_state = on(ins, state)
    got = _loss_and_grads(kalman_filter, dev_ins, dev_state, seed=6, output_final_state=True,
                          backend="triton", form=form)
    ref = _loss_and_grads(kalman_filter_loop, {n: x.to(F64) for n, x in ins.items()},
                          tuple(s.to(F64) for s in state), seed=6)
    for name, g, r in zip(NAMES, got, ref):
        assert g.dtype == torch.float32, name
        assert_close(g, r, "kalman_grad", torch.float32, name=f"d{name}")


@pytest.mark.parametrize("form", FUSED_FORMS)
def test_fused_state_carry_and_zero_keys(form, schedule):
    ins = make_inputs(1, 12, 4, 2)
    ins["k"][:, 3:5] = 0.0
    ins["prec"][:, 9:] = 1e-30
    dev = on(ins)
    y, y_var, state = kalman_filter(**dev, output_final_state=True, backend="triton", form=form)
    first = {n: (x[:, :6] if x.dim() >= 3 else x) for n, x in dev.items()}
    second = {n: (x[:, 6:] if x.dim() >= 3 else x) for n, x in dev.items()}
    y1, v1, mid = kalman_filter(**first, output_final_state=True, backend="triton", form=form)
    y2, v2, end = kalman_filter(**second, initial_state=mid, output_final_state=True, backend="triton", form=form)
    assert torch.isfinite(y).all() and torch.isfinite(y_var).all()
    ref_y, ref_var, (ref_lam, ref_eta) = kalman_filter_loop(**ins)
    assert_close(torch.cat([y1, y2], 1), ref_y, "kalman_out", torch.float32, name="y")
    assert_close(torch.cat([v1, v2], 1), ref_var, "kalman_out", torch.float32, name="y_var")
    assert_close(end[0], ref_lam, "kalman_out", torch.float32, name="lam")
    assert_close(end[1], ref_eta, "kalman_out", torch.float32, name="eta")


def test_dispatch_and_errors():
    ins = make_inputs(1, 3, 4, 3)          # S = 3: not a power of two
    with pytest.raises(ValueError, match="form: 'fused' runs the generated mixer kernels"):
        kalman_filter(**on(ins), backend="triton", form="fused")
    with pytest.raises(ValueError, match="form: 'fused_two' runs the generated mixer kernels"):
        kalman_filter(**make_inputs(1, 3, 4, 2), backend="reference", form="fused_two")
    # S = 3 on the triton backend falls back to the sl.scan kernels
    y, y_var, _ = kalman_filter(**on(ins), backend="triton")
    ref_y, ref_var, _ = covariance_filter(**ins)
    assert_close(y, ref_y, "kalman_out", torch.float32, name="y")


def test_default_form_follows_the_measurements():
    from scanlang.recipes.kalman.filter import choose_form
    assert choose_form("triton", 16, needs_grad=False) == "fused"
    assert choose_form("triton", 16, needs_grad=True) == "two_scans"
    assert choose_form("triton", 16, needs_grad=True, lanes=8 * 1536 * 16) == "fused"   # lane-sequential
    assert choose_form("triton", 12, needs_grad=False) == "two_scans"     # S not a power of two
    assert choose_form("reference", 16, needs_grad=False) == "two_scans"


def test_one_forward_and_one_backward_kernel_per_mixer():
    for mix in (joint_mixer(), precision_mixer(), information_mixer()):
        source = mix.source()
        assert source.count("\ndef scan_forward(") == 1 and source.count("\ndef scan_backward(") == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("form", FUSED_FORMS)
def test_fused_long_sequence_gradients_on_gpu(form):
    ins = make_inputs(2, 3000, 32, 16, heads=2, decay=(0.9, 0.99995), noise=(1e-4, 0.05), precision=(1e-3, 1e3))
    state = make_state(2, 32, 16)
    got = _loss_and_grads(kalman_filter, *on(ins, state), seed=7, output_final_state=True, form=form)
    ref = _loss_and_grads(kalman_filter_loop, on({n: x.to(F64) for n, x in ins.items()}),
                          tuple(s.to(F64).to(DEVICE) for s in state), seed=7)
    for name, g, r in zip(NAMES, got, ref):
        assert torch.isfinite(g).all(), name
        assert_close(g, r, "kalman_grad", torch.float32, name=f"d{name}")


@pytest.mark.parametrize("form", FUSED_FORMS)
def test_fused_bfloat16_inputs_scan_in_float32(form):
    ins = make_inputs(2, 9, 4, 4, dtype=torch.bfloat16)
    y, y_var, (lam, eta) = kalman_filter(**on(ins), output_final_state=True, backend="triton", form=form)
    assert y.dtype == y_var.dtype == lam.dtype == eta.dtype == torch.float32
    ref_y, ref_var, _ = covariance_filter(**ins)          # the same rounded inputs, in float64
    assert_close(y, ref_y, "kalman_out", torch.float32, name="y")
    assert_close(y_var, ref_var, "kalman_out", torch.float32, name="y_var")


def test_time_major_inputs_give_the_same_filter():
    """The mixer fed time-contiguous copies (another generated schedule): outputs and gradients agree."""
    from scanlang.recipes.kalman.fused import fused_filter
    ins = make_inputs(2, 13, 4, 4, heads=2)
    state = make_state(2, 4, 4)

    def run(v, prec, k, q, a_bar, p_bar, initial_state):
        y, y_var, final = fused_filter(v, prec, k, q, a_bar, p_bar, *initial_state, True, time_major=True)
        return y, y_var, final

    got = _loss_and_grads(run, *on(ins, state), seed=8)
    ref = _loss_and_grads(kalman_filter_loop, {n: x.to(F64) for n, x in ins.items()},
                          tuple(s.to(F64) for s in state), seed=8)
    for name, g, r in zip(NAMES, got, ref):
        assert_close(g, r, "kalman_grad", torch.float32, name=f"d{name}")


@pytest.mark.parametrize("form", FUSED_FORMS)
def test_fused_zero_keys_give_zero_not_nan_gradients(form, schedule):
    ins = make_inputs(1, 9, 4, 2)
    ins["k"][:, 3] = 0.0
    leaves = {n: x.to(DEVICE).requires_grad_() for n, x in ins.items()}
    y, y_var, _ = kalman_filter(**leaves, backend="triton", form=form)
    (y.sum() + y_var.sum()).backward()
    for n, x in leaves.items():
        assert torch.isfinite(x.grad).all(), n
    assert (leaves["v"].grad[:, 3] == 0).all() and (leaves["prec"].grad[:, 3] == 0).all()


def test_lanes_run_the_specialised_carry(knobs):
    """On the lane-sequential schedule the 3x3 program carries (lam, eta) alone: 5 of its 7 fields
    are constants of the generated kernels, which have no tile schedule."""
    knobs(lanes_min=1)
    ins = make_inputs(1, 5, 4, 2)
    kalman_filter(**on(ins), backend="triton", form="fused")
    (program,) = [p for p in joint_mixer()._specialised.values() if p is not joint_mixer().program]
    assert dict(program.ir.constants) == {"a": 0.0, "c": 0.0, "d": 1.0, "e": 0.0, "g": 0.0}
    assert "\ndef scan_forward(" not in program.source and "\ndef scan_forward_lanes(" in program.source
    kalman_filter(**on(ins), backend="triton", form="fused_two")
    (mob,) = [p for p in precision_mixer()._specialised.values() if p is not precision_mixer().program]
    assert dict(mob.ir.constants) == {"a": 0.0, "c": 0.0, "d": 1.0}
    (aff,) = [p for p in information_mixer()._specialised.values() if p is not information_mixer().program]
    assert dict(aff.ir.constants) == {"a": 0.0}


def test_key_gradients_summed_per_program_or_per_lane_agree(knobs):
    """dk, dq (keys shared by the channels): summed over a program's groups before the atomic add
    (plan mode 5) or one atomic per lane (mode 1); both against float64 autograd of the loop."""
    from scanlang.backends.triton import plan
    knobs(lanes_min=1)
    ins = make_inputs(2, 9, 4, 2)
    state = make_state(2, 4, 2)
    ref = _loss_and_grads(kalman_filter_loop, {n: x.to(F64) for n, x in ins.items()},
                          tuple(s.to(F64) for s in state), seed=9)
    for grouped in (True, False):
        knobs(sum_groups_before_atomics=grouped)
        plan.PLANS.plans.clear()   # only this setting's plans inspected below
        got = _loss_and_grads(kalman_filter, *on(ins, state), seed=9, output_final_state=True, backend="triton",
                              form="fused")
        for name, g, r in zip(NAMES, got, ref):
            assert_close(g, r, "kalman_grad", torch.float32, name=f"d{name} (grouped={grouped})")
        plans = [*plan.PLANS.plans.values()]
        plans += [b for p in plans if hasattr(p, "backward_plans") for b in p.backward_plans.plans.values()]   # kept by their forward plans
        modes = {v for p in plans for _, _, meta, _ in getattr(p, "_launch", {}).values()
                 for k, v in meta.items() if k.startswith("DU")}
        assert (5 in modes) == grouped and (1 in modes) != grouped
