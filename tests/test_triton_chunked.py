"""The chunk-parallel schedule (backends/triton/kernel/chunked.py, three kernels per pass, and its
one-pass variant kernel/chunked_lookback.py) against float64 loops written here.

The schedule is forced through tuning.override(forced=...) with small chunks (interpreter on CPU, GPU
otherwise): chunks of 8 steps at T = 1, 7 (chunk - 1), 9 (chunk + 1); chunks of 4 at T = 37 (ten
chunks, so the carry kernels walk three tiles of 4 aggregates with a partial one); chunks of 64 at
T = 5000 (79 chunks, the last partial; one lane). Lanes: [1, 3, T] with time contiguous (the few-lanes shape
the schedule is for) and [2, T, 3] with channels contiguous. Every output field, and the gradients
of every element and initial field under random output weights, are checked; the kernel launch
counter shows the chunked kernels (and only they) ran. Every test with a forced config runs both
variants.
"""
import os

import pytest
import torch

import scanlang as sl
from scanlang import tuning
from scanlang.backends.triton import chunked_launch, plan, runtime
from scanlang.testing import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ---- the float64 loops: y_t = y_{t-1} (+) x_t, y_{-1} = initial (raw) or the identity -------------

def affine_step(h, x):
    """(a, b) after (a', b'): the map h -> a h + b applied after the carry."""
    return (x[0] * h[0], x[0] * h[1] + x[1])


def mobius_step(h, x):
    """2x2 matrices [[a, b], [c, d]], the later one on the left, renormalised by a + d."""
    a = x[0] * h[0] + x[1] * h[2]
    b = x[0] * h[1] + x[1] * h[3]
    c = x[2] * h[0] + x[3] * h[2]
    d = x[2] * h[1] + x[3] * h[3]
    s = a + d
    return (a / s, b / s, c / s, d / s)


STEPS = {"Affine": affine_step, "Mobius": mobius_step}
IDENTITY = {"Affine": (1.0, 0.0), "Mobius": (1.0, 0.0, 0.0, 1.0)}


def loop(name, elems, dim, reverse=False, initial=None):
    """The inclusive scan along `dim` one step at a time (differentiable: torch autograd gives the
    reference gradients)."""
    shape = torch.broadcast_shapes(*(e.shape for e in elems))
    xs = [e.expand(shape).movedim(dim, 0) for e in elems]
    T = shape[dim]
    lane_shape = xs[0].shape[1:]
    if initial is None:
        h = tuple(torch.full(lane_shape, v, dtype=torch.float64, device=xs[0].device) for v in IDENTITY[name])
    else:
        h = tuple(i.to(torch.float64).expand(lane_shape) for i in initial)
    out = [[None] * T for _ in elems]
    for k in range(T):
        t = T - 1 - k if reverse else k
        h = STEPS[name](h, [x[t].to(torch.float64) for x in xs])
        for f in range(len(elems)):
            out[f][t] = h[f]
    return [torch.stack(o, 0).movedim(0, dim) for o in out]


# ---- inputs ----------------------------------------------------------------------------------------

def nonzero(*shape, positive=False):
    x = torch.rand(*shape, dtype=torch.float64) + 0.5
    if not positive:
        x = x * torch.where(torch.rand(*shape) < 0.3, -1.0, 1.0).double()
    return x.to(DEVICE)


