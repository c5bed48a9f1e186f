"""The compile pipeline: one plain function per stage, called in this order.

    declare -> trace -> verify -> lower -> differentiate -> render -> load -> launch

`declare` and `trace` happen when a `Monoid` is built (`@sl.monoid` traces the combine into sympy);
`verify` proves the law (the user or `scanlang verify` calls it; scans do not re-prove); `lower`
adds the lift/readout and yields the scan IR; `differentiate` derives the adjoint; `render` prints
the Triton module; `load` writes it to the content-addressed cache and imports it; `launch` runs
it through the `torch.library` ops under torch.compile and tracing, and through the same code
without the dispatcher for plain eager tensors (launch plans cached per shape). `build` runs
lower..load once per program.
"""
from __future__ import annotations

from typing import Callable

from . import settings
from .autodiff import Adjoint, differentiate
from .ir import ScanIR, lower
from .monoid import Monoid, monoid as declare


def trace(m: Monoid):
    """The traced combine: one sympy expression per field (x = earlier operand)."""
    return m.exprs


def verify(m: Monoid, seconds: float | None = None):
    """Prove associativity and identity (symbolically where sympy can)."""
    return m.verify(seconds=seconds)


def render(ir: ScanIR, adjoint: Adjoint) -> str:
    """Triton source of the forward and backward kernels (deterministic)."""
    from scanlang.backends.triton.codegen import render as render_triton
    source = render_triton(ir, adjoint)
    if settings.debug():
        print(f"# scanlang: generated Triton for {ir.name} ({ir.key})\n{source}")
    return source


def load(source: str):
    """Cache the source under settings.cache_dir() (content-addressed) and import it."""
    from scanlang.backends.triton.runtime import load as load_module
    return load_module(source)


def build(ir: ScanIR):
    """lower's result -> differentiate -> render -> load: a launchable `Program` (cached by ir.key)."""
    from scanlang.backends.triton.ops import PROGRAMS, Program
    key = ir.key
    if key not in PROGRAMS:
        adjoint = differentiate(ir)
        source = render(ir, adjoint)
        PROGRAMS[key] = Program(key=key, ir=ir, adjoint=adjoint, source=source, module=load(source))
    return PROGRAMS[key]


def launch(program, inputs, initial, dim: int, reverse: bool, fp64: bool, cu_seqlens=None):
    """Run the forward (autograd attached): returns (outputs, final prefix [fields, sequences, lanes]).

    Eager calls on plain tensors skip the torch.library dispatcher; see backends/triton/ops.py."""
    from scanlang.backends.triton.ops import launch as launch_op
    return launch_op(program, inputs, initial, dim, reverse, fp64, cu_seqlens)


def compile_monoid(m: Monoid, inputs=None, lift: Callable | None = None, outputs=None,
                   readout: Callable | None = None, reduce_state: bool = False, prove: bool = False):
    """The whole sequence for one declaration: (verify) -> lower -> build."""
    if prove:
        verify(m)
    return build(lower(m, inputs=inputs, lift=lift, outputs=outputs, readout=readout, reduce_state=reduce_state))


__all__ = ["declare", "trace", "verify", "lower", "differentiate", "render", "load", "launch", "build",
           "compile_monoid"]
