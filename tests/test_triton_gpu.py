"""GPU-only checks of the generated kernels at long lengths (skipped with a reason without CUDA)."""
import pytest
import torch

import scanlang as sl
from scanlang.backends import reference
from scanlang.testing import assert_close

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none found)")]


@pytest.mark.parametrize("layout", ["time_contiguous", "channels_contiguous"])
def test_affine_two_to_the_twenty_steps_forward_and_backward(layout):
    T = 1 << 20
    shape, dim = ((3, 5, T), 2) if layout == "time_contiguous" else ((2, T, 6), 1)
    a = (torch.rand(shape, device="cuda", dtype=torch.float64) * 0.5 + 0.5).requires_grad_()
    b = torch.randn(shape, device="cuda", dtype=torch.float64).requires_grad_()
    g = torch.randn(shape, device="cuda", dtype=torch.float64)
    out = sl.scan(sl.Affine, (a.float(), b.float()), dim=dim, backend="triton")
    ref = reference.scan(sl.Affine, (a, b), dim, False, None, torch.float64)
    assert_close(out.b, ref[1], "scan", torch.float32, name="h")
    got = torch.autograd.grad((out.b * g.float()).sum(), (a, b))
    want = torch.autograd.grad((ref[1] * g).sum(), (a, b))
    for x, y in zip(got, want):
        assert_close(x, y, "scan_grad", torch.float32, name="gradient")


def test_mobius_long_sequence_stays_finite_and_exact():
    T = 1 << 20
    elems = tuple(torch.rand(2, T, 3, device="cuda", dtype=torch.float64) + 0.5 for _ in range(4))
    out = sl.scan(sl.Mobius, tuple(e.float() for e in elems), dim=1, backend="triton")
    ref = reference.scan(sl.Mobius, elems, 1, False, None, torch.float64)
    for o, r in zip(out, ref):
        assert torch.isfinite(o).all()
        assert_close(o, r, "scan", torch.float32)


@pytest.mark.parametrize("layout", ["time_contiguous", "channels_contiguous"])
def test_welford_float32_long_sequence_against_float64_moments(layout):
    """Welford in float32 on the GPU (its combine divides: the RCP_APPROX path), 2^16 steps of data with
    mean 3, against running moments computed here in float64 from cumulative sums; gradients of a
    weighted sum of (mean, m2) with respect to the data against autograd of the same float64 formulas."""
    from scanlang import library
    T = 1 << 16
    shape, dim = ((4, 3, T), 2) if layout == "time_contiguous" else ((4, T, 3), 1)
    v64 = (torch.randn(shape, device="cuda", dtype=torch.float64) + 3).requires_grad_()
    v = v64.detach().float().requires_grad_()
    out = sl.scan(library.Welford, (torch.ones_like(v), v, torch.zeros_like(v)), dim=dim, backend="triton")
    t = torch.arange(1, T + 1, device="cuda", dtype=torch.float64)
    t = t if dim == 2 else t[:, None]
    mean = v64.cumsum(dim) / t
    m2 = (v64 * v64).cumsum(dim) - t * mean * mean   # float64: cancellation leaves ~1e-15 relative
    assert_close(out.n, t.expand(shape), "scan", torch.float32, name="n")
    assert_close(out.mean, mean, "scan", torch.float32, name="mean")
    assert_close(out.m2, m2, "scan", torch.float32, name="m2")
    w1, w2 = (torch.randn(shape, device="cuda", dtype=torch.float64) for _ in range(2))
    got, = torch.autograd.grad((out.mean * w1.float()).sum() + (out.m2 * w2.float() / T).sum(), v)
    want, = torch.autograd.grad((mean * w1).sum() + (m2 * w2 / T).sum(), v64)
    assert_close(got, want, "scan_grad", torch.float32, name="dv")


def _misaligned_copy(x: torch.Tensor) -> torch.Tensor:
    """`x` copied to storage starting 4 bytes past a 16-byte boundary."""
    out = torch.empty(x.numel() + 1, device=x.device, dtype=x.dtype)[1:].view(x.shape).copy_(x)
    assert out.data_ptr() % 16 != 0
    return out


def test_relaunched_kernels_match_the_reference_at_every_alignment(monkeypatch):
    """The eager path relaunches a compiled kernel directly (backends/triton/launcher.py) once a plan,
    config and pointer alignment launched it: values and gradients stay exact whichever launch ran,
    and inputs not 16-byte aligned get their own compiled kernel."""
    from scanlang.backends.triton import launcher
    direct = []
    real_stream = launcher._stream
    monkeypatch.setattr(launcher, "_stream", lambda device: direct.append(1) or real_stream(device))
    shape = (3, 1001, 5)
    a64 = torch.rand(shape, device="cuda", dtype=torch.float64) * 0.5 + 0.5
    b64 = torch.randn(shape, device="cuda", dtype=torch.float64)
    g = torch.randn(shape, device="cuda", dtype=torch.float64)
    a64.requires_grad_(), b64.requires_grad_()
    ref = reference.scan(sl.Affine, (a64, b64), 1, False, None, torch.float64)[1]
    want = torch.autograd.grad((ref * g).sum(), (a64, b64))
    first = None
    for aligned in (True, True, False, False, True):
        a, b = (x.detach().float() for x in (a64, b64))
        if not aligned:
            a, b = _misaligned_copy(a), _misaligned_copy(b)
        a.requires_grad_(), b.requires_grad_()
        out = sl.scan(sl.Affine, (a, b), dim=1, backend="triton").b
        got = torch.autograd.grad((out * g.float()).sum(), (a, b))
        assert_close(out, ref, "scan", torch.float32, name="h")
        for x, y in zip(got, want):
            assert_close(x, y, "scan_grad", torch.float32, name="gradient")
        if aligned:   # the direct relaunch is bitwise the JIT launch
            first = first or (out.detach().clone(), [x.clone() for x in got])
            assert torch.equal(out, first[0]) and all(torch.equal(x, y) for x, y in zip(got, first[1]))
    assert direct, "no launch went through the direct path"