def case(kind, shape, dim):
    """(monoid, elements, initial) in float64: Affine with mixed signs (|a| < 1), Möbius with positive
    entries, Affine with a broadcast parameter: a static decay per channel (shape [C] viewed in the
    scan's shape, time stride 0) next to a full input, and Affine with a gate shared by the lanes."""
    lane_shape = shape[:dim] + shape[dim + 1:]
    if kind == "Mobius":
        return sl.Mobius, tuple(nonzero(*shape, positive=True) for _ in range(4)), tuple(
            nonzero(*lane_shape, positive=True) for _ in range(4))
    initial = (nonzero(*lane_shape) * 0.9, nonzero(*lane_shape))
    if kind == "Affine":
        return sl.Affine, (nonzero(*shape) * 0.9, nonzero(*shape)), initial
    if kind == "shared":   # a gate shared by every lane, varying in time: its gradient is added atomically
        view = [1] * len(shape)
        view[dim] = shape[dim]
        return sl.Affine, (nonzero(*view) * 0.9, nonzero(*shape)), initial
    view = [1] * len(shape)
    channel = 1 if dim == 2 else len(shape) - 1       # [1, C, T] or [B, T, C]
    view[channel] = shape[channel]
    decay = (torch.rand(shape[channel], dtype=torch.float64) * 0.8 + 0.1).to(DEVICE).reshape(view)
    return sl.Affine, (decay, nonzero(*shape)), initial


@pytest.fixture(params=[False, True], ids=["three-pass", "one-pass"])
def variant(request, knobs):
    """Both variants of the schedule: three kernels per pass (kernel/chunked.py), one with a look-back
    (kernel/chunked_lookback.py); the knob is in the plans' key."""
    knobs(chunk_single_pass=request.param)
    return request.param


@pytest.fixture
def chunked(request, knobs, variant):
    """Force the chunk-parallel schedule with chunks of `request.param` steps, both passes, both layouts
    (the forced configs are in the plans' key: no cache to clear), in each variant."""
    cfg = runtime.Config(block_t=request.param, block_l=4, num_warps=1, schedule="chunked")
    knobs(forced={(c, b): cfg for c in (False, True) for b in (False, True)})
    return cfg


def check(kind, shape, dim, reverse, with_initial, dtype=torch.float64):
    """Outputs and every gradient (elements and initial) against the loop; the chunked kernels ran."""
    monoid, elems, initial = case(kind, shape, dim)
    elems = tuple(e.to(dtype).requires_grad_() for e in elems)
    initial = tuple(i.to(dtype).requires_grad_() for i in initial) if with_initial else None
    before = dict(chunked_launch.LAUNCHED)
    out = sl.scan(monoid, elems, dim=dim, reverse=reverse, initial=initial, backend="triton")
    ref = loop(monoid.name, elems, dim, reverse, initial)
    for f, o, r in zip(monoid.fields, out, ref):
        assert o.shape == r.shape
        assert_close(o, r, "scan", dtype=dtype, name=f"{kind}.{f}")
    weights = [torch.randn(r.shape, dtype=torch.float64, device=DEVICE) for r in ref]
    leaves = elems + (initial or ())
    got = torch.autograd.grad(sum((o * w).sum() for o, w in zip(out, weights)), leaves)
    want = torch.autograd.grad(sum((r * w).sum() for r, w in zip(ref, weights)), leaves)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == leaves[i].shape
        assert_close(g, w, "scan_grad", dtype=dtype, name=f"{kind} grad {i}")
    ran = {k: v - before.get(k, 0) for k, v in chunked_launch.LAUNCHED.items()}
    # the layout the plan saw (T = 1 is not "time contiguous") decides the variants under "auto"
    variants = {chunked_launch.kernel_names(len(monoid.fields), c) for c in (True, False)}
    assert any(all(ran.get(k, 0) == 1 for k in names) for names in variants), ran


SHORT = [(8, 1), (8, 7), (8, 9), (4, 37)]


@pytest.mark.parametrize("chunked,T", SHORT, indirect=["chunked"], ids=lambda v: str(v))
@pytest.mark.parametrize("kind", ["Affine", "Mobius", "broadcast"])
@pytest.mark.parametrize("reverse,with_initial", [(False, False), (True, True)], ids=["forward", "reverse-initial"])
def test_float64_time_contiguous(chunked, T, kind, reverse, with_initial):
    check(kind, (1, 3, T), 2, reverse, with_initial)


@pytest.mark.parametrize("chunked", [4], indirect=True)
@pytest.mark.parametrize("kind", ["Affine", "Mobius", "broadcast", "shared"])
@pytest.mark.parametrize("reverse,with_initial", [(True, False), (False, True)], ids=["reverse", "initial"])
def test_float64_reverse_or_initial(chunked, kind, reverse, with_initial):
    check(kind, (1, 3, 37), 2, reverse, with_initial)


