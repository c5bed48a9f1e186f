"""Run-based tile bodies of `scan_forward` / `scan_backward` as lines: thin wrappers over the kernel-IR
schedule in kernel/runs.py (what the bodies compute: its docstring), for the line-list callers
codegen_tile.py (runs_prologue, forward_loop, backward_loop, runs_epilogue) and codegen_module.py
(raw_functions, sum_fields_function).

The seam is `body_lines` (statements) and `kernel_lines` (whole kernels): the one printer
(kernel/printer.py) prints the IR inside a dummy kernel and the body's lines come back unindented.
Once the callers build kernel IR themselves they take kernel/runs.py's functions directly
(prologue, forward_loop, backward_loop, epilogue, raw_kernels, sum_fields_kernel) and this file goes.
"""
from __future__ import annotations

from scanlang.autodiff import Adjoint
from scanlang.ir import ScanIR

from .kernel import ir as K
from .kernel import runs
from .kernel.printer import render as print_module
from .kernel.runs import runs_shape, scale_invariant_readout

__all__ = ["backward_loop", "body_lines", "forward_loop", "kernel_lines", "raw_functions", "runs_epilogue",
           "runs_prologue", "runs_shape", "scale_invariant_readout", "sum_fields_function"]

_BODY = "_runs_body"


def body_lines(stmts) -> list[str]:
    """IR statements as source lines at indentation 0 (printed as the body of a dummy kernel)."""
    lines = print_module(K.Module("", (K.Kernel(_BODY, (), tuple(stmts)),))).splitlines()
    start = lines.index(f"def {_BODY}():") + 1
    return [ln[4:] for ln in lines[start:]]


def kernel_lines(kernels) -> list[str]:
    """Whole IR kernels as source lines (decorator first, two blank lines between kernels)."""
    if not kernels:
        return []
    lines = print_module(K.Module("", tuple(kernels))).splitlines()
    return lines[lines.index("@triton.jit"):]


def runs_prologue(ir: ScanIR, carried: str) -> list[str]:
    return body_lines(runs.prologue(ir, carried))


def runs_epilogue(ir: ScanIR, carried: str) -> list[str]:
    return body_lines(runs.epilogue(ir, carried))


def forward_loop(ir: ScanIR) -> list[str]:
    return body_lines(runs.forward_loop(ir))


def backward_loop(ir: ScanIR, adj: Adjoint) -> list[str]:
    return body_lines(runs.backward_loop(ir, adj))


def raw_functions(ir: ScanIR) -> list[str]:
    return kernel_lines(runs.raw_kernels(ir))


def sum_fields_function(ir: ScanIR) -> list[str]:
    return kernel_lines((runs.sum_fields_kernel(ir),))
