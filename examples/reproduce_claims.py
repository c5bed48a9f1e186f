"""Reproduce, at small scale, what the Kalman and Kaczmarz papers claim, with `scanlang.train`.

    python examples/reproduce_claims.py --scale cpu OUT      # the CPU-scale runs of docs/RESULTS.md
    python examples/reproduce_claims.py --scale gpu OUT      # larger runs, one GPU (CUDA, bf16 autocast)
    python examples/reproduce_claims.py                      # a few-second smoke run (what CI does)

Experiments (each run writes OUT/<experiment>/<run>/{metrics.json,curves.png}; each experiment
gets OUT/<experiment>/{report.md,report.png} from `scanlang report`, and OUT/summary.md collects them):
- state_tracking: A5 word problem, accuracy against depth 1/2/4 for kalman, gdn, mamba, attention
  (claim, Kalman paper: Kalman solves it at constant depth; linear/affine mixers need depth growing
  with length);
- mqar_extrapolation: kaczmarz against gdn, 2 layers, 4 heads, trained at one length and evaluated
  at 8x (claim, Kaczmarz paper: 73.84 vs 66.81);
- mqar_kalman_long (gpu scale only): kalman on MQAR at length 2048 (claim: > 95%);
- selective_copy: kalman against gdn and mamba (claim, Kalman paper's MAD results).
`--only NAME[,NAME]` runs a subset; `--max-minutes` stops starting new runs past a wall-clock budget
(finished runs and their reports stay).

The gpu scale (about 4 minutes on one H200, kernel compiles included) differs where its first
attempt learnt nothing (A5 at length 32 and MQAR over 8192 tokens stayed at chance in 500-1000
steps; docs/RESULTS.md): state tracking over S3 at length 16 (evaluated at 32), depths 1 and 2,
without mamba; MQAR over 256 tokens with 8 pairs at length 64 and an attention control; it starts
with `check_gpu_path` (the generated kernels against the float64 reference backend on the device,
`--skip-check` to leave it out). Every scanlang mixer there has d_model 128 and 4 heads, so each
compiles its kernels once.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from scanlang.report import report
from scanlang.train import TrainConfig, fit, prepare, require_extra

try:
    require_extra()
    HAVE_EXTRA = True
except ImportError as exc:   # still runs: no progress bar, no plots, metrics.json and report.md only
    print(f"note: {exc}", file=sys.stderr)
    HAVE_EXTRA = False


def experiments(scale: str) -> dict[str, list[tuple[str, TrainConfig]]]:
    """{experiment: [(run name, config)]} at `scale` ("smoke", "cpu" or "gpu")."""
    gpu, smoke = scale == "gpu", scale == "smoke"
    device = "cuda" if gpu else "cpu"
    threads = None if gpu else 1
    common = dict(device=device, threads=threads, progress=HAVE_EXTRA and not smoke, seed=0)
    out: dict[str, list] = {}
    # on the CPU, kalman and mamba get a state of 4 (2 for the smoke run) instead of 16: their CPU
    # reference scans cost time in proportion to it
    small_state = {} if gpu else {"d_state": 2 if smoke else 4}
    # and the delta rules a chunk of 16 (the CPU reference's chunk cost grows with its square)
    small_chunk = {} if gpu else {"chunk_size": 16}

    # state tracking, A5 (S3 at the gpu scale): accuracy against depth
    st = dict(task="state_tracking", task_options={"group": "A5"}, **common)
    if gpu:   # S3 (solvable): short enough that some mixer can rise above chance in a few hundred steps
        st.update(d_model=128, heads=4, seq_len=16, steps=500, batch=128, lr=3e-3, eval_lengths=(32,),
                  eval_size=1024, task_options={"group": "S3"})
    elif smoke:
        st.update(d_model=16, heads=2, seq_len=6, steps=2, batch=4, eval_size=8)
    else:
        st.update(d_model=32, seq_len=16, steps=100, batch=32, lr=3e-3, eval_size=512)
    # the gpu scale leaves mamba out (its kernel compile costs as much as its runs) and stops at depth 2
    mixers = ("kalman", "gdn", "attention") if gpu else ("kalman", "gdn", "mamba", "attention")
    depths = (1, 2) if smoke or gpu else (1, 2, 4)
    out["state_tracking"] = []
    for mixer in mixers:
        opts = small_state if mixer in ("kalman", "mamba") else small_chunk if mixer == "gdn" else {}
        if smoke and mixer not in ("kalman", "attention"):
            continue
        for layers in depths:
            cfg = dict(st, mixer=mixer, layers=layers, mixer_options=dict(opts))
            out["state_tracking"].append((f"{mixer}-L{layers}", TrainConfig(**cfg)))

    # MQAR, kaczmarz vs gdn, trained at one length, evaluated at 8x
    mq = dict(task="mqar", layers=2, heads=4, **common)
    if gpu:   # a small vocabulary: with 8192 tokens nothing leaves the ln(4096) plateau in 1000 steps
        mq.update(d_model=128, seq_len=64, steps=1000, batch=128, lr=3e-3, eval_lengths=(128, 256, 512),
                  task_options={"num_kv_pairs": 8, "vocab_size": 256}, eval_size=1024)
    elif smoke:
        mq.update(d_model=16, heads=2, seq_len=8, steps=2, batch=4, eval_size=8, eval_lengths=(16,),
                  task_options={"num_kv_pairs": 2, "vocab_size": 16})
    else:
        mq.update(d_model=64, seq_len=32, steps=150, batch=32, lr=3e-3, eval_lengths=(64, 128, 256),
                  task_options={"num_kv_pairs": 4, "vocab_size": 64}, eval_size=256)
    # attention is the control on the GPU: it runs no scanlang kernel, so if it learns and the delta
    # rules do not, suspect the kernels rather than the config
    mq_mixers = ("kaczmarz", "gdn", "attention") if gpu else ("kaczmarz", "gdn")
    out["mqar_extrapolation"] = [(m, TrainConfig(**dict(mq, mixer=m, mixer_options=dict(small_chunk)
                                                      if m != "attention" else {})))
                                 for m in mq_mixers]

    if gpu:   # Kalman at sequence length 2048: kept short (the budget allows a first look, not convergence)
        out["mqar_kalman_long"] = [("kalman-2048", TrainConfig(
            task="mqar", mixer="kalman", layers=2, d_model=128, heads=4, seq_len=2048, steps=150, batch=16,
            lr=3e-3, task_options={"num_kv_pairs": 8, "vocab_size": 256}, eval_size=128, **common))]

    # selective copy: kalman vs gdn vs mamba
    sc = dict(task="selective_copy", layers=2, **common)
    if gpu:
        sc.update(d_model=128, heads=4, seq_len=128, steps=500, batch=128, lr=3e-3, eval_size=1024,
                  task_options={"num_tokens_to_copy": 8, "vocab_size": 16})
    elif smoke:
        sc.update(d_model=16, heads=2, seq_len=8, steps=2, batch=4, eval_size=8,
                  task_options={"num_tokens_to_copy": 2, "vocab_size": 6})
    else:
        sc.update(d_model=32, seq_len=32, steps=150, batch=32, lr=3e-3, eval_size=256,
                  task_options={"num_tokens_to_copy": 4, "vocab_size": 8})
    out["selective_copy"] = []
    left_out = {"smoke": "gdn", "gpu": "mamba"}.get(scale)
    for mixer in ("kalman", "gdn", "mamba"):
        if mixer == left_out:
            continue
        opts = small_state if mixer in ("kalman", "mamba") else small_chunk
        out["selective_copy"].append((mixer, TrainConfig(**dict(sc, mixer=mixer, mixer_options=dict(opts)))))
    # most telling first, so that --max-minutes cuts the least telling: MQAR (with the gpu scale's
    # attention control), then the depth sweep, selective copy, and the one long Kalman run
    order = ("mqar_extrapolation", "state_tracking", "selective_copy", "mqar_kalman_long")
    return {name: out[name] for name in order if name in out}


def check_gpu_path(device: str = "cuda", d_model: int = 128, length: int = 64, backend: str = "triton") -> list[str]:
    """The GPU runs' models against a float64 copy of themselves on the reference backend, on `device`.

    For each scanlang mixer of the gpu scale (d_model 128, 4 heads, 2 layers, the training runs'
    shapes, so the kernels compiled here are the ones the runs reuse): the generated kernels' fp32
    loss and every parameter's gradient against the float64 reference backend (ratio
    RMS(err)/RMS(ref), within the tolerance table's row of that mixer), and a bf16-autocast step
    (what `scanlang train --device cuda` runs): finite, and its gradient within 10% of the float64 one
    (bf16 rounds activations to 8 bits of mantissa; a wrong kernel misses by O(1)). Returns the
    markdown rows (printed as they come); a mismatch is marked **NO** with the worst parameter named,
    and the training runs still follow, so one call shows both."""
    import torch

    lines = ["| mixer | loss ratio (fp32) | worst grad ratio (fp32) | tolerance | worst grad ratio (bf16) | ok |",
             "|---|---|---|---|---|---|"]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (4, length), generator=gen).to(device)
    labels = torch.randint(0, 64, (4 * length,), generator=gen).to(device)
    # TF32 off for the fp32 comparison, so that a ratio over the tolerance is the kernels' and not
    # cuDNN's or cuBLAS's reduced-precision matmuls
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        for name in ("kalman", "gdn", "kaczmarz"):
            try:
                lines.append(_check_mixer(name, tokens, labels, d_model, backend))
            except Exception as exc:   # recorded, not raised: the training runs still follow
                lines.append(f"| {name} | **error**: {type(exc).__name__}: {str(exc)[:200]} | | | | **NO** |")
            print(lines[-1], flush=True)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    return lines


def _check_mixer(name, tokens, labels, d_model, backend) -> str:
    import copy

    import torch
    import torch.nn.functional as F

    from scanlang.models import SequenceModel
    from scanlang.testing import ratio, tolerance

    torch.manual_seed(0)
    fused = SequenceModel(64, d_model, 2, name, 4, {"backend": backend}).to(tokens.device)
    ref = copy.deepcopy(fused).double()
    for block in ref.blocks:
        block.mixer.backend = "reference"

    def loss_and_grads(model, autocast):
        model.zero_grad()
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(tokens)
        wide = torch.float64 if logits.dtype == torch.float64 else torch.float32
        loss = F.cross_entropy(logits.to(wide).flatten(0, 1), labels)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    out_row, grad_row = ("kalman_out", "kalman_grad") if name == "kalman" else ("delta_out", "delta_grad")
    loss, grads = loss_and_grads(fused, False)
    loss_ref, grads_ref = loss_and_grads(ref, False)
    loss_bf16, grads_bf16 = loss_and_grads(fused, True)
    names = [n for n, _ in fused.named_parameters()]
    fp32 = {n: ratio(g, r) for n, g, r in zip(names, grads, grads_ref)}
    bf16 = {n: ratio(g, r) for n, g, r in zip(names, grads_bf16, grads_ref)}
    worst, worst_bf16 = max(fp32, key=fp32.get), max(bf16, key=bf16.get)
    loss_ratio, grad_tol = ratio(loss, loss_ref), tolerance(grad_row, torch.float32)
    ok = (loss_ratio <= tolerance(out_row, torch.float32) and fp32[worst] <= grad_tol
          and bool(torch.isfinite(loss_bf16)) and bf16[worst_bf16] <= 0.1)
    return (f"| {name} | {loss_ratio:.1e} | {fp32[worst]:.1e} ({worst}) | {grad_tol:.0e} "
            f"| {bf16[worst_bf16]:.1e} ({worst_bf16}) | {'yes' if ok else '**NO**'} |")


def _finished(config: TrainConfig):
    """The metrics of this exact config when an earlier call of the script already ran it (resume)."""
    import dataclasses
    import json
    path = Path(config.out) / "metrics.json"
    if not path.is_file():
        return None
    metrics = json.loads(path.read_text())
    mine = dataclasses.asdict(config)
    volatile = ("out", "overwrite", "progress", "seq_len", "eval_lengths")
    same = all(metrics["config"].get(k) == v for k, v in mine.items() if k not in volatile)
    return metrics if same and metrics["config"]["eval_lengths"] == list(config.eval_lengths) else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default=None, help="output folder (default: a temporary one)")
    parser.add_argument("--scale", choices=("smoke", "cpu", "gpu"), default="smoke")
    parser.add_argument("--only", default=None, help="comma-separated experiment names")
    parser.add_argument("--skip-check", action="store_true", help="gpu scale: skip the kernels-vs-reference check")
    parser.add_argument("--max-minutes", type=float, default=None, help="start no run after this many minutes")
    args = parser.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="scanlang-repro-"))
    plan = experiments(args.scale)
    if args.only:
        wanted = args.only.split(",")
        unknown = [w for w in wanted if w not in plan]
        if unknown:
            parser.error(f"--only: unknown experiments {unknown}; expected some of {list(plan)}")
        plan = {k: v for k, v in plan.items() if k in wanted}
    start, summary = time.perf_counter(), []
    if args.scale == "gpu" and not args.skip_check:
        rows = check_gpu_path()
        summary.append("## gpu path check (generated kernels against the float64 reference backend)\n\n"
                       + "\n".join(rows) + f"\n\n({time.perf_counter() - start:.0f} s, kernel compiles included)\n")
    for name, runs in plan.items():
        done = []
        for run_name, config in runs:
            if args.max_minutes is not None and time.perf_counter() - start > 60 * args.max_minutes:
                print(f"skipping {name}/{run_name}: past --max-minutes", flush=True)
                continue
            config.out, config.overwrite = str(root / name / run_name), True
            metrics = _finished(config)
            if metrics is None:
                metrics = fit(prepare(config))
            by_length = ", ".join(f"@{n} {a:.3f}" for n, a in metrics["accuracy_by_length"].items())
            print(f"{name}/{run_name}: {by_length}  ({metrics['train_time_s']:.0f} s)", flush=True)
            done.append(config.out)
        if done:
            md, _ = report(done, root / name)
            summary.append(f"## {name}\n\n" + md.read_text().split("\n", 2)[2].replace(
                "](report.png)", f"]({name}/report.png)"))
    (root / "summary.md").write_text(f"# scale {args.scale}, total {time.perf_counter() - start:.0f} s\n\n"
                                     + "\n".join(summary))
    print(f"wrote {root}/summary.md ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