@pytest.mark.parametrize("chunked", [4], indirect=True)
@pytest.mark.parametrize("kind", ["Affine", "Mobius", "broadcast"])
def test_float32_reverse_with_initial(chunked, kind):
    check(kind, (1, 3, 37), 2, True, True, dtype=torch.float32)


@pytest.mark.parametrize("chunked", [4], indirect=True)
@pytest.mark.parametrize("kind", ["Affine", "broadcast"])
def test_channels_contiguous(chunked, kind):
    check(kind, (2, 37, 3), 1, False, True)


@pytest.mark.parametrize("chunked", [4], indirect=True)
@pytest.mark.parametrize("loss", ["b only", "sum", "a weighted, b summed"])
def test_gradients_constant_in_time(chunked, loss):
    """Upstream gradients with time stride 0 (the kernels load them once per lane, GSTATIC): an output
    the loss does not use (its gradient arrives as an expanded zero) and a plain sum (expanded ones),
    next to a full gradient; every input and initial gradient against the loop's."""
    monoid, elems, initial = case("Affine", (1, 3, 37), 2)
    elems = tuple(e.requires_grad_() for e in elems)
    initial = tuple(i.requires_grad_() for i in initial)
    out = sl.scan(monoid, elems, dim=2, reverse=True, initial=initial, backend="triton")
    ref = loop(monoid.name, elems, 2, True, initial)
    w = torch.randn(ref[0].shape, dtype=torch.float64, device=DEVICE)
    losses = {"b only": lambda o: (o[1] * w).sum(), "sum": lambda o: o[0].sum() + o[1].sum(),
              "a weighted, b summed": lambda o: (o[0] * w).sum() + o[1].sum()}
    got = torch.autograd.grad(losses[loss](out), elems + initial)
    want = torch.autograd.grad(losses[loss](ref), elems + initial, allow_unused=True)   # b never reads a's initial
    for i, (g, r) in enumerate(zip(got, want)):
        r = torch.zeros_like(g) if r is None else r
        assert_close(g, r, "scan_grad", dtype=torch.float64, name=f"{loss}: grad {i}")


@pytest.mark.parametrize("single_pass", ["none", "auto", "both"])
@pytest.mark.parametrize("T", [1, 7, 37])
@pytest.mark.parametrize("kind,reverse,with_initial", [("Affine", False, False), ("Affine", True, True),
                                                       ("Mobius", True, True)], ids=["Affine", "Affine-reverse-initial",
                                                                                     "Mobius-reverse-initial"])
def test_forward_chunks_longer_than_the_checkpoint_interval(single_pass, T, kind, reverse, with_initial, knobs):
    """A forward of 16-step chunks checkpointing every 4 steps (the default shape of the one-pass
    forward: chunks of 4096, checkpoints every 1024) serves a backward of 4-step chunks, in every
    combination of the variants: each chunk stores the checkpoints inside it, the carry out of it
    lands at its next chunk's slot (the last slot for the last chunk), and the outputs and gradients
    equal the loop's (T = 37: three chunks, the last partial; T = 7: one partial chunk)."""
    fwd = runtime.Config(block_t=16, block_l=4, num_warps=1, chunk=4, schedule="chunked")
    bwd = runtime.Config(block_t=16, block_l=4, num_warps=1, schedule="chunked")   # block_t: the forward's interval
    knobs(chunk_single_pass=single_pass, forced={(c, b): bwd if b else fwd for c in (False, True) for b in (False, True)})
    assert plan.chunk_of(fwd) == 4
    check(kind, (1, 3, T), 2, reverse, with_initial)


