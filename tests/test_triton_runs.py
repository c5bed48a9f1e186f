"""Run-based tile kernels (backends/triton/codegen_runs.py: tiles of at least RUN_TILE steps, each
thread scanning runs of RUN consecutive steps) against float64 sequential loops.

The tile configs are forced through runtime.OVERRIDES: 128-step tiles on 2 lanes (the smallest
tile that takes the run bodies), checkpoints every 64, 128 or 4 steps (multiples of the run, and one
that ends inside runs). Lengths 1, 13 (one partial run), 128 (one whole tile) and 203 (two tiles,
the last one ending inside a run) cover partial runs, partial tiles and the carry between tiles.
"""
import pytest
import torch
from scanlang.backends.reference import scan_sequential
from scanlang.backends.triton import codegen_runs, runtime
from test_triton_scan import DEVICE, LIBRARY, elems_for

import scanlang as sl
from scanlang.testing import assert_close

TILE = codegen_runs.RUN_TILE


def _force(chunk: int, block_l: int = 2):
    runtime.OVERRIDES.clear()
    for contiguous in (False, True):
        runtime.OVERRIDES[(contiguous, False)] = runtime.Config(block_t=TILE, block_l=block_l, num_warps=1, chunk=chunk)
        runtime.OVERRIDES[(contiguous, True)] = runtime.Config(block_t=chunk, block_l=block_l, num_warps=1, chunk=chunk)


@pytest.fixture
def runs():
    _force(64)
    yield _force
    runtime.OVERRIDES.clear()


@pytest.mark.parametrize("monoid", LIBRARY, ids=lambda m: m.name)
@pytest.mark.parametrize("length", [1, 13, 128, 203])
def test_runs_forward_matches_sequential_loop(runs, monoid, length):
    shape = (2, 3, length)
    elems = elems_for(monoid, shape)
    out = sl.scan(monoid, elems, dim=2, backend="triton")
    ref = scan_sequential(monoid, elems, dim=2)
    for f, o, r in zip(monoid.fields, out, ref):
        assert torch.isfinite(o).all(), f"{f}: some output was not written"
        assert_close(o, r, "scan", name=f"{monoid.name}.{f}")


@pytest.mark.parametrize("monoid", LIBRARY, ids=lambda m: m.name)
@pytest.mark.parametrize("layout,reverse,chunk", [("time", False, 64), ("channels", True, 4), ("time", True, 128)])
def test_runs_gradients_with_initial(runs, monoid, layout, reverse, chunk):
    runs(chunk)
    shape, dim = ((2, 3, 203), 2) if layout == "time" else ((2, 203, 3), 1)
    elems = tuple(e.requires_grad_() for e in elems_for(monoid, shape))
    initial = tuple(e.requires_grad_() for e in elems_for(monoid, shape[:dim] + shape[dim + 1:]))
    out = sl.scan(monoid, elems, dim=dim, reverse=reverse, initial=initial, backend="triton")
    ref = scan_sequential(monoid, elems, dim=dim, reverse=reverse, initial=initial)
    for f, o, r in zip(monoid.fields, out, ref):
        assert_close(o, r, "scan", name=f"{monoid.name}.{f}")
    weights = [torch.randn(shape, dtype=torch.float64, device=DEVICE) for _ in monoid.fields]
    leaves = elems + initial
    got = torch.autograd.grad(sum((o * w).sum() for o, w in zip(out, weights)), leaves)
    want = torch.autograd.grad(sum((r * w).sum() for r, w in zip(ref, weights)), leaves)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape
        assert_close(g, w, "scan_grad", name=f"{monoid.name} grad {i}")


def test_runs_take_the_run_bodies():
    """Both generated kernels switch to the run bodies at RUN_TILE steps (a constexpr branch)."""
    from scanlang.backends.triton.codegen import render

    from scanlang.autodiff import differentiate
    from scanlang.ir import lower
    ir = lower(sl.Affine)
    source = render(ir, differentiate(ir))
    assert source.count(f"if BLOCK_T >= {TILE}:") == 2
    assert "tl.associative_scan((r7_a, r7_b,), 0, combine)" in source


def test_runs_mixer_with_state_readout_previous_prefix_and_initial(runs):
    """A readout summed over the state lanes and using the previous prefix, with a final state."""
    import test_mixer
    runs(TILE)
    test_mixer.test_fused_mixer_outputs_final_state_and_gradients(150)


@pytest.mark.parametrize("reverse", [False, True])
def test_runs_packed_sequences(runs, reverse):
    """cu_seqlens: sequences start anywhere in memory (runs straddle sequence ends)."""
    import test_mixer
    runs(TILE)
    test_mixer.test_packed_sequences_restart_at_every_start(reverse)


def test_runs_gradients_of_broadcast_inputs(runs):
    """Input gradients summed over time, over the state lanes, and atomically over lanes."""
    import test_mixer
    runs(TILE)
    test_mixer.test_gradients_of_inputs_broadcast_over_several_lane_axes()
