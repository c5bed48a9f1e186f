"""The lane-sequential schedule (scan_forward_lanes / scan_backward_lanes) against float64 loops, and
fitting launch configs to the device (shrink on OutOfResources, remembered per program and shape).

The schedule is forced through `scanlang.tuning` (forced configs, how the benchmark selects it). Chunks of 4 steps
and 8 lanes per program (two groups of the mixers' 4 state lanes; masked tails), so T = 1, 7, 9
cover one partial chunk, a tail and several chunks. With CHUNK == UNROLL (here 4) the backward
replays each chunk in registers; `test_lanes_chunk_not_a_multiple_of_the_unroll` covers the
scratch-memory replay (CHUNK != UNROLL) and a 6-step register chunk.
"""
import pytest
import torch
from triton.runtime.errors import OutOfResources

import scanlang as sl
from scanlang.backends.reference import scan_sequential
from scanlang import tuning
from scanlang.backends.triton import ops, runtime
from scanlang.testing import assert_close

import test_mixer
from test_triton_scan import DEVICE, LIBRARY, check_with_initial, elems_for

LANES = runtime.Config(block_t=4, block_l=8, num_warps=1, chunk=4, schedule="lanes", unroll=4)
# 64 lanes on one warp: 2 lanes per thread slot (runtime.lanes_per_thread), so a group of the mixers'
# 4 state lanes spans 2 slots (sums in registers, then across the slots)
WIDE = runtime.Config(block_t=4, block_l=64, num_warps=1, chunk=4, schedule="lanes", unroll=4)


def _forced(fwd: str, bwd: str, cfg: runtime.Config = LANES) -> dict:
    """The forced configs (tuning.override(forced=...)) that run `cfg` on the passes named "lanes"."""
    passes = [backward for backward, name in ((False, fwd), (True, bwd)) if name == "lanes"]
    return {(contiguous, backward): cfg for contiguous in (False, True) for backward in passes}


@pytest.fixture
def lanes(monkeypatch, request):
    """Force the lanes schedule and check that only its kernels ran: one lane per thread slot, or
    several ("wide", parametrized indirectly by the mixer tests: their 4 state lanes)."""
    from scanlang.backends.triton import launcher
    real, real_launch, ran = ops.wrap_triton, launcher.launch, []

    def spy(kernel):
        ran.append(kernel.__name__)
        return real(kernel)

    def spy_launch(plan, cfg, kernel, *args):   # eager calls launch here, not through wrap_triton
        ran.append(kernel.__name__)
        return real_launch(plan, cfg, kernel, *args)
    monkeypatch.setattr(ops, "wrap_triton", spy)
    monkeypatch.setattr(launcher, "launch", spy_launch)
    cfg = WIDE if getattr(request, "param", "one") == "wide" else LANES
    with tuning.override(forced=_forced("lanes", "lanes", cfg)):
        yield
    assert ran and set(ran) <= {"scan_forward_lanes", "scan_backward_lanes"}, ran


def _shape(layout, T):
    return ((2, 3, T), 2) if layout == "time" else ((2, T, 5), 1)


@pytest.mark.parametrize("monoid", LIBRARY, ids=lambda m: m.name)
@pytest.mark.parametrize("length", [1, 7, 9])
def test_lanes_forward_matches_sequential_loop(lanes, monoid, length):
    shape, dim = _shape("channels", length)
    elems = elems_for(monoid, shape)
    out = sl.scan(monoid, elems, dim=dim, backend="triton")
    ref = scan_sequential(monoid, elems, dim=dim)
    for f, o, r in zip(monoid.fields, out, ref):
        assert torch.isfinite(o).all(), f"{f}: some output was not written"
        assert_close(o, r, "scan", name=f"{monoid.name}.{f}")


@pytest.mark.parametrize("monoid", LIBRARY, ids=lambda m: m.name)
@pytest.mark.parametrize("layout,reverse", [("time", False), ("channels", True)])
def test_lanes_gradients_with_initial(lanes, monoid, layout, reverse):
    shape, dim = _shape(layout, 9)
    check_with_initial(monoid, shape, dim, reverse)