@pytest.mark.parametrize("single_pass", ["none", "auto"])
def test_a_forward_without_a_backward_stores_no_checkpoints_inside_its_chunks(single_pass, knobs, monkeypatch):
    """Without a gradient to serve, the 16-step forward chunks checkpoint only their carries (CHUNK =
    BLOCK_T: the cheapest forward), and the outputs still equal the loop's."""
    fwd = runtime.Config(block_t=16, block_l=4, num_warps=1, chunk=4, schedule="chunked")
    knobs(chunk_single_pass=single_pass, forced={(c, False): fwd for c in (False, True)})
    assert plan.chunk_of(fwd, checkpoint=False) == 16 and plan.chunk_of(fwd) == 4
    metas = []
    run = chunked_launch._run
    monkeypatch.setattr(chunked_launch, "_run", lambda *a: (metas.append(a[5]), run(*a))[1])
    monoid, elems, initial = case("Affine", (1, 3, 37), 2)
    out = sl.scan(monoid, elems, dim=2, initial=initial, backend="triton")
    for f, o, r in zip(monoid.fields, out, loop(monoid.name, elems, 2, False, initial)):
        assert_close(o, r, "scan", dtype=torch.float64, name=f)
    assert metas and [m["CHUNK"] for m in metas] == [16] * len(metas)   # every launch is the forward's


# T = 5000 costs minutes in the interpreter (its scans step through every row), so these run in the
# slow tier: Affine at T = 5000; Möbius (a 12-value adjoint scan) at T = 1100 (17 chunks of 64, the
# last partial), and at T = 5000 only with SCANLANG_SLOW_TESTS=1 (over 17 minutes on a loaded 2-core machine).
MOBIUS_5000 = pytest.mark.skipif(os.environ.get("SCANLANG_SLOW_TESTS") != "1",
                                 reason="Möbius at T = 5000 interprets for over 15 minutes; SCANLANG_SLOW_TESTS=1 runs it")


@pytest.mark.slow
@pytest.mark.parametrize("chunked", [64], indirect=True)
@pytest.mark.parametrize("kind,dtype,T", [("Affine", torch.float32, 5000), ("Mobius", torch.float64, 1100),
                                          pytest.param("Mobius", torch.float64, 5000, marks=MOBIUS_5000)])
def test_long_sequence(chunked, kind, dtype, T):
    check(kind, (1, 1, T), 2, True, True, dtype=dtype)


# ---- the pick ----------------------------------------------------------------------------------------

def test_choose_config_picks_chunked_for_few_lanes_and_long_time(monkeypatch, knobs):
    """[1, 16, 2^20] with time contiguous: the chunk-parallel schedule on the GPU branch (one lane per
    program; a one-pass forward takes 4096-step chunks checkpointing every 1024, a three-kernel one 1024;
    the backward takes the checkpoint interval, 2 warps in three kernels, 8 in one pass), not for many
    lanes, short sequences or programs without it."""
    monkeypatch.setattr(runtime.settings, "triton_interpret", lambda: False)
    for single, fwd_chunk, bwd_warps in (("both", 4096, 8), ("forward", 4096, 2), ("auto", 4096, 2), ("none", 1024, 2)):
        knobs(chunk_single_pass=single)
        fwd = runtime.choose_config(1 << 20, 16, True, 1, backward=False, checkpoint=True, chunkable=True)
        bwd = runtime.choose_config(1 << 20, 16, True, 1, backward=True, checkpoint=True, chunkable=True)
        assert (fwd.schedule, fwd.block_t, fwd.block_l, fwd.num_warps) == ("chunked", fwd_chunk, 1, 4)
        assert plan.chunk_of(fwd) == 1024
        assert (bwd.schedule, bwd.block_t, bwd.block_l, bwd.num_warps) == ("chunked", 1024, 1, bwd_warps)
    # a monoid of more fields keeps 4 rows a thread in the three-kernel backward (its registers grow with them)
    knobs(chunk_single_pass=False)
    mobius = runtime.choose_config(1 << 20, 16, True, 1, backward=True, checkpoint=True, chunkable=True, fields=4)
    assert (mobius.block_t, mobius.num_warps) == (1024, 8)
    knobs(chunk_single_pass="forward")   # and 16 rows a thread in the one-pass forward (4 warps spilled)
    mobius = runtime.choose_config(1 << 20, 16, True, 1, backward=False, checkpoint=True, chunkable=True, fields=4)
    assert (mobius.block_t, mobius.chunk, mobius.num_warps) == (4096, 1024, 8)
    knobs(chunk_single_pass="auto")      # by default Möbius's forward runs the three kernels (faster on the H100)
    mobius = runtime.choose_config(1 << 20, 16, True, 1, backward=False, checkpoint=True, chunkable=True, fields=4)
    assert (mobius.block_t, mobius.chunk, mobius.num_warps) == (1024, 1024, 4)
    assert chunked_launch.kernel_names(4) == chunked_launch.chunked.KERNELS
    assert chunked_launch.kernel_names(2) == ("chunk_scan",) + chunked_launch.chunked.KERNELS[3:]
    assert chunked_launch.kernel_names(2, time_contiguous=False) == chunked_launch.chunked.KERNELS   # not timed there
    assert runtime.choose_config(1 << 20, 16, False, 1, chunkable=True, fields=4).block_t == 64
    assert runtime.choose_config(1 << 20, 16, False, 1, chunkable=True).schedule == "chunked"
    assert runtime.choose_config(1 << 20, 16, True, 1, chunkable=False).schedule == "tile"
    assert runtime.choose_config(4096, 16, True, 1, chunkable=True).schedule == "tile"           # short T
    assert runtime.choose_config(1536 * 8 * 4, 12288, True, 1, chunkable=True).schedule == "tile"  # many lanes


