"""The `scanlang` command: verify, show, demo, bench.

    scanlang verify MODULE:NAME   exit 0 and print the proof; exit 1 and the counterexample
    scanlang show MODULE:NAME     the traced expressions and the generated Triton kernels (a monoid
                                  whose laws fail is refused: exit 1 and the counterexample)
    scanlang demo                 the tour on a built-in default (CPU or GPU)
    scanlang bench                the GPU benchmark of the generated scans (see BENCHMARKS.md)

MODULE is an importable module (`scanlang.library`) or a path to a .py file (`examples/my.py`).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

from .errors import IdentityError, NotAssociativeError
from .monoid import Monoid


class CliError(Exception):
    """A usage problem: printed without a traceback, exit status 2."""


def load_monoid(target: str) -> Monoid:
    """Resolve MODULE:NAME (module path or .py file) to a declared Monoid."""
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
    if not isinstance(obj, Monoid):
        kind = "nothing" if obj is None else type(obj).__name__
        raise CliError(f"{target}: expected a monoid declared with @sl.monoid, found {kind}")
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
    monoid = load_monoid(args.target)
    proof = _verified(monoid)
    if proof is None:
        return 1
    print(proof)
    return 0


def cmd_show(args) -> int:
    monoid = load_monoid(args.target)
    if _verified(monoid) is None:   # kernels are generated only for a monoid whose laws hold
        return 1
    print(monoid.describe())
    try:
        from .backends import triton as triton_backend
        source = triton_backend.show(monoid)
    except ImportError as exc:
        print(f"\n# generated Triton kernels unavailable here: {exc}")
        return 0
    print()
    print(source)
    return 0


def cmd_demo(args) -> int:
    from .demo import run
    return run(device=args.device, length=args.length)


def cmd_bench(args) -> int:
    try:
        from .bench import main as bench_main
    except ImportError as exc:
        raise CliError(f"the benchmark is not available: {exc}") from None
    return bench_main(args.rest) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scanlang", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("verify", help="prove a monoid's laws (exit 1 with a counterexample if they fail)")
    p.add_argument("target", metavar="MODULE:NAME")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("show", help="print a monoid's traced expressions and generated kernels")
    p.add_argument("target", metavar="MODULE:NAME")
    p.set_defaults(func=cmd_show)
    p = sub.add_parser("demo", help="the tour: declare, prove, refute, scan, check, time")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--length", type=int, default=None, help="sequence length of the demo scan")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("bench", help="GPU benchmark of the generated scans against the anchors")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_bench)
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
