"""H200 benchmark of the Kalman filter scan: every implementation checked against float64, then timed.

    python -m scanlang.tools.bench_kalman [--out DIR] [--authors PATH] [--quick] [--only fused,scan-joint]

Implementations: "fused" (the 3x3 monoid as one sl.mixer), "fused-two" (a Möbius mixer then an
affine mixer), "scan-joint" / "scan-two" (generated
sl.scan kernels, PyTorch glue, the spec's adjoint), "authors-triton" (with --authors: the authors'
public code, measured side by side; never copied into this repository).

Workload (docs/spec/kalman.md; BENCHMARKS.md's targets): fp32, B=8, T=4096, M=1536, S=16 -> B*M*S = 196,608 independent
scalar lanes of length 4096, i.e. N = B*T*M*S = 8.05e8 (b, t, m, s) entries.

Floor, counted before measuring:
- bytes, forward: read v, prec [B,T,M] and k, q [B,T,S]; write y, y_var [B,T,M]:
  4 * (4 * 50.3M + 2 * 0.5M) = 0.81 GB -> 0.19 ms at the 4.27 TB/s copy ceiling.
  backward (recomputing the forward from per-tile checkpoints): read v, prec, k, q, dy, dy_var,
  write dv, dprec (+ dk, dq, da, dp, all small): 1.2 GB -> 0.28 ms; fwd+bwd >= 0.47 ms.
- flops, forward per entry (state recursion): prec k, phi, r (3 mul), den = a^2 + p lam (1 fma),
  1/den, lam = lam/den + phi (1 fma), f = a/den (1 mul), eta = f eta + r (1 fma), 1/lam,
  y += q eta/lam, y_var += q^2/lam (1 mul, 2 fma): ~16 flops and 2 reciprocals per entry,
  12.9 GFLOP (0.19 ms at 67 TFLOP/s fp32) but 1.6 G reciprocals at 16/clk/SM
  (132 SMs x 1.98 GHz -> 4.2 T/s): 0.39 ms. Forward floor ~0.4 ms (the reciprocal unit); the
  backward replays the forward and adds ~25 flops per entry: fwd+bwd floor ~0.9 ms.

Every implementation's outputs and all gradients (v, prec, k, q, a_bar, p_bar) are compared with
float64 autograd of the sequential loop at a shorter T in the same run (ratio RMS(err)/RMS(ref)) on
the schedule the timed shape uses, its outputs at the timed shape with the float64 loop's, then it
is timed with `triton.testing.do_bench` (median, fresh random inputs, warm-up). "fused" and
"fused-two" run the configs `runtime.choose_config` picks (at this shape: the lane-sequential
schedule with the specialised (lam, eta) carry); the "*-lanes" rows force `--lanes-*` instead.
`--lanes-stages FWD,BWD` software-pipelines the lane kernels' block loops in every row (one setting
per run: the tuning's loop_stages_forward / loop_stages_backward, render-time knobs).

The checks gate the timing: each output and gradient is compared with scanlang.testing's rows
("kalman_out", "kalman_grad"; RMS and element-wise, the GPU rows on CUDA). An implementation that
fails is reported as FAILED and not timed, and the run exits 1 (the authors' code, an anchor, is
marked FAILED but does not change the exit status). `--device cpu` runs the same steps in Triton's
interpreter (TRITON_INTERPRET=1) with a wall-clock timer: the CPU tests use it at tiny shapes.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

from scanlang import tuning
from scanlang.testing import check as check_close

from scanlang.recipes.kalman.filter import kalman_filter
from scanlang.recipes.kalman.reference import kalman_filter_loop

SHAPE = dict(B=8, T=4096, M=1536, S=16)
CHECK_SHAPE = dict(B=2, T=512, M=64, S=16)
NAMES = ("v", "prec", "k", "q", "a_bar", "p_bar")
ANCHORS = ("authors-triton",)   # checked and marked, not counted in the exit status


def make_inputs(B, T, M, S, device, dtype=torch.float32, seed=0):
    """Inputs in the ranges the layer produces: unit-norm keys/queries, log-uniform precisions."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    rnd = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
    v = torch.randn(B, T, M, generator=g, dtype=torch.float64)
    prec = torch.exp(math.log(0.05) + (math.log(50.0) - math.log(0.05)) * rnd(B, T, M))
    k = torch.nn.functional.normalize(torch.randn(B, T, S, generator=g, dtype=torch.float64), dim=-1)
    q = torch.nn.functional.normalize(torch.randn(B, T, S, generator=g, dtype=torch.float64), dim=-1)
    delta = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * rnd(M, S))
    a_bar = torch.exp(-delta)                                   # a = -1
    p_bar = 0.01 / 2 * -torch.expm1(-2 * delta)                 # OU noise, p = 0.01
    return [x.to(device=device, dtype=dtype) for x in (v, prec, k, q, a_bar, p_bar)]


