"""`scanlang train`: fit a small model (`scanlang.models`) on a synthetic task (`scanlang.tasks`).

    config = TrainConfig(task="state_tracking", mixer="kalman", layers=1, seq_len=16,
                         task_options={"group": "S3"}, steps=300, out="runs/s3-kalman")
    metrics = train(config)            # also writes out/metrics.json and out/curves.png

The loop: AdamW, linear warm-up then cosine decay, gradient clipping, bf16 autocast on CUDA (fp32
on CPU), a progress bar (tqdm) with the loss and accuracy, evaluation on a held-out split (its own
seed) at the training length and at every `eval_lengths` entry (extrapolation). The training data
is generated up front from `seed` (a fresh batch per step, never repeated), the held-out split
from `seed + 1`, each eval length from its own seed, and the model is initialised from `seed`: on
the CPU the same config gives the same metrics (deterministic algorithms are switched on for the
run). Everything that can be wrong with a config (task, mixer, group, lengths, the output folder,
the device) is checked by `prepare` before any training, and the files are written only at the end.

Needs the `train` extra (`pip install scanlang[train]`: tqdm and matplotlib).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from . import tasks
from .models import MIXERS, SequenceModel

INSTALL_HINT = "pip install scanlang[train]"
OUTPUT_FILES = ("metrics.json", "curves.png")
DEFAULT_LENGTH = {"mqar": 64, "state_tracking": 32, "selective_copy": 64}


def require_extra():
    """Import the `train` extra's libraries, or raise ImportError naming the install command."""
    try:
        import matplotlib  # noqa: F401
        import tqdm  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"scanlang train and report need tqdm and matplotlib ({exc}); install them with "
                          f"`{INSTALL_HINT}`") from None


@dataclasses.dataclass
class TrainConfig:
    task: str
    mixer: str = "kalman"
    layers: int = 2
    d_model: int = 64
    heads: int = 4
    mixer_options: dict = dataclasses.field(default_factory=dict)   # e.g. {"d_state": 8}
    seq_len: int | None = None           # the task's length argument; None: DEFAULT_LENGTH
    task_options: dict = dataclasses.field(default_factory=dict)
    steps: int = 300
    batch: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.1
    warmup: float = 0.1                  # fraction of the steps
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    eval_lengths: tuple = ()
    eval_size: int = 512
    eval_every: int = 0                  # 0: about 10 evaluations per run
    threads: int | None = None           # torch CPU threads (None: torch's default)
    out: str | None = None
    overwrite: bool = False
    progress: bool = True


@dataclasses.dataclass
class Prepared:
    config: TrainConfig
    model: torch.nn.Module
    train_data: tuple
    test_data: tuple
    eval_data: dict
    device: torch.device
    out: Path | None


def _positive(value, name):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def check_output_dir(out, overwrite: bool) -> Path | None:
    """The output folder: refused when it exists with files in it, unless `overwrite`."""
    if out is None:
        return None
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"out: {path} exists and is not a folder")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ValueError(f"out: {path} already holds files; pass --overwrite to write {', '.join(OUTPUT_FILES)} "
                         "there anyway, or choose another folder")
    return path


def resolve_device(device: str) -> torch.device:
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but no CUDA GPU is available here (use --device cpu)")
    return torch.device(device)


