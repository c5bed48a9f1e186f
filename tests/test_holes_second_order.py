"""Class 4 of issue 18: no silent wrong higher derivatives.

The reference backend (plain torch ops) is differentiable any number of times: its Hessian-vector
products equal those of a float64 loop written here and a central finite difference of its gradient.
The generated kernels' backward passes are differentiable once: every second-order request through
them (grad of grad, `torch.autograd.functional.hvp`, `backward(create_graph=True)` then grad) raises
a SecondOrderError naming the op and pointing at backend="reference" -- never None or zeros.
"""
import functools

import pytest
import torch

import scanlang as sl
from scanlang.recipes.kaczmarz import delta_rule
from scanlang.recipes.kalman import kalman_filter
from scanlang.second_order import SecondOrderError
from scanlang.testing import assert_close

F64 = torch.float64


def affine_loop(a, b):
    """h_t = a_t h_{t-1} + b_t along dim 1, float64, by autograd-able torch ops."""
    h, out = torch.zeros_like(b[:, 0]), []
    for t in range(b.shape[1]):
        h = a[:, t] * h + b[:, t]
        out.append(h)
    return torch.stack(out, 1)


def mobius_loop(x0, x1, x2, x3):
    """lam_t = (a lam + b) / (c lam + d) from lam_{-1} = 1: the Möbius prefix applied to 1."""
    lam, out = torch.ones_like(x0[:, 0]), []
    for t in range(x0.shape[1]):
        lam = (x0[:, t] * lam + x1[:, t]) / (x2[:, t] * lam + x3[:, t])
        out.append(lam)
    return torch.stack(out, 1)


def scan_loss(backend, weight):
    def loss(a, b):
        h = sl.scan(sl.Affine, (a, b), dim=1, backend=backend).b
        return (weight * h * h).sum() + (a * h).sum()
    return loss


def loop_loss(weight):
    def loss(a, b):
        h = affine_loop(a, b)
        return (weight * h * h).sum() + (a * h).sum()
    return loss


def affine_inputs(T):
    a = (0.3 + 0.6 * torch.rand(2, T, 3, dtype=F64))
    return a, torch.randn(2, T, 3, dtype=F64), torch.randn(2, T, 3, dtype=F64)


@pytest.mark.parametrize("T", [1, 7, 40])
def test_reference_scan_hvp_equals_the_loop_and_a_finite_difference(T):
    a, b, w = affine_inputs(T)
    va, vb = torch.randn_like(a), torch.randn_like(b)
    _, (ha, hb) = torch.autograd.functional.hvp(scan_loss("reference", w), (a, b), (va, vb))
    _, (ra, rb) = torch.autograd.functional.hvp(loop_loss(w), (a, b), (va, vb))
    assert_close(ha, ra, "scan_grad", name="hvp a")
    assert_close(hb, rb, "scan_grad", name="hvp b")
    eps = 1e-6

    def grad_at(s):
        x, y = (a + s * va).requires_grad_(), (b + s * vb).requires_grad_()
        return torch.autograd.grad(scan_loss("reference", w)(x, y), (x, y))
    plus, minus = grad_at(eps), grad_at(-eps)
    fd_a, fd_b = ((p - m) / (2 * eps) for p, m in zip(plus, minus))
    assert torch.allclose(ha, fd_a, rtol=1e-5, atol=1e-6) and torch.allclose(hb, fd_b, rtol=1e-5, atol=1e-6)


def test_reference_projective_scan_second_derivative_equals_the_loop():
    xs = [torch.rand(2, 9, 2, dtype=F64) + 0.5 for _ in range(4)]
    v = [torch.randn_like(x) for x in xs]

    def scanned(*x):
        p = sl.scan(sl.Mobius, x, dim=1, backend="reference")
        return (((p.a + p.b) / (p.c + p.d)) ** 2).sum()

    def looped(*x):
        return (mobius_loop(*x) ** 2).sum()
    _, got = torch.autograd.functional.hvp(scanned, tuple(xs), tuple(v))
    _, want = torch.autograd.functional.hvp(looped, tuple(xs), tuple(v))
    for g, r in zip(got, want):
        assert_close(g, r, "scan_grad")


def _refused(fn):
    with pytest.raises(SecondOrderError, match="reference"):
        fn()


def test_triton_scan_refuses_every_second_order_request():
    a, b, w = affine_inputs(6)
    a.requires_grad_(), b.requires_grad_()
    loss = scan_loss("triton", w)
    first = torch.autograd.grad(loss(a, b), (a, b))            # first order stays correct
    want = torch.autograd.grad(loop_loss(w)(a, b), (a, b))
    for g, r in zip(first, want):
        assert_close(g, r, "scan_grad")

    def grad_of_grad():
        gb, = torch.autograd.grad(loss(a, b), b, create_graph=True)
        return torch.autograd.grad(gb.sum(), a, allow_unused=True)
    _refused(grad_of_grad)
    _refused(lambda: torch.autograd.functional.hvp(loss, (a.detach(), b.detach()), (torch.ones_like(a),) * 2))

    def backward_create_graph():
        a.grad = None
        loss(a, b).backward(create_graph=True, inputs=[a])
        return torch.autograd.grad(a.grad.sum(), b)
    _refused(backward_create_graph)
    a.grad = None


