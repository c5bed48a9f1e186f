"""Time the matrix-state members' generated kernels on a GPU, checked against the float64 chunked
reference in the same run.

    python -m scanlang.tools.bench_linear [--B 8] [--T 4096] [--H 16] [--K 128] [--V 128] [--chunk 64]
                                          [--members a,b] [--forward auto|fused|split] [--key-block 64]
                                          [--delta-key-block 32] [--pairwise-block 1]
                                          [--no-fla] [--breakdown]

Per member (linear_attention, simple_gla, gla and kda on backends/linear; gated_delta_product with n = 2
on the delta-rule kernels over the interleaved rows), bf16 inputs (the delta members' keys unit vectors): first o and every gradient against
backend="reference" in float64 at B1 and T = min(T, 1024) (the reference's per-key pairwise tensor is
[C, C, K] per chunk), under scanlang.testing's rows (RMS ratio and every element); a member that fails
its check (or raises) is reported FAIL and not timed, and the run exits 1. Then the median forward and
forward+backward time (triton.testing.do_bench; on CUDA also the GPU's own time, scanlang/tools/timing.py)
at the given shape, both on the chunk kernels (the
no-grad forward of a short input would otherwise take the decode kernel: tuning.decode_max_tokens = 0),
next to fla's chunk op (chunk_linear_attn with normalize=False, chunk_simple_gla, chunk_gla, chunk_kda,
chunk_gated_delta_product) on the same inputs when fla-core is installed. `--breakdown` adds every kernel's
GPU time over one forward+backward. `--device cpu` runs the same steps
in Triton's interpreter with wall-clock times (tests, tiny shapes).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import triton
import triton.testing

from scanlang import tuning
from scanlang.recipes import linear
from scanlang.testing import check as check_close
from scanlang.tools.timing import gpu_ms, kernel_ms

MEMBERS = ("linear_attention", "simple_gla", "gla", "kda", "gated_delta_product")
N_HOUSEHOLDER = 2   # gated_delta_product's steps per token (DESIGN.md's row)
# each member's inputs after q, k, v: (name, per-key?, rows per token) and the tolerance row of their gradient
EXTRA = {"linear_attention": [], "simple_gla": [("g", False, 1)], "gla": [("g", True, 1)],
         "kda": [("g", True, 1), ("beta", False, 1)],
         "gated_delta_product": [("g", False, 1), ("beta", False, N_HOUSEHOLDER)]}
KIND = {"g": "delta_gate_grad", "beta": "delta_grad"}   # rows of scanlang.testing


def _names(member):
    extra = [n for n, *_ in EXTRA[member]]
    return ("o", "dq", "dk", "dv", *(f"d{n}" for n in extra)), \
        ("delta_out", "delta_grad", "delta_grad", "delta_grad", *(KIND[n] for n in extra))


def _inputs(member, B, T, H, K, V, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    n = N_HOUSEHOLDER if member == "gated_delta_product" else 1
    delta = member in ("kda", "gated_delta_product")
    q = torch.randn(B, T, H, K, generator=gen, device=device) * K ** -0.5
    k = torch.randn(B, T * n, H, K, generator=gen, device=device)
    # the delta rule's keys are unit vectors (fla's use_qk_l2norm), the plain writes' scaled
    k = torch.nn.functional.normalize(k, dim=-1) if delta else k * K ** -0.5
    v = torch.randn(B, T * n, H, V, generator=gen, device=device)
    xs = []
    for name, per_key, rows in EXTRA[member]:
        x = torch.randn(B, T * rows, H, *((K,) if per_key else ()), generator=gen, device=device)
        xs.append(torch.nn.functional.logsigmoid(x + 3) if name == "g" else torch.sigmoid(x))
    return [t.to(dtype) for t in (q, k, v)] + xs


def _call(member, *ins, **kw):
    fn = getattr(linear, member)
    if member == "gated_delta_product":
        return fn(*ins, N_HOUSEHOLDER, **kw)
    return fn(*ins, **kw)


def check(member, T, H, K, V, C, device) -> dict:
    """{name: (within its rows, RMS ratio)} for o and every gradient of the bf16 triton run against the
    float64 reference."""
    ins = _inputs(member, 1, T, H, K, V, torch.bfloat16, device)
    out = {}
    for be in ("triton", "reference"):
        xs = [t.detach().clone().to(torch.float64 if be == "reference" else t.dtype).requires_grad_() for t in ins]
        o, _ = _call(member, *xs, backend=be, chunk_size=C)
        w = torch.randn(o.shape, generator=torch.Generator(device=device).manual_seed(1), device=device,
                        dtype=torch.float64).to(o.dtype)
        (o * w).sum().backward()
        out[be] = [o] + [x.grad for x in xs]
    names, kinds = _names(member)
    return {n: check_close(a, b, kind, torch.bfloat16)
            for n, kind, a, b in zip(names, kinds, out["triton"], out["reference"])}


def bench_ms(fn, device) -> float:
    if device.type != "cuda":   # the interpreter (tests): one call's wall-clock time after a first call
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return triton.testing.do_bench(fn)


def _member_fns(member, B, T, H, K, V, C, device):
    """(forward, forward+backward) of `member` on fresh bf16 inputs, the forward without autograd."""
    ins = [t.requires_grad_() for t in _inputs(member, B, T, H, K, V, torch.bfloat16, device)]
    do = torch.randn(B, T, H, V, device=device)

    def fwd():
        with torch.no_grad(), tuning.override(decode_max_tokens=0):   # the chunk kernels, not the decode kernel
            return _call(member, *ins, backend="triton", chunk_size=C)

    def fwd_bwd():
        o, _ = _call(member, *ins, backend="triton", chunk_size=C)
        torch.autograd.grad(o, ins, do)
    return fwd, fwd_bwd


def time_member(member, B, T, H, K, V, C, device) -> tuple[float, float, float, float]:
    """(fwd, fwd+bwd) wall ms, then their GPU ms (timing.gpu_ms: the host's gaps left out; NaN off CUDA)."""
    fwd, fwd_bwd = _member_fns(member, B, T, H, K, V, C, device)
    walls = (bench_ms(fwd, device), bench_ms(fwd_bwd, device))
    if device.type != "cuda":
        return (*walls, float("nan"), float("nan"))
    return (*walls, gpu_ms(fwd), gpu_ms(fwd_bwd))


def breakdown(member, B, T, H, K, V, C, device) -> list[tuple[str, str, float]]:
    """(kernel, what, ms) of one forward+backward. CUDA: every kernel, memset and copy by name, GPU ms per
    call and launches per call (timing.kernel_ms). Elsewhere: every backends/linear kernel launch in order
    with its grid, each launch timed again on its own (buffers as the run left them)."""
    from scanlang.backends.linear import ops
    _, fwd_bwd = _member_fns(member, B, T, H, K, V, C, device)
    if device.type == "cuda":
        return [(name, f"x{n:g} per call", ms) for name, ms, n in kernel_ms(fwd_bwd)]
    with ops.recording(run=True) as launches:
        fwd_bwd()
    return [(name, f"grid {grid}", bench_ms(lambda: kernel[grid](*args, **meta), device))
            for name, kernel, grid, args, meta in launches]


def _fla_op(member):
    """fla's chunk op of `member` with our argument order (q, k, v[, g]), or None without fla-core."""
    try:
        if member == "linear_attention":
            from fla.ops.linear_attn import chunk_linear_attn
            return lambda q, k, v: chunk_linear_attn(q, k, v, normalize=False)
        if member == "simple_gla":
            from fla.ops.simple_gla import chunk_simple_gla
            return lambda q, k, v, g: chunk_simple_gla(q, k, v, g)
        if member == "gla":
            from fla.ops.gla import chunk_gla
            return lambda q, k, v, g: chunk_gla(q, k, v, g)
        if member == "kda":
            from fla.ops.kda import chunk_kda
            return lambda q, k, v, g, beta: chunk_kda(q, k, v, g, beta)
        from fla.ops.gated_delta_product import chunk_gated_delta_product
        return lambda q, k, v, g, beta: chunk_gated_delta_product(q, k, v, g, beta, N_HOUSEHOLDER)
    except ImportError:
        return None


def time_anchor(member, B, T, H, K, V, device, kernels: bool = False):
    """(fla fwd ms, fwd+bwd ms (wall), their GPU ms, RMS ratio of fla's o to ours, and with `kernels` fla's
    (kernel, ms, launches) of one forward+backward) on the same inputs, or None without fla."""
    op = _fla_op(member)
    if op is None or device.type != "cuda":
        return None
    ins = [t.requires_grad_() for t in _inputs(member, B, T, H, K, V, torch.bfloat16, device)]
    with torch.no_grad():
        ours, _ = _call(member, *ins, backend="triton")
        theirs = op(*ins)[0]
        t_fwd = bench_ms(lambda: op(*ins), device)
        g_fwd = gpu_ms(lambda: op(*ins))
    do = torch.randn(B, T, H, V, device=device, dtype=torch.bfloat16)
    fwd_bwd = lambda: torch.autograd.grad(op(*ins)[0], ins, do)  # noqa: E731
    try:
        fwd_bwd()
    except RuntimeError as exc:   # fla 0.6 refuses its gated backward under Triton 3.4-3.7.0 on Hopper (its #640)
        if "#640" not in str(exc):
            raise
        # the refusal guards fla's gradients, not its speed: time the same kernels with the guard lifted, and
        # say so (fla's gradients are then not used for anything)
        import fla.ops.common.chunk_o as fla_chunk_o
        fla_chunk_o.TRITON_ABOVE_3_7_1 = True
        print(f"  {'':17s} fla's backward refuses to run ({str(exc).splitlines()[0][:60]}...): timed with "
              "its #640 guard lifted (timing only; its gradients unchecked)")
    t_all, g_all = bench_ms(fwd_bwd, device), gpu_ms(fwd_bwd)
    parts = kernel_ms(fwd_bwd) if kernels else []
    return t_fwd, t_all, g_fwd, g_all, float((theirs.float() - ours).norm() / ours.norm()), parts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("B", 8), ("T", 4096), ("H", 16), ("K", 128), ("V", 128), ("chunk", 64)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--members", default=",".join(MEMBERS))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--forward", default="auto", choices=("auto", "fused", "split"),
                   help="the plain-write forward (tuning.linear_forward)")
    p.add_argument("--key-block", type=int, default=64, help="tuning.linear_key_block (per-key backward)")
    p.add_argument("--delta-key-block", type=int, default=32,
                   help="tuning.linear_delta_key_block (the per-key delta backward: kda)")
    p.add_argument("--pairwise-block", type=int, default=tuning.DEFAULT.linear_pairwise_block,
                   help="tuning.linear_pairwise_block (per-key decay: rows inside which pairs are formed exactly)")
    p.add_argument("--no-fla", action="store_true", help="do not time fla's chunk op (timed when installed)")
    p.add_argument("--breakdown", action="store_true", help="also time each kernel of one forward+backward")
    a = p.parse_args(argv)
    with tuning.override(linear_forward=a.forward, linear_key_block=a.key_block,
                         linear_delta_key_block=a.delta_key_block, linear_pairwise_block=a.pairwise_block):
        return _run(a)