def prepare(config: TrainConfig) -> Prepared:
    """Validate everything, generate the data and build the model; trains nothing, writes nothing."""
    if config.task not in tasks.TASKS:
        raise ValueError(f"task: expected one of {tuple(tasks.TASKS)}, got {config.task!r}")
    if not isinstance(config.mixer, str) or config.mixer not in MIXERS:
        raise ValueError(f"mixer: expected one of {tuple(MIXERS)}, got {config.mixer!r}")
    for name in ("layers", "d_model", "heads", "steps", "batch", "eval_size"):
        _positive(getattr(config, name), name)
    if not config.lr > 0:
        raise ValueError(f"lr: expected a positive learning rate, got {config.lr}")
    if not 0 <= config.warmup < 1:
        raise ValueError(f"warmup: expected a fraction of the steps in [0, 1), got {config.warmup}")
    device = resolve_device(config.device)
    out = check_output_dir(config.out, config.overwrite)
    length = config.seq_len if config.seq_len is not None else DEFAULT_LENGTH[config.task]
    _positive(length, "seq_len")
    for n in config.eval_lengths:
        _positive(n, "eval_lengths")
    opts = dict(config.task_options)
    if config.threads is not None:
        _positive(config.threads, "threads")
        torch.set_num_threads(config.threads)
    # every generator call validates its options and lengths: errors come here, before training
    train_data = tasks.generate(config.task, config.steps * config.batch, length, config.seed, **opts)
    test_data = tasks.generate(config.task, config.eval_size, length, config.seed + 1, **opts)
    eval_data = {n: tasks.generate(config.task, config.eval_size, n, config.seed + 2 + i, **opts)
                 for i, n in enumerate(config.eval_lengths)}
    torch.manual_seed(config.seed)
    model = SequenceModel(tasks.vocab_size(config.task, **opts), config.d_model, config.layers, config.mixer,
                          config.heads, config.mixer_options)
    return Prepared(config, model.to(device), train_data, test_data, eval_data, device, out)


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _loss_and_hits(model, inputs, targets, device):
    with _autocast(device):
        logits = model(inputs)
    logits = logits.float()
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=tasks.IGNORE)
    scored = targets != tasks.IGNORE
    hits = ((logits.argmax(-1) == targets) & scored)
    return loss, hits, scored


@torch.no_grad()
def evaluate(model, data, batch: int, device) -> dict:
    """Token accuracy over the scored positions, the fraction of sequences with every scored
    position right, and the mean loss, over `data` = (inputs, targets)."""
    model.eval()
    inputs, targets = data
    loss_sum, hits, scored, whole, n = 0.0, 0, 0, 0, inputs.shape[0]
    for start in range(0, n, batch):
        x, y = inputs[start:start + batch].to(device), targets[start:start + batch].to(device)
        loss, h, s = _loss_and_hits(model, x, y, device)
        loss_sum += float(loss) * x.shape[0]
        hits, scored = hits + int(h.sum()), scored + int(s.sum())
        whole += int((h == s).all(dim=1).sum())
    model.train()
    return {"accuracy": hits / max(scored, 1), "sequence_accuracy": whole / n, "loss": loss_sum / n}


def _schedule(step: int, steps: int, warmup_steps: int) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return 0.5 * (1 + math.cos(math.pi * progress))


def versions() -> dict:
    import scanlang
    out = {"scanlang": scanlang.__version__, "torch": torch.__version__, "python": platform.python_version()}
    with contextlib.suppress(ImportError):
        import triton
        out["triton"] = triton.__version__
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


class _NoBar:
    """Stands in for tqdm when the progress bar is off (and tqdm perhaps not installed)."""

    def __init__(self, iterable, **_):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def set_postfix(self, **_):
        pass

    def close(self):
        pass


def fit(prep: Prepared) -> dict:
    """Train the prepared model; returns the metrics (and writes them when an output folder is set).

    With `progress=False` neither tqdm nor (if it is missing) matplotlib is needed: then only
    metrics.json is written, and a warning says why curves.png is not."""
    if prep.config.progress:
        from tqdm.auto import tqdm
    else:
        tqdm = _NoBar
    cfg, model, device = prep.config, prep.model, prep.device
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(device.type == "cpu" or deterministic)
    try:
        return _fit(prep, cfg, model, device, tqdm)
    finally:
        torch.use_deterministic_algorithms(deterministic)


