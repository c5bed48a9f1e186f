"""Generated Triton scan kernels (forward and backward) against float64 sequential loops.

Runs in Triton's interpreter on CPU (conftest sets TRITON_INTERPRET=1 when there is no GPU), on the
GPU otherwise. Interpreter tiles are 8 steps x 4 lanes, so T = 1, 7, 8, 19 cover one partial tile,
exactly one tile and several tiles with a tail. The float32 path by the hardware reciprocal
(RCP_APPROX) runs on a GPU; here its instruction is emulated (`hardware_reciprocal`).
"""
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import scanlang as sl
from scanlang import library
from scanlang.backends import triton as tb
from scanlang.backends.reference import scan_sequential
from scanlang.backends.triton import plan
from scanlang.testing import assert_close

LIBRARY = [m for m in vars(library).values() if isinstance(m, sl.Monoid)]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def nonzero(*shape, dtype=torch.float64, positive=False):
    x = torch.rand(*shape, dtype=torch.float64) + 0.5
    if not positive:
        x = x * torch.where(torch.rand(*shape) < 0.3, -1.0, 1.0).double()
    return x.to(dtype).to(DEVICE)


def elems_for(monoid, shape, dtype=torch.float64):
    if monoid is sl.Affine:   # |a| < 1 keeps long products tame, mixed signs
        return (nonzero(*shape, dtype=dtype) * 0.9, nonzero(*shape, dtype=dtype))
    return tuple(nonzero(*shape, dtype=dtype, positive=True) for _ in monoid.fields)


@pytest.mark.parametrize("monoid", LIBRARY, ids=lambda m: m.name)
@pytest.mark.parametrize("length", [1, 7, 8, 19])
def test_forward_matches_sequential_loop(monoid, length):
    shape = (2, length, 3)
    elems = elems_for(monoid, shape)
    out = sl.scan(monoid, elems, dim=1, backend="triton")
    ref = scan_sequential(monoid, elems, dim=1)
    for f, o, r in zip(monoid.fields, out, ref):
        assert o.shape == r.shape and o.dtype == torch.float64
        assert torch.isfinite(o).all(), f"{f}: some output was not written"
        assert_close(o, r, "scan", name=f"{monoid.name}.{f}")


@pytest.mark.parametrize("monoid", LIBRARY, ids=lambda m: m.name)
@pytest.mark.parametrize("layout", ["time_contiguous", "channels_contiguous", "time_first", "strided"])
@pytest.mark.parametrize("reverse", [False, True])
def test_layouts_reverse_and_initial(monoid, layout, reverse):
    T = 13
    if layout == "time_contiguous":
        shape, dim = (2, 3, T), 2
    elif layout == "channels_contiguous":
        shape, dim = (2, T, 5), 1
    elif layout == "time_first":
        shape, dim = (T, 3), 0
    else:
        shape, dim = (2, T, 3, 2), 1
    elems = elems_for(monoid, shape)
    if layout == "strided":  # non-contiguous views: every other channel of a wider tensor, transposed
        elems = tuple(torch.cat([e, e], -1)[..., ::2].transpose(0, 2).transpose(0, 2) for e in elems)
    lane_shape = shape[:dim] + shape[dim + 1:]
    initial = elems_for(monoid, lane_shape)
    out = sl.scan(monoid, elems, dim=dim, reverse=reverse, initial=initial, backend="triton")
    ref = scan_sequential(monoid, elems, dim=dim, reverse=reverse, initial=initial)
    for f, o, r in zip(monoid.fields, out, ref):
        assert_close(o, r, "scan", name=f"{monoid.name}.{f}")


def test_broadcast_parameter_and_float32():
    a = (torch.rand(5, dtype=torch.float64) * 0.9 + 0.05).to(DEVICE)      # static decay per channel
    b = nonzero(2, 21, 5)
    out = sl.scan(sl.Affine, (a.float(), b.float()), dim=1, backend="triton")
    ref = scan_sequential(sl.Affine, (a, b), dim=1)
    assert out.b.dtype == torch.float32
    assert_close(out.b, ref[1], "scan", dtype=torch.float32)
    half = sl.scan(sl.Affine, (a.to(torch.bfloat16), b.to(torch.bfloat16)), dim=1, backend="triton")
    ref_rounded = scan_sequential(sl.Affine, (a.to(torch.bfloat16), b.to(torch.bfloat16)), dim=1)
    assert half.b.dtype == torch.float32
    assert_close(half.b, ref_rounded[1], "scan", dtype=torch.bfloat16)


