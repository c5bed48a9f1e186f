"""The compile pipeline: one plain function per stage, called in this order.

    declare -> trace -> verify -> lower -> differentiate -> render -> load -> launch

This file is the route: `sl.scan` (backend "triton", through `program_key` and `launch`),
`sl.mixer` (`build` and `launch`) and `scanlang show` (`show`) all take it, and it holds the
registry of compiled programs (`PROGRAMS`). `declare` and `trace` happen when a `Monoid` is built
(`@sl.monoid` traces the combine into sympy); `verify` proves the law (the user or `scanlang
verify` calls it; scans do not re-prove); `lower` adds the lift/readout and yields the scan IR;
`differentiate` derives the adjoint; `render` prints the backend's module (Triton source); `load`
writes it to the content-addressed cache and imports it; `launch` runs it through the backend's
`torch.library` ops under torch.compile and tracing, and through the same code without the
dispatcher for plain eager tensors (launch plans cached per shape). `build` runs
differentiate..load once per program. The backend is reached by name (`scanlang.backend.get`).
"""
from __future__ import annotations

from dataclasses import dataclass
import torch

from . import backend as registry
from . import settings, tuning
from .autodiff import Adjoint, differentiate
from .ir import ScanIR, lower
from .monoid import DECLARED, Monoid, monoid as declare

COMPILER = "triton"   # the backend that renders, loads and launches programs


@dataclass
class Program:
    """One lowered scan with its adjoint, generated source and loaded module."""

    key: str
    ir: object
    adjoint: object
    source: str
    module: object


PROGRAMS: dict[str, Program] = {}   # program key -> Program (one per lowered IR: generated once)


def trace(m: Monoid):
    """The traced combine: one sympy expression per field (x = earlier operand)."""
    return m.exprs


def verify(m: Monoid, seconds: float | None = None):
    """Prove associativity and identity (symbolically where sympy can)."""
    return m.verify(seconds=seconds)


def render(ir: ScanIR, adjoint: Adjoint) -> str:
    """The backend's source of the forward and backward kernels (deterministic)."""
    source = registry.get(COMPILER).render(ir, adjoint)
    if settings.debug():
        print(f"# scanlang: generated Triton for {ir.name} ({ir.key})\n{source}")
    return source


def load(source: str):
    """Cache the source under settings.cache_dir() (content-addressed) and import it."""
    return registry.get(COMPILER).load(source)


def build(ir: ScanIR) -> Program:
    """lower's result -> differentiate -> render -> load: a launchable `Program`, cached by its key:
    the IR's key and the render-time knobs in effect (`scanlang.tuning`), which the renderer reads."""
    key = f"{ir.key}.{tuning.current().render_key}"
    if key not in PROGRAMS:
        adjoint = differentiate(ir)
        source = render(ir, adjoint)
        PROGRAMS[key] = Program(key=key, ir=ir, adjoint=adjoint, source=source, module=load(source))
    return PROGRAMS[key]


def launch(program: Program, inputs, initial, dim: int, reverse: bool, fp64: bool, cu_seqlens=None,
           is_eager: bool | None = None):
    """Run the forward (autograd attached): returns (outputs, final prefix [fields, sequences, lanes]).

    Eager calls on plain tensors skip the torch.library dispatcher (`is_eager`: the caller's
    `eager(...)` of these tensors, None: decided by the backend)."""
    return registry.get(COMPILER).launch(program, inputs, initial, dim, reverse, fp64, cu_seqlens, is_eager=is_eager)


def program(m: Monoid) -> Program:
    """The compiled plain-scan program of `m` (lowered, generated and loaded once)."""
    return PROGRAMS[program_key(m.key, m.name)]


_KEYS: dict = {}   # (monoid key, name, render-time knobs) -> the key of its plain-scan program in PROGRAMS


@torch.compiler.assume_constant_result
def program_key(key: str, name: str) -> str:
    """Build (once) and name the plain-scan program of the declaration `(monoid.key, monoid.name)`.

    torch.compile runs this at trace time and keeps only the string. It takes two strings (constants
    to Dynamo in every torch version, also when a recompile turns numbers dynamic) rather than the
    Monoid object or its parts; the object is found in `scanlang.monoid.DECLARED`. The program is the
    one of the render-time knobs in effect (`scanlang.tuning`).
    """
    found = (key, name, tuning.current().render_key)
    if found not in _KEYS:
        _KEYS[found] = build(lower(DECLARED[(key, name)])).key
    return _KEYS[found]


def show(m: Monoid, shape=None, layout: str = "time") -> str:
    """The generated module (forward and backward kernels, every variant) of `m`'s plain scan
    (`scanlang show --all`); with a `shape` (B, T, D), the configs chosen for it in `layout` and the
    kernels they launch, specialised to that launch (`scanlang show`)."""
    if shape is None:
        return program(m).source
    return registry.get("triton").show_for_shape(program(m), shape, layout)


__all__ = ["declare", "trace", "verify", "lower", "differentiate", "render", "load", "launch", "build",
           "program", "program_key", "show", "PROGRAMS", "Program"]