@pytest.fixture
def deterministic():
    """torch.use_deterministic_algorithms(True) for the test, restored after."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def test_deterministic_algorithms_run_the_three_kernels(knobs, deterministic):
    """The one-pass variant's carries depend on how far each look-back reached: under
    torch.use_deterministic_algorithms the three kernels per pass run even with the knob on."""
    cfg = runtime.Config(block_t=8, block_l=4, num_warps=1, schedule="chunked")
    knobs(forced={(c, b): cfg for c in (False, True) for b in (False, True)}, chunk_single_pass=True)
    assert tuning.current().chunk_single_pass == "both"
    assert not (chunked_launch.single_pass(False, 2) or chunked_launch.single_pass(True, 2))
    assert chunked_launch.kernel_names() == chunked_launch.chunked.KERNELS
    check("Affine", (1, 3, 37), 2, False, True)
    torch.use_deterministic_algorithms(False)
    assert chunked_launch.single_pass(False, 2) and chunked_launch.single_pass(True, 2)
    assert chunked_launch.kernel_names() == chunked_launch.chunked_lookback.KERNELS


def test_plan_picks_chunked_for_a_plain_scan_not_for_packed_sequences():
    """The plan asks for the chunk-parallel schedule where the program and call allow it."""
    from scanlang import pipeline
    prog = pipeline.program(sl.Affine)
    x = torch.empty(1, 16, 1 << 14, device="meta")
    p = plan.ForwardPlan(prog, [x, x], [], 1, False, 2, False, False, True)
    assert p.fwd_chosen.schedule == "chunked"
    packed = plan.ForwardPlan(prog, [x, x], [], 1, True, 2, False, False, True)
    assert packed.fwd_chosen.schedule != "chunked"
    assert p.checkpoint_shape(p.fwd_chosen) == (2, (1 << 14) // plan.chunk_of(p.fwd_chosen) + 1, 16)
    # a mixer (lift and readout) keeps the other schedules
    mixer = pipeline.lower(sl.Affine, inputs=("g", "x"), lift=lambda u: (u.g, 2 * u.x))
    assert chunked_launch.chunked.supports(pipeline.lower(sl.Affine)) and not chunked_launch.chunked.supports(mixer)


@pytest.mark.parametrize("chunked", [8], indirect=True)
def test_compile_fullgraph_runs_the_chunked_kernels_through_the_registered_ops(chunked):
    """torch.compile(fullgraph=True) traces the registered ops, which launch the chunked kernels
    through wrap_triton: same outputs and gradients as the loop."""
    monoid, elems, _ = case("Affine", (1, 3, 21), 2)
    a, b = (e.requires_grad_() for e in elems)
    before = dict(chunked_launch.LAUNCHED)
    # a compiled graph keeps the kernels of the variant in effect when it was traced, and neither its
    # guards nor inductor's caches of compiled graphs and backward graphs see the tuning knobs: without a
    # reset and those caches off, the other variant's run would reuse the first one's kernels
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: sl.scan(sl.Affine, (a, b), dim=2, backend="triton").b, fullgraph=True,
                             backend="inductor" if DEVICE == "cuda" else "eager")
    with torch._inductor.config.patch(fx_graph_cache=False, fx_graph_remote_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        out = compiled(a, b)
        ref = loop("Affine", (a, b), 2)[1]
        assert_close(out, ref, "scan", name="compiled Affine.b")
        g = torch.randn_like(ref)
        for got, want in zip(torch.autograd.grad(out, (a, b), g), torch.autograd.grad(ref, (a, b), g)):
            assert_close(got, want, "scan_grad", name="compiled Affine grad")
    assert all(chunked_launch.LAUNCHED[k] > before.get(k, 0) for k in chunked_launch.kernel_names())


# ---- projective leaves near 1e20: renormalised by an exact power of two, as on the other schedules -----

def huge_mobius(T, generator, with_initial):
    """Möbius leaves in [1e19, 1.1e20] (a product of two overflows float32), exactly representable in
    float32; an initial element near 1 when asked."""
    x = [(torch.rand(1, 3, T, generator=generator, dtype=torch.float64) * 1e20 + 1e19).float().double()
         for _ in range(4)]
    init = [torch.rand(1, 3, generator=generator, dtype=torch.float64) + 0.5 for _ in range(4)] if with_initial else []
    return x, init


@pytest.mark.parametrize("chunked,T,reverse,with_initial", [(8, 1, False, False), (4, 9, False, True),
                                                            (4, 11, True, True)], indirect=["chunked"],
                         ids=["T1", "T9-initial", "T11-reverse-initial"])
def test_huge_projective_leaves_are_renormalised(chunked, T, reverse, with_initial):
    """float32 Möbius leaves near 1e20 on the chunked schedule: every output field, the projective
    ratio and the gradients of the leaves and of the initial element equal the float64 loop's."""
    gen = torch.Generator().manual_seed(T)
    x64, init64 = huge_mobius(T, gen, with_initial)
    x = [t.float().to(DEVICE).requires_grad_() for t in x64]
    initial = [i.float().to(DEVICE).requires_grad_() for i in init64] or None
    before = dict(chunked_launch.LAUNCHED)
    out = sl.scan(sl.Mobius, x, dim=2, reverse=reverse, initial=initial, backend="triton")
    ins64 = [t.to(DEVICE).requires_grad_() for t in x64 + init64]
    want = loop("Mobius", ins64[:4], 2, reverse, ins64[4:] or None)
    for f, o, w in zip("abcd", out, want):
        assert_close(o, w, "scan", dtype=torch.float32, name=f)
    assert_close((out.a + out.b) / (out.c + out.d), (want[0] + want[1]) / (want[2] + want[3]), "scan",
                 dtype=torch.float32, name="ratio")
    weights = [torch.randn(w.shape, generator=gen, dtype=torch.float64).to(DEVICE) for w in want]
    got = torch.autograd.grad(sum((o * v.float()).sum() for o, v in zip(out, weights)), x + (initial or []))
    ref = torch.autograd.grad(sum((w * v).sum() for w, v in zip(want, weights)), ins64)
    for name, g, r in zip(["da", "db", "dc", "dd", "dinit_a", "dinit_b", "dinit_c", "dinit_d"], got, ref):
        assert_close(g, r, "scan_grad", dtype=torch.float32, name=name)
    ran = {k: v - before.get(k, 0) for k, v in chunked_launch.LAUNCHED.items()}
    assert all(ran.get(k, 0) == 1 for k in chunked_launch.kernel_names(4)), ran


