"""GPU-only checks of the generated kernels at long lengths (skipped with a reason without CUDA)."""
import pytest
import torch

import scanlang as sl
from scanlang.backends import reference
from scanlang.testing import ratio, tolerance

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
    assert ratio(out.b, ref[1]) <= tolerance("scan", torch.float32)
    got = torch.autograd.grad((out.b * g.float()).sum(), (a, b))
    want = torch.autograd.grad((ref[1] * g).sum(), (a, b))
    for x, y in zip(got, want):
        assert ratio(x, y) <= tolerance("scan_grad", torch.float32)


def test_mobius_long_sequence_stays_finite_and_exact():
    T = 1 << 20
    elems = tuple(torch.rand(2, T, 3, device="cuda", dtype=torch.float64) + 0.5 for _ in range(4))
    out = sl.scan(sl.Mobius, tuple(e.float() for e in elems), dim=1, backend="triton")
    ref = reference.scan(sl.Mobius, elems, 1, False, None, torch.float64)
    for o, r in zip(out, ref):
        assert torch.isfinite(o).all()
        assert ratio(o, r) <= tolerance("scan", torch.float32)