@pytest.mark.parametrize("fwd,bwd", [("lanes", "tile"), ("tile", "lanes")])
def test_schedules_share_checkpoints(fwd, bwd):
    """Either backward runs after either forward: both read the same checkpoint slots."""
    with tuning.override(forced=_forced(fwd, bwd)):
        shape = (2, 11, 3)
        elems = tuple(e.requires_grad_() for e in elems_for(sl.Mobius, shape))
        out = sl.scan(sl.Mobius, elems, dim=1, backend="triton")
        ref = scan_sequential(sl.Mobius, elems, dim=1)
        w = torch.randn(shape, dtype=torch.float64, device=DEVICE)
        got = torch.autograd.grad((out.a * w).sum() + out.d.sum(), elems)
        want = torch.autograd.grad((ref[0] * w).sum() + ref[3].sum(), elems)
        for g, r in zip(got, want):
            assert_close(g, r, "scan_grad")


@pytest.mark.parametrize("unroll", [1, 4, 6, 16])
def test_lanes_chunk_not_a_multiple_of_the_unroll(knobs, unroll):
    """Checkpoints every 6 steps, stepped in blocks of 1, 4 (a partial block per chunk), 6 (one block:
    the backward's replay stays in registers) or 16 (more than a chunk)."""
    odd = runtime.Config(block_t=6, block_l=8, num_warps=1, chunk=6, schedule="lanes", unroll=unroll)
    knobs(forced=_forced("lanes", "lanes", odd))
    shape = (2, 17, 3)
    elems = tuple(e.requires_grad_() for e in elems_for(sl.Mobius, shape))
    initial = tuple(e.requires_grad_() for e in elems_for(sl.Mobius, (2, 3)))
    out = sl.scan(sl.Mobius, elems, dim=1, reverse=True, initial=initial, backend="triton")
    ref = scan_sequential(sl.Mobius, elems, dim=1, reverse=True, initial=initial)
    for o, r in zip(out, ref):
        assert_close(o, r, "scan")
    w = torch.randn(shape, dtype=torch.float64, device=DEVICE)
    got = torch.autograd.grad((out.b * w).sum() + out.c.sum(), elems + initial)
    want = torch.autograd.grad((ref[1] * w).sum() + ref[2].sum(), elems + initial)
    for g, r in zip(got, want):
        assert_close(g, r, "scan_grad")


def test_lanes_gradcheck_float64(lanes):
    elems = tuple(e.requires_grad_() for e in elems_for(sl.Mobius, (1, 5, 2)))
    initial = tuple(e.requires_grad_() for e in elems_for(sl.Mobius, (1, 2)))

    def f(*xs):
        return tuple(sl.scan(sl.Mobius, xs[:4], dim=1, initial=xs[4:], backend="triton"))
    assert torch.autograd.gradcheck(f, elems + initial, eps=1e-6, atol=1e-8, fast_mode=True)


# mixers on the lanes schedule: lift/readout, the previous prefix, state reduction, packed sequences,
# inputs broadcast over lane axes (the mixer tests, run with the schedule forced)

@pytest.mark.parametrize("T", [1, 11])
@pytest.mark.parametrize("lanes", ["one", "wide"], indirect=True)
def test_lanes_fused_mixer(lanes, T):
    test_mixer.test_fused_mixer_outputs_final_state_and_gradients(T)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("lanes", ["one", "wide"], indirect=True)
def test_lanes_packed_sequences(lanes, reverse):
    test_mixer.test_packed_sequences_restart_at_every_start(reverse)


@pytest.mark.parametrize("lanes", ["one", "wide"], indirect=True)
def test_lanes_broadcast_input_gradients(lanes):
    test_mixer.test_gradients_of_inputs_broadcast_over_several_lane_axes()


@pytest.mark.parametrize("lanes", ["one", "wide"], indirect=True)
def test_lanes_projective_readout_float32(lanes):
    test_mixer.test_mixer_float32_projective_readout()


# (block_l, warps, chunk, unroll) on the Kalman program with L = 2 x 16 x 4 lanes: R = 2 lanes per
# slot with full programs (no lane masks) and register chunks; R = 4 (a group per slot) with a
# partial program and scratch chunks; R = 2 with chunks of 6 steps in blocks of 4 (a partial block
# in every chunk). T = 11: a partial last chunk everywhere.
SEVERAL = [(64, 1, 4, 4), (256, 1, 4, 2), (64, 1, 6, 4)]
# The key/query gradients' DU mode each case must launch (plan._lanes_mode, worked by hand): the
# program sum (5) needs BLOCK_L to divide the 16 x 4 inner lanes; the warp sum (6) needs 32 slots of
# R lanes to divide them too (R = 2 at 64 lanes on one warp; R = 4 at 256: 128 does not divide 64).
EXPECTED_MODE = {("program", 64): 5, ("warp", 64): 6, ("none", 64): 1,
                 ("program", 256): 1, ("warp", 256): 1, ("none", 256): 1}