def _fit(prep, cfg, model, device, tqdm):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.98))
    warmup_steps = max(1, int(cfg.warmup * cfg.steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _schedule(s, cfg.steps, warmup_steps))
    eval_every = cfg.eval_every or max(1, cfg.steps // 10)
    history = {"step": [], "loss": [], "accuracy": []}
    evals = {"step": [], "accuracy": [], "loss": []}
    inputs, targets = prep.train_data
    start = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc=f"{cfg.task} {cfg.mixer} x{cfg.layers}", disable=not cfg.progress,
               dynamic_ncols=True, file=sys.stderr)
    for step in bar:
        rows = slice(step * cfg.batch, (step + 1) * cfg.batch)
        x, y = inputs[rows].to(device), targets[rows].to(device)
        loss, hits, scored = _loss_and_hits(model, x, y, device)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        loss_value, accuracy = float(loss.detach()), int(hits.sum()) / max(int(scored.sum()), 1)
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"the training loss became {loss_value} at step {step}; lower --lr")
        history["step"].append(step + 1)
        history["loss"].append(loss_value)
        history["accuracy"].append(accuracy)
        if (step + 1) % eval_every == 0 or step + 1 == cfg.steps:
            result = evaluate(model, prep.test_data, 4 * cfg.batch, device)
            evals["step"].append(step + 1)
            evals["accuracy"].append(result["accuracy"])
            evals["loss"].append(result["loss"])
            bar.set_postfix(loss=f"{loss_value:.3f}", acc=f"{accuracy:.3f}", test=f"{result['accuracy']:.3f}")
        elif step % 5 == 0:
            bar.set_postfix(loss=f"{loss_value:.3f}", acc=f"{accuracy:.3f}")
    train_seconds = time.perf_counter() - start
    bar.close()
    test = evaluate(model, prep.test_data, 4 * cfg.batch, device)
    length = cfg.seq_len if cfg.seq_len is not None else DEFAULT_LENGTH[cfg.task]
    per_length = {str(length): test["accuracy"]}
    per_length_seq = {str(length): test["sequence_accuracy"]}
    for n, data in prep.eval_data.items():
        result = evaluate(model, data, max(1, 4 * cfg.batch * length // n), device)
        per_length[str(n)], per_length_seq[str(n)] = result["accuracy"], result["sequence_accuracy"]
    tail = max(1, cfg.steps // 10)
    config = dataclasses.asdict(cfg)
    config["seq_len"], config["eval_lengths"] = length, list(cfg.eval_lengths)
    metrics = {
        "task": cfg.task, "mixer": cfg.mixer, "layers": cfg.layers, "d_model": cfg.d_model, "steps": cfg.steps,
        "seq_len": length, "seed": cfg.seed, "task_options": dict(cfg.task_options),
        "test_accuracy": test["accuracy"], "test_sequence_accuracy": test["sequence_accuracy"],
        "test_loss": test["loss"], "train_loss": sum(history["loss"][-tail:]) / tail,
        "accuracy_by_length": per_length, "sequence_accuracy_by_length": per_length_seq,
        "parameters": sum(p.numel() for p in prep.model.parameters()),
        "wall_time_s": time.perf_counter() - start, "train_time_s": train_seconds,
        "device": device_name(device), "versions": versions(), "config": config,
        "history": history, "evals": evals,
    }
    if prep.out is not None:
        write_outputs(prep.out, metrics)
    return metrics


def write_outputs(out: Path, metrics: dict) -> None:
    """metrics.json and curves.png, each written to a temporary name and renamed into place."""
    from .report import plot_curves
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".metrics.json.tmp"
    tmp.write_text(json.dumps(metrics, indent=1) + "\n")
    png = out / ".curves.png.tmp"
    try:
        plot_curves(metrics, png)
        os.replace(png, out / "curves.png")
    except ImportError as exc:
        warnings.warn(f"curves.png not written: {exc}; `{INSTALL_HINT}`", stacklevel=2)
    os.replace(tmp, out / "metrics.json")


def train(config: TrainConfig) -> dict:
    """`prepare` then `fit`: the metrics dict (see `scanlang train --help`)."""
    require_extra()
    return fit(prepare(config))
