"""GPU benchmark of the chunk-parallel schedule: the affine scan with few lanes and a long T.

    python -m scanlang.tools.bench_chunked [--shape 1,16,1048576] [--chunk 1024 [--forward-chunk 4096] [--warps 4,2]]
        [--single-pass auto|forward|both|none [--lookback 32]] [--breakdown]

Times `sl.scan(sl.Affine, (a, b), dim=2)` at fp32 [B, D, T] (T contiguous; the default is the
prefill-at-batch-1 row of DESIGN.md's targets) forward and forward+backward against a copy of the
same bytes (torch clone of the tensors each pass must read and write once) and accelerated-scan's
Triton kernel when it is importable; `--single-pass` names the passes that run the one-pass look-back
variant instead of three kernels (tuning.chunk_single_pass; default auto: the affine forward). `--chunk` forces the
chunk of both passes (the forward checkpointing every chunk), `--forward-chunk` a longer forward chunk
checkpointing every `--chunk` steps. Before timing, outputs and
gradients are checked against the float64 reference backend (scanlang.testing's fp32 GPU rows); a
mismatch, or a pick other than the chunk-parallel kernels, exits 1. Prints a table of ms, GB/s and % of copy bandwidth;
`--breakdown` adds the GPU time of every kernel, memset and copy of one forward and one forward+backward.

Bytes counted (n = B * D * T elements, 4 bytes each): forward reads a, b and writes both prefixes
(4n); forward+backward adds the backward's reads of a, b and the gradient of out.b and its writes of
da, db (5n). accelerated-scan returns only the b prefix (forward 3n, forward+backward 3n + 5n).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys

import torch

from scanlang.tools.timing import gpu_ms


def _bench(fn) -> float:
    import triton.testing as tt
    fn()
    torch.cuda.synchronize()
    return tt.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _parse_shape(text: str) -> tuple[int, int, int]:
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"--shape: expected B,D,T (three positive integers), got {text!r}")
    return shape


def main(argv=None) -> int:
    from scanlang import tuning
    from scanlang.backends.triton import runtime

    parser = argparse.ArgumentParser(prog="python -m scanlang.tools.bench_chunked", description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default=f"1,16,{1 << 20}", help="B,D,T (default 1,16,1048576)")
    parser.add_argument("--chunk", type=int, default=0, help="steps per chunk (default: choose_config's)")
    parser.add_argument("--forward-chunk", type=int, default=0, help="with --chunk: the forward's steps per chunk "
                        "(a multiple of --chunk; default --chunk)")
    parser.add_argument("--warps", default="4,2", help="with --chunk: warps of the forward and backward kernels (default 4,2)")
    parser.add_argument("--single-pass", default="auto", choices=("auto", "forward", "both", "none"),
                        help="the passes that run the one-pass look-back variant (default auto: the forward)")
    parser.add_argument("--lookback", type=int, default=32, help="its chunks per look-back window (a power of two)")
    parser.add_argument("--breakdown", action="store_true", help="also list every kernel's GPU time")
    args = parser.parse_args(argv)
    try:
        B, D, T = _parse_shape(args.shape)
    except ValueError as exc:
        parser.error(str(exc))
    forced = {}
    if args.chunk:
        if args.chunk < 1 or args.chunk & (args.chunk - 1):
            parser.error(f"--chunk: expected a power of two, got {args.chunk}")
        try:
            fwd_warps, bwd_warps = (int(w) for w in args.warps.split(","))
        except ValueError:
            fwd_warps = bwd_warps = 0
        if not all(w in (1, 2, 4, 8, 16, 32) for w in (fwd_warps, bwd_warps)):
            parser.error(f"--warps: expected two powers of two in 1..32 (forward,backward), got {args.warps!r}")
        fchunk = args.forward_chunk or args.chunk
        if fchunk < args.chunk or fchunk % args.chunk or fchunk & (fchunk - 1):
            parser.error(f"--forward-chunk: expected a power of two and a multiple of --chunk, got {fchunk}")
        cfg = runtime.Config(block_t=args.chunk, block_l=1, num_warps=bwd_warps, schedule="chunked")
        forced = {(True, False): dataclasses.replace(cfg, block_t=fchunk, chunk=args.chunk, num_warps=fwd_warps),
                  (True, True): cfg}
    elif args.forward_chunk:
        parser.error("--forward-chunk: needs --chunk")
    if not torch.cuda.is_available():
        print("bench_chunked: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.lookback < 1 or args.lookback & (args.lookback - 1):
        parser.error(f"--lookback: expected a power of two, got {args.lookback}")
    with tuning.override(chunk_single_pass=args.single_pass, chunk_lookback=args.lookback), \
            tuning.override(forced=forced) if forced else contextlib.nullcontext():
        return _checked_then_timed(B, D, T, args.breakdown)


def _checked_then_timed(B: int, D: int, T: int, breakdown: bool = False) -> int:
    """The scan at [B, D, T] checked against float64 (exit status 1 on a mismatch), then the table."""
    import scanlang as sl
    from scanlang.backends.triton import chunked_launch, runtime
    from scanlang.testing import check

    torch.manual_seed(0)
    a = (torch.rand(B, D, T, device="cuda") * 0.1 + 0.9)
    b = torch.randn(B, D, T, device="cuda")
    g = torch.randn(B, D, T, device="cuda")
    n = a.numel()

    # correctness first: float64 reference (blocked torch scan) and its autograd
    a64, b64 = a.double().requires_grad_(), b.double().requires_grad_()
    ref = sl.scan(sl.Affine, (a64, b64), dim=2, backend="reference")
    ref_grads = torch.autograd.grad(ref.b, (a64, b64), g.double(), allow_unused=True)   # T = 1: out.b is b alone
    ref_grads = [torch.zeros_like(x) if d is None else d for x, d in zip((a64, b64), ref_grads)]
    ref = [r.detach() for r in ref]
    before = dict(chunked_launch.LAUNCHED)
    al, bl = a.clone().requires_grad_(), b.clone().requires_grad_()
    out = sl.scan(sl.Affine, (al, bl), dim=2, backend="triton")
    grads = torch.autograd.grad(out.b, (al, bl), g)
    ran = {k: v - before.get(k, 0) for k, v in chunked_launch.LAUNCHED.items() if v - before.get(k, 0)}
    failures = []
    if set(ran) != set(chunked_launch.kernel_names()):
        failures.append(f"the chunk-parallel kernels did not all run (ran: {ran})")
    for what, got, want, name in [("scan", out.a, ref[0], "out.a"), ("scan", out.b, ref[1], "out.b"),
                                  ("scan_grad", grads[0], ref_grads[0], "da"), ("scan_grad", grads[1], ref_grads[1], "db")]:
        ok, r = check(got, want, what, dtype=torch.float32)
        print(f"check {name}: RMS ratio {r:.2e} {'ok' if ok else 'MISMATCH'}")
        if not ok:
            failures.append(f"{name} differs from the float64 reference (ratio {r:.2e})")
    del a64, b64, ref, ref_grads, out, grads
    if failures:
        for f in failures:
            print(f"FAIL: {f}", file=sys.stderr)
        return 1

    rows = []

    def add(name, fn, nbytes):
        """A row: wall ms (do_bench), GPU ms (device time) and their GB/s as % of the copy's."""
        row = (name, _bench(fn), gpu_ms(fn), nbytes)
        rows.append(row)
        return row

    copy = add("copy (clone a, b)", lambda: (a.clone(), b.clone()), 4 * n * 4)
    passes = [runtime.chunk_single_pass(backward, len(sl.Affine.fields)) for backward in (False, True)]
    variant = {(True, False): "1-pass fwd", (True, True): "1-pass", (False, False): "3-kernel"}[tuple(passes)]
    add(f"scanlang ({variant}) fwd", lambda: sl.scan(sl.Affine, (a, b), dim=2, backend="triton"), 4 * n * 4)

    def fwd_bwd():
        o = sl.scan(sl.Affine, (al, bl), dim=2, backend="triton")
        return torch.autograd.grad(o.b, (al, bl), g)
    add(f"scanlang ({variant}) fwd+bwd", fwd_bwd, 9 * n * 4)
    if breakdown:
        _print_breakdown({"fwd": lambda: sl.scan(sl.Affine, (a, b), dim=2, backend="triton"), "fwd+bwd": fwd_bwd})
    try:   # its Triton kernel: accelerated_scan.scalar in 0.3, .triton in earlier releases
        from accelerated_scan.scalar import scan as accelerated
    except ImportError:
        try:
            from accelerated_scan.triton import scan as accelerated
        except ImportError as exc:
            accelerated = None
            print(f"accelerated-scan unavailable: {exc}")
    if accelerated is not None:
        ac, bc = a.contiguous(), b.contiguous()
        add("accelerated-scan (Triton) fwd", lambda: accelerated(ac, bc), 3 * n * 4)
        aa, ba = ac.clone().requires_grad_(), bc.clone().requires_grad_()
        add("accelerated-scan (Triton) fwd+bwd", lambda: torch.autograd.grad(accelerated(aa, ba), (aa, ba), g), 8 * n * 4)
    import triton
    print(f"\naffine scan fp32 [{B}, {D}, {T}], T contiguous; {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}, Triton {triton.__version__}; wall: median of triton.testing.do_bench; GPU: device "
          "time per call (torch.profiler), the host's gaps left out; % of the copy's GB/s, wall and GPU")
    print(f"| {'what':<34} | {'wall ms':>9} | {'GPU ms':>9} | {'GPU GB/s':>8} | {'% wall':>7} | {'% GPU':>7} |")
    print(f"|{'-' * 36}|{'-' * 11}|{'-' * 11}|{'-' * 10}|{'-' * 9}|{'-' * 9}|")
    copy_wall, copy_gpu = copy[3] / copy[1], copy[3] / copy[2]
    for name, wall, gpu, nbytes in rows:
        print(f"| {name:<34} | {wall:9.4f} | {gpu:9.4f} | {nbytes / gpu / 1e6:8.1f} | "
              f"{100 * nbytes / wall / copy_wall:6.1f}% | {100 * nbytes / gpu / copy_gpu:6.1f}% |")
    return 0


def _print_breakdown(calls) -> None:
    """Every kernel, memset and copy of each call in `calls` (name -> function), by GPU time."""
    from scanlang.tools.timing import kernel_ms
    for what, fn in calls.items():
        print(f"\n{what}: GPU time per kernel (torch.profiler)")
        for name, ms, launches in kernel_ms(fn):
            print(f"  {ms:8.4f} ms  x{launches:g}  {name[:90]}")


if __name__ == "__main__":
    sys.exit(main())
