"""Every generated source the replay test records: name -> source text (deterministic).

    python -m tests.replay.sources --write DIR    write each source to DIR/NAME.py (to diff two trees)
    python -m tests.replay.sources --record       rewrite tests/replay/record.json from this tree

The record holds, per source, the sha256 of `ast.dump(ast.parse(source))` and its line count: a
structural move of the generator must leave every digest unchanged; a behavioural change updates the
record in its own commit, with its reason in the message.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import pathlib

RECORD = pathlib.Path(__file__).with_name("record.json")


def programs() -> dict:
    """name -> a function returning its source: the library monoids' plain scans, the chunk-parallel
    modules of sl.Affine and sl.Mobius, the three Kalman programs, every delta rule at every chunk size, the
    plain-write matrix-state members' generated modules, every member's decode module."""
    from scanlang import library, pipeline
    from scanlang.backends.triton.kernel import chunked, chunked_lookback
    from scanlang.library import LIBRARY
    from scanlang.delta import RULES
    from scanlang.backends.delta.codegen import kernel_source
    from scanlang.recipes.kaczmarz.ops import CHUNK_SIZES
    from scanlang.recipes.kalman import fused

    def scan(m):
        ir = pipeline.lower(m)
        return pipeline.render(ir, pipeline.differentiate(ir))

    def chunked_module(m, variant=chunked):
        ir = pipeline.lower(m)
        return variant.render(ir, pipeline.differentiate(ir))

    out = {}
    for m in LIBRARY:
        out[f"scan_{m.name}"] = lambda m=m: scan(m)
    for m in (library.Affine, library.Mobius):   # Möbius: the projective module (leaf_scale)
        out[f"chunked_{m.name}"] = lambda m=m: chunked_module(m)
        out[f"chunked_lookback_{m.name}"] = lambda m=m: chunked_module(m, chunked_lookback)
    for name in ("precision_mixer", "information_mixer", "joint_mixer"):
        out[f"kalman_{name}"] = lambda name=name: getattr(fused, name)().program.source
    for rule_name, rule in sorted(RULES.items()):
        for c in CHUNK_SIZES:
            out[f"delta_{rule_name}_c{c}"] = lambda rule=rule, c=c: kernel_source(rule, c)
    from scanlang.backends.linear import kernels as linear_kernels
    from scanlang.backends.linear import kernels_delta as linear_delta_kernels
    from scanlang.recipes.linear.members import GLA, KDA, LINEAR_ATTENTION, SIMPLE_GLA
    for decl in (LINEAR_ATTENTION, SIMPLE_GLA, GLA):
        out[f"linear_{decl.name}"] = lambda decl=decl: linear_kernels.render(decl)
    out[f"linear_delta_{KDA.name}"] = lambda: linear_delta_kernels.render(KDA)
    from scanlang.backends.linear import decode as linear_decode
    from scanlang.recipes.linear import members as linear_members
    decls = [getattr(linear_members, n) for n in ("LINEAR_ATTENTION", "SIMPLE_GLA", "GLA", "DELTANET", "DELTA_RULE",
                                                  "KDA", "KACZMARZ")]
    decls += [linear_members.gated_delta_product_declaration(n, gated) for n, gated in ((2, True), (3, False))]
    for decl in decls:
        out[f"decode_{decl.name}"] = lambda decl=decl: linear_decode.render(decl)
    return out


def sources(names=None) -> dict[str, str]:
    """name -> generated source, for `names` (default: every program)."""
    progs = programs()
    return {n: progs[n]() for n in (sorted(progs) if names is None else names)}


def digest(source: str) -> dict:
    return {"ast_sha256": hashlib.sha256(ast.dump(ast.parse(source)).encode()).hexdigest(),
            "lines": source.count("\n") + 1}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.replay.sources")
    p.add_argument("--write", metavar="DIR", help="write every source to DIR/NAME.py")
    p.add_argument("--record", action="store_true", help="rewrite record.json from this tree")
    args = p.parse_args(argv)
    srcs = sources()
    if args.write:
        d = pathlib.Path(args.write)
        d.mkdir(parents=True, exist_ok=True)
        for name, src in srcs.items():
            (d / f"{name}.py").write_text(src)
    if args.record:
        RECORD.write_text(json.dumps({n: digest(s) for n, s in sorted(srcs.items())}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
