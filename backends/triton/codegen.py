"""The expression side of the Triton source for a lowered scan (`ScanIR`) and its adjoint (`Adjoint`):
the one sympy -> Triton printer of the monoid's expressions (`_assign`, `_assign_inverted`, over
`scanlang.expr.render`), the names the kernels share (argument lists, combine operands) and the adjoint
combine's expressions. No statements are written here: every kernel
is built as statement IR (kernel/ir.py) by the schedules and their shared builders (kernel/builders.py,
kernel/common.py; printed expressions become assignments through `common.assign` /
`common.assign_inverted`) and printed once by kernel/printer.py. `codegen_module.render` assembles
one module per program, deterministic text, holding:
- `combine(x.., y..)`: the monoid's combine on one scalar per field (x earlier), renormalised by the
  scale expression for projective monoids; `combine_rcp`, where the combine divides or rescales: the
  same with every reciprocal by the hardware instruction (`reciprocal`), which the tile kernels call
  instead under constexpr RCP_APPROX (float32 compiled for a GPU; plan.py). Their readouts and
  adjoint expressions multiply by `reciprocal(d, RCP_APPROX)` instead of dividing by d;
- `leaf_scale`, for projective monoids: every schedule scales each lifted leaf by a power of two that brings
  its largest field into [1, 2) before any product (`builders.renormalise_leaf`), and its backward scales the leaf's
  gradient by the same factor;
- `adjoint_combine`: the reverse affine scan's combine over (B entries, vector) pairs;
- `scan_forward`: lanes = every index but time, flattened over up to four lane dims with arbitrary
  strides (stride 0 = a broadcast parameter, loaded, never materialised). A program owns BLOCK_L
  lanes and walks time in [BLOCK_T, BLOCK_L] tiles: lift, `tl.associative_scan` along time,
  combine with the prefix carried in registers, readout (optionally summed over the last lane axis,
  STATE lanes), store. It stores the carry at every tile start (the backward's checkpoints) and the
  last prefix per lane;
- `scan_backward`: walks the tiles in reverse, replays the tile's prefixes (and, from the elements
  shifted by one step, the previous prefixes) from its checkpoint, loads the next step's inputs,
  forms the adjoint elements (B_{t+1}, dy_t + c_{t+1}) and runs the reverse scan, carrying gbar
  across tiles; writes the input gradients (stored, or reduced in-kernel where an input is
  broadcast) and the gradient of the initial element (see scanlang/autodiff.py).
- `scan_forward_lanes` / `scan_backward_lanes`: the lane-sequential schedule (kernel/lanes.py, kernel/lanes_adjoint.py), same
  arguments and checkpoints, selected by `Config.schedule` (runtime.py).
Time runs backwards in memory when REVERSE is set (index T-1-t), which is `flip, scan, flip`.
"""
from __future__ import annotations

import sympy

from scanlang import expr as E
from scanlang.autodiff import Adjoint, matmul, matvec
from scanlang.ir import ScanIR

LANE_DIMS = 4
STRIDES = ("st", "s0", "s1", "s2", "s3")


def _num(v: float) -> str:
    return E.TRITON.number(E.constant(v))


def _piecewise(exprs, names, prefix):
    """Heaviside/sign atoms (derivatives of maximum/minimum/abs) as `tl.where` temporaries.

    Ties follow torch: d max(a, b)/da = 1/2 when a == b (sympy's Heaviside(0) = 1/2 as well).
    """
    atoms = sorted(set().union(*(e.atoms(sympy.Heaviside, sympy.sign) for e in exprs)), key=sympy.default_sort_key)
    lines, names, subs = [], dict(names), {}
    for k, atom in enumerate(atoms):
        arg_lines, (arg,) = E.render([atom.args[0]], names, E.TRITON, temp_prefix=f"{prefix}h{k}_")
        lines += arg_lines
        sym = E.symbol(f"{prefix}h{k}")
        neg = "0.0, 0.5" if isinstance(atom, sympy.Heaviside) else "-1.0, 0.0"
        lines.append(f"{sym.name} = tl.where({arg} > 0, 1.0, tl.where({arg} < 0, {neg}))")
        names[sym] = sym.name
        subs[atom] = sym
    return lines, [e.xreplace(subs) for e in exprs], names


def _assign(names_out, exprs, names, prefix, shape_like=None):
    """Lines assigning rendered `exprs` to `names_out`; constants become full tiles when `shape_like`."""
    pre, exprs, names = _piecewise(list(exprs), names, prefix)
    lines, outs = E.render(exprs, names, E.TRITON, temp_prefix=prefix)
    lines = pre + lines
    for name, src, e in zip(names_out, outs, exprs):
        if shape_like is not None and not (e.free_symbols & set(names)):
            src = f"tl.zeros_like({shape_like}) + {src}"
        lines.append(f"{name} = {src}")
    return lines


