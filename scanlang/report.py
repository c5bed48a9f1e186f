"""Plots of one training run (`plot_curves`) and `scanlang report DIR...`: a comparison of runs.

`report(dirs, out)` reads each `DIR/metrics.json` (written by `scanlang train`) and writes
`out/report.md` (a markdown table: task, mixer, depth, length, steps, accuracy at the training
length and at every evaluated length, loss, time) and `out/report.png`: accuracy against depth,
one line per mixer, when the runs differ by depth; otherwise accuracy against evaluated length,
one line per run. Needs the `train` extra (matplotlib).
"""
from __future__ import annotations

import json
import os
from pathlib import Path


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")   # headless: no display needed
    import matplotlib.pyplot as plt
    return plt


def plot_curves(metrics: dict, path) -> None:
    """Training loss and accuracy against step, with the held-out accuracy, as a PNG at `path`."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    hist, evals = metrics["history"], metrics["evals"]
    left.plot(hist["step"], hist["loss"], lw=0.8, label="train")
    left.plot(evals["step"], evals["loss"], "o-", ms=3, label="held-out")
    left.set_xlabel("step")
    left.set_ylabel("cross-entropy")
    left.set_yscale("log")
    left.legend()
    right.plot(hist["step"], hist["accuracy"], lw=0.8, label="train batch")
    right.plot(evals["step"], evals["accuracy"], "o-", ms=3, label="held-out")
    right.set_xlabel("step")
    right.set_ylabel("token accuracy")
    right.set_ylim(0, 1.02)
    right.legend()
    opts = ", ".join(f"{k}={v}" for k, v in metrics.get("task_options", {}).items())
    fig.suptitle(f"{metrics['task']} ({opts}, length {metrics['seq_len']}): {metrics['mixer']} x{metrics['layers']}, "
                 f"d={metrics['d_model']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90, format="png")
    plt.close(fig)


def load_runs(dirs) -> list[dict]:
    runs = []
    for d in dirs:
        path = Path(d) / "metrics.json"
        if not path.is_file():
            raise ValueError(f"DIR: {d} holds no metrics.json (written by scanlang train)")
        try:
            metrics = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"DIR: {path} is not valid JSON: {exc}") from None
        metrics["_name"] = Path(d).name or str(d)
        runs.append(metrics)
    if not runs:
        raise ValueError("DIR: give at least one run folder")
    return runs


def markdown_table(runs: list[dict]) -> str:
    lengths = sorted({int(n) for r in runs for n in r["accuracy_by_length"]})
    head = ["run", "task", "mixer", "layers", "d", "train len", "steps"] + [f"acc @{n}" for n in lengths]
    head += ["train loss", "time (s)", "device"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        opts = ",".join(f"{v}" for v in r.get("task_options", {}).values())
        accs = [r["accuracy_by_length"].get(str(n)) for n in lengths]
        row = [r["_name"], r["task"] + (f" ({opts})" if opts else ""), r["mixer"], str(r["layers"]),
               str(r["d_model"]), str(r["seq_len"]), str(r["steps"])]
        row += ["" if a is None else f"{a:.3f}" for a in accs]
        row += [f"{r['train_loss']:.3f}", f"{r['wall_time_s']:.0f}", r["device"]]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot_comparison(runs: list[dict], path) -> str:
    """Accuracy against depth (runs differ by layers) or against evaluated length; returns which."""
    plt = _pyplot()
    by_depth = len({r["layers"] for r in runs}) > 1
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    if by_depth:
        lengths = sorted({int(n) for r in runs for n in r["accuracy_by_length"]})
        for mixer in dict.fromkeys(r["mixer"] for r in runs):
            mine = sorted((r for r in runs if r["mixer"] == mixer), key=lambda r: r["layers"])
            for n, style in zip(lengths, ("o-", "s--", "^:", "d-.")):
                points = [(r["layers"], r["accuracy_by_length"][str(n)]) for r in mine if str(n) in r["accuracy_by_length"]]
                if points:
                    label = mixer if len(lengths) == 1 else f"{mixer} @{n}"
                    ax.plot(*zip(*points), style, label=label)
        ax.set_xlabel("layers")
        ax.set_xticks(sorted({r["layers"] for r in runs}))
    else:
        for r in runs:
            points = sorted((int(n), a) for n, a in r["accuracy_by_length"].items())
            ax.plot(*zip(*points), "o-", label=f"{r['_name']} ({r['mixer']})")
        ax.set_xlabel("evaluated length")
        ax.set_xscale("log", base=2)
    ax.set_ylabel("token accuracy")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7)
    ax.set_title(f"{runs[0]['task']}: accuracy against {'depth' if by_depth else 'length'}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90, format="png")
    plt.close(fig)
    return "depth" if by_depth else "length"


def report(dirs, out=".") -> tuple[Path, Path]:
    """Write out/report.md and out/report.png comparing the runs in `dirs`; returns their paths."""
    runs = load_runs(dirs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    md, png = out / "report.md", out / "report.png"
    tmp = out / ".report.png.tmp"
    axis = "depth" if len({r["layers"] for r in runs}) > 1 else "length"
    try:
        plot_comparison(runs, tmp)
        os.replace(tmp, png)
        image = f"\n![accuracy against {axis}]({png.name})\n"
    except ImportError as exc:   # the table still helps without matplotlib
        image = f"\n(no plot: {exc})\n"
    md.write_text(f"# {len(runs)} runs, accuracy against {axis}\n\n" + markdown_table(runs) + image)
    return md, png