def check_with_initial(monoid, shape, dim: int, reverse: bool):
    """sl.scan with a per-lane initial element against the float64 loop: every output field, and the
    gradients of every element and initial field under random output weights (the schedule is
    whatever the caller's fixture or forced configs (scanlang.tuning) chose)."""
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


@pytest.mark.parametrize("monoid", LIBRARY, ids=lambda m: m.name)
@pytest.mark.parametrize("reverse", [False, True])
def test_gradients_match_autograd_of_the_loop(monoid, reverse):
    check_with_initial(monoid, (2, 19, 3), 1, reverse)


def test_float32_gradients_and_broadcast_parameter_gradient():
    a = (torch.rand(3, dtype=torch.float64) * 0.8 + 0.1).to(DEVICE).requires_grad_()
    b = nonzero(2, 17, 3).requires_grad_()
    w = torch.randn(2, 17, 3, dtype=torch.float64, device=DEVICE)
    out = sl.scan(sl.Affine, (a.float(), b.float()), dim=1, backend="triton")
    ga, gb = torch.autograd.grad((out.b * w.float()).sum(), (a, b))
    ref = scan_sequential(sl.Affine, (a, b), dim=1)
    ra, rb = torch.autograd.grad((ref[1] * w).sum(), (a, b))
    assert ga.shape == (3,)
    assert_close(ga, ra, "scan_grad", torch.float32, name="grad a")
    assert_close(gb, rb, "scan_grad", torch.float32, name="grad b")


@pytest.mark.parametrize("monoid", LIBRARY, ids=lambda m: m.name)
def test_gradcheck_float64(monoid):
    elems = tuple(e.requires_grad_() for e in elems_for(monoid, (1, 9, 2)))
    initial = tuple(e.requires_grad_() for e in elems_for(monoid, (1, 2)))

    def f(*xs):
        return tuple(sl.scan(monoid, xs[:len(elems)], dim=1, initial=xs[len(elems):], backend="triton"))
    assert torch.autograd.gradcheck(f, elems + initial, eps=1e-6, atol=1e-8, fast_mode=True)


def test_empty_time_axis():
    a, b = torch.ones(2, 0, 3, dtype=torch.float64, device=DEVICE), torch.ones(2, 0, 3, dtype=torch.float64, device=DEVICE)
    out = tb.scan(sl.Affine, (a, b), 1, False, None, torch.float64)
    assert out[0].shape == (2, 0, 3)


def test_bad_inputs_raise_typed_errors():
    a = torch.ones(2, 4, 3, dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="elems"):
        tb.scan(sl.Affine, (a, a), 1, False, None, torch.float32)
    x = torch.ones(2, 4, 3, device=DEVICE)
    with pytest.raises(ValueError, match="dim"):
        tb.scan(sl.Affine, (x, x), 3, False, None, torch.float32)
    with pytest.raises(TypeError, match="out_dtype"):
        tb.scan(sl.Affine, (x, x), 1, False, None, torch.float16)
    if DEVICE == "cuda":
        with pytest.raises(ValueError, match="devices"):
            tb.scan(sl.Affine, (x, x.cpu()), 1, False, None, torch.float32)
    else:
        with pytest.raises(ValueError, match="devices"):
            tb.scan(sl.Affine, (x, torch.ones(2, 4, 3, device="meta")), 1, False, None, torch.float32)


SHOW = ("import scanlang as sl; from scanlang import pipeline; "
        "import sys; sys.stdout.write(pipeline.show(sl.Mobius))")


def test_generated_source_is_byte_identical_across_processes(tmp_path):
    env = dict(os.environ, SCANLANG_CACHE_DIR=str(tmp_path), TRITON_INTERPRET="1", PYTHONHASHSEED="random")
    runs = [subprocess.run([sys.executable, "-c", SHOW], env=dict(env, PYTHONHASHSEED=str(seed)),
                           capture_output=True, text=True, check=True).stdout for seed in (1, 2)]
    assert runs[0] == runs[1]
    assert "def scan_forward(" in runs[0] and "def scan_backward(" in runs[0]
    assert "tl.associative_scan" in runs[0] and "reverse=True" in runs[0]
    cached = list((tmp_path / "triton").glob("scanlang_*.py"))
    assert len(cached) == 1 and cached[0].read_text() == runs[0]
    assert not list((tmp_path / "triton").glob("*.tmp"))
    debug = subprocess.run([sys.executable, "-c", SHOW.replace("sys.stdout.write(pipeline.show(sl.Mobius))", "pipeline.show(sl.Mobius)")],
                           env=dict(env, SCANLANG_DEBUG="1"), capture_output=True, text=True, check=True).stdout
    assert "generated Triton for Mobius" in debug and runs[0] in debug