@pytest.mark.parametrize("single_pass", [False, True], ids=["three-pass", "one-pass"])
def test_generated_module_scales_every_leaf_before_any_product(single_pass, knobs):
    """The projective module holds leaf_scale and calls it for each lift, and scales dx; no leaf is
    loaded shifted by a step (every row of the backward reads its own step); a module of a monoid that
    is not projective has none."""
    from scanlang import pipeline
    knobs(chunk_single_pass=single_pass)
    src = chunked_launch.source(pipeline.program(sl.Mobius), single_pass)
    assert "def leaf_scale(m)" in src
    assert "inv_leaf = leaf_scale(" in src
    assert "inv_leafn" not in src and "inv_leafv" not in src and "* step" not in src
    assert "dx_a = dx_a * inv_leaf" in src
    assert "leaf_scale" not in chunked_launch.source(pipeline.program(sl.Affine), single_pass)


@pytest.mark.parametrize("chunked", [4], indirect=True)
def test_kalman_filter_with_huge_precisions(chunked):
    """prec = 1e30 (an observation trusted completely) on the chunked schedule: outputs and the
    gradients of v, prec and q finite and equal to the float64 loop's. (dk is left out: in float32 it
    is off by a factor of order one on every backend, the reference one included, so not a matter of
    the schedule; float64 agrees with the loop.)"""
    from scanlang.recipes.kalman import kalman_filter
    from scanlang.recipes.kalman.reference import kalman_filter_loop
    gen = torch.Generator().manual_seed(3)
    B, T, M, S = 1, 9, 2, 2
    v = torch.randn(B, T, M, generator=gen, dtype=torch.float64)
    prec = torch.rand(B, T, M, generator=gen, dtype=torch.float64) + 0.5
    prec[:, ::3] = 1e30
    k, q = (torch.randn(B, T, S, generator=gen, dtype=torch.float64) for _ in range(2))
    a_bar = torch.rand(M, S, generator=gen, dtype=torch.float64) * 0.5 + 0.4
    p_bar = torch.rand(M, S, generator=gen, dtype=torch.float64) * 0.2 + 0.05
    ins = [t.float().to(DEVICE).requires_grad_() for t in (v, prec, k, q)]
    before = dict(chunked_launch.LAUNCHED)
    y, y_var, _ = kalman_filter(*ins, a_bar.float().to(DEVICE), p_bar.float().to(DEVICE), backend="triton",
                                form="two_scans")
    ins64 = [t.detach().double().requires_grad_() for t in ins]
    want, want_var, _ = kalman_filter_loop(*ins64, a_bar.to(DEVICE), p_bar.to(DEVICE))
    assert_close(y, want.float(), "kalman_out")
    assert_close(y_var, want_var.float(), "kalman_out")
    ran = {k: n - before.get(k, 0) for k, n in chunked_launch.LAUNCHED.items()}
    assert ran.get("chunk_scan", 0) + ran.get("chunk_reduce", 0) >= 1, ran   # the forward ran chunk-parallel
    w, w_var = torch.randn(y.shape, generator=gen, dtype=torch.float64), torch.randn(y.shape, generator=gen,
                                                                                    dtype=torch.float64)
    got = torch.autograd.grad((y * w.float().to(DEVICE)).sum() + (y_var * w_var.float().to(DEVICE)).sum(), ins)
    ref = torch.autograd.grad((want * w.to(DEVICE)).sum() + (want_var * w_var.to(DEVICE)).sum(), ins64)
    for name, g, r in zip(["dv", "dprec", "dk", "dq"], got, ref):
        if name != "dk":
            assert_close(g, r.float(), "kalman_grad", name=name)