def _assign_inverted(names_out, exprs, names, prefix, shape_like=None, hw: str = "RCP_APPROX",
                     recips: dict | None = None) -> list[str]:
    """`_assign`, with every base raised to a negative integer power inverted once by
    `reciprocal(base, hw)`: b^-n becomes r^n (r = 1 / b), so a multiply replaces each division.
    `recips` (rendered base -> variable) shares the reciprocals across the assignments of one scope."""
    recips = {} if recips is None else recips
    names = dict(names)
    exprs = [sympy.sympify(e) for e in exprs]
    lines, subs = [], {}
    powers = {a for e in exprs for a in e.atoms(sympy.Pow) if a.exp.is_Integer and a.exp < 0}
    for atom in sorted(powers, key=sympy.default_sort_key):
        key = E.print_expr(atom.base, names, E.TRITON)
        var = recips.get(key)
        if var is None:
            var = recips[key] = f"{prefix}rcp{len(recips)}"
            pre, (src,) = E.render([atom.base], names, E.TRITON, temp_prefix=f"{var}_")
            lines += pre + [f"{var} = reciprocal({src}, {hw})"]
        names[E.symbol(var)] = var
        subs[atom] = E.symbol(var) ** (-atom.exp)
    return lines + _assign(names_out, [e.xreplace(subs) for e in exprs], names, prefix, shape_like)


def has_combine_rcp(ir: ScanIR) -> bool:
    """Whether the combine inverts anything (a division, or a projective rescale): then the module has
    `combine_rcp`, the combine with the hardware reciprocal."""
    return ir.is_projective or any(a.exp.is_Integer and a.exp < 0 for e in ir.combine
                                   for a in sympy.sympify(e).atoms(sympy.Pow))


def combine_operands(ir: ScanIR) -> tuple[list[str], list[str], dict, list[str]]:
    """The names a generated combine uses: parameters x_<field> (earlier) and y_<field> (later), the
    symbol -> name map for rendering, and the results m_<field>."""
    xs = [f"x_{f}" for f in ir.fields]
    ys = [f"y_{f}" for f in ir.fields]
    return xs, ys, dict(zip(ir.earlier, xs)) | dict(zip(ir.later, ys)), [f"m_{f}" for f in ir.fields]


def adjoint_combine_exprs(ir: ScanIR, adj: Adjoint):
    """The reverse affine scan's combine over (B, e) pairs, w -> B w + e, x applied first (the later
    time step): (yB xB, yB xe + ye), B keeping the adjoint's sparsity. Returns the operand symbols
    (xb, yb, xe, ye) and the result expressions (b_out, e_out); every schedule prints these."""
    n = len(ir.fields)
    nb = len(adj.b_entries)
    xb = [E.symbol(f"xb{k}") for k in range(nb)]
    yb = [E.symbol(f"yb{k}") for k in range(nb)]
    xe = [E.symbol(f"xe{i}") for i in range(n)]
    ye = [E.symbol(f"ye{i}") for i in range(n)]
    mx, my = adj.matrix(xb), adj.matrix(yb)
    b_out = adj.entries(matmul(my, mx))
    e_out = [m + y for m, y in zip(matvec(my, xe), ye)]
    return (xb, yb, xe, ye), (b_out, e_out)


def _strides(prefix):
    return [f"{prefix}_{s}" for s in STRIDES]


def forward_args(ir: ScanIR) -> list[str]:
    """The forward kernels' runtime arguments (both schedules take the same ones)."""
    args = []
    for i in range(len(ir.inputs)):
        args += [f"u{i}_ptr", *_strides(f"u{i}")]
    for j in range(len(ir.outputs)):
        args += [f"o{j}_ptr", *_strides(f"o{j}")]
    for f in range(len(ir.fields)):
        args += [f"init{f}_ptr", f"init{f}_sn", *_strides(f"init{f}")[1:]]
    return args + ["ckpt_ptr", "final_ptr", "cu_ptr", "T", "L", "D1", "D2", "D3", "n_seq", "n_slots"]


def backward_args(ir: ScanIR) -> list[str]:
    """The backward kernels' runtime arguments (the lane-sequential one adds a scratch pointer)."""
    args = []
    for i in range(len(ir.inputs)):
        args += [f"u{i}_ptr", *_strides(f"u{i}")]
    for j in range(len(ir.outputs)):
        args += [f"g{j}_ptr", *_strides(f"g{j}")]
    for i in range(len(ir.inputs)):
        args += [f"du{i}_ptr", *_strides(f"du{i}")]
    args += [f"dinit{f}_ptr" for f in range(len(ir.fields))]
    return args + ["dfinal_ptr", "ckpt_ptr", "cu_ptr", "T", "L", "D1", "D2", "D3", "n_seq", "n_slots"]


def _symbols_named(symbols, fmt):
    return {s: fmt.format(s.name[2:]) for s in symbols}