def test_unexpanded_broadcast_inputs_get_reduced_gradients():
    """Size-1 dims broadcast inside the kernel; their gradients are reduced there, never full-size."""
    a = (torch.rand(1, 1, 3, dtype=torch.float64, device=DEVICE) * 0.8 + 0.1).requires_grad_()   # static decay
    b = nonzero(2, 19, 3).requires_grad_()
    h0 = nonzero(1, 3).requires_grad_()
    out = tb.scan(sl.Affine, (a, b), 1, False, (torch.ones(1, 3, dtype=torch.float64, device=DEVICE), h0), torch.float64)
    ref = scan_sequential(sl.Affine, (a, b), dim=1, initial=(torch.ones(1, 3, dtype=torch.float64, device=DEVICE), h0))
    assert out[1].shape == (2, 19, 3)
    assert_close(out[1], ref[1], "scan")
    w = torch.randn(2, 19, 3, dtype=torch.float64, device=DEVICE)
    got = torch.autograd.grad((out[1] * w).sum(), (a, b, h0))
    want = torch.autograd.grad((ref[1] * w).sum(), (a, b, h0))
    for g, r in zip(got, want):
        assert g.shape == r.shape
        assert_close(g, r, "scan_grad")


@pytest.fixture
def hardware_reciprocal(monkeypatch):
    """The float32 tile kernels on their GPU path (RCP_APPROX) in the interpreter: the flag forced on,
    and the inline rcp.approx.ftz.f32 evaluated as float32 1 / x rounded to nearest (within the
    instruction's 1 ulp), inputs and results below 2^-126 flushed to zero as .ftz does. Yields the
    number of reciprocals evaluated (one entry per call)."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the float32 tests run the instruction itself")
    from triton.runtime import interpreter
    tiny, calls = np.float32(2.0 ** -126), []

    def create_inline_asm(self, asm, constraints, values, type, is_pure, pack):
        assert asm.startswith("rcp.approx.ftz.f32") and len(values) == 1
        x = values[0].data.astype(np.float32)
        x = np.where(np.abs(x) < tiny, np.float32(0), x)
        with np.errstate(divide="ignore"):
            r = (np.float32(1) / x).astype(np.float32)
        r = np.where(np.abs(r) < tiny, np.float32(0), r).astype(np.float32)
        calls.append(r.size)
        handle = interpreter.TensorHandle(r, values[0].dtype)
        return SimpleNamespace(get_result=lambda i: handle)

    original = plan._Plan.tile_meta
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", create_inline_asm)
    monkeypatch.setattr(plan._Plan, "tile_meta", lambda self, cfg: dict(original(self, cfg), RCP_APPROX=not self.common["FP64"]))
    plan.PLANS.clear()
    yield calls
    plan.PLANS.clear()


@pytest.mark.parametrize("monoid", [library.Mobius, library.Welford], ids=lambda m: m.name)
@pytest.mark.parametrize("length", [1, 8, 19])
def test_float32_by_the_hardware_reciprocal(hardware_reciprocal, monoid, length):
    """Small tiles on the RCP_APPROX path: a combine that rescales (Möbius) or divides (Welford) by
    combine_rcp, the adjoint expressions by reciprocals; outputs and gradients of every element and
    initial field against the float64 loop at the float32 tolerances."""
    shape = (2, length, 3)
    elems = tuple(e.requires_grad_() for e in elems_for(monoid, shape))
    initial = tuple(e.requires_grad_() for e in elems_for(monoid, (2, 3)))
    out = sl.scan(monoid, tuple(e.float() for e in elems), dim=1, initial=tuple(i.float() for i in initial),
                  backend="triton")
    ref = scan_sequential(monoid, elems, dim=1, initial=initial)
    for f, o, r in zip(monoid.fields, out, ref):
        assert o.dtype == torch.float32
        assert_close(o, r, "scan", dtype=torch.float32, name=f"{monoid.name}.{f}")
    weights = [torch.randn_like(r) for r in ref]
    got = torch.autograd.grad(sum((o.double() * w).sum() for o, w in zip(out, weights)), elems + initial)
    want = torch.autograd.grad(sum((r * w).sum() for r, w in zip(ref, weights)), elems + initial)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, "scan_grad", dtype=torch.float32, name=f"{monoid.name} grad {i}")
    assert hardware_reciprocal, "the hardware-reciprocal path did not run"