def _fused_time_major(v, prec, k, q, a_bar, p_bar):
    from scanlang.recipes.kalman.fused import fused_filter
    lam0 = torch.ones(v.shape[0], v.shape[2], k.shape[-1], device=v.device)
    return fused_filter(v, prec, k, q, a_bar, p_bar, lam0, torch.zeros_like(lam0), False, time_major=True)[:2]


def implementations(authors: str | None):
    """name -> fn(v, prec, k, q, a_bar, p_bar) -> (y, y_var)."""
    impls = {
        # one sl.mixer: the 3x3 monoid fused with lift and readout, generated fwd + bwd kernels
        "fused": lambda *x: kalman_filter(*x, backend="triton", validate=False, form="fused")[:2],
        # the same mixer fed time-contiguous copies of the inputs (the generator's long-tile schedule)
        "fused-tm": _fused_time_major,
        # two sl.mixers: Möbius (readout: gate and 1/lam), then affine with the (y, y_var) readout
        "fused-two": lambda *x: kalman_filter(*x, backend="triton", validate=False, form="fused_two")[:2],
        # generated sl.scan kernels with the spec's adjoint; lift/readout glue in PyTorch
        "scan-joint": lambda *x: kalman_filter(*x, backend="triton", validate=False, form="joint")[:2],
        "scan-two": lambda *x: kalman_filter(*x, backend="triton", validate=False, form="two_scans")[:2],
    }
    # the same fused programs on the lane-sequential schedule (forced configs set around the run)
    impls["fused-lanes"] = impls["fused"]
    # the default program with the key/query gradients summed over a program's groups before one
    # atomic per state index (plan mode 5) instead of one relaxed atomic per lane (mode 1, the default)
    impls["fused-groupsum"] = impls["fused"]
    impls["fused-two-lanes"] = impls["fused-two"]
    if authors:
        sys.path.insert(0, authors)
        try:
            from kla.ops import kla_scan
            impls["authors-triton"] = lambda *x: kla_scan(*x, backend="triton")[:2]
        except Exception as exc:  # noqa: BLE001 - report and go on without it
            print(f"authors' code not importable: {exc!r}")
    return impls


def _compared(out, ref, what: str, failed: list, name: str) -> float:
    """The RMS ratio of `out` against `ref`; `name` appended to `failed` unless within the
    (what, float32) row of scanlang.testing on out's device (RMS and element-wise)."""
    ok, r = check_close(out, ref, what, torch.float32)
    if not ok:
        failed.append(name)
    return r


def worst(values) -> float:
    """The largest of `values`, NaN if any is NaN (max() would drop it)."""
    values = list(values)
    return float("nan") if any(math.isnan(v) for v in values) else max(values, default=0.0)


