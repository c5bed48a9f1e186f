"""GPU benchmark of the generated delta-rule kernels against flash-linear-attention (fla), with checks.

    python -m scanlang.tools.bench_delta [--out DIR] [--skip-correctness] [--no-breakdown]
                                      [--sweep [SECONDS]]

In this order, so that a run cut short by a time limit still has the headline table:
1. Timing at B8 T4096 H16 K=V=128 bf16 (GDN-style inputs), median of triton.testing.do_bench: fwd and
   fwd+bwd for fla, ours (GDN step), ours (Kaczmarz step), and one-token decode at B8 H16 (the whole call,
   and replayed as a CUDA graph: kernels only); then the outputs of that shape checked against the
   float64 reference, and the headline table.
2. Correctness (B2 T300 H4 K=V=64, bf16, T not a multiple of the chunk): ours and fla's
   chunk_gated_delta_rule against the float64 chunked reference (itself checked against the token
   loop by the CPU tests): o, final state and every gradient, ratio RMS(err)/RMS(ref). Kaczmarz with
   raw keys (norms log-uniform over [1e-2, 10]) for ours; fla runs it through the exact identity
   GDN(q, k r, v r, beta=eta), r = (||k||^2 + eps)^-1/2.
3. GPU time per kernel over one fwd+bwd (torch profiler), unless --no-breakdown.
4. With --sweep: a per-kernel search over value block / warps / stages within SECONDS (default 300; every
   config compiles, so it is bounded: kernels not reached keep their configs), then ours timed again.
Everything printed is also written to DIR/delta_bench.log and DIR/delta_bench.json after every step.

Checks gate what is reported: before ours is timed, its outputs and every gradient on a slice of the timed
inputs (one batch row, two heads, the timed T, K, V: the same kernels and launch configs) are compared
with the float64 reference under scanlang.testing's rows (RMS and element-wise, the GPU rows on CUDA); a
contender that fails is not timed. Every sweep config is checked the same way before it is timed, and one
that fails is reported FAILED and never kept. Any failed check of ours, or a step that raised, makes the
run exit 1 (fla, the anchor, is checked and marked FAIL but does not change the exit status).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

import torch
import triton
import triton.testing

from scanlang import tuning
from scanlang.recipes.kaczmarz import delta_rule, kaczmarz_delta_rule
from scanlang.testing import check as check_close
from scanlang.tools.timing import kernel_ms

LOG: list[str] = []
SHAPE = (8, 4096, 16, 128, 128)     # B, T, H, K, V of the timed runs and the sweep


def say(*parts):
    line = " ".join(str(p) for p in parts)
    LOG.append(line)
    print(line, flush=True)


def gdn_inputs(B, T, H, K, V, dtype, device, seed=0, requires_grad=False):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=device, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=device, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, device=device, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=device, generator=gen))
    beta = torch.randn(B, T, H, device=device, generator=gen).sigmoid()
    h0 = torch.randn(B, H, K, V, device=device, generator=gen)
    out = [q.to(dtype), k.to(dtype), v.to(dtype), g.float(), beta.float(), h0]
    return [t.requires_grad_(requires_grad) for t in out]


def grads_of(fn, inputs, seed=1):
    """fn(*inputs) -> (o, S); random float32 cotangents; returns [o, S, grad per input]."""
    ins = [t.detach().clone().requires_grad_() for t in inputs]
    o, S = fn(*ins)
    gen = torch.Generator(device=o.device).manual_seed(seed)
    do = torch.randn(o.shape, device=o.device, generator=gen, dtype=torch.float64).to(o.dtype)
    dS = torch.randn(S.shape, device=o.device, generator=gen, dtype=torch.float64).to(S.dtype)
    gs = torch.autograd.grad((o * do).sum() + (S * dS).sum(), ins)
    return [o.detach(), S.detach(), *gs]


def reference_fn(q, k, v, g, beta, h0):
    return delta_rule(*(t.double() for t in (q, k, v, g, beta)), initial_state=h0.double(), output_final_state=True,
                      backend="reference")


def kaczmarz_reference_fn(q, k, v, g, eta, h0):
    return kaczmarz_delta_rule(*(t.double() for t in (q, k, v, g, eta)), initial_state=h0.double(),
                               output_final_state=True, backend="reference")


def ours_fn(q, k, v, g, beta, h0):
    return delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="triton")


def fla_fn(q, k, v, g, beta, h0):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)


NAMES = ("o", "S", "dq", "dk", "dv", "dg", "dbeta", "dh0")
KINDS = ("delta_out", "delta_out", "delta_grad", "delta_grad", "delta_grad", "delta_gate_grad", "delta_gate_grad",
         "delta_grad")


def check(label, got, ref, dtype, results) -> bool:
    """o, S and every gradient of `got` against `ref` under scanlang.testing's rows for `dtype` on got's
    device; the verdict is said, kept in results[label], and (ours only) added to results["failures"]."""
    row = {}
    for name, kind, a, b in zip(NAMES, KINDS, got, ref, strict=True):
        row[name + "_ok"], row[name] = check_close(a, b, kind, dtype)
    results[label] = row
    passed = all(v for n, v in row.items() if n.endswith("_ok"))
    failed = [n for n in NAMES if not row[n + "_ok"]]
    say(f"  {label:28s} {'PASS' if passed else 'FAIL'} " + " ".join(f"{n}={row[n]:.2e}" for n in NAMES)
        + (f"  (outside its rows: {', '.join(failed)})" if failed else ""))
    if not passed and not label.startswith("fla"):
        results.setdefault("failures", []).append(label)
    return passed


def check_slice(label, fn, ins, results) -> bool:
    """`check` of fn on a slice of the timed inputs `ins` (batch row 0, the first two heads; same T, K, V, so
    the same kernels and launch configs) against the float64 reference: outputs and every gradient."""
    part = [t.detach()[:1, :, :2].contiguous() for t in ins[:5]] + [ins[5].detach()[:1, :2].contiguous()]
    ref = grads_of(reference_fn if "Kaczmarz" not in label else kaczmarz_reference_fn, part)
    return check(label + " (checked slice)", grads_of(fn, part), ref, part[0].dtype, results)


def correctness(device, results, have_fla):
    say("## correctness vs float64 reference (B2 T300 H4 K=V=64, bf16 inputs)")
    dtype = torch.bfloat16
    inputs = gdn_inputs(2, 300, 4, 64, 64, dtype, device)
    ref = grads_of(reference_fn, inputs)
    check("ours GDN-step", grads_of(ours_fn, inputs), ref, dtype, results)
    if have_fla:
        check("fla chunk_gated_delta_rule", grads_of(fla_fn, inputs), ref, dtype, results)
    # Kaczmarz: raw keys with norms log-uniform over [1e-2, 10]
    q, k, v, g, eta, h0 = inputs
    gen = torch.Generator(device=device).manual_seed(3)
    k = (k.float() * torch.exp(torch.empty(*k.shape[:3], 1, device=device).uniform_(
        math.log(1e-2), math.log(10), generator=gen))).to(dtype)
    kin = [q, k, v, g, eta, h0]
    kref = grads_of(lambda q, k, v, g, e, h0: kaczmarz_delta_rule(
        *(t.double() for t in (q, k, v, g, e)), initial_state=h0.double(), output_final_state=True,
        backend="reference"), kin)
    check("ours Kaczmarz raw keys", grads_of(lambda q, k, v, g, e, h0: kaczmarz_delta_rule(
        q, k, v, g, e, initial_state=h0, output_final_state=True, backend="triton"), kin), kref, dtype, results)
    if have_fla:
        def fla_kaczmarz(q, k, v, g, e, h0):
            r = ((k.float() ** 2).sum(-1, keepdim=True) + 1e-6).rsqrt()
            return fla_fn(q, (k.float() * r).to(dtype), (v.float() * r).to(dtype), g, e, h0)
        check("fla via identity (Kaczmarz)", grads_of(fla_kaczmarz, kin), kref, dtype, results)


def bench_ms(fn):
    if not torch.cuda.is_available():   # the interpreter (tests): one call's wall-clock time
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_ms(fn):
    """GPU time of `fn` replayed as a CUDA graph: the kernels without the host's work; None if it cannot be
    captured. (Called once first, so caches are filled outside the capture.)"""
    if not torch.cuda.is_available():
        return None
    try:
        fn()
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as exc:  # capture is a diagnostic; the whole-call time stands without it
        say(f"    (CUDA graph capture failed: {type(exc).__name__}: {str(exc)[:100]})")
        return None


def fwd_bwd(fn, ins, do):
    o = fn(*ins)[0]
    torch.autograd.grad(o, ins[:5], do)


DQK_ALL = dict(DG_SUMS=True, LOWP=True, LOWP_DK=True, LOWP_DTM=True)    # every bwd_dqk variant but WY
SWEEP_OPTIONS = {
    # prep: maxnreg=128 fits 4 blocks per SM instead of 3 for 160 B of spills (offline, Triton 3.6, K=V=128 bf16)
    "prep": [dict(num_warps=w, num_stages=st) for w in (4, 8) for st in (1, 2)] + [
        dict(num_warps=4, num_stages=2, maxnreg=128)],
    "wu": [dict(BV=64, num_warps=4, num_stages=st, PER_CHUNK=True) for st in (2, 1)] + [
        dict(BV=bv, num_warps=w, num_stages=2, PER_CHUNK=False) for bv in (64, 128) for w in (4, 8)],
    "state_fwd": [dict(BV=bv, num_warps=w, num_stages=st) for bv, w, st in
                  ((64, 4, 2), (64, 4, 1), (32, 4, 2), (64, 8, 2), (128, 8, 2))],
    # state_output: see tuning.DELTA_CONFIGS' comment (blocks per SM against B8 H16's 128 * V / BV sequential programs)
    # (BV=32, 8 warps, 1 stage) is left out: on the H200 (Triton 3.6, run 9 of session 4) it raised an illegal
    # memory access, which poisons the CUDA context and ends the sweep; not yet reduced to a repro
    "state_output": [dict(BV=bv, num_warps=w, num_stages=st) for bv, w, st in
                     ((64, 4, 1), (128, 8, 2), (128, 8, 1), (64, 8, 1), (64, 4, 2), (32, 4, 1))] + [
        dict(BV=32, num_warps=4, num_stages=1, maxnreg=128)],
    # The backward (tuning.DELTA_CONFIGS' defaults: run 12's picks among these variants, fwd+bwd 3.487 ms). Offline,
    # Triton 3.6, sm_90a, K=V=128 bf16 (registers, spill bytes, SASS instructions of the longest loop).
    # state_bwd (LOCAL_DU, 64 value columns, 4 warps, 1 stage; DECAY_V, LOWP_DU: 255, 120 B, loop 1932; plain: 255,
    # 236 B, 2468); SEQ_BOUNDS: 144 B, 1942; the separate dU_local pass (DECAY_V, LOWP_DU): 0 B, 1128. Two blocks per SM
    # (4 warps, <= 255 registers) run B8 H16's 256 sequential programs in one wave.
    "state_bwd": [dict(LOCAL_DU=True, BV=64, num_warps=4, num_stages=1, DECAY_V=True, LOWP_DU=True, SEQ_BOUNDS=True),
                  dict(LOCAL_DU=False, BV=64, num_warps=4, num_stages=1, DECAY_V=True, LOWP_DU=True, SEQ_BOUNDS=True),
                  dict(LOCAL_DU=True, BV=64, num_warps=4, num_stages=1, DECAY_V=True)],
    "dU_local": [dict(BV=bv, num_warps=w, num_stages=2) for bv in (64, 128) for w in (4, 8)] + [
        dict(BV=64, num_warps=4, num_stages=2, maxnreg=128)],     # 4 blocks per SM instead of 3, no spills
    # bwd_dqk (64 key columns, 32 value columns, 4 warps, 2 stages, DG_SUMS + LOWP + LOWP_DK: 255, 148 B, two blocks
    # per SM); LOWP_DTM halves the dTm share's bytes (bwd_wy reads it too: its loop 342 -> 322 instructions), 180 B
    # spilled. With every flag: 32 key columns 255, no spills; 64 on 8 warps 229, no spills, one block per SM.
    "bwd_dqk": [dict(WY=False, BKS=bk, BV=bv, num_warps=w, num_stages=st, **flags) for bk, bv, w, st, flags in (
        (64, 32, 4, 2, DQK_ALL), (64, 32, 4, 1, DQK_ALL), (64, 16, 4, 2, DQK_ALL), (32, 32, 4, 2, DQK_ALL),
        (128, 32, 8, 2, DQK_ALL), (64, 32, 8, 2, DQK_ALL),
        (64, 32, 4, 2, dict(DG_SUMS=True, LOWP=True)))],
    # bwd_wy (64 value columns, 4 warps, 1 stage, LOWP: 248, no spills, loop 326); 32 value columns: 229, loop 322;
    # on 8 warps: 218 (64 columns), 175 (32); maxnreg=168 on 4 warps: 84 B spilled, 3 blocks per SM.
    "bwd_wy": [dict(BV=bv, num_warps=w, num_stages=1, LOWP=True) for bv, w in ((64, 8), (32, 4), (32, 8), (128, 8))] + [
        dict(BV=32, num_warps=4, num_stages=1, LOWP=True, maxnreg=168),
        dict(BV=64, num_warps=4, num_stages=2, LOWP=True)],
}


def sweep(device, results, budget_s: float, only=()) -> bool:
    """Per kernel (those named in `only`, else all): try value blocks / warps / stages, keep the fastest (others at
    their current best), until `budget_s` seconds are spent (kernels not reached keep their configs). Every config
    runs under `tuning.override(delta_configs=...)`; nothing global changes. The configs it ends with (the ones in
    effect with its picks applied) go to results["sweep_config"]. Returns whether a config changed."""
    B, T, H, K, V = SHAPE
    say(f"## per-kernel sweep (B{B} T{T} H{H} K=V={K} bf16), budget {budget_s:.0f} s")
    deadline = time.monotonic() + budget_s
    ins = gdn_inputs(B, T, H, K, V, torch.bfloat16, device, seed=5, requires_grad=True)
    do = torch.randn(B, T, H, V, device=device)
    f = lambda: ours_fn(*ins)  # noqa: E731
    fb = lambda: fwd_bwd(ours_fn, ins, do)  # noqa: E731
    # every config is checked before it is timed: outputs and gradients on the check inputs (the sweep's K, V)
    check_ins = gdn_inputs(1, min(T, 333), min(H, 2), K, V, torch.bfloat16, device, seed=6)
    check_ref = grads_of(reference_fn, check_ins)
    changed = False
    kept: dict = {}   # the picks so far; every later kernel is timed with them (greedy)
    options = {name: cfgs for name, cfgs in SWEEP_OPTIONS.items() if not only or name in only}
    names = list(options)
    for i, (name, cfgs) in enumerate(options.items()):
        timer = f if name in ("prep", "state_output") else fb   # "wu" runs in the backward only
        start = tuning.current().delta_config(name)
        best = None
        for cfg in [start] + [c for c in cfgs if c != start]:
            if time.monotonic() > deadline:
                break
            try:
                with tuning.override(delta_configs={**kept, name: cfg}):   # in the plans' key: no cache to clear
                    if not check(f"sweep {name} {cfg}", grads_of(ours_fn, check_ins), check_ref, torch.bfloat16,
                                 results):
                        say(f"  {name} {cfg}: FAILED its check against float64: not timed, not kept")
                        continue
                    t = bench_ms(timer)
            except Exception as exc:  # a config that does not compile (registers, shared memory) is skipped
                say(f"  {name} {cfg}: failed ({type(exc).__name__}: {str(exc)[:80]})")
                continue
            if best is None or t < best[0]:
                best = (t, cfg)
        kept[name] = best[1] if best else start
        changed |= kept[name] != start
        if best:
            say(f"  {name}: best {best[1]} -> {'fwd' if timer is f else 'fwd+bwd'} {best[0]:.3f} ms")
        if time.monotonic() > deadline:
            say(f"  sweep budget spent; kept as they were: {names[i + 1:]}")
            break
    with tuning.override(delta_configs=kept):
        results["sweep_config"] = tuning.current().delta_launch_configs()
    return changed


def kernel_breakdown(label, fn, results):
    """GPU time per kernel over one fwd+bwd (torch profiler), largest first."""
    try:   # the device's own events (timing.kernel_ms): a CPU op's row would repeat its kernels' time
        rows = [(name, ms, count) for name, ms, count in kernel_ms(fn, calls=1) if ms > 0]
    except Exception as exc:  # the profiler is a diagnostic; the timings above stand without it
        say(f"    (profiler unavailable: {type(exc).__name__}: {exc})")
        return
    rows.sort(key=lambda r: -r[1])
    results.setdefault("kernels", {})[label] = rows[:12]
    for name, ms, count in rows[:8]:
        say(f"    {ms:8.3f} ms  x{count:<3g} {name[:90]}")


def _contenders(device, have_fla, only_ours=False):
    B, T, H, K, V = SHAPE
    ins = gdn_inputs(B, T, H, K, V, torch.bfloat16, device, seed=7, requires_grad=True)
    gen = torch.Generator(device=device).manual_seed(8)
    kz = [ins[0], (ins[1].float() * torch.exp(torch.empty(B, T, H, 1, device=device).uniform_(
        math.log(0.1), math.log(10), generator=gen))).to(torch.bfloat16).requires_grad_(), *ins[2:]]
    kz_fn = lambda q, k, v, g, e, h0: kaczmarz_delta_rule(  # noqa: E731
        q, k, v, g, e, initial_state=h0, output_final_state=True, backend="triton")
    contenders = [("ours GDN-step", ours_fn, ins), ("ours Kaczmarz", kz_fn, kz)]
    if have_fla and not only_ours:
        contenders.insert(0, ("fla chunk_gated_delta_rule", fla_fn, ins))
    return ins, contenders


def timings(device, results, have_fla, label_suffix="", only_ours=False):
    """fwd, fwd+bwd and decode times first; checks of the same outputs against float64 after; then the table."""
    B, T, H, K, V = SHAPE
    say(f"## timing B{B} T{T} H{H} K=V={K} bf16 (median ms, do_bench){label_suffix}")
    say(f"  launch configs: {tuning.current().delta_launch_configs()}")
    ins, contenders = _contenders(device, have_fla, only_ours)
    do = torch.randn(B, T, H, V, device=device)
    timing = results.setdefault("timing" + label_suffix.replace(" ", "_"), {})
    outputs = {}
    for label, fn, args in contenders:
        if not check_slice(label, fn, args, results) and not label.startswith("fla"):
            say(f"  {label:28s} FAILED its check against float64: not timed")
            continue
        with torch.no_grad():
            outputs[label] = fn(*args)[0]
            fwd = bench_ms(lambda: fn(*args))
        fb = bench_ms(lambda: fwd_bwd(fn, args, do))
        timing[label] = dict(fwd_ms=fwd, fwd_bwd_ms=fb)
        say(f"  {label:28s} fwd {fwd:7.3f} ms   fwd+bwd {fb:7.3f} ms")
    say(f"## one-token decode B{B} H{H} K=V={K} (bf16 q/k/v, fp32 state carried), whole call")
    q, k, v, g, beta = (t.detach()[:, :1].contiguous() for t in ins[:5])
    h0 = ins[5].detach()
    state_bytes = 2 * h0.numel() * 4
    dec = [("ours (recurrent kernel)", lambda: delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                          backend="triton"))]
    if have_fla and not only_ours:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
        dec.insert(0, ("fla fused_recurrent", lambda: fused_recurrent_gated_delta_rule(
            q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True)))   # 4th positional is gk
    decode = results.setdefault("decode" + label_suffix.replace(" ", "_"), {})
    with torch.no_grad():
        dec_out = {}
        for label, fn in dec:
            dec_out[label] = fn()
            t, tg = bench_ms(fn), graph_ms(fn)
            decode[label] = dict(us=t * 1e3, graph_us=None if tg is None else tg * 1e3)
            kernels = "" if tg is None else (f", as a CUDA graph (kernels only) {tg * 1e3:6.1f} us = "
                                             f"{state_bytes / (tg * 1e-3) / 1e12:5.2f} TB/s of state r+w")
            say(f"  {label:28s} whole call {t * 1e3:7.1f} us{kernels}")
        # checks after the clock: outputs of the timed shape against float64
        o_ref = reference_fn(*[t.detach() for t in ins])[0]
        for label, fn, args in contenders:
            if args is ins and label in outputs:
                ok, timing[label]["o_ratio_vs_f64"] = check_close(outputs[label], o_ref, "delta_out", torch.bfloat16)
                timing[label]["o_ok"] = ok
                if not ok and not label.startswith("fla"):
                    results.setdefault("failures", []).append(f"{label} (timed shape, o)")
        del o_ref
        o_ref, S_ref = reference_fn(q, k, v, g, beta, h0)
        for label, (o, S) in dec_out.items():
            ok_o, o_ratio = check_close(o, o_ref, "delta_out", torch.bfloat16)
            ok_s, S_ratio = check_close(S, S_ref, "delta_out", torch.bfloat16)   # bf16 inputs
            decode[label].update(o_ratio=o_ratio, S_ratio=S_ratio, ok=ok_o and ok_s)
            if not (ok_o and ok_s) and not label.startswith("fla"):
                results.setdefault("failures", []).append(f"decode {label}")
    say(f"## headline{label_suffix}: B{B} T{T} H{H} K=V={K} bf16, {results['gpu']}, torch {results['torch']}, "
        f"triton {results['triton']}")
    say("  | | fwd (ms) | fwd+bwd (ms) | o ratio vs float64 |")
    say("  |---|---|---|---|")
    for label, row in timing.items():
        r = row.get("o_ratio_vs_f64")
        shown = "- (other inputs; see the correctness section)" if r is None else f"{r:.1e}"
        shown += "" if row.get("o_ok", True) else " **FAIL**"
        say(f"  | {label} | {row['fwd_ms']:.3f} | {row['fwd_bwd_ms']:.3f} | {shown} |")
    for label, row in decode.items():
        graph = "" if row["graph_us"] is None else f", kernels only {row['graph_us']:.1f} us"
        say(f"  decode {label}: whole call {row['us']:.1f} us{graph} (o ratio {row.get('o_ratio', float('nan')):.1e}, "
            f"S ratio {row.get('S_ratio', float('nan')):.1e}){'' if row.get('ok', True) else ' FAIL'}")
    results["config"] = tuning.current().delta_launch_configs()


def breakdown(device, results, have_fla):
    B, T, H, K, V = SHAPE
    say("## GPU time per kernel over one fwd+bwd (torch profiler)")
    ins, contenders = _contenders(device, have_fla)
    do = torch.randn(B, T, H, V, device=device)
    for label, fn, args in contenders:
        say(f"  {label}")
        kernel_breakdown(label, lambda: fwd_bwd(fn, args, do), results)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--sweep", nargs="?", type=float, const=300.0, default=None, metavar="SECONDS",
                        help="per-kernel config sweep after everything else, bounded to SECONDS (default 300)")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--no-breakdown", action="store_true")
    parser.add_argument("--sweep-only", default="", metavar="NAMES",
                        help="comma-separated kernels to sweep, e.g. state_bwd,dU_local,bwd_dqk,bwd_wy (default: all)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: Triton's interpreter (TRITON_INTERPRET=1), wall-clock times (tests, tiny SHAPE)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    results = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)",
                   torch=torch.__version__, triton=triton.__version__)
    try:
        import fla
        import fla.ops.common.chunk_o as fla_chunk_o
        fla_chunk_o.TRITON_ABOVE_3_7_1 = True   # fla refuses its gated backward under Triton 3.4-3.7.0 on Hopper
        results["fla"] = getattr(fla, "__version__", "?")
        have_fla = True
    except ImportError as exc:
        say(f"fla not importable ({exc}); timing ours only")
        have_fla = False
    say(f"# delta-rule benchmark {results['date']} on {results['gpu']}: torch {results['torch']}, "
        f"triton {results['triton']}, fla {results.get('fla')}")
    steps = [("timings", lambda: timings(device, results, have_fla))]
    if not args.skip_correctness:
        steps.append(("correctness", lambda: correctness(device, results, have_fla)))
    if not args.no_breakdown:
        steps.append(("breakdown", lambda: breakdown(device, results, have_fla)))
    if args.sweep is not None:
        def sweep_then_time():
            if sweep(device, results, args.sweep, set(filter(None, args.sweep_only.split(",")))):
                with tuning.override(delta_configs=results["sweep_config"]):
                    timings(device, results, have_fla, label_suffix=" after sweep", only_ours=True)
        steps.append(("sweep", sweep_then_time))
    for name, step in steps:
        try:
            step()
        except Exception as exc:  # report and go on: one failing stage should not hide the others
            import traceback
            say(f"!! {name} failed: {type(exc).__name__}: {exc}")
            say(traceback.format_exc()[-3000:])
            results.setdefault("failures", []).append(f"step {name} raised {type(exc).__name__}")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "delta_bench.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
        with open(os.path.join(args.out, "delta_bench.log"), "w") as f:
            f.write("\n".join(LOG) + "\n")
    if results.get("failures"):
        say(f"FAILED: {results['failures']}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