def _kalman_inputs():
    B, T, M, S = 1, 6, 2, 2
    return dict(v=torch.randn(B, T, M, dtype=F64), prec=torch.rand(B, T, M, dtype=F64) + 0.5,
                k=torch.randn(B, T, S, dtype=F64), q=torch.randn(B, T, S, dtype=F64),
                a_bar=torch.rand(M, S, dtype=F64) * 0.5 + 0.4, p_bar=torch.rand(M, S, dtype=F64) * 0.2 + 0.05)


def kalman_loop(v, prec, k, q, a_bar, p_bar):
    """The information-form recursion of docs/spec/kalman.md, float64, one token at a time (no floors hit)."""
    lam = torch.ones(v.shape[0], v.shape[2], k.shape[2], dtype=F64)
    eta = torch.zeros_like(lam)
    ys = []
    for t in range(v.shape[1]):
        kt = k[:, t, None, :]
        den = a_bar * a_bar + p_bar * lam
        eta = a_bar / den * eta + prec[:, t, :, None] * v[:, t, :, None] * kt
        lam = lam / den + prec[:, t, :, None] * kt * kt
        ys.append((q[:, t, None, :] * eta / lam).sum(-1))
    return torch.stack(ys, 1)


def _weighted_square_loss(ins: dict, w, fn, **kw):
    """(v, prec) -> sum(w * y^2) of the Kalman filter `fn` (the loop or kalman_filter with `kw`), the other inputs
    from `ins`."""
    def loss(v, prec):
        y = fn(v=v, prec=prec, **{n: x for n, x in ins.items() if n not in ("v", "prec")}, **kw)
        y = y[0] if isinstance(y, tuple) else y
        return (w * y * y).sum()
    return loss


def test_kalman_filter_second_derivatives():
    ins = _kalman_inputs()
    w = torch.randn_like(ins["v"])
    dv, dprec = torch.randn_like(ins["v"]), torch.randn_like(ins["prec"])
    loss_of = functools.partial(_weighted_square_loss, ins, w)
    _, want = torch.autograd.functional.hvp(loss_of(kalman_loop), (ins["v"], ins["prec"]), (dv, dprec))
    # the instance: 0 here before, on the reference backend
    _, got = torch.autograd.functional.hvp(loss_of(kalman_filter, backend="reference"), (ins["v"], ins["prec"]),
                                           (dv, dprec))
    for g, r in zip(got, want):
        assert_close(g, r, "kalman_grad", name="hvp")


@pytest.mark.slow
def test_kalman_filter_second_derivatives_on_generated_kernels():
    ins = _kalman_inputs()
    w, dv, dprec = torch.randn_like(ins["v"]), torch.randn_like(ins["v"]), torch.randn_like(ins["prec"])
    loss_of = functools.partial(_weighted_square_loss, ins, w)
    # the exact adjoint is itself a pair of scans, so grad of grad is exact ...
    v = ins["v"].clone().requires_grad_()
    g_ref, = torch.autograd.grad(loss_of(kalman_loop)(v, ins["prec"]), v, create_graph=True)
    want_vv, = torch.autograd.grad((g_ref * dv).sum(), v)
    g_tri, = torch.autograd.grad(loss_of(kalman_filter, backend="triton", form="two_scans")(v, ins["prec"]), v,
                                 create_graph=True)
    got_vv, = torch.autograd.grad((g_tri * dv).sum(), v)
    assert_close(got_vv, want_vv, "kalman_grad", name="gradgrad triton")
    # ... and the fused mixer kernels refuse
    _refused(lambda: torch.autograd.functional.hvp(loss_of(kalman_filter, backend="triton", form="fused"),
                                                   (ins["v"], ins["prec"]), (dv, dprec)))


def _delta_inputs(dtype):
    B, T, H, K, V = 1, 5, 1, 4, 3
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = -torch.rand(B, T, H, generator=gen, dtype=dtype) * 0.3
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    return q, k, v, g, beta


def delta_loop(q, k, v, g, beta):
    """S_t = e^g (I - beta k k^T) S + beta k v^T, o_t = K^-1/2 S_t^T q_t; float64, autograd-able."""
    S = torch.zeros(q.shape[2], q.shape[3], v.shape[3], dtype=q.dtype)
    out = []
    for t in range(q.shape[1]):
        S = torch.exp(g[0, t])[:, None, None] * S
        e = v[0, t] - torch.einsum("hkv,hk->hv", S, k[0, t])
        S = S + beta[0, t][:, None, None] * k[0, t][:, :, None] * e[:, None, :]
        out.append(q.shape[3] ** -0.5 * torch.einsum("hkv,hk->hv", S, q[0, t]))
    return torch.stack(out)[None]


def test_delta_rule_second_derivatives():
    q, k, v, g, beta = _delta_inputs(F64)
    dv = torch.randn_like(v)

    def loss_of(fn, **kw):
        return lambda v: (fn(q, k, v, g, beta, **kw)[0] ** 2).sum() if kw else (fn(q, k, v, g, beta) ** 2).sum()
    _, got = torch.autograd.functional.hvp(loss_of(delta_rule, backend="reference", chunk_size=16), v, dv)
    _, want = torch.autograd.functional.hvp(loss_of(delta_loop), v, dv)
    assert_close(got, want, "scan_grad", name="hvp v (reference)")
    q32, k32, v32, g32, b32 = (t.float() for t in (q, k, v, g, beta))
    _refused(lambda: torch.autograd.functional.hvp(
        lambda v: (delta_rule(q32, k32, v, g32, b32, backend="triton", chunk_size=16)[0] ** 2).sum(), v32, dv.float()))