def check(fn, device, weights_seed=1):
    """Ratios of outputs and every gradient against float64 autograd of the loop (CHECK_SHAPE), on
    the schedule the timed shape runs (the lane threshold lowered when SHAPE has enough lanes)."""
    from scanlang.backends.triton import runtime
    lanes = runtime.prefers_lanes(SHAPE["B"] * SHAPE["M"] * SHAPE["S"])
    with tuning.override(lanes_min=1) if lanes else contextlib.nullcontext():
        return _check(fn, device, weights_seed)


def check_full_forward(fn, device):
    """Output ratios at the timed shape against the float64 loop (forward only: memory)."""
    ins = make_inputs(**SHAPE, device=device, seed=3)
    with torch.no_grad():
        y, y_var = fn(*ins)
        if device not in _FULL_REFERENCE:   # computed once per run
            _FULL_REFERENCE[device] = kalman_filter_loop(*(x.double() for x in ins))[:2]
        y64, v64 = _FULL_REFERENCE[device]
    failed = []
    out = {"y_full": _compared(y, y64, "kalman_out", failed, "y_full"),
           "y_var_full": _compared(y_var, v64, "kalman_out", failed, "y_var_full")}
    return dict(out, failed=failed)


_FULL_REFERENCE: dict = {}


def _check(fn, device, weights_seed):
    ins = make_inputs(**CHECK_SHAPE, device=device)
    leaves = [x.clone().requires_grad_() for x in ins]
    y, y_var = fn(*leaves)
    g = torch.Generator(device="cpu").manual_seed(weights_seed)
    wy, wv = (torch.randn(y.shape, generator=g).to(device) for _ in range(2))
    grads = torch.autograd.grad((y * wy).sum() + (y_var * wv).sum(), leaves)
    leaves64 = [x.detach().double().requires_grad_() for x in ins]
    y64, v64, _ = kalman_filter_loop(*leaves64)
    ref_grads = torch.autograd.grad((y64 * wy.double()).sum() + (v64 * wv.double()).sum(), leaves64)
    failed = []
    out = {"y": _compared(y, y64, "kalman_out", failed, "y"), "y_var": _compared(y_var, v64, "kalman_out", failed, "y_var")}
    out.update({f"d{n}": _compared(a, b, "kalman_grad", failed, f"d{n}") for n, a, b in zip(NAMES, grads, ref_grads)})
    return dict(out, failed=failed)


def _do_bench(fn, device, **kw) -> float:
    """triton.testing.do_bench's median on CUDA; one call's wall-clock time elsewhere (the interpreter)."""
    if device != "cuda":
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing as tt
    return tt.do_bench(fn, return_mode="median", **kw)


