"""The `scanlang` command: verify, show, demo, bench, train, report.

    scanlang verify MODULE:NAME   exit 0 and print the proof; exit 1 and the counterexample
    scanlang show MODULE:NAME     the traced expressions and the generated Triton kernels that a
                                  training call of shape --shape B,T,D [--layout time|channels]
                                  (default 4,2048,256, time) runs, with the configs chosen for it;
                                  --all: the whole generated module, every variant (a monoid whose
                                  laws fail is refused: exit 1 and the counterexample)
    scanlang demo                 the tour on a built-in default (CPU or GPU)
    scanlang bench                the GPU benchmark of the generated scans (see BENCHMARKS.md)
    scanlang train TASK --mixer M a small model on a synthetic task: metrics.json and curves.png
    scanlang report DIR...        a markdown table and a plot comparing training runs

MODULE is an importable module (`scanlang.library`) or a path to a .py file (`examples/my.py`).
NAME names a monoid, a matrix state (sl.matrix_state) or a delta rule (scanlang.delta.DeltaRule); for the
latter two verify prints the proof and the traced hooks, show the declaration and the generated source
of the kernels that run for it, each under a header saying when it runs (scanlang/show.py); --chunk C
(16, 32 or 64, default 64) picks the delta-rule kernels' chunk. A matrix state takes --shape B,T,H,K,V:
then show prints only the modules that a training call and an inference call of that shape run, under
header lines naming each route.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

from . import pipeline, show
from .delta import DeltaRule
from .errors import IdentityError, NotAssociativeError
from .linear import MatrixState
from .monoid import Monoid

DECLARATIONS = (Monoid, MatrixState, DeltaRule)   # what MODULE:NAME may name
KINDS = "a monoid (@sl.monoid), a matrix state (sl.matrix_state) or a delta rule (scanlang.delta.DeltaRule)"


class CliError(Exception):
    """A usage problem: printed without a traceback, exit status 2."""


def load_declaration(target: str):
    """Resolve MODULE:NAME (module path or .py file) to a declared Monoid, MatrixState or DeltaRule."""
    if ":" not in target:
        raise CliError(f"expected MODULE:NAME (e.g. scanlang.library:Affine), got {target!r}")
    module_name, _, name = target.rpartition(":")
    if module_name.endswith(".py") or Path(module_name).is_file():
        path = Path(module_name)
        if not path.is_file():
            raise CliError(f"no such file: {path}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            # `scanlang` runs as a console script, whose sys.path lacks the current directory that
            # `python -m` would have: a module next to the user (mymod.py, pkg/mod.py) is found there
            local = Path.cwd() / (module_name.replace(".", "/") + ".py")
            if not (isinstance(exc, ModuleNotFoundError) and local.is_file() and str(Path.cwd()) not in sys.path):
                raise CliError(f"cannot import module {module_name!r}: {exc}") from None
            sys.path.insert(0, str(Path.cwd()))
            try:
                module = importlib.import_module(module_name)
            except ImportError as exc2:
                raise CliError(f"cannot import module {module_name!r}: {exc2}") from None
    obj = getattr(module, name, None)
    if not isinstance(obj, DECLARATIONS):
        kind = "nothing" if obj is None else type(obj).__name__
        raise CliError(f"{target}: expected {KINDS}, found {kind}")
    return obj


def _verified(monoid):
    """The proof, or None after printing why the monoid is refused (the caller exits 1)."""
    try:
        return monoid.verify()
    except NotAssociativeError as exc:
        print(f"{monoid.name}: NOT associative\n{exc}")
        print(f"counterexample (x, y, z) = {exc.counterexample}")
    except IdentityError as exc:
        print(f"{monoid.name}: identity law fails\n{exc}")
    except ValueError as exc:   # a degenerate declaration (e.g. a projective scale that is identically zero)
        print(f"{monoid.name}: refused\n{exc}")
    return None


def cmd_verify(args) -> int:
    decl = load_declaration(args.target)
    if not isinstance(decl, Monoid):   # proved when declared (a failing structure raises there)
        print(show.verify_matrix_state(decl) if isinstance(decl, MatrixState) else show.verify_delta_rule(decl))
        return 0
    proof = _verified(decl)
    if proof is None:
        return 1
    print(proof)
    return 0


SHOW_SHAPE = "4,2048,256"   # the [B, T, D] `scanlang show` prints the kernels of without --shape


def _show_declaration(decl, args) -> int:
    """`scanlang show` of a matrix state or a delta rule (scanlang/show.py): the scan options are refused."""
    matrix = isinstance(decl, MatrixState)
    for flag, given in (("--shape", args.shape is not None and not matrix), ("--layout", args.layout is not None),
                        ("--all", args.all)):
        if given:
            kinds = "scans (@sl.monoid) and matrix states" if flag == "--shape" else "scans (@sl.monoid)"
            raise CliError(f"{flag}: an option of {kinds}; {args.target} is a {type(decl).__name__}")
    try:
        if matrix and args.shape is not None:
            source = show.show_matrix_state_at(decl, args.shape, args.chunk)
        else:
            source = (show.show_matrix_state if matrix else show.show_delta_rule)(decl, args.chunk)
    except ValueError as exc:   # --chunk or --shape, named in the message
        raise CliError(str(exc)) from None
    except ImportError as exc:
        source = f"# generated Triton kernels unavailable here: {exc}"
    print(show.describe_matrix_state(decl) if matrix else show.describe_delta_rule(decl))
    print()
    print(source)
    return 0


def cmd_show(args) -> int:
    decl = load_declaration(args.target)
    if not isinstance(decl, Monoid):
        return _show_declaration(decl, args)
    if args.chunk is not None:
        raise CliError("--chunk: an option of delta-rule kernels (a matrix state or a DeltaRule); "
                       f"{args.target} is a monoid")
    args.layout = "time" if args.layout is None else args.layout
    if args.shape is None and args.layout != "time":
        raise CliError(f"--layout: {args.layout!r} needs --shape B,T,D (the layout of that shape's tensors)")
    if args.all and args.shape is not None:
        raise CliError("--all: prints every variant of the module, for no one shape; drop --shape or --all")
    monoid = decl
    if _verified(monoid) is None:   # kernels are generated only for a monoid whose laws hold
        return 1
    print(monoid.describe())
    try:
        source = pipeline.show(monoid) if args.all else pipeline.show(monoid, args.shape or SHOW_SHAPE, args.layout)
    except ValueError as exc:   # --shape / --layout, named in the message
        raise CliError(str(exc)) from None
    except ImportError as exc:
        print(f"\n# generated Triton kernels unavailable here: {exc}")
        return 0
    print()
    print(source)
    return 0


def cmd_demo(args) -> int:
    from .demo import run
    return run(device=args.device, length=args.length, train=not args.no_train)


def cmd_bench(args) -> int:
    try:
        from .tools.bench_scan import main as bench_main
    except ImportError as exc:
        raise CliError(f"the benchmark is not available: {exc}") from None
    return bench_main(args.rest) or 0


def _train_extra():
    try:
        from . import train
        train.require_extra()
    except ImportError as exc:
        raise CliError(str(exc)) from None
    return train


def cmd_train(args) -> int:
    train = _train_extra()
    options = {name: getattr(args, name) for name in TASK_OPTIONS if getattr(args, name) is not None}
    config = train.TrainConfig(
        task=args.task, mixer=args.mixer, layers=args.layers, d_model=args.d_model, heads=args.heads,
        mixer_options={} if args.d_state is None else {"d_state": args.d_state},
        seq_len=args.seq_len, task_options=options, steps=args.steps, batch=args.batch, lr=args.lr,
        seed=args.seed, device=args.device, eval_lengths=tuple(args.eval_lengths), eval_size=args.eval_size,
        threads=args.threads, out=args.out, overwrite=args.overwrite, progress=not args.no_progress)
    try:   # everything a config can get wrong is found here, before any training
        prepared = train.prepare(config)
    except (ValueError, TypeError) as exc:
        raise CliError(str(exc)) from None
    metrics = train.fit(prepared)
    lengths = ", ".join(f"{n}: {a:.3f}" for n, a in metrics["accuracy_by_length"].items())
    print(f"{metrics['task']} {metrics['mixer']} x{metrics['layers']}: test accuracy {metrics['test_accuracy']:.4f} "
          f"(by length {lengths}), train loss {metrics['train_loss']:.4f}, {metrics['wall_time_s']:.1f} s"
          + (f"; wrote {args.out}/metrics.json and curves.png" if args.out else ""))
    return 0


def cmd_report(args) -> int:
    _train_extra()
    from .report import report
    try:
        md, png = report(args.dirs, args.out)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    print(md.read_text())
    print(f"wrote {md} and {png}")
    return 0


# task options: flags named like the generators' arguments (scanlang.tasks)
TASK_OPTIONS = {"group": str, "num_kv_pairs": int, "vocab_size": int, "num_tokens_to_copy": int}


def _add_train_parser(sub):
    p = sub.add_parser("train", help="train a small model on a synthetic task (needs scanlang[train])")
    p.add_argument("task", help="mqar, state_tracking or selective_copy")
    p.add_argument("--mixer", required=True, help="kalman, kaczmarz, gdn, gla, kda, mamba, attention")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d-state", type=int, default=None, help="state size of kalman and mamba (their default: 16)")
    p.add_argument("--seq-len", type=int, default=None, help="training length (the generator's length argument)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--out", default=None, help="folder for metrics.json and curves.png")
    p.add_argument("--overwrite", action="store_true", help="write into an --out folder that holds files")
    p.add_argument("--eval-lengths", type=int, nargs="*", default=[], help="also evaluate at these lengths")
    p.add_argument("--eval-size", type=int, default=512, help="held-out sequences per length")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    for name, kind in TASK_OPTIONS.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None,
                       help=f"task option {name} (see scanlang.tasks)")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("report", help="compare training runs: a markdown table and a plot")
    p.add_argument("dirs", nargs="+", metavar="DIR")
    p.add_argument("--out", default=".", help="folder for report.md and report.png (default: here)")
    p.set_defaults(func=cmd_report)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scanlang", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("verify", help="prove a monoid's laws (exit 1 with a counterexample if they fail), "
                                      "or print a matrix state's or delta rule's proof")
    p.add_argument("target", metavar="MODULE:NAME")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("show", help="print a monoid's, matrix state's or delta rule's traced expressions and "
                                    "generated kernels")
    p.add_argument("target", metavar="MODULE:NAME")
    p.add_argument("--shape", default=None, metavar="B,T,D",
                   help=f"print the kernels the configs chosen for this shape run (default {SHOW_SHAPE}); for a "
                        f"matrix state B,T,H,K,V: the modules its training and inference routes take there")
    p.add_argument("--layout", default=None, help="time (T contiguous, the default) or channels (D contiguous)")
    p.add_argument("--all", action="store_true", help="print the whole generated module (every variant)")
    p.add_argument("--chunk", type=int, default=None, metavar="C",
                   help="the chunk size of delta-rule kernels (16, 32 or 64; default 64)")
    p.set_defaults(func=cmd_show)
    p = sub.add_parser("demo", help="the tour: declare, prove, refute, scan, check, time")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--length", type=int, default=None, help="sequence length of the demo scan")
    p.add_argument("--no-train", action="store_true", help="skip the closing training run")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("bench", help="GPU benchmark of the generated scans against the anchors")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_bench)
    _add_train_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CliError as exc:
        print(f"scanlang {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
