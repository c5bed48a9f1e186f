"""The eager fast path (one autograd.Function, no torch.library dispatch) against the registered ops,
and the launch-plan cache: hits on a repeated call, new plans for new shapes and for a changed
scanlang.tuning's forced configs. Interpreter on CPU, GPU otherwise."""
import pytest
import torch

import scanlang as sl
from scanlang import tuning
from scanlang.backends.reference import scan_sequential
from scanlang.backends.triton import ops, plan, runtime
from scanlang.testing import assert_close

import test_mixer
from test_triton_scan import DEVICE, elems_for


@pytest.fixture
def passes(monkeypatch):
    """Record, per forward/backward body call, whether it ran eagerly; `force_ops` takes the op path."""
    seen = []
    real_fwd, real_bwd = ops._forward, ops._backward_pass

    def fwd(*args, eager, **kwargs):
        seen.append(("fwd", eager))
        return real_fwd(*args, eager=eager, **kwargs)

    def bwd(*args, eager, **kwargs):
        seen.append(("bwd", eager))
        return real_bwd(*args, eager=eager, **kwargs)
    monkeypatch.setattr(ops, "_forward", fwd)
    monkeypatch.setattr(ops, "_backward_pass", bwd)

    def force_ops():
        monkeypatch.setattr(ops, "eager", lambda tensors: False)
    return seen, force_ops


def _run_mixer_case():
    """The Kalman-like mixer with every feature at once: a broadcast static parameter, a reduced
    state axis, packed sequences, reverse, a per-sequence initial element and the final state."""
    lengths = [5, 0, 3]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=DEVICE)
    T, M, S, N = sum(lengths), 3, 4, len(lengths)
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=gen).to(DEVICE).requires_grad_()
    v, k, q = rnd(1, T, M), rnd(1, T, S), rnd(1, T, S)
    a = (torch.rand(M, S, dtype=torch.float64, generator=gen) * 0.5 + 0.5).to(DEVICE).requires_grad_()
    h0 = rnd(N, 1, M, S)
    out = test_mixer.kalman_like()(v=v, k=k, q=q, a=a, initial=(1.0, h0), output_final_state=True, cu_seqlens=cu,
                                   reverse=True)
    w = [torch.randn(o.shape, dtype=torch.float64, generator=gen).to(DEVICE) for o in (out.y, out.z, out.final[1])]
    loss = (out.y * w[0]).sum() + (out.z * w[1]).sum() + (out.final[1] * w[2]).sum()
    return [out.y, out.z, out.final[1]], torch.autograd.grad(loss, (v, k, q, a, h0))


def _run_scan_case():
    """sl.scan with a broadcast gate [1, T, D], an initial element, float32."""
    shape = (2, 7, 3)
    gen = torch.Generator().manual_seed(0)
    a = (torch.rand(1, 7, 3, generator=gen) * 0.5 + 0.5).to(DEVICE).requires_grad_()
    b = torch.randn(shape, generator=gen).to(DEVICE).requires_grad_()
    h0 = (torch.ones(2, 3, device=DEVICE), torch.randn(2, 3, generator=gen).to(DEVICE))
    out = sl.scan(sl.Affine, (a, b), dim=1, initial=h0, backend="triton")
    w = torch.randn(shape, generator=gen).to(DEVICE)
    return [out.a, out.b], torch.autograd.grad((out.b * w).sum() + out.a.sum(), (a, b))


@pytest.mark.parametrize("case", [_run_mixer_case, _run_scan_case], ids=["mixer", "scan"])
def test_eager_path_equals_registered_ops(passes, case):
    """Same kernels, same configs: outputs and gradients are bitwise equal on both paths."""
    passes, force_ops = passes
    outs, grads = case()
    assert passes and all(eager for _, eager in passes), passes
    assert {p for p, _ in passes} == {"fwd", "bwd"}
    passes.clear()
    force_ops()
    ops_outs, ops_grads = case()
    assert passes and not any(eager for _, eager in passes), passes
    for x, y in zip(outs + list(grads), ops_outs + list(ops_grads)):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert torch.equal(x, y)