def _run(a) -> int:
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU (or --device cpu)", file=sys.stderr)
        return 2
    device = torch.device(a.device)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"{gpu}, torch {torch.__version__}, Triton {triton.__version__}; "
          f"bf16 B{a.B} T{a.T} H{a.H} K{a.K} V{a.V} C{a.chunk}; forward {a.forward}, key block {a.key_block}, "
          f"delta key block {a.delta_key_block}, pairwise block {a.pairwise_block}")
    failures = []
    for member in a.members.split(","):
        try:
            verdicts = check(member, min(a.T, 1024), a.H, a.K, a.V, a.chunk, device)
        except Exception as exc:   # a member that cannot run is a failed check, not a missing row
            print(f"  {member:17s} FAIL: {type(exc).__name__}: {exc}", flush=True)
            failures.append(member)
            continue
        ratios = " ".join(f"{n} {r:.1e}" for n, (_, r) in verdicts.items())
        bad = [n for n, (ok, _) in verdicts.items() if not ok]
        if bad:
            print(f"  {member:17s} FAIL against float64 ({', '.join(bad)} outside their rows): {ratios}; not timed",
                  flush=True)
            failures.append(member)
            continue
        t_fwd, t_all, g_fwd, g_all = time_member(member, a.B, a.T, a.H, a.K, a.V, a.chunk, device)
        gpu = f" (GPU {g_fwd:.3f} / {g_all:.3f})" if device.type == "cuda" else ""
        print(f"  {member:17s} fwd {t_fwd:8.3f} ms  fwd+bwd {t_all:8.3f} ms{gpu}  vs float64 (PASS): {ratios}",
              flush=True)
        if a.breakdown:
            for name, what, ms in breakdown(member, a.B, a.T, a.H, a.K, a.V, a.chunk, device):
                print(f"  {'':17s}   {name[:40]:40s} {what:24s} {ms:8.3f} ms", flush=True)
        if a.no_fla:
            continue
        anchor = time_anchor(member, a.B, a.T, a.H, a.K, a.V, device, kernels=a.breakdown)
        if anchor is None:
            print(f"  {'':17s} fla: not installed (pip fla-core) or not on a GPU; no anchor")
        else:
            f_fwd, f_all, fg_fwd, fg_all, rel, parts = anchor
            print(f"  {'':17s} fla fwd {f_fwd:8.3f} ms  fwd+bwd {f_all:8.3f} ms (GPU {fg_fwd:.3f} / {fg_all:.3f})  "
                  f"-> ours/fla GPU {g_fwd / fg_fwd:.2f}x / {g_all / fg_all:.2f}x, wall {t_fwd / f_fwd:.2f}x / "
                  f"{t_all / f_all:.2f}x (fla's o vs ours: RMS ratio {rel:.1e})", flush=True)
            for name, ms, n in parts:
                print(f"  {'':17s}   fla {name[:36]:36s} {f'x{n:g} per call':24s} {ms:8.3f} ms", flush=True)
    if failures:
        print(f"FAILED: {failures}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
