"""Run-based tile kernels (backends/triton/kernel/runs.py: tiles of at least tuning.run_tile steps,
each thread scanning runs of tuning.run consecutive steps) against float64 sequential loops.

The tile configs are forced through `scanlang.tuning` (forced configs): 128-step tiles on 2 lanes (the smallest
tile that takes the run bodies), checkpoints every 64, 128 or 4 steps (multiples of the run, and one
that ends inside runs). Lengths 1, 13 (one partial run), 128 (one whole tile) and 203 (two tiles,
the last one ending inside a run) cover partial runs, partial tiles and the carry between tiles;
256 steps on 3 lanes (full tiles, EVEN_T, a partial lane block) the mask-free loads and stores. The
float32 path by the hardware reciprocal (RCP_APPROX) runs on a GPU; here its instruction is emulated.
"""
import ast

import pytest
import test_triton_scan
import torch
from scanlang.backends.reference import scan_sequential
from scanlang.backends.triton import plan, runtime
from test_triton_scan import DEVICE, LIBRARY, check_with_initial, elems_for

import scanlang as sl
from scanlang import library, tuning
from scanlang.testing import assert_close

TILE = tuning.DEFAULT.run_tile
hardware_reciprocal = test_triton_scan.hardware_reciprocal   # the fixture (float32 RCP_APPROX path emulated)


def _forced(chunk: int, block_l: int = 2, block_t: int = TILE) -> dict:
    """Forced configs: a forward on `block_t`-step tiles checkpointing every `chunk` steps, the backward on chunks."""
    out = {}
    for contiguous in (False, True):
        out[(contiguous, False)] = runtime.Config(block_t=block_t, block_l=block_l, num_warps=1, chunk=chunk)
        out[(contiguous, True)] = runtime.Config(block_t=chunk, block_l=block_l, num_warps=1, chunk=chunk)
    return out


@pytest.fixture
def runs(knobs):
    """Force 128-step forward tiles checkpointing every 64 steps; runs(chunk) forces another interval."""
    knobs(forced=_forced(64))
    return lambda chunk: knobs(forced=_forced(chunk))


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


# Which monoids each checkpoint config runs: every monoid in one time-contiguous and one channels
# config, one forward and one reverse scan (all with an initial element); Möbius (projective, the
# renormalised adjoint) in all four. Every monoid's own kernels also run under every config of the
# forward test above and in test_triton_scan's gradient test; here the configs are what varies.
_FIRST_PAIR = (library.Affine, library.Matrix2, library.MinPlus, library.LogAffine, library.OnlineSoftmax,
               library.Add, library.Mobius)
_SECOND_PAIR = (library.MaxPlus, library.ComplexMul, library.LogSumExp, library.Welford, library.Max, library.Mobius)
_GRADIENT_CASES = [pytest.param(layout, reverse, chunk, m, id=f"{layout}-{reverse}-{chunk}-{m.name}")
                   for (layout, reverse, chunk), monoids in ((("time", False, 64), _FIRST_PAIR),
                                                             (("channels", True, 4), _FIRST_PAIR),
                                                             (("time", True, 128), _SECOND_PAIR),
                                                             (("channels", False, 128), _SECOND_PAIR))
                   for m in monoids]
assert {m.name for m in _FIRST_PAIR + _SECOND_PAIR} == {m.name for m in LIBRARY}


@pytest.mark.parametrize("layout,reverse,chunk,monoid", _GRADIENT_CASES)
def test_runs_gradients_with_initial(runs, monoid, layout, reverse, chunk):
    """Checkpoints every 64 steps (time-contiguous), every 4 steps (channels, reverse: the old backward's
    4-step tiles), every 128 steps reversed (time) and on strided time (channels: the run-based backward
    the training default takes there), each with an initial element (cases: _GRADIENT_CASES)."""
    runs(chunk)
    T = 203 if chunk > 4 else 37   # 4-step checkpoints: the old backward's 4-step tiles are slow to interpret
    shape, dim = ((2, 3, T), 2) if layout == "time" else ((2, T, 3), 1)
    check_with_initial(monoid, shape, dim, reverse)