def _launched_backward_modes(monkeypatch) -> list:
    """Spy on the launches: the DU* modes of every scan_backward_lanes launch, appended as they run."""
    from scanlang.backends.triton import launcher
    real_wrap, real_launch, modes = ops.wrap_triton, launcher.launch, []

    def record(kernel, meta):
        if kernel.__name__ == "scan_backward_lanes":
            modes.append({k: v for k, v in meta.items() if k.startswith("DU")})

    class SpyWrap:   # wrap_triton(kernel)[grid](*args, **meta), under tracing
        def __init__(self, kernel):
            self.kernel, self.wrapped = kernel, real_wrap(kernel)

        def __getitem__(self, grid):
            return lambda *args, **meta: record(self.kernel, meta) or self.wrapped[grid](*args, **meta)

    def spy_launch(plan, cfg, kernel, grid, args, meta):
        record(kernel, meta)
        return real_launch(plan, cfg, kernel, grid, args, meta)
    monkeypatch.setattr(ops, "wrap_triton", SpyWrap)
    monkeypatch.setattr(launcher, "launch", spy_launch)
    return modes


def _force_group_sums(knobs, group_sums: str):
    """Set the summing flags (launch-time knobs: in the plans' keys, so no cached plan is reused
    across settings, and nothing needs clearing)."""
    knobs(sum_groups_before_atomics=group_sums == "program", sum_warp_groups_before_atomics=group_sums == "warp")


def _assert_launched(modes, group_sums, block_l):
    want = EXPECTED_MODE[group_sums, block_l]
    assert modes, "no scan_backward_lanes launch"
    launched = {v for m in modes for v in m.values()}
    assert want in launched, (group_sums, block_l, modes)
    assert not ({5, 6} - {want}) & launched, (group_sums, block_l, modes)


