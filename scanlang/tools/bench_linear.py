"""Time the generated plain-write matrix-state kernels (backends/linear) on a GPU, checked against the
float64 chunked reference in the same run.

    python -m scanlang.tools.bench_linear [--B 8] [--T 4096] [--H 16] [--K 128] [--V 128] [--chunk 64]

Per member (linear_attention, simple_gla, gla), bf16 inputs: the median forward and forward+backward
time (triton.testing.do_bench) at the given shape, and the RMS ratio of o and of every gradient against
backend="reference" in float64 at B1 and T = min(T, 1024) (the reference's per-key pairwise tensor is
[C, C, K] per chunk).
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.testing

from scanlang.recipes import linear
from scanlang.testing import ratio

MEMBERS = ("linear_attention", "simple_gla", "gla")


def _inputs(member, B, T, H, K, V, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen, device=device) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, device=device)
    extra = {"linear_attention": [], "simple_gla": [(B, T, H)], "gla": [(B, T, H, K)]}[member]
    gs = [torch.nn.functional.logsigmoid(torch.randn(s, generator=gen, device=device) + 3) for s in extra]
    return [t.to(dtype) for t in (q * K ** -0.5, k * K ** -0.5, v)] + gs


def check(member, T, H, K, V, C, device) -> dict:
    """RMS ratios of the bf16 triton run against the float64 reference, o and every gradient."""
    ins = _inputs(member, 1, T, H, K, V, torch.bfloat16, device)
    out = {}
    for be in ("triton", "reference"):
        xs = [t.detach().clone().to(torch.float64 if be == "reference" else t.dtype).requires_grad_() for t in ins]
        o, _ = getattr(linear, member)(*xs, backend=be, chunk_size=C)
        w = torch.randn(o.shape, generator=torch.Generator(device=device).manual_seed(1), device=device,
                        dtype=torch.float64).to(o.dtype)
        (o * w).sum().backward()
        out[be] = [o] + [x.grad for x in xs]
    names = ["o", "dq", "dk", "dv", "dg"]
    return {n: ratio(a.double(), b) for n, a, b in zip(names, out["triton"], out["reference"])}


def time_member(member, B, T, H, K, V, C, device) -> tuple[float, float]:
    ins = [t.requires_grad_() for t in _inputs(member, B, T, H, K, V, torch.bfloat16, device)]
    fn = getattr(linear, member)
    fwd = lambda: fn(*ins, backend="triton", chunk_size=C)  # noqa: E731
    with torch.no_grad():
        t_fwd = triton.testing.do_bench(fwd)
    do = torch.randn(B, T, H, V, device=device)

    def fwd_bwd():
        o, _ = fwd()
        torch.autograd.grad(o, ins, do)
    return t_fwd, triton.testing.do_bench(fwd_bwd)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("B", 8), ("T", 4096), ("H", 16), ("K", 128), ("V", 128), ("chunk", 64)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--members", default=",".join(MEMBERS))
    a = p.parse_args(argv)
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}; "
          f"bf16 B{a.B} T{a.T} H{a.H} K{a.K} V{a.V} C{a.chunk}")
    for member in a.members.split(","):
        r = check(member, min(a.T, 1024), a.H, a.K, a.V, a.chunk, device)
        t_fwd, t_all = time_member(member, a.B, a.T, a.H, a.K, a.V, a.chunk, device)
        ratios = " ".join(f"{n} {v:.1e}" for n, v in r.items())
        print(f"  {member:17s} fwd {t_fwd:8.3f} ms  fwd+bwd {t_all:8.3f} ms  vs float64: {ratios}", flush=True)


if __name__ == "__main__":
    main()
