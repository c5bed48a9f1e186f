"""Knobs as data (scanlang.tuning): the override context, and the keys the knobs are part of:
a render-time knob in the program key (a flip renders another program), a launch-time knob in
the plan key (a flip builds another plan; the old plans are found again after)."""
import threading

import pytest
import torch

import scanlang as sl
from scanlang import pipeline, tuning
from scanlang.backends.reference import scan_sequential
from scanlang.ir import lower
from scanlang.testing import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_override_changes_the_named_knobs_and_restores_them():
    assert tuning.current() is tuning.DEFAULT
    with tuning.override(lanes_min=3, loop_stages_backward=2) as outer:
        assert tuning.current() is outer and (outer.lanes_min, outer.loop_stages_backward) == (3, 2)
        with tuning.override(lanes_min=5):
            assert (tuning.current().lanes_min, tuning.current().loop_stages_backward) == (5, 2)
        assert tuning.current().lanes_min == 3
    assert tuning.current() == tuning.DEFAULT


def test_override_refuses_unknown_knobs_and_bad_values_before_the_block():
    with pytest.raises(TypeError, match="unknown knobs \\['LOOP_STAGES'\\]"):
        with tuning.override(LOOP_STAGES=2):
            pass
    with pytest.raises(ValueError, match="loop_stages_forward: expected an int >= 1"):
        with tuning.override(loop_stages_forward=0):
            pass
    with pytest.raises(ValueError, match="run: expected a multiple of vec"):
        with tuning.override(run=6):
            pass
    with pytest.raises(TypeError, match="sum_groups_before_atomics: expected a bool"):
        with tuning.override(sum_groups_before_atomics=1):
            pass
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="chunk_single_pass: expected 'auto', 'forward', 'both', 'none' or a bool"):
            with tuning.override(chunk_single_pass=bad):
                pass
    with tuning.override(chunk_single_pass=True):
        assert tuning.current().chunk_single_pass == "both"
    with tuning.override(chunk_single_pass=False):
        assert tuning.current().chunk_single_pass == "none"
    for bad in (0, 8, 48, True):
        with pytest.raises(ValueError, match="linear_key_block: expected a power of two >= 16"):
            with tuning.override(linear_key_block=bad):
                pass
        with pytest.raises(ValueError, match="linear_delta_key_block: expected a power of two >= 16"):
            with tuning.override(linear_delta_key_block=bad):
                pass
    for bad in (0, 3, 1.0, "1", True):
        with pytest.raises(ValueError, match="linear_pairwise_block: expected a power of two >= 1"):
            with tuning.override(linear_pairwise_block=bad):
                pass
    for bad in (0, 3, 48, True):
        with pytest.raises(ValueError, match="chunk_lookback: expected a power of two >= 1"):
            with tuning.override(chunk_lookback=bad):
                pass
    assert tuning.current() is tuning.DEFAULT


def test_overrides_from_threads_end_in_any_order():
    """Two threads' overrides are both in effect while open; the first to enter leaving first keeps
    the second's knobs, and nothing is left once both have left."""
    entered, leave_first, seen = threading.Event(), threading.Event(), {}

    def first():
        with tuning.override(lanes_min=7):
            entered.set()
            leave_first.wait(10)
        seen["after first"] = tuning.current().lanes_min, tuning.current().delta_key_block

    worker = threading.Thread(target=first)
    worker.start()
    assert entered.wait(10)
    with tuning.override(delta_key_block=16):
        assert (tuning.current().lanes_min, tuning.current().delta_key_block) == (7, 16)
        leave_first.set()
        worker.join(10)
        assert seen["after first"] == (tuning.DEFAULT.lanes_min, 16)
    assert tuning.current() is tuning.DEFAULT