def test_eager_path_matches_float64_loop():
    """The eager path's values and gradients against the sequential reference (not only vs the ops)."""
    shape = (2, 9, 3)
    elems = tuple(e.requires_grad_() for e in elems_for(sl.Affine, shape))
    out = sl.scan(sl.Affine, elems, dim=1, reverse=True, backend="triton")
    ref = scan_sequential(sl.Affine, elems, dim=1, reverse=True)
    for o, r in zip(out, ref):
        assert_close(o, r, "scan")
    w = torch.randn(shape, dtype=torch.float64, device=DEVICE)
    for g, r in zip(torch.autograd.grad((out.b * w).sum(), elems), torch.autograd.grad((ref[1] * w).sum(), elems)):
        assert_close(g, r, "scan_grad")


def test_eager_only_for_plain_tensors_outside_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode
    x = torch.randn(2, 3, device=DEVICE)
    assert ops.eager([x])
    assert not ops.eager([torch.empty(2, 3, device="meta")])
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        assert not ops.eager([fake])
        assert not ops.eager([x])      # a dispatch mode is active


def test_shape_propagation_under_fake_tensors_takes_the_op_path():
    from torch._subclasses.fake_tensor import FakeTensorMode
    mix = test_mixer.kalman_like()
    with FakeTensorMode():
        v, k, q = (torch.randn(2, 5, n, device=DEVICE) for n in (3, 4, 4))
        out = mix(v=v, k=k, q=q, a=torch.rand(3, 4, device=DEVICE))
        assert out.y.shape == (2, 5, 3) and out.z.shape == (2, 5, 3)


def _affine_step(shape, dim=1):
    a, b = (e.requires_grad_() for e in elems_for(sl.Affine, shape))
    out = sl.scan(sl.Affine, (a, b), dim=dim, backend="triton")
    torch.autograd.grad(out.b.sum(), (a, b))
    return a, b, out


def test_repeated_call_hits_the_plan_cache():
    plan.PLANS.clear()
    built = plan.PLANS.built
    _affine_step((2, 5, 3))
    assert plan.PLANS.built == built + 2   # one forward and one backward plan
    _affine_step((2, 5, 3))              # same shapes, strides, dtypes: both plans reused
    assert plan.PLANS.built == built + 2
    _affine_step((2, 6, 3))              # a new length: one forward and one backward plan
    assert plan.PLANS.built == built + 4


def test_plan_cache_follows_overrides(monkeypatch):
    """A forced config (tuning.override(forced=...), a launch-time knob in the plan key) takes effect on
    the next call with the same shapes, and the default plans are found again after it."""
    from scanlang.backends.triton import launcher
    ran = []
    real = launcher.launch
    monkeypatch.setattr(launcher, "launch", lambda plan, cfg, kernel, *rest: ran.append(kernel.__name__)
                        or real(plan, cfg, kernel, *rest))
    shape = (2, 7, 3)
    _affine_step(shape)
    assert set(ran) == {"scan_forward", "scan_backward"}
    built, ran[:] = plan.PLANS.built, []
    lanes = runtime.Config(block_t=4, block_l=4, num_warps=1, chunk=4, schedule="lanes", unroll=2)
    with tuning.override(forced=runtime.lanes_overrides(block_l=4, num_warps=1, chunk=4, unroll=2)) as knobs:
        assert knobs.forced_config(True, True) == lanes
        a, b, out = _affine_step(shape)
    assert set(ran) == {"scan_forward_lanes", "scan_backward_lanes"}
    assert plan.PLANS.built == built + 2
    assert_close(out.b, scan_sequential(sl.Affine, (a, b), dim=1)[1], "scan")
    ran[:] = []
    _affine_step(shape)                  # back to the default configs: their plans are still cached
    assert set(ran) == {"scan_forward", "scan_backward"}
    assert plan.PLANS.built == built + 2


def test_mixer_revalidates_when_the_environment_changes(monkeypatch):
    """The mixer remembers validation per input signature, but the device check still runs."""
    if DEVICE == "cuda":
        pytest.skip("the interpreter switch only matters for CPU tensors")
    mix = test_mixer.kalman_like()
    v, k, q, a = torch.randn(2, 5, 3), torch.randn(2, 5, 4), torch.randn(2, 5, 4), torch.rand(3, 4)
    mix(v=v, k=k, q=q, a=a)
    with pytest.raises(ValueError, match="axis 'm'"):
        mix(v=v, k=k, q=q, a=torch.rand(2, 4))
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        mix(v=v, k=k, q=q, a=a)


