"""The generated kernels as torch.library ops: opcheck, autograd registration, torch.compile."""
import pytest
import torch

import scanlang as sl
from scanlang import pipeline
from scanlang.backends.reference import scan_sequential
from scanlang.testing import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_opcheck_forward_op():
    prog = pipeline.program(sl.Affine)
    a = (torch.rand(2, 9, 3, dtype=torch.float64, device=DEVICE) * 0.9 + 0.05).requires_grad_()
    b = torch.randn(2, 9, 3, dtype=torch.float64, device=DEVICE).requires_grad_()
    h0 = [torch.ones(2, 3, dtype=torch.float64, device=DEVICE), torch.randn(2, 3, dtype=torch.float64, device=DEVICE)]
    torch.library.opcheck(torch.ops.scanlang.scan_fwd.default, (prog.key, [a, b], h0, None, 1, False, True, True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_compile_fullgraph_has_no_graph_break():
    def model(a, b):
        out = sl.scan(sl.Affine, (torch.sigmoid(a), b), dim=1, backend="triton")
        return (out.b * 2).sum(-1)
    a = torch.randn(2, 11, 3, device=DEVICE, requires_grad=True)
    b = torch.randn(2, 11, 3, device=DEVICE, requires_grad=True)
    # On CPU the kernels run in Triton's interpreter, which cannot take the fake tensors that AOT tracing
    # feeds a kernel; Dynamo alone ("eager") still proves the whole model is one graph.
    compiled = torch.compile(model, fullgraph=True, backend="inductor" if DEVICE == "cuda" else "eager")
    y = compiled(a, b)
    ref = scan_sequential(sl.Affine, (torch.sigmoid(a.double()), b.double()), dim=1)[1].mul(2).sum(-1)
    assert_close(y, ref, "scan")
    ga, gb = torch.autograd.grad(y.sum(), (a, b))
    ra, rb = torch.autograd.grad(ref.sum(), (a, b))
    assert_close(ga, ra, "scan_grad", dtype=torch.float32)
    assert_close(gb, rb, "scan_grad", dtype=torch.float32)


def test_mixer_compiles_fullgraph():
    from scanlang.mixer import mixer
    ema = mixer(sl.Affine, axes="b t d", inputs={"x": "b t d", "decay": "d"},
                lift=lambda u: (u.decay, (1 - u.decay) * u.x), readout=lambda p, u, q: p.b, outputs=("h",))

    def model(x, raw):
        return ema(x=x, decay=torch.sigmoid(raw)).h.square().mean()
    x = torch.randn(2, 13, 3, device=DEVICE, requires_grad=True)
    raw = torch.randn(3, device=DEVICE, requires_grad=True)
    compiled = torch.compile(model, fullgraph=True, backend="inductor" if DEVICE == "cuda" else "eager")
    loss = compiled(x, raw)
    assert_close(loss, model(x, raw), "scan")
    got = torch.autograd.grad(loss, (x, raw))
    want = torch.autograd.grad(model(x, raw), (x, raw))
    for g, w in zip(got, want):
        assert_close(g, w, "scan_grad", dtype=torch.float32)