def test_a_render_time_knob_is_in_the_program_key():
    """Flipping loop_stages_forward after the first build renders a new program (its loops pipelined),
    which sl.scan then runs; the default program is the one found again afterwards."""
    ir = lower(sl.Add)
    default = pipeline.build(ir)
    with tuning.override(loop_stages_forward=2):
        staged = pipeline.build(ir)
        x = torch.randn(2, 9, 3, dtype=torch.float64, device=DEVICE)
        out = sl.scan(sl.Add, (x,), dim=1, backend="triton")
        assert pipeline.program(sl.Add) is staged
    assert staged.key != default.key and staged.ir is ir
    assert "num_stages=2" in staged.source and "num_stages=2" not in default.source
    assert_close(out[0], scan_sequential(sl.Add, (x,), dim=1)[0], "scan")
    assert pipeline.build(ir) is default and pipeline.program(sl.Add) is default


def test_a_render_time_knob_reaches_a_mixer_built_before_it():
    mix = sl.mixer(sl.Affine, axes="b t d", inputs={"x": "b t d", "decay": "d"},
                   lift=lambda u: (u.decay, (1 - u.decay) * u.x), readout=lambda p, u, q: p.b, outputs=("h",))
    x = torch.randn(1, 6, 2, dtype=torch.float64, device=DEVICE)
    decay = torch.tensor([0.5, 0.25], dtype=torch.float64, device=DEVICE)
    want = mix(x=x, decay=decay).h
    with tuning.override(loop_stages_backward=3):
        assert mix._general() is not mix.program and "num_stages=3" in mix._general().source
        assert_close(mix(x=x, decay=decay).h, want, "scan")
    assert mix._general() is mix.program


def _affine_step(shape):
    a = (torch.rand(shape, device=DEVICE) * 0.9 + 0.05).requires_grad_()
    b = torch.randn(shape, device=DEVICE).requires_grad_()
    out = sl.scan(sl.Affine, (a, b), dim=1, backend="triton")
    torch.autograd.grad(out.b.sum(), (a, b))
    return out


@pytest.mark.parametrize("knob", [dict(sum_warp_groups_before_atomics=False), dict(sum_groups_before_atomics=True),
                                  dict(lanes_min=1), dict(chunk_single_pass=True), dict(chunk_lookback=4)],
                         ids=lambda k: next(iter(k)))
def test_a_launch_time_knob_is_in_the_plan_key(knob):
    """The same eager call under a flipped launch-time knob builds a forward and a backward plan of its
    own (a plan memoises its launch meta, gradient modes included); back at the defaults, the first
    plans are found again."""
    from scanlang.backends.triton import plan
    shape = (2, 5, 3)
    _affine_step(shape)
    built = plan.PLANS.built
    _affine_step(shape)
    assert plan.PLANS.built == built
    with tuning.override(**knob):
        _affine_step(shape)
        assert plan.PLANS.built == built + 2
        _affine_step(shape)
        assert plan.PLANS.built == built + 2
    _affine_step(shape)
    assert plan.PLANS.built == built + 2


def test_delta_launch_configs_are_knobs_with_read_only_defaults():
    """The delta kernels' configs: DELTA_CONFIGS' defaults with `delta_configs` applied by kernel name
    (nested overrides add up, leaving restores); the defaults and ops.CONFIG (the same table) are read-only."""
    from scanlang.backends.delta import ops as delta_ops
    defaults = {name: dict(cfg) for name, cfg in tuning.DELTA_CONFIGS.items()}
    assert tuning.current().delta_launch_configs() == defaults and delta_ops.CONFIG is tuning.DELTA_CONFIGS
    with pytest.raises(TypeError):
        delta_ops.CONFIG["bwd_wy"] = dict(BV=16)
    with pytest.raises(TypeError):
        tuning.DELTA_CONFIGS["bwd_wy"]["BV"] = 16
    with tuning.override(delta_configs={"bwd_wy": dict(BV=16, num_warps=2)}):
        with tuning.override(delta_configs={"prep": dict(num_warps=8)}):
            got = tuning.current().delta_launch_configs()
            assert got == {**defaults, "bwd_wy": dict(BV=16, num_warps=2), "prep": dict(num_warps=8)}
            got["prep"]["num_warps"] = 1   # fresh dicts: the knobs do not change
            assert tuning.current().delta_config("prep") == dict(num_warps=8)
        assert tuning.current().delta_config("prep") == defaults["prep"]
    assert tuning.current().delta_launch_configs() == defaults and tuning.current().delta_configs == ()