@pytest.mark.parametrize("monoid", [library.Affine, library.Mobius], ids=lambda m: m.name)
@pytest.mark.parametrize("block_t,chunk,T,reverse", [(4, 16, 37, False), (32, TILE, 203, True), (TILE, 2 * TILE, 300, False)])
def test_checkpoints_every_few_forward_tiles(knobs, monoid, block_t, chunk, T, reverse):
    """Checkpoint intervals longer than the forward's tile (the channels training default: 32-step forward
    tiles, 256-step backward tiles): the short-tile, run-based and run-to-run pairings, channels layout."""
    knobs(forced=_forced(chunk, block_t=block_t))   # chunk a multiple of block_t
    assert plan.chunk_of(tuning.current().forced_config(False, False)) == chunk
    check_with_initial(monoid, (2, T, 3), 1, reverse)


def test_checkpoints_every_few_forward_tiles_packed(knobs):
    """cu_seqlens with 16-step checkpoints over 4-step forward tiles: each sequence's slots start at its own."""
    import test_mixer
    knobs(forced=_forced(16, block_t=4))
    test_mixer.test_packed_sequences_restart_at_every_start(False)


def test_runs_take_the_run_bodies():
    """Both generated kernels switch to the run bodies at tuning.run_tile steps (a constexpr branch)."""
    from scanlang.backends.triton.codegen_module import render

    from scanlang.autodiff import differentiate
    from scanlang.ir import lower
    ir = lower(sl.Affine)
    source = render(ir, differentiate(ir))
    assert source.count(f"if BLOCK_T >= {TILE}:") == 2
    calls = {ast.unparse(node) for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)}
    assert "tl.associative_scan((r7_a, r7_b), 0, combine)" in calls   # the scan over the runs' last steps


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


def _mobius_ratio_mixer():
    from scanlang.mixer import mixer
    return mixer(sl.Mobius, axes="b d t", inputs={f: "b d t" for f in "abcd"}, lift=lambda u: (u.a, u.b, u.c, u.d),
                 readout=lambda p, u, q: ((p.a + p.b) / (p.c + p.d), (p.a + p.b) / (p.c + p.d) - (q.a + q.b) / (q.c + q.d)),
                 outputs=("lam", "dlam"))


def _mobius_ratio_loop(xs, T):
    m = torch.ones(xs["a"].shape[:2], dtype=torch.float64, device=DEVICE)
    s, lams, dlams = [m, 0 * m, 0 * m, m], [], []
    for t in range(T):
        x = [xs[f][..., t] for f in "abcd"]
        prev = (s[0] + s[1]) / (s[2] + s[3])
        s = [x[0] * s[0] + x[1] * s[2], x[0] * s[1] + x[1] * s[3], x[2] * s[0] + x[3] * s[2], x[2] * s[1] + x[3] * s[3]]
        lams.append((s[0] + s[1]) / (s[2] + s[3]))
        dlams.append(lams[-1] - prev)
    return torch.stack(lams, -1), torch.stack(dlams, -1)


@pytest.mark.parametrize("chunk", [64, 4, 128])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_runs_scale_invariant_readout(runs, chunk, dtype):
    """A projective readout invariant to rescaling (Möbius lam = (a + b) / (c + d), and its change
    from the previous prefix): the forward reads unnormalised prefixes, checkpoints and carry are
    rescaled (checkpoints inside runs when chunk = 4)."""
    from scanlang.backends.triton.kernel.runs import scale_invariant_readout
    runs(chunk)
    mix = _mobius_ratio_mixer()
    assert scale_invariant_readout(mix.ir) and "def combine_raw(" in mix.program.source
    T = 203
    xs = {f: (torch.rand(2, 3, T, dtype=torch.float64, device=DEVICE) + 0.5).requires_grad_() for f in "abcd"}
    out = mix(**{f: x.to(dtype) for f, x in xs.items()})
    lam, dlam = _mobius_ratio_loop(xs, T)
    assert out.lam.dtype == dtype
    assert_close(out.lam, lam, "scan", dtype=dtype)
    assert_close(out.dlam, dlam, "scan", dtype=dtype)
    w = torch.randn_like(lam)
    got = torch.autograd.grad((out.lam * w).sum() + out.dlam.sum(), tuple(xs.values()))
    want = torch.autograd.grad((lam * w).sum() + dlam.sum(), tuple(xs.values()))
    for f, g, r in zip("abcd", got, want):
        assert_close(g, r, "scan_grad", dtype=dtype, name=f"d{f}")