@pytest.mark.parametrize("block_l,warps,chunk,unroll", SEVERAL)
@pytest.mark.parametrize("group_sums", ["program", "warp", "none"])
def test_lanes_several_per_thread_kalman(monkeypatch, knobs, block_l, warps, chunk, unroll, group_sums):
    """Several lanes per thread slot (the layout the Kalman benchmark runs): outputs, final state and
    every gradient against float64 autograd of the loop; key gradients summed over the program's
    groups (plan mode 5), over each warp's groups (mode 6, where a warp's lanes share the batch
    index) or per lane (mode 1) before the atomic add. Each case checks that it launched its mode."""
    from scanlang.recipes.kalman import kalman_filter
    from scanlang.recipes.kalman.reference import kalman_filter_loop
    from test_kalman import NAMES, _loss_and_grads, make_inputs, make_state
    cfg = runtime.Config(block_t=chunk, block_l=block_l, num_warps=warps, chunk=chunk, schedule="lanes", unroll=unroll)
    assert runtime.lanes_per_thread(cfg, 4) == min(4, block_l // (32 * warps)) > 1
    _force_group_sums(knobs, group_sums)
    modes = _launched_backward_modes(monkeypatch)
    knobs(forced=_forced("lanes", "lanes", cfg))
    ins = make_inputs(2, 11, 16, 4)
    state = make_state(2, 16, 4)
    dev = {n: x.to(DEVICE) for n, x in ins.items()}
    dev_state = tuple(s.to(DEVICE) for s in state)
    got = _loss_and_grads(kalman_filter, dev, dev_state, seed=3, output_final_state=True, backend="triton",
                          form="fused")
    _assert_launched(modes, group_sums, block_l)
    ref = _loss_and_grads(kalman_filter_loop, {n: x.to(torch.float64) for n, x in ins.items()},
                          tuple(s.to(torch.float64) for s in state), seed=3)
    for name, g, r in zip(NAMES, got, ref):
        assert_close(g, r, "kalman_grad", torch.float32, name=f"d{name}")
    y, y_var, (lam, eta) = kalman_filter(**dev, initial_state=dev_state, output_final_state=True,
                                         backend="triton", form="fused")
    ref_y, ref_var, (ref_lam, ref_eta) = kalman_filter_loop(**{n: x.to(torch.float64) for n, x in ins.items()},
                                                            initial_state=tuple(s.to(torch.float64) for s in state))
    for name, out, want in (("y", y, ref_y), ("y_var", y_var, ref_var), ("lam", lam, ref_lam), ("eta", eta, ref_eta)):
        assert_close(out, want, "kalman_out", torch.float32, name=name)


def test_each_group_sum_case_launches_its_mode_in_sequence(monkeypatch, knobs):
    """The guard for the test above in suite order: the three flag settings one after another in one
    process (plans cached in between, as the suite leaves them) each launch their own DU mode."""
    from scanlang.recipes.kalman import kalman_filter
    from test_kalman import make_inputs, make_state
    cfg = runtime.Config(block_t=4, block_l=64, num_warps=1, chunk=4, schedule="lanes", unroll=4)
    knobs(forced=_forced("lanes", "lanes", cfg))
    ins = {n: x.to(DEVICE).requires_grad_() for n, x in make_inputs(1, 5, 16, 4).items()}
    state = tuple(s.to(DEVICE) for s in make_state(1, 16, 4))
    for group_sums in ("program", "warp", "none", "program"):
        _force_group_sums(knobs, group_sums)
        modes = _launched_backward_modes(monkeypatch)
        y, y_var, _ = kalman_filter(**ins, initial_state=state, backend="triton", form="fused")
        (y.sum() + y_var.sum()).backward()
        _assert_launched(modes, group_sums, 64)


# ---- fitting configs to the device ------------------------------------------------------------

def test_fit_launch_shrinks_and_remembers():
    tried = []

    def attempt(cfg):
        tried.append(cfg)
        if cfg.block_t * cfg.block_l > 256:
            raise OutOfResources(cfg.block_t * cfg.block_l * 4, 1024, "shared memory")
        return "ran"
    remembered = {}
    big = runtime.Config(block_t=64, block_l=32, num_warps=4)
    assert runtime.fit_launch("k", big, attempt, runtime.smaller_config, remembered) == "ran"
    assert [c.block_t for c in tried] == [64, 32, 16, 8]
    assert remembered["k"] == runtime.Config(block_t=8, block_l=32, num_warps=4)
    tried.clear()
    runtime.fit_launch("k", big, attempt, runtime.smaller_config, remembered)
    assert tried == [remembered["k"]]                 # the fitted config is tried first next time
    kept = runtime.Config(block_t=64, block_l=32, num_warps=4)
    tried.clear()
    runtime.fit_launch("b", kept, attempt, lambda c: runtime.smaller_config(c, keep_block_t=True), remembered)
    assert [(c.block_t, c.block_l) for c in tried] == [(64, 32), (64, 16), (64, 8), (64, 4)]


def test_fit_launch_reraises_when_nothing_smaller_fits():
    def attempt(cfg):
        raise OutOfResources(1 << 20, 1024, "shared memory")
    with pytest.raises(OutOfResources):
        runtime.fit_launch("x", runtime.Config(block_t=2, block_l=1, num_warps=2), attempt, runtime.smaller_config, {})


def test_scan_shrinks_a_tile_that_does_not_fit(monkeypatch):
    """A fake launcher raises OutOfResources for tiles over 2 x 4: the forward shrinks its tile (and
    with it the checkpoint interval), the backward finds the same interval, results stay exact."""
    real = ops.wrap_triton
    launched = []

    class FakeLauncher:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **meta):
                if meta.get("BLOCK_T", 1) * meta["BLOCK_L"] > 8:
                    raise OutOfResources(meta["BLOCK_T"] * meta["BLOCK_L"] * 1024, 8 * 1024, "shared memory")
                launched.append((self.kernel.__name__, meta.get("BLOCK_T"), meta["BLOCK_L"], meta["CHUNK"]))
                return real(self.kernel)[grid](*args, **meta)
            return launch
    from scanlang.backends.triton import launcher
    monkeypatch.setattr(ops, "wrap_triton", FakeLauncher)
    # eager calls launch through launcher.launch, not wrap_triton
    monkeypatch.setattr(launcher, "launch", lambda plan, cfg, kernel, grid, args, meta: FakeLauncher(kernel)[grid](*args, **meta))
    monkeypatch.setattr(runtime, "FITTED", {})
    shape = (2, 13, 3)
    elems = tuple(e.requires_grad_() for e in elems_for(sl.Affine, shape))
    out = sl.scan(sl.Affine, elems, dim=1, backend="triton")
    ref = scan_sequential(sl.Affine, elems, dim=1)
    assert_close(out.b, ref[1], "scan")
    w = torch.randn(shape, dtype=torch.float64, device=DEVICE)
    for g, r in zip(torch.autograd.grad((out.b * w).sum(), elems), torch.autograd.grad((ref[1] * w).sum(), elems)):
        assert_close(g, r, "scan_grad")
    assert launched and all(bt * bl <= 8 for _, bt, bl, _ in launched)
    fwd = [x for x in launched if x[0] == "scan_forward"]
    bwd = [x for x in launched if x[0] == "scan_backward"]
    assert fwd and bwd and bwd[0][3] == fwd[-1][3]    # the backward's tile = the forward's interval
    assert len(runtime.FITTED) == 2                   # remembered per (program, pass, shape bucket)