def test_no_grad_forward_skips_autograd_and_checkpoints_per_tile():
    """Without gradients the eager forward returns plain tensors (no graph)."""
    a, b = elems_for(sl.Affine, (2, 9, 3))
    a.requires_grad_()
    with torch.no_grad():
        out = sl.scan(sl.Affine, (a, b), dim=1, backend="triton")
    assert out.b.grad_fn is None and not out.b.requires_grad
    assert_close(out.b, scan_sequential(sl.Affine, (a.detach(), b), dim=1)[1], "scan")


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_graph_tracing_records_the_registered_op(mode):
    """make_fx (a proxy dispatch mode; symbolic shapes too) sees the registered op, not the eager path."""
    from torch.fx.experimental.proxy_tensor import make_fx
    ema = sl.mixer(sl.Affine, axes="b t d", inputs={"x": "b t d", "decay": "d"},
                   lift=lambda u: (u.decay, (1 - u.decay) * u.x), readout=lambda p, u, q: p.b, outputs=("h",))
    x, decay = torch.randn(2, 5, 3, device=DEVICE), torch.rand(3, device=DEVICE)
    gm = make_fx(lambda x, d: ema(x=x, decay=d).h, tracing_mode=mode)(x, decay)
    assert torch.ops.scanlang.scan_fwd.default in [n.target for n in gm.graph.nodes]


def _ema():
    return sl.mixer(sl.Affine, axes="b t d", inputs={"x": "b t d", "decay": "d"},
                    lift=lambda u: (u.decay, (1 - u.decay) * u.x), readout=lambda p, u, q: p.b, outputs=("h",))


def _ema_loop(x, decay):
    h, out = torch.zeros(x.shape[0], x.shape[2], dtype=torch.float64, device=x.device), []
    for t in range(x.shape[1]):
        h = decay.double() * h + (1 - decay.double()) * x[:, t].double()
        out.append(h)
    return torch.stack(out, 1)


def test_cached_calls_follow_every_change_of_shape_stride_and_dtype():
    """One mixer called repeatedly while the inputs' length, batch, strides and dtype change (and
    back): each call misses or hits the validation and plan caches correctly, every output and
    gradient matches the float64 loop, and no plan of another signature is reused."""
    ema = _ema()
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(3, 9, 4, dtype=torch.float64, generator=gen)
    cases = [("float32", base[:2, :5].float()), ("longer", base[:2].float()), ("batch", base.float()),
             ("time-major strides", base.float().transpose(0, 1).contiguous().transpose(0, 1)),
             ("float64", base), ("float32 again", base[:2, :5].float())]
    for name, x in cases:
        for _ in range(2):   # the second call takes the cached path
            x_in = x.to(DEVICE).requires_grad_()
            decay = (torch.rand(4, dtype=x.dtype, generator=gen) * 0.5 + 0.4).to(DEVICE).requires_grad_()
            out = ema(x=x_in, decay=decay)
            assert out.h.dtype == (torch.float64 if x.dtype == torch.float64 else torch.float32), name
            ref = _ema_loop(x_in.detach(), decay.detach())
            assert_close(out.h, ref, "scan", name=name)
            w = torch.randn(ref.shape, dtype=torch.float64, generator=gen).to(DEVICE)
            got = torch.autograd.grad((out.h * w.to(out.h.dtype)).sum(), (x_in, decay))
            x64, d64 = x_in.detach().double().requires_grad_(), decay.detach().double().requires_grad_()
            want = torch.autograd.grad((_ema_loop(x64, d64) * w).sum(), (x64, d64))
            for g, r in zip(got, want):
                assert g.dtype == x.dtype
                assert_close(g, r, "scan_grad", name=name)


def test_create_graph_backward_refuses_a_second_differentiation():
    """With create_graph=True the eager backward refuses a second order (scanlang.second_order): gradients come
    back, and differentiating them again raises instead of returning wrong (zero) second derivatives."""
    a, b = (e.requires_grad_() for e in elems_for(sl.Affine, (2, 5, 3)))
    w = torch.randn(2, 5, 3, dtype=torch.float64, device=DEVICE, requires_grad=True)
    out = sl.scan(sl.Affine, (a, b), dim=1, backend="triton")
    _, gb = torch.autograd.grad(out.b, (a, b), w, create_graph=True)
    assert_close(gb, torch.autograd.grad(scan_sequential(sl.Affine, (a, b), dim=1)[1], b, w)[0], "scan_grad")
    assert gb.requires_grad
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gb.sum().backward()