# ---- the one-pass variant's look-back fold -------------------------------------------------------------
# The interpreter runs programs one after another, so a chunk's look-back always finds its predecessor's
# inclusive value published (flag 2) and never folds an aggregate. This test makes it fold: after the
# normal launch (which publishes every aggregate and inclusive value), each pass is launched again for
# ONE chunk per lane block (the last in the forward, the first in the backward) with the flags saying
# that the chunks in between published only their aggregates (flag 1) and the three at the far end
# their inclusive values (flag 2). The inclusive values in between and that chunk's own results are
# overwritten with NaN first, so reading a wrong value, folding a chunk twice or leaving a result
# unwritten shows in the comparison with the loop.

def _relaunch_one_chunk(real_run, n_in: int, n_out: int, n_fields: int, block_t: int, relaunched: list):
    def run(plan, cfg, kernel, grid, args, meta, eager):
        real_run(plan, cfg, kernel, grid, args, meta, eager)
        lanes = args[-1].numel() - grid[0]              # the grid: n_chunks x lanes programs; sync: n_chunks + 1 per lane block
        n_chunks = grid[0] // lanes
        backward = kernel.fn.__name__ == "chunk_bwd_scan"
        sync = args[-1].view(lanes, n_chunks + 1)
        sync.zero_()
        sync[:, 0] = n_chunks - 1                        # the next ticket: chunk n-1 (forward), 0 (backward)
        if backward:   # chunks n-3 .. n-1 published their inclusive values, 1 .. n-4 only their aggregates
            sync[:, 2:n_chunks - 2], sync[:, n_chunks - 2:] = 1, 2
        else:          # chunks 0 .. 2 published their inclusive values, 3 .. n-2 only their aggregates
            sync[:, 1:4], sync[:, 4:n_chunks] = 2, 1
        if backward:
            args[-2][:, 1:n_chunks - 3] = float("nan")   # G_1 .. G_(n-4)
            for j in range(n_in):                        # chunk 0's input gradients (stored, one per step)
                args[6 * (n_in + n_out + j)][..., :block_t] = float("nan")
            if meta["HAS_INIT"]:
                for k in range(n_fields):
                    args[6 * (2 * n_in + n_out) + k].fill_(float("nan"))
            real_run(plan, cfg, kernel, (lanes,), args, meta, eager)
        else:
            ckpt = next(a for a in args if torch.is_tensor(a) and a.shape == (n_fields, n_chunks + 1, a.shape[-1]))
            kept = ckpt.clone()
            ckpt[:, 4:n_chunks] = float("nan")           # P_4 .. P_(n-1): the inclusive values of chunks 3 .. n-2
            for j in range(n_out):                       # the last chunk's outputs
                args[6 * (n_in + j)][..., (n_chunks - 1) * block_t:] = float("nan")
            real_run(plan, cfg, kernel, (lanes,), args, meta, eager)
            ckpt[:, :n_chunks] = kept[:, :n_chunks]      # the backward replays from every checkpoint
        chunked_launch.LAUNCHED[kernel.fn.__name__] -= 1   # check() counts the pass's launches
        relaunched.append(kernel.fn.__name__)
    return run


@pytest.mark.parametrize("variant", [True], indirect=True, ids=["one-pass"])
@pytest.mark.parametrize("chunked", [4], indirect=True)
@pytest.mark.parametrize("lookback", [32, 4, 1], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("with_initial", [False, True], ids=["identity", "initial"])
@pytest.mark.parametrize("kind", ["Affine", "Mobius"])
def test_look_back_folds_published_aggregates(chunked, kind, with_initial, lookback, monkeypatch, knobs):
    """Windows of 32 chunks (all in one), 4 (three windows, the last reaching before chunk 0) and 1."""
    knobs(chunk_lookback=lookback)
    monoid = {"Affine": sl.Affine, "Mobius": sl.Mobius}[kind]
    relaunched = []
    n = len(monoid.fields)
    monkeypatch.setattr(chunked_launch, "_run", _relaunch_one_chunk(chunked_launch._run, n, n, n, 4, relaunched))
    check(kind, (1, 3, 37), 2, False, with_initial)    # ten chunks of 4 steps, the last partial
    assert relaunched == ["chunk_scan", "chunk_bwd_scan"]