def test_scale_invariance_is_detected_only_where_it_holds():
    from scanlang.backends.triton.kernel.runs import scale_invariant_readout

    from scanlang.ir import lower
    ratio = lower(sl.Mobius, inputs=tuple("abcd"), lift=lambda u: (u.a, u.b, u.c, u.d),
                  outputs=("lam",), readout=lambda p, u, q: (p.a + p.b) / (p.c + p.d))
    plain = lower(sl.Mobius)
    mixed = lower(sl.Mobius, inputs=tuple("abcd"), lift=lambda u: (u.a, u.b, u.c, u.d),
                  outputs=("lam",), readout=lambda p, u, q: p.a / (q.c + q.d))
    assert scale_invariant_readout(ratio)
    assert not scale_invariant_readout(plain)
    assert not scale_invariant_readout(mixed)
    assert not scale_invariant_readout(lower(sl.Affine))


@pytest.fixture
def tile_flags(monkeypatch):
    """The tile constexprs (RCP_APPROX, EVEN_T, EVEN_L) of every tile launch, in launch order."""
    seen, original = [], plan._Plan.tile_meta

    def spy(self, cfg):
        seen.append(original(self, cfg))
        return seen[-1]
    plan.PLANS.clear()
    monkeypatch.setattr(plan._Plan, "tile_meta", spy)
    yield seen
    plan.PLANS.clear()


@pytest.mark.parametrize("monoid", LIBRARY, ids=lambda m: m.name)
def test_runs_full_tiles_drop_their_masks(runs, tile_flags, monoid):
    """256 steps in 128-step tiles and checkpoints (every tile full in both passes: EVEN_T) on 3 lanes
    in blocks of 2 (the last block half empty: not EVEN_L), outputs and gradients with an initial element."""
    runs(TILE)
    check_with_initial(monoid, (1, 3, 256), 2, reverse=False)
    assert [(m["EVEN_T"], m["EVEN_L"]) for m in tile_flags] == [(True, False), (True, False)]
    assert not any(m["RCP_APPROX"] for m in tile_flags)   # float64, and the interpreter


@pytest.mark.parametrize("monoid", [library.Affine, library.Mobius], ids=lambda m: m.name)
def test_runs_full_tiles_strided_reverse_and_full_lane_blocks(runs, tile_flags, monoid):
    """Full tiles and full lane blocks (EVEN_T and EVEN_L: no mask at all) with strided time (one load
    per step), reversed."""
    runs(64)
    check_with_initial(monoid, (2, 128, 2), 1, reverse=True)
    assert [(m["EVEN_T"], m["EVEN_L"]) for m in tile_flags] == [(True, True), (True, True)]


def test_tile_flags_follow_the_layout(runs, tile_flags):
    """EVEN_T only where every tile is full: not for 203 steps, nor for packed sequences filling whole
    tiles in all (256 steps in sequences of 100 and 156, each against its own loop)."""
    sl.scan(library.Affine, elems_for(library.Affine, (2, 3, 203)), dim=2, backend="triton")
    mix = _mobius_ratio_mixer()
    xs = {f: torch.rand(1, 3, 256, dtype=torch.float64, device=DEVICE) + 0.5 for f in "abcd"}
    out = mix(**xs, cu_seqlens=torch.tensor([0, 100, 256], device=DEVICE))
    for lo, hi in ((0, 100), (100, 256)):
        lam, _ = _mobius_ratio_loop({f: x[..., lo:hi] for f, x in xs.items()}, hi - lo)
        assert_close(out.lam[..., lo:hi], lam, "scan")
    assert [m["EVEN_T"] for m in tile_flags] == [False, False]


