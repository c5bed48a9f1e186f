"""A new sequence mixer in a few lines: a decayed outer-product state read out by a query.

    h_t[d, s] = exp(log_a[d, s]) * h_{t-1}[d, s] + v_t[d] * k_t[s]        (an affine recurrence)
    y_t[d]    = sum_s q_t[s] * h_t[d, s]

The naive PyTorch loop below materialises h for every step (B*T*D*S floats) and runs T small
kernels; `sl.mixer` generates one fused forward and one fused backward kernel that read v, k, q
once, keep h in registers and write only y (plus one checkpoint per lane every few hundred steps).
Runs on a GPU, or on CPU through Triton's interpreter at a small size.
"""
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # run the generated kernels on CPU

import scanlang as sl  # noqa: E402
from scanlang.testing import assert_close  # noqa: E402

# ---- the whole mixer ---------------------------------------------------------------------------
decayed_attention = sl.mixer(
    sl.Affine, axes="b t d s",
    inputs={"v": "b t d", "k": "b t s", "q": "b t s", "log_a": "d s"},
    lift=lambda u: (sl.exp(u.log_a), u.v * u.k),       # element (a, b) of h -> a h + b
    readout=lambda p, u, prev: p.b * u.q,              # p.b is h_t
    outputs=("y",), reduce="s")                        # y sums over the state axis s
# -------------------------------------------------------------------------------------------------


def loop(v, k, q, log_a):
    h = torch.zeros(v.shape[0], *log_a.shape, dtype=v.dtype, device=v.device)
    ys = []
    for t in range(v.shape[1]):
        h = log_a.exp() * h + v[:, t, :, None] * k[:, t, None, :]
        ys.append((h * q[:, t, None, :]).sum(-1))
    return torch.stack(ys, 1)


def main():
    cuda = torch.cuda.is_available()
    B, T, D, S = (8, 2048, 512, 16) if cuda else (2, 37, 3, 4)
    dev = "cuda" if cuda else "cpu"
    v, k, q = torch.randn(B, T, D, device=dev), torch.randn(B, T, S, device=dev), torch.randn(B, T, S, device=dev)
    log_a = (-torch.rand(D, S, device=dev) * 0.1).requires_grad_()
    for x in (v, k, q):
        x.requires_grad_()

    y = decayed_attention(v=v, k=k, q=q, log_a=log_a).y
    ref = loop(*(x.double() for x in (v, k, q, log_a)))
    assert_close(y, ref, "scan", dtype=torch.float32)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, (v, k, q, log_a), g)
    want = torch.autograd.grad(ref, (v, k, q, log_a), g.double())
    for name, a, b in zip(("dv", "dk", "dq", "dlog_a"), got, want):
        assert_close(a, b, "scan_grad", dtype=torch.float32, name=name)
    print(f"fused mixer matches the float64 loop (B={B} T={T} D={D} S={S}): outputs and gradients")

    def timed(fn, reps=3 if cuda else 1):   # on CPU the interpreter's time says nothing: one rep
        fn()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps * 1e3
    with torch.no_grad():
        fused = timed(lambda: decayed_attention(v=v, k=k, q=q, log_a=log_a))
        naive = timed(lambda: loop(v, k, q, log_a))
    where = "GPU" if cuda else "CPU (Triton interpreter: slow by design, correctness only)"
    print(f"forward on {where}: fused {fused:.2f} ms, naive loop {naive:.2f} ms")


if __name__ == "__main__":
    main()