def test_delta_launch_shrinks_through_the_shared_helper(monkeypatch):
    """backends/delta launches through runtime.fit_launch: fewer stages, then half the value block."""
    from scanlang.backends.delta import ops as delta_ops
    seen = []

    def fake_wrap(kernel):
        class Launcher:
            def __getitem__(self, grid):
                def run(*args, **opts):
                    seen.append((grid, opts["num_stages"]))
                    if opts["BV"] > 32:
                        raise OutOfResources(opts["BV"] * 1024, 32 * 1024, "shared memory")
                return run
        return Launcher()
    monkeypatch.setattr(delta_ops, "wrap_triton", fake_wrap)
    configs = {"probe": dict(BV=128, num_warps=4, num_stages=2)}   # a plan's configs
    delta_ops._launch("probe", None, lambda cfg: (cfg["BV"],), (), {}, V=128, configs=configs)
    assert seen == [((128,), 2), ((128,), 1), ((64,), 1), ((32,), 1)]
    assert configs["probe"] == dict(BV=32, num_warps=4, num_stages=1)   # remembered in the plan's configs


def test_gradient_modes_for_inputs_shared_by_state_groups(knobs):
    """Keys shared by the channels of a reducing mixer (broadcast only over the lane dim above the
    state): summed over a program's groups, then one relaxed atomic per state index (mode 5, when
    tuning.sum_groups_before_atomics), only on the lane-sequential schedule and when programs do not
    straddle an outer lane index."""
    from scanlang.backends.triton import plan
    knobs(sum_groups_before_atomics=True)
    sizes = (2, 3, 8, 4)   # lane dims (b, h, g, s); s is the state
    assert plan._du_mode([5, 96, 4, 0, 1], sizes, True, 7) == 5     # k[b, t, h, s]
    assert plan._du_mode([5, 96, 8, 1, 0], sizes, True, 7) == 3     # v[b, t, h, g]: summed over s
    assert plan._du_mode([5, 96, 4, 0, 1], sizes, False, 7) == 1    # no state reduction: per-lane atomics
    lanes = runtime.Config(block_t=4, block_l=16, num_warps=1, chunk=4, schedule="lanes", unroll=4)
    assert plan._lanes_mode(5, sizes, lanes) == 5
    assert plan._lanes_mode(5, sizes, runtime.Config(block_t=4, block_l=16, num_warps=1)) == 1   # tiles
    assert plan._lanes_mode(5, (2, 3, 3, 4), lanes) == 1            # 16 does not divide 3 x 4 lanes
    assert plan._lanes_mode(3, sizes, runtime.Config(block_t=4, block_l=16, num_warps=1)) == 3
    knobs(sum_groups_before_atomics=False)
    assert plan._lanes_mode(5, sizes, lanes) == 1                    # 16 slots: less than a warp
    wide = runtime.Config(block_t=4, block_l=64, num_warps=1, chunk=4, schedule="lanes", unroll=4)   # R = 2
    assert plan._lanes_mode(5, (2, 3, 16, 4), wide, 4) == 6          # summed over each warp's groups
    assert plan._lanes_mode(5, sizes, wide, 4) == 1                  # a warp's 64 lanes straddle 8 x 4
    knobs(sum_warp_groups_before_atomics=False)
    assert plan._lanes_mode(5, (2, 3, 16, 4), wide, 4) == 1          # per-lane atomics