@pytest.mark.parametrize("monoid", [library.Mobius, library.Welford], ids=lambda m: m.name)
@pytest.mark.parametrize("length", [13, 256])
def test_runs_float32_by_the_hardware_reciprocal(runs, hardware_reciprocal, monoid, length):
    """float32 scans whose combine rescales (Möbius) or divides (Welford) on the RCP_APPROX path
    (combine_rcp), outputs and gradients against the float64 loop at the float32 tolerances."""
    runs(TILE)
    elems = tuple(e.requires_grad_() for e in elems_for(monoid, (2, 3, length)))
    out = sl.scan(monoid, tuple(e.float() for e in elems), dim=2, backend="triton")
    ref = scan_sequential(monoid, elems, dim=2)
    for f, o, r in zip(monoid.fields, out, ref):
        assert o.dtype == torch.float32
        assert_close(o, r, "scan", dtype=torch.float32, name=f"{monoid.name}.{f}")
    weights = [torch.randn_like(r) for r in ref]
    got = torch.autograd.grad(sum((o.double() * w).sum() for o, w in zip(out, weights)), elems)
    want = torch.autograd.grad(sum((r * w).sum() for r, w in zip(ref, weights)), elems)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, "scan_grad", dtype=torch.float32, name=f"{monoid.name} grad {i}")
    assert hardware_reciprocal, "the hardware-reciprocal path did not run"


@pytest.mark.parametrize("length", [1, 203, 256])
def test_runs_scale_invariant_readout_by_the_hardware_reciprocal(runs, hardware_reciprocal, length):
    """The Möbius ratio readout in float32 on the RCP_APPROX path: rescales by `normalise(.., HW)`, the
    readout (a + b) / (c + d) as a product with the reciprocal, checkpoints inside runs (chunk 4)."""
    runs(4 if length == 203 else TILE)
    mix = _mobius_ratio_mixer()
    xs = {f: (torch.rand(2, 3, length, dtype=torch.float64, device=DEVICE) + 0.5).requires_grad_() for f in "abcd"}
    out = mix(**{f: x.float() for f, x in xs.items()})
    lam, dlam = _mobius_ratio_loop(xs, length)
    assert_close(out.lam, lam, "scan", dtype=torch.float32)
    assert_close(out.dlam, dlam, "scan", dtype=torch.float32)
    w = torch.randn_like(lam)
    got = torch.autograd.grad((out.lam.double() * w).sum() + out.dlam.double().sum(), tuple(xs.values()))
    want = torch.autograd.grad((lam * w).sum() + dlam.sum(), tuple(xs.values()))
    for f, g, r in zip("abcd", got, want):
        assert_close(g, r, "scan_grad", dtype=torch.float32, name=f"d{f}")
    assert hardware_reciprocal, "the hardware-reciprocal path did not run"


def test_channels_training_takes_run_tiles_inference_the_short_tile(monkeypatch):
    """Channels contiguous on a GPU: the forward keeps the 32-step tile (fastest), checkpointing every 256 steps
    when it serves a backward, whose tile that is (run-based, kernel/runs.py)."""
    monkeypatch.setattr(runtime.settings, "triton_interpret", lambda: False)
    T, L = 4096, 8 * 1536
    inference = runtime.choose_config(T, L, False, 1)
    forward = runtime.choose_config(T, L, False, 1, checkpoint=True)
    backward = runtime.choose_config(T, L, False, 1, backward=True)
    assert inference.block_t < TILE and plan.chunk_of(inference, checkpoint=False) == inference.block_t
    assert forward.block_t == inference.block_t and plan.chunk_of(forward) == backward.block_t >= TILE
    short = runtime.choose_config(5, L, False, 1, checkpoint=True)   # short sequences: short tiles and chunks
    assert plan.chunk_of(short) == runtime.choose_config(5, L, False, 1, backward=True).block_t == 8
