"""sl.mixer: fused lift -> scan -> readout against float64 loops (interpreter on CPU, GPU otherwise)."""
import pytest
import torch

import scanlang as sl
from scanlang.mixer import mixer
from scanlang.testing import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rnd(*shape, lo=None):
    x = torch.randn(*shape, dtype=torch.float64, device=DEVICE)
    return x if lo is None else x.abs() * (1 - lo) / 4 + lo


def kalman_like():
    """Gated outer-product state with a readout summed over the state axis, one using h_{t-1}."""
    return mixer(sl.Affine, axes="b t m s",
                 inputs={"v": "b t m", "k": "b t s", "q": "b t s", "a": "m s"},
                 lift=lambda u: (u.a, u.v * u.k),
                 readout=lambda p, u, prev: (p.b * u.q, p.b * prev.b),
                 outputs=("y", "z"), reduce="s")


def loop(v, k, q, a, h0=None):
    h = torch.zeros(v.shape[0], a.shape[0], a.shape[1], dtype=torch.float64, device=DEVICE) if h0 is None else h0
    ys, zs = [], []
    for t in range(v.shape[1]):
        prev = h
        h = a * h + v[:, t, :, None] * k[:, t, None, :]
        ys.append((h * q[:, t, None, :]).sum(-1))
        zs.append((h * prev).sum(-1))
    if not ys:
        empty = torch.zeros(v.shape[0], 0, a.shape[0], dtype=torch.float64, device=DEVICE)
        return empty, empty, h
    return torch.stack(ys, 1), torch.stack(zs, 1), h


@pytest.mark.parametrize("T", [1, 11])
def test_fused_mixer_outputs_final_state_and_gradients(T):
    B, M, S = 2, 3, 4
    v, k, q = rnd(B, T, M).requires_grad_(), rnd(B, T, S).requires_grad_(), rnd(B, T, S).requires_grad_()
    a = rnd(M, S, lo=0.5).requires_grad_()
    h0 = rnd(B, M, S).requires_grad_()
    mix = kalman_like()
    out = mix(v=v, k=k, q=q, a=a, initial=(1.0, h0), output_final_state=True)
    y, z, h = loop(v, k, q, a, h0)
    assert out.y.shape == (B, T, M) and out.final[1].shape == (B, M, S)
    assert_close(out.y, y, "scan")
    assert_close(out.z, z, "scan")
    assert_close(out.final[1], h, "scan")
    w = [torch.randn_like(y), torch.randn_like(z), torch.randn_like(h)]
    leaves = (v, k, q, a, h0)
    got = torch.autograd.grad((out.y * w[0]).sum() + (out.z * w[1]).sum() + (out.final[1] * w[2]).sum(), leaves)
    want = torch.autograd.grad((y * w[0]).sum() + (z * w[1]).sum() + (h * w[2]).sum(), leaves)
    for name, g, r in zip("v k q a h0".split(), got, want):
        assert g.shape == r.shape
        assert_close(g, r, "scan_grad", name=f"d{name}")


def test_mixer_float32_projective_readout():
    """Möbius scan with one value out: lam_t = prefix applied to lam0 = 1."""
    mix = mixer(sl.Mobius, axes="b t d", inputs={f: "b t d" for f in "abcd"},
                lift=lambda u: (u.a, u.b, u.c, u.d), readout=lambda p, u, q: (p.a + p.b) / (p.c + p.d),
                outputs=("lam",))
    xs = {f: (torch.rand(2, 13, 3, dtype=torch.float64, device=DEVICE) + 0.5) for f in "abcd"}
    lam = mix(**{f: x.float() for f, x in xs.items()}).lam
    m = torch.ones(2, 3, dtype=torch.float64, device=DEVICE)
    ref, s = [], [m, 0 * m, 0 * m, m]
    for t in range(13):
        x = [xs[f][:, t] for f in "abcd"]
        s = [x[0] * s[0] + x[1] * s[2], x[0] * s[1] + x[1] * s[3], x[2] * s[0] + x[3] * s[2], x[2] * s[1] + x[3] * s[3]]
        ref.append((s[0] + s[1]) / (s[2] + s[3]))
    assert lam.dtype == torch.float32
    assert_close(lam, torch.stack(ref, 1), "scan", dtype=torch.float32)


