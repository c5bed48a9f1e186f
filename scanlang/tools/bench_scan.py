"""`scanlang bench`: the generated scans against the anchors on one GPU, every row checked.

    scanlang bench [--B 8 --D 1536 --T 4096] [--sweep] [--out DIR] [--no-anchors]
    python -m scanlang.tools.bench_scan ...     (the same)

Rows: affine scan (h only, and sl.scan returning both fields) and Möbius scan (4 fields in, one
value lam = (a + b)/(c + d) out, i.e. the prefix applied to lam0 = 1), forward and forward+backward,
fp32, time contiguous ([B, D, T], dim=-1) and channels contiguous ([B, T, D], dim=1). Anchors in the
same run: accelerated-scan (its Triton and CUDA kernels, when importable) and
torch._higher_order_ops.associative_scan under torch.compile (its backward once, not repeated).
Each scan also runs on the lane-sequential schedule (rows marked [lanes]; --sweep adds a few lane
blocks). Every row is compared with a float64 reference (RMS(err)/RMS(ref)); bandwidth is the minimum HBM
traffic over the time, also as a fraction of a device-to-device copy measured in the same run.

Every configuration is checked before it is timed: its outputs and its gradients against float64, with
scanlang.testing's rows ("scan", "scan_grad"; RMS and element-wise). A configuration that fails is
reported as FAILED, never timed, never chosen; scanlang's own rows that fail make the run exit 1.
The anchors (other libraries) are checked the same way and marked FAIL in the table, but do not
change the exit status: their bugs are not ours to gate on (torch's associative_scan backward is
known to be wrong, BENCHMARKS.md).

`--device cpu` runs the same steps in Triton's interpreter (TRITON_INTERPRET=1) with a wall-clock
timer, at tiny shapes: the CPU tests use it to prove a wrong kernel fails the run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch


DEVICE = "cuda"   # main(--device) sets it; "cpu" only under TRITON_INTERPRET=1 (tests)


def _bench(fn, graph: bool = False) -> float:
    import triton.testing as tt
    fn()
    if DEVICE != "cuda":   # the interpreter: one call's wall-clock time, no graphs
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    if graph:
        return tt.do_bench_cudagraph(fn, rep=50, return_mode="median")
    return tt.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _ratio(out, ref) -> float:
    from scanlang.testing import ratio
    return ratio(out, ref)


def _checked(outs, refs, what: str) -> tuple[bool, float]:
    """(every tensor within scanlang.testing's (what, float32) row on DEVICE, RMS and element-wise;
    the worst RMS ratio, inf when any is NaN)."""
    from scanlang.testing import check
    ok, worst = True, 0.0
    for out, ref in zip(outs, refs, strict=True):
        good, r = check(out, ref, what, torch.float32, device=DEVICE)
        ok &= good
        worst = r if not r <= worst else worst
    return ok, worst


class Table:
    def __init__(self, copy_gbs: float):
        self.copy_gbs = copy_gbs
        self.rows = []
        self.failures = []   # scanlang configurations whose outputs or gradients failed their check

    def fail(self, what: str):
        """A scanlang configuration failed its check: said now, in the summary, and in the exit status."""
        self.failures.append(what)
        print(f"FAILED: {what}", flush=True)

    def add(self, name, layout, ms, nbytes, err=None, note="", ok=True):
        gbs = nbytes / (ms * 1e-3) / 1e9 if ms else float("nan")
        row = dict(name=name, layout=layout, ms=ms, gbs=gbs, frac=gbs / self.copy_gbs, err=err, ok=ok, note=note)
        self.rows.append(row)
        print(f"{name:44s} {layout:9s} {ms:9.4f} ms {gbs:8.0f} GB/s {100 * row['frac']:5.1f}% "
              f"err {err if err is None else f'{err:.1e}'}{'' if ok else ' FAIL'} {note}", flush=True)

    def markdown(self) -> str:
        lines = ["| workload | layout | ms | GB/s | % of copy | RMS err / RMS ref vs float64 | note |",
                 "|---|---|---|---|---|---|---|"]
        for r in self.rows:
            err = "-" if r["err"] is None else f"{r['err']:.1e}" + ("" if r["ok"] else " **FAIL**")
            lines.append(f"| {r['name']} | {r['layout']} | {r['ms']:.4f} | {r['gbs']:.0f} | "
                         f"{100 * r['frac']:.1f}% | {err} | {r['note']} |")
        if self.failures:
            lines.append("")
            lines.extend(f"FAILED (not timed, not chosen): {f}" for f in self.failures)
        return "\n".join(lines)


def _mixer(kind: str, layout: str):
    """The benchmarked mixer for (kind, layout), built on first use (each costs a kernel generation)."""
    import scanlang as sl
    from scanlang.mixer import mixer
    key = kind, layout
    if key not in _MIXERS:
        axes = "b d t" if layout == "time" else "b t d"
        if kind == "affine":
            _MIXERS[key] = mixer(sl.Affine, axes=axes, inputs={"a": axes, "b": axes},
                                 lift=lambda u: (u.a, u.b), readout=lambda p, u, q: p.b, outputs=("h",))
        else:
            _MIXERS[key] = mixer(sl.Mobius, axes=axes, inputs={f: axes for f in "abcd"},
                                 lift=lambda u: (u.a, u.b, u.c, u.d),
                                 readout=lambda p, u, q: (p.a + p.b) / (p.c + p.d), outputs=("lam",))
    return _MIXERS[key]


_MIXERS: dict = {}


def _data(kind, layout, B, D, T, gen):
    shape = (B, D, T) if layout == "time" else (B, T, D)
    if kind == "affine":
        a = torch.rand(shape, device=DEVICE, generator=gen) * 0.5 + 0.5
        b = torch.randn(shape, device=DEVICE, generator=gen)
        return {"a": a, "b": b}
    return {f: torch.rand(shape, device=DEVICE, generator=gen) + 0.5 for f in "abcd"}


def _reference(kind, data, dim, grad_out=None):
    """float64 prefixes (and gradients) via the reference backend."""
    import scanlang as sl
    from scanlang.backends import reference
    d64 = {k: v.double().requires_grad_(grad_out is not None) for k, v in data.items()}
    monoid = sl.Affine if kind == "affine" else sl.Mobius
    outs = reference.scan(monoid, tuple(d64[f] for f in monoid.fields), dim, False, None, torch.float64)
    y = outs[1] if kind == "affine" else (outs[0] + outs[1]) / (outs[2] + outs[3])
    grads = None
    if grad_out is not None:
        grads = torch.autograd.grad(y, tuple(d64.values()), grad_out.double())
    return y.detach(), grads


def run_scans(table, B, D, T, anchors: bool, sweep: bool, log: dict, lanes: bool = True, only=None,
              bwd_sweep: bool = False):
    import scanlang as sl
    from scanlang import tuning
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for kind, layout in (("affine", "time"), ("affine", "channels"), ("mobius", "time"), ("mobius", "channels")):
        if only is not None and f"{kind}:{layout}" not in only:
            continue
        dim = 2 if layout == "time" else 1
        mix = _mixer(kind, layout)
        data = _data(kind, layout, B, D, T, gen)
        n = data["a"].numel()
        nf = len(data)
        g = torch.randn_like(data["a"])
        y_ref, g_ref = _reference(kind, data, dim, g)
        leaves = {k: v.clone().requires_grad_() for k, v in data.items()}

        def fwd_bwd():
            y = mix(**leaves)[0]
            return torch.autograd.grad(y, tuple(leaves.values()), g)
        configs = [None]
        if sweep:
            configs += _sweep_configs(layout)
        best = None
        for cfg in configs:
            with tuning.override(forced={} if cfg is None else {(layout == "time", False): cfg}):
                label = f"{kind} {layout} fwd config {cfg or 'default'}"
                try:   # checked first (its output, and the gradients through its checkpoints), then timed
                    ok, err = _checked([mix(**data)[0]], [y_ref], "scan")
                    ok_g, gerr = _checked(fwd_bwd(), g_ref, "scan_grad")
                    if not (ok and ok_g):
                        table.fail(f"{label}: output ratio {err:.1e}, worst gradient ratio {gerr:.1e}")
                        log.setdefault("sweep", []).append(dict(kind=kind, layout=layout, pass_="fwd", cfg=str(cfg),
                                                                failed=True, err=err, grad_err=gerr))
                        continue
                    ms = _bench(lambda: mix(**data), graph=True)
                except Exception as exc:  # a config that does not compile is skipped, and said so
                    print(f"config {cfg} failed: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                log.setdefault("sweep", []).append(dict(kind=kind, layout=layout, pass_="fwd", cfg=str(cfg), ms=ms, err=err))
                if best is None or ms < best[0]:
                    best = (ms, err, cfg)
        if best is None:
            table.fail(f"{kind} {layout}: no forward configuration passed its check; no rows for it")
            continue
        fwd_forced = {} if best[2] is None else {(layout == "time", False): best[2]}   # the chosen forward
        table.add(f"scanlang {kind} fwd ({nf} in, 1 out)", layout, best[0], (nf + 1) * n * 4, best[1],
                  note=str(best[2]) if best[2] else "default config")
        bwd_configs = [None]
        best_b = None
        for cfg in bwd_configs:
            forced = fwd_forced if cfg is None else {**fwd_forced, (layout == "time", True): cfg}
            with tuning.override(forced=forced):
                try:
                    ok, e = _checked(fwd_bwd(), g_ref, "scan_grad")
                    if not ok:
                        table.fail(f"{kind} {layout} fwd+bwd config {cfg or 'default'}: worst gradient ratio {e:.1e}")
                        continue
                    ms = _bench(fwd_bwd)
                    try:  # GPU time alone (CUDA graph replay), next to the time with Python launches
                        ms_graph = _bench(fwd_bwd, graph=True)
                    except Exception as exc:
                        ms_graph = float("nan")
                        print(f"fwd+bwd graph capture failed: {type(exc).__name__}: {str(exc)[:200]}")
                except Exception as exc:
                    print(f"bwd config {cfg} failed: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                log.setdefault("sweep", []).append(dict(kind=kind, layout=layout, pass_="fwd+bwd", cfg=str(cfg), ms=ms, err=e))
                if best_b is None or ms < best_b[0]:
                    best_b = (ms, e, cfg, ms_graph)
        if best_b is not None:
            table.add(f"scanlang {kind} fwd+bwd (grad err: max over inputs)", layout, best_b[0],
                      (nf + 1 + 2 * nf + 1) * n * 4, best_b[1],
                      note=f"{best_b[2] or 'default config'}; GPU time alone (CUDA graph) {best_b[3]:.4f} ms")
        if bwd_sweep:
            _bwd_sweep_rows(table, kind, layout, mix, data, g, y_ref, g_ref, n, log)
        if lanes:
            _lanes_rows(table, kind, layout, mix, data, g, y_ref, g_ref, n, sweep, log)
        if kind == "affine":
            monoid_out = sl.scan(sl.Affine, (data["a"], data["b"]), dim=dim, backend="triton")
            ok, err = _checked([monoid_out.b], [y_ref], "scan")
            if ok:
                ms = _bench(lambda: sl.scan(sl.Affine, (data["a"], data["b"]), dim=dim, backend="triton"))
                table.add("sl.scan(Affine) fwd (2 in, 2 out)", layout, ms, 4 * n * 4, err)
            else:
                table.fail(f"sl.scan(Affine) {layout}: output ratio {err:.1e}")
        if anchors:
            _anchors(table, kind, layout, data, dim, g, y_ref, g_ref, n, log)
        del data, leaves, y_ref, g_ref
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


# (block_t, block_l, warps, stages): the forward tiles `--bwd-sweep` times alone, per layout. Time contiguous:
# run-based tiles (kernel/runs.py; 256 steps per warp is one 8-step run per thread). Channels contiguous: the
# 32 x 32 tile (the default forward) and run-based tiles of 128-512 steps over 8-32 lanes (256 x 16: the training
# backward's tile).
FWD_SWEEP = {"time": ((256, 1, 1, 1), (512, 1, 2, 1), (1024, 1, 4, 1), (512, 1, 1, 1), (1024, 1, 2, 1),
                      (2048, 1, 4, 1), (256, 1, 1, 2), (512, 1, 2, 2)),
             "channels": ((32, 32, 1, 4), (256, 16, 4, 1), (128, 16, 4, 1), (256, 32, 4, 1))}
# fwd+bwd configs: (checkpoint interval = backward tile, block_l, warps, stages) of the backward, and the forward's
# (block_t, block_l, warps, stages) or None for the backward's tile. Channels: the 32 x 32 forward checkpointing
# every 256 steps (the training default) against run-based forwards on the backward's tile.
BWD_SWEEP = {"time": ((256, 1, 1, 1, None), (512, 1, 2, 1, None), (1024, 1, 4, 1, None), (512, 1, 1, 1, None),
                      (1024, 1, 2, 1, None)),
             "channels": ((32, 32, 1, 4, None), (256, 16, 4, 1, None), (256, 16, 4, 1, (32, 32, 1, 4)),
                          (128, 16, 4, 1, (32, 32, 1, 4)), (256, 16, 4, 2, (32, 32, 1, 4)),
                          (128, 16, 4, 2, (32, 32, 1, 4)), (256, 8, 4, 1, (32, 32, 1, 4)),
                          (256, 16, 2, 1, (32, 32, 1, 4)))}


def _bwd_sweep_rows(table, kind, layout, mix, data, g, y_ref, g_ref, n, log: dict):
    """Tile shapes for `layout` (FWD_SWEEP, BWD_SWEEP), GPU time alone (CUDA graph): the forward alone per
    tile; then fwd+bwd per backward tile = checkpoint interval (the forward on that tile or its own). Each
    checked first: its output and its gradients against float64."""
    from scanlang import tuning
    from scanlang.backends.triton.runtime import Config
    nf = len(data)
    key = layout == "time"
    leaves = {k: v.clone().requires_grad_() for k, v in data.items()}

    def fwd_bwd():
        return torch.autograd.grad(mix(**leaves)[0], tuple(leaves.values()), g)

    def checked(note) -> tuple[float, float] | None:
        ok, err = _checked([mix(**data)[0]], [y_ref], "scan")
        ok_g, gerr = _checked(fwd_bwd(), g_ref, "scan_grad")
        if ok and ok_g:
            return err, gerr
        table.fail(f"{kind} {layout} {note}: output ratio {err:.1e}, worst gradient ratio {gerr:.1e}")
        return None
    for bt, bl, warps, stages in FWD_SWEEP[layout]:
        forced = {(key, False): Config(block_t=bt, block_l=bl, num_warps=warps, stages=stages)}
        with tuning.override(forced=forced):
            note = f"forward tile {bt} x {bl}, warps {warps}, stages {stages}"
            try:
                errs = checked(note)
                if errs is None:
                    continue
                ms = _bench(lambda: mix(**data), graph=True)
                table.add(f"scanlang {kind} fwd, GPU time (CUDA graph)", layout, ms, (nf + 1) * n * 4, errs[0],
                          note=note)
                log.setdefault("fwd_sweep", []).append(dict(kind=kind, layout=layout, cfg=note, ms=ms, err=errs[0]))
            except Exception as exc:  # reported, not fatal
                print(f"fwd sweep {note} failed: {type(exc).__name__}: {str(exc)[:300]}")
    for chunk, bl, warps, stages, fwd in BWD_SWEEP[layout]:
        fbt, fbl, fwarps, fstages = fwd or (chunk, bl, warps, stages)
        forced = {(key, True): Config(block_t=chunk, block_l=bl, num_warps=warps, stages=stages, chunk=chunk),
                  (key, False): Config(block_t=fbt, block_l=fbl, num_warps=fwarps, stages=fstages, chunk=chunk)}
        with tuning.override(forced=forced):
            note = (f"backward tile {chunk} x {bl} (= checkpoint interval), warps {warps}, stages {stages}; forward "
                    + (f"tile {fbt} x {fbl}, warps {fwarps}, stages {fstages}" if fwd else "the same"))
            try:
                errs = checked(note)
                if errs is None:
                    continue
                ms = _bench(fwd_bwd, graph=True)
                table.add(f"scanlang {kind} fwd+bwd, GPU time (CUDA graph)", layout, ms, (3 * nf + 2) * n * 4, errs[1],
                          note=note)
                log.setdefault("bwd_sweep", []).append(dict(kind=kind, layout=layout, cfg=note, ms=ms, err=errs[1]))
            except Exception as exc:  # reported, not fatal
                print(f"bwd sweep {note} failed: {type(exc).__name__}: {str(exc)[:300]}")


def _lanes_rows(table, kind, layout, mix, data, g, y_ref, g_ref, n, sweep: bool, log: dict):
    """The same mixer on the lane-sequential schedule (forward and backward forced through
    `tuning.override(forced=...)`): fwd and fwd+bwd rows, each checked against the float64 reference before it
    is timed."""
    from scanlang import tuning
    from scanlang.backends.triton import runtime
    nf = len(data)
    shapes = [(64, 2, 64, 16)] + ([(32, 1, 64, 16), (128, 4, 64, 16), (64, 2, 64, 4), (64, 2, 128, 8)] if sweep else [])
    leaves = {k: v.clone().requires_grad_() for k, v in data.items()}

    def fwd_bwd():
        return torch.autograd.grad(mix(**leaves)[0], tuple(leaves.values()), g)
    for block_l, warps, chunk, unroll in shapes:
        forced = runtime.lanes_overrides(block_l=block_l, num_warps=warps, chunk=chunk, unroll=unroll)
        with tuning.override(forced=forced):
            note = f"lanes block_l={block_l} warps={warps} chunk={chunk} unroll={unroll}"
            try:
                ok, err = _checked([mix(**data)[0]], [y_ref], "scan")
                ok_g, gerr = _checked(fwd_bwd(), g_ref, "scan_grad")
                if not (ok and ok_g):
                    table.fail(f"{kind} {layout} {note}: output ratio {err:.1e}, worst gradient ratio {gerr:.1e}")
                    continue
                ms = _bench(lambda: mix(**data), graph=True)
                table.add(f"scanlang {kind} fwd [lanes] ({nf} in, 1 out)", layout, ms, (nf + 1) * n * 4, err, note=note)
                ms_b = _bench(fwd_bwd)
                table.add(f"scanlang {kind} fwd+bwd [lanes]", layout, ms_b, (nf + 1 + 2 * nf + 1) * n * 4, gerr, note=note)
                log.setdefault("lanes", []).append(dict(kind=kind, layout=layout, cfg=note, fwd_ms=ms, fwd_bwd_ms=ms_b,
                                                        err=err, grad_err=gerr))
            except Exception as exc:  # reported, not fatal: the tile rows above stand
                print(f"lanes {note} failed: {type(exc).__name__}: {str(exc)[:300]}")


def _sweep_configs(layout):
    """A few forward tiles besides the default (the default itself came from a wider sweep)."""
    from scanlang.backends.triton.runtime import Config
    if layout == "time":   # one 8-step run per thread (kernel/runs.py), and two; a pipelined tile loop
        return [Config(2048, 1, 8), Config(1024, 1, 4), Config(512, 1, 2), Config(2048, 1, 4),
                Config(1024, 1, 4, stages=2)]
    # one lane per thread keeps the time scan inside a thread (no shared memory, no barriers); more
    # stages keep more loads in flight (384 single-warp programs: ~3 warps per SM); 64 lanes on 1 warp
    # is 2 lanes per thread
    return [Config(64, 32, 1, 3), Config(128, 32, 1, 2), Config(128, 32, 1, 3), Config(32, 32, 1, 4),
            Config(64, 64, 1, 2), Config(64, 64, 2, 2), Config(128, 64, 2, 3), Config(32, 128, 4, 3)]


def _anchors(table, kind, layout, data, dim, g, y_ref, g_ref, n, log):
    """Other libraries' scans, checked like ours (a failure is marked FAIL, not counted in the exit status)."""
    nf = len(data)
    if kind == "affine" and layout == "time":
        for mod_name in ("scalar", "warp"):
            try:
                mod = __import__(f"accelerated_scan.{mod_name}", fromlist=["scan"])
                a, b = data["a"].contiguous(), data["b"].contiguous()
                ok, err = _checked([mod.scan(a, b)], [y_ref], "scan")
                ms = _bench(lambda: mod.scan(a, b))
                table.add(f"accelerated-scan.{mod_name} fwd", layout, ms, 3 * n * 4, err, ok=ok)
                al, bl = a.clone().requires_grad_(), b.clone().requires_grad_()
                ok, e = _checked(torch.autograd.grad(mod.scan(al, bl), (al, bl), g), g_ref, "scan_grad")
                ms = _bench(lambda: torch.autograd.grad(mod.scan(al, bl), (al, bl), g))
                table.add(f"accelerated-scan.{mod_name} fwd+bwd", layout, ms, 8 * n * 4, e, ok=ok)
            except Exception as exc:
                print(f"accelerated-scan.{mod_name} unavailable: {type(exc).__name__}: {str(exc)[:300]}")
    try:
        from torch._higher_order_ops.associative_scan import associative_scan
    except ImportError as exc:
        print(f"torch associative_scan unavailable: {exc}")
        return
    if kind == "affine":
        def combine(x, y):
            return y[0] * x[0], y[0] * x[1] + y[1]
    else:
        def combine(x, y):
            m = (y[0] * x[0] + y[1] * x[2], y[0] * x[1] + y[1] * x[3], y[2] * x[0] + y[3] * x[2], y[2] * x[1] + y[3] * x[3])
            s = m[0] + m[3]
            return tuple(v / s for v in m)

    def torch_scan(*xs):
        out = associative_scan(combine, tuple(xs), dim, combine_mode="pointwise")
        return out[1] if kind == "affine" else (out[0] + out[1]) / (out[2] + out[3])
    try:
        compiled = torch.compile(torch_scan, fullgraph=True)
        xs = tuple(data[f] for f in ("a", "b") if f in data) if kind == "affine" else tuple(data[f] for f in "abcd")
        ok, err = _checked([compiled(*xs)], [y_ref], "scan")
        ms = _bench(lambda: compiled(*xs))
        table.add(f"torch associative_scan+compile {kind} fwd", layout, ms, (nf + 1) * n * 4, err, ok=ok)
        if layout == "time":
            leaves = tuple(x.clone().requires_grad_() for x in xs)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = compiled(*leaves)
            gr = torch.autograd.grad(out, leaves, g)
            torch.cuda.synchronize()
            first = (time.perf_counter() - t0) * 1e3
            t0 = time.perf_counter()
            gr = torch.autograd.grad(compiled(*leaves), leaves, g)
            torch.cuda.synchronize()
            once = (time.perf_counter() - t0) * 1e3
            errs = [_ratio(x, r) for x, r in zip(gr, g_ref)]
            ok, worst = _checked(gr, g_ref, "scan_grad")
            table.add(f"torch associative_scan+compile {kind} fwd+bwd (1 call)", layout, once,
                      (3 * nf + 2) * n * 4, worst, ok=ok,
                      note=f"grad err per input {['%.1e' % e for e in errs]}; first call incl. compile {first:.0f} ms")
    except Exception as exc:
        print(f"torch associative_scan failed: {type(exc).__name__}: {str(exc)[:300]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scanlang bench", description=__doc__.splitlines()[0])
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--D", type=int, default=1536)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--sweep", action="store_true", help="also time a few tile configs and keep the best")
    p.add_argument("--no-anchors", action="store_true")
    p.add_argument("--no-lanes", action="store_true", help="skip the [lanes] rows (the lane-sequential schedule)")
    p.add_argument("--bwd-sweep", action="store_true", help="fwd and fwd+bwd under a few tiles per layout (FWD_SWEEP, BWD_SWEEP)")
    p.add_argument("--only", default=None, help="comma-separated workloads, e.g. affine:time,mobius:channels")
    p.add_argument("--out", default=None, help="folder for bench.json and bench.md")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: Triton's interpreter (TRITON_INTERPRET=1), tiny shapes, wall-clock times (tests)")
    args = p.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("scanlang bench needs a CUDA GPU (none found)")
        return 1
    import triton
    x = torch.empty(args.B * args.D * args.T, device=DEVICE)
    y = torch.empty_like(x)
    copy_ms = _bench(lambda: y.copy_(x), graph=True)
    copy_gbs = 2 * x.numel() * 4 / (copy_ms * 1e-3) / 1e9
    del x, y
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (Triton interpreter)"
    header = (f"{datetime.date.today()} | {device_name} | torch {torch.__version__} | "
              f"Triton {triton.__version__} | B={args.B} D={args.D} T={args.T} fp32 | copy {copy_gbs:.0f} GB/s")
    print(header, flush=True)
    table = Table(copy_gbs)
    log = {"header": header}
    run_scans(table, args.B, args.D, args.T, not args.no_anchors, args.sweep, log, lanes=not args.no_lanes,
              only=args.only.split(",") if args.only else None, bwd_sweep=args.bwd_sweep)
    md = f"{header}\n\n{table.markdown()}\n"
    print(md)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.md").write_text(md)
        (out / "bench.json").write_text(json.dumps(dict(log, rows=table.rows, failures=table.failures), indent=1,
                                                   default=str))
    if table.failures:
        print(f"{len(table.failures)} scanlang configuration(s) failed their check against float64:")
        for f in table.failures:
            print(f"  {f}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