def timing(fn, device, quick: bool):
    shape = dict(SHAPE, T=min(512, SHAPE["T"])) if quick else SHAPE
    ins = make_inputs(**shape, device=device, seed=2)
    with torch.no_grad():
        fwd = _do_bench(lambda: fn(*ins), device, warmup=25, rep=100)
    leaves = [x.clone().requires_grad_() for x in ins]
    gy = torch.randn(shape["B"], shape["T"], shape["M"], device=device)

    def step():
        y, y_var = fn(*leaves)
        torch.autograd.backward((y, y_var), (gy, gy))
        for x in leaves:
            x.grad = None
    both = _do_bench(step, device, warmup=10, rep=100)
    return fwd, both, shape


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write results.json there")
    parser.add_argument("--authors", default=None, help="path holding the authors' `kla` package (src/)")
    parser.add_argument("--quick", action="store_true", help="T=512 timings (smoke test)")
    parser.add_argument("--only", default=None, help="comma-separated implementation names to run")
    parser.add_argument("--lanes-block", type=int, default=128,
                        help="lanes per program for the *-lanes rows (the plain rows use runtime.choose_config)")
    parser.add_argument("--lanes-warps", type=int, default=4)
    parser.add_argument("--lanes-chunk", type=int, default=8)
    parser.add_argument("--lanes-unroll", type=int, default=8)
    parser.add_argument("--lanes-unroll-bwd", type=int, default=None,
                        help="the backward's unroll in the *-lanes rows (default: --lanes-unroll)")
    parser.add_argument("--lanes-stages", default="1,1",
                        help="FWD,BWD: software-pipelining depth of the lane kernels' block loops, every row "
                             "(tuning loop_stages_forward, loop_stages_backward; 1 = plain loops)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: Triton's interpreter (TRITON_INTERPRET=1), wall-clock times (tests, tiny shapes)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("the benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    fwd_stages, bwd_stages = (int(x) for x in args.lanes_stages.split(","))
    with tuning.override(loop_stages_forward=fwd_stages, loop_stages_backward=bwd_stages):   # every row
        return _run(args)


def _run(args) -> int:
    """Every implementation checked, then timed; the table; the exit status."""
    from scanlang.backends.triton import runtime
    knobs = tuning.current()
    device = args.device
    import triton
    env = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               gpu=torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
               torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
               lanes_stages=dict(forward=knobs.loop_stages_forward, backward=knobs.loop_stages_backward))
    print(json.dumps(env))
    results = []
    for name, fn in implementations(args.authors).items():
        if args.only and name not in args.only.split(","):
            continue
        row = dict(name=name)
        forced = {}
        if name.endswith("-lanes"):
            unroll_bwd = args.lanes_unroll if args.lanes_unroll_bwd is None else args.lanes_unroll_bwd
            lanes = runtime.lanes_overrides(block_l=args.lanes_block, num_warps=args.lanes_warps,
                                            chunk=args.lanes_chunk, unroll=args.lanes_unroll)
            forced = {key: dataclasses.replace(cfg, unroll=unroll_bwd) if key[1] else cfg   # (layout, backward)
                      for key, cfg in lanes.items()}
            row["config"] = dict(block_l=args.lanes_block, warps=args.lanes_warps, chunk=args.lanes_chunk,
                                 unroll=args.lanes_unroll, unroll_bwd=unroll_bwd)
        with tuning.override(forced=forced, sum_groups_before_atomics=name == "fused-groupsum"):
            try:   # checked first; timed only when every output and gradient passed
                row["check"] = check(fn, device)
                full = check_full_forward(fn, device)
                row["check"]["failed"] += full.pop("failed")
                row["check"].update(full)
                if row["check"]["failed"]:
                    row["failed"] = row["check"]["failed"]
                else:
                    row["fwd_ms"], row["fwd_bwd_ms"], shape = timing(fn, device, args.quick)
                    row["shape"] = shape
            except Exception as exc:  # noqa: BLE001 - one failing implementation must not hide the rest
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        if device == "cuda":
            torch.cuda.empty_cache()
        results.append(row)
        print(json.dumps(row), flush=True)
    print("\n| implementation | fwd ms | fwd+bwd ms | worst output ratio | worst gradient ratio |")
    print("|---|---|---|---|---|")
    for row in results:
        if "error" in row:
            print(f"| {row['name']} | error: {row['error'][:80]} | | | |")
            continue
        c = row["check"]
        worst_out = worst([c["y"], c["y_var"], c.get("y_full", 0.0), c.get("y_var_full", 0.0)])
        worst_grad = worst(v for k_, v in c.items() if k_.startswith("d"))
        if "failed" in row:
            print(f"| {row['name']} | FAILED: {', '.join(row['failed'])} | not timed | {worst_out:.1e} | {worst_grad:.1e} |")
            continue
        print(f"| {row['name']} | {row['fwd_ms']:.3f} | {row['fwd_bwd_ms']:.3f} | {worst_out:.1e} | {worst_grad:.1e} |")
    counted = [row for row in results if row["name"] not in ANCHORS and ("failed" in row or "error" in row)]
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        tag = (args.only or "all").replace(",", "_")
        Path(args.out, f"kalman_bench_{tag}.json").write_text(json.dumps(dict(env=env, results=results), indent=1))
    if counted:
        print(f"FAILED (checks or errors): {', '.join(row['name'] for row in counted)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