def test_mixer_errors_name_the_argument():
    mix = kalman_like()
    v, k = rnd(2, 5, 3), rnd(2, 5, 4)
    with pytest.raises(ValueError, match="missing"):
        mix(v=v, k=k, q=k)
    with pytest.raises(ValueError, match="axis 's'"):
        mix(v=v, k=k, q=rnd(2, 5, 2), a=rnd(3, 4))
    with pytest.raises(ValueError, match="power of two"):
        mix(v=v, k=rnd(2, 5, 3), q=rnd(2, 5, 3), a=rnd(3, 3))
    with pytest.raises(ValueError, match="reduce"):
        mixer(sl.Affine, axes="b t d", inputs={"x": "b t d"}, lift=lambda u: (u.x, u.x),
              readout=lambda p, u, q: p.b, outputs=("y",), reduce="b")
    with pytest.raises(ValueError, match="order"):
        mixer(sl.Affine, axes="b t d", inputs={"x": "t b"}, lift=lambda u: (u.x, u.x),
              readout=lambda p, u, q: p.b, outputs=("y",))


@pytest.mark.parametrize("reverse", [False, True])
def test_packed_sequences_restart_at_every_start(reverse):
    """cu_seqlens: one launch over packed sequences equals separate runs (empty and odd lengths)."""
    lengths = [5, 0, 13, 1]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=DEVICE)
    T, M, S, N = sum(lengths), 3, 4, len(lengths)
    v, k, q = rnd(1, T, M).requires_grad_(), rnd(1, T, S).requires_grad_(), rnd(1, T, S).requires_grad_()
    a = rnd(M, S, lo=0.5).requires_grad_()
    h0 = rnd(N, 1, M, S).requires_grad_()
    mix = kalman_like()
    out = mix(v=v, k=k, q=q, a=a, initial=(1.0, h0), output_final_state=True, cu_seqlens=cu, reverse=reverse)
    assert out.final[1].shape == (N, 1, M, S)
    ys, zs, hs = [], [], []
    for n in range(N):
        sl_ = slice(int(cu[n]), int(cu[n + 1]))
        vv, kk, qq = v[:, sl_], k[:, sl_], q[:, sl_]
        if reverse:
            vv, kk, qq = vv.flip(1), kk.flip(1), qq.flip(1)
        y, z, h = loop(vv, kk, qq, a, h0[n])
        if reverse:
            y, z = y.flip(1), z.flip(1)
        ys.append(y), zs.append(z), hs.append(h)
    y, z, h = torch.cat(ys, 1), torch.cat(zs, 1), torch.stack(hs)
    assert_close(out.y, y, "scan")
    assert_close(out.z, z, "scan")
    assert_close(out.final[1], h, "scan")
    w = [torch.randn_like(y), torch.randn_like(z), torch.randn_like(h)]
    leaves = (v, k, q, a, h0)
    got = torch.autograd.grad((out.y * w[0]).sum() + (out.z * w[1]).sum() + (out.final[1] * w[2]).sum(), leaves)
    want = torch.autograd.grad((y * w[0]).sum() + (z * w[1]).sum() + (h * w[2]).sum(), leaves)
    for name, g, r in zip("v k q a h0".split(), got, want):
        assert_close(g, r, "scan_grad", name=f"d{name}")


def test_gradients_of_inputs_broadcast_over_several_lane_axes():
    """A per-token gate 'b t' (broadcast over m and s: summed over the state lanes, then atomically
    over m) and a per-channel 'm' parameter (summed over time)."""
    mix = mixer(sl.Affine, axes="b t m s", inputs={"gate": "b t", "k": "b t s", "w": "m"},
                lift=lambda u: (u.gate, u.w * u.k), readout=lambda p, u, q: p.b, outputs=("y",), reduce="s")
    B, T, M, S = 2, 9, 3, 4
    gate = (torch.rand(B, T, dtype=torch.float64, device=DEVICE) * 0.8 + 0.1).requires_grad_()
    k, w = rnd(B, T, S).requires_grad_(), rnd(M).requires_grad_()
    y = mix(gate=gate, k=k, w=w).y
    h = torch.zeros(B, M, S, dtype=torch.float64, device=DEVICE)
    ref = []
    for t in range(T):
        h = gate[:, t, None, None] * h + w[None, :, None] * k[:, t, None, :]
        ref.append(h.sum(-1))
    ref = torch.stack(ref, 1)
    assert_close(y, ref, "scan")
    g = torch.randn_like(ref)
    for name, a, b in zip(("gate", "k", "w"), torch.autograd.grad(y, (gate, k, w), g),
                          torch.autograd.grad(ref, (gate, k, w), g)):
        assert_close(a, b, "scan_grad", name=f"d{name}")
