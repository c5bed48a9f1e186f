"""Pieces every schedule rendered on the kernel IR shares: the user's declaration as `Origin`s,
expressions through the one sympy -> Triton printer, the combine functions and the small helpers.

Expressions are printed by `scanlang.expr.render` (common subexpressions hoisted) by way of the
tile generator's `_assign` (which also turns the Heaviside/sign atoms of derivatives into
`tl.where`): there is one expression printer, and this module only wraps its lines as statements.
"""
from __future__ import annotations

import inspect
import os
from pathlib import Path

from scanlang import expr as E
from scanlang.autodiff import Adjoint, matmul, matvec
from scanlang.ir import ScanIR

from ..codegen import _assign, _assign_inverted, _num, adjoint_combine_exprs
from . import ir as K


def number(value: float) -> str:
    """A constant as Triton source (the expression printer's spelling: 1.0, float('inf'), ...)."""
    return _num(value)


def assign(targets, exprs, names: dict, prefix: str, shape_like: str | None = None) -> tuple[K.Assign, ...]:
    """`targets[i] = exprs[i]` as statements, printed by the one expression printer (shared
    subexpressions named `prefix<k>` first); constants become full tiles shaped like `shape_like`."""
    return K.assign_lines(_assign(list(targets), list(exprs), names, prefix, shape_like))


def assign_inverted(targets, exprs, names: dict, prefix: str, *, shape_like: str | None = None,
                    recips: dict | None = None, hw: str = "RCP_APPROX") -> tuple[K.Assign, ...]:
    """`assign` with every reciprocal taken once by `reciprocal(base, hw)` (codegen._assign_inverted);
    `recips` shares them across the assignments of one scope (a step, a tile)."""
    return K.assign_lines(_assign_inverted(list(targets), list(exprs), names, prefix, shape_like, hw=hw, recips=recips))


def source_path(path: str) -> str:
    """`path` as an origin comment prints it: relative to the working directory when the file is
    under it, else relative to the root of the package that holds it (`scanlang/library.py`), else
    its file name. An absolute path would make the generated source depend on where the checkout
    lives, so the same declaration would render differently on two machines. Names Python gives
    code that has no file (`<stdin>`, `<string>`) stay as they are.

    >>> source_path(os.path.join(os.getcwd(), "examples", "my.py"))
    'examples/my.py'
    """
    if path.startswith("<"):
        return path
    file = Path(os.path.realpath(path))
    cwd = Path(os.path.realpath(os.getcwd()))
    if cwd in file.parents:
        return file.relative_to(cwd).as_posix()
    root = file.parent
    while (root / "__init__.py").is_file():
        root = root.parent
    return file.relative_to(root).as_posix()   # the file name alone when no package holds it


def _where(fn, what: str) -> K.Origin | None:
    """`what` declared at fn's file:line, or None when Python cannot tell (a builtin, a C function)."""
    try:
        path = inspect.getsourcefile(fn)
        line = fn.__code__.co_firstlineno
    except (TypeError, AttributeError):
        return None
    return None if path is None else K.Origin(what, source_path(path), line)


def origins(ir: ScanIR) -> tuple[K.Origin, ...]:
    """Where the code behind `ir` was declared: the monoid's combine and (projective) scale functions,
    then a mixer's lift and readout (`ScanIR.declared_at`, recorded when it was lowered).

    The IR holds expressions, not functions; the monoid is found among the declared monoids
    (`scanlang.monoid.DECLARED`) by name and traced combine. None found (an IR built by hand): no
    combine or scale line."""
    from scanlang.monoid import DECLARED
    found = []
    for m in DECLARED.values():
        if m.name == ir.name and tuple(m.exprs) == tuple(ir.combine):
            found = [_where(m.combine_fn, f"combine of {E.docstring_text(m.name)}")]
            if m.scale_fn is not None:
                found.append(_where(m.scale_fn, f"scale of {E.docstring_text(m.name)}"))
            break
    found += [K.Origin(E.docstring_text(what), source_path(path), line) for what, path, line in ir.declared_at]
    return tuple(o for o in found if o is not None)


def combine_kernel(ir: ScanIR, origin: tuple[K.Origin, ...]) -> K.Kernel:
    """`combine(x.., y..)`: the monoid's combine on one value per field (x the earlier operand),
    renormalised by the scale for projective monoids (any positive multiple is the same element;
    float32 rescales by Triton's non-IEEE division tl.fdiv, as the tile kernels do)."""
    xs = [f"x_{f}" for f in ir.fields]
    ys = [f"y_{f}" for f in ir.fields]
    out = [f"m_{f}" for f in ir.fields]
    names = dict(zip(ir.earlier, xs)) | dict(zip(ir.later, ys))
    body = list(assign(out, ir.combine, names, "_c", shape_like=xs[0]))
    if ir.is_projective:
        body += assign(["scale"], [ir.scale], dict(zip(ir.scale_symbols, out)), "_s")
        body.append(K.If(K.expr("scale.dtype == tl.float32"), (K.assign("inv_scale", "tl.fdiv(1.0, scale)"),),
                         (K.assign("inv_scale", "1.0 / scale"),)))
        body.append(K.Return(tuple(K.expr(f"{o} * inv_scale") for o in out)))
    else:
        body.append(K.Return(tuple(K.expr(o) for o in out)))
    return K.Kernel("combine", tuple(K.Param(p) for p in xs + ys), tuple(body),
                    doc="combine(x, y) with x the earlier operand, one value per field.", origin=origin)


def adjoint_combine_kernel(ir: ScanIR, adj: Adjoint) -> K.Kernel:
    """`adjoint_combine`: the reverse affine scan's combine over (B, e) pairs, w -> B w + e, with x
    applied first (the later time step): (yB xB, yB xe + ye). B keeps the adjoint's sparsity."""
    n, nb = len(ir.fields), len(adj.b_entries)
    (xb, yb, xe, ye), (b_out, e_out) = adjoint_combine_exprs(ir, adj)
    outs = [f"b{k}" for k in range(nb)] + [f"e{i}" for i in range(n)]
    body = assign(outs, b_out + e_out, {s: s.name for s in xb + yb + xe + ye}, "_a", shape_like="xe0")
    params = tuple(K.Param(s.name) for s in xb + xe + yb + ye)
    return K.Kernel("adjoint_combine", params, body + (K.Return(tuple(K.expr(o) for o in outs)),),
                    doc="(B, e) pairs of w -> B w + e, x applied first (the later time step).")


def adjoint_exclusive_combine_kernel(ir: ScanIR, adj: Adjoint) -> K.Kernel:
    """`adjoint_exclusive_combine`: a reverse scan giving the adjoint gbar_t from the transitions M_t
    of the same rows (M_t = B_t = J1(y_{t-1}, x_t)^T, aligned with the step's own inputs) rather than
    of the next ones. gbar_t = v_t + M_{t+1} gbar_{t+1}; with z_t = M_t gbar_t (what row t hands to
    row t - 1), a segment of rows i..j is (F, c, L): gbar_i = c + F z_{j+1}, L = M_i. x is the later
    segment: (yF xL xF, yc + yF xL xc, yL); the leaf of row t is (I, v_t, M_t). F and L keep the
    adjoint's sparsity (its pattern is closed under products)."""
    n, nb = len(ir.fields), len(adj.b_entries)
    sym = lambda p, k: [E.symbol(f"{p}{i}") for i in range(k)]  # noqa: E731
    xf, xc, xl, yf, yc, yl = sym("xf", nb), sym("xc", n), sym("xl", nb), sym("yf", nb), sym("yc", n), sym("yl", nb)
    yfxl = matmul(adj.matrix(yf), adj.matrix(xl))
    f_out = adj.entries(matmul(yfxl, adj.matrix(xf)))
    c_out = [y + m for y, m in zip(yc, matvec(yfxl, xc))]
    outs = [f"f{k}" for k in range(nb)] + [f"c{i}" for i in range(n)] + [f"l{k}" for k in range(nb)]
    body = assign(outs[:nb + n], f_out + c_out, {s: s.name for s in xf + xc + xl + yf + yc}, "_x", shape_like="xc0")
    body += (K.assign_lines([f"l{k} = yl{k}" for k in range(nb)]))
    params = tuple(K.Param(s.name) for s in xf + xc + xl + yf + yc + yl)
    return K.Kernel("adjoint_exclusive_combine", params, body + (K.Return(tuple(K.expr(o) for o in outs)),),
                    doc="(F, c, L) of rows i..j: gbar_i = c + F z_(j+1), L = M_i; x the later segment.")


def prefix_pair_combine_kernel(ir: ScanIR) -> K.Kernel:
    """`prefix_pair_combine`: a scan giving each row's prefix y_t and the previous one y_{t-1} from the
    tile's own elements (no load shifted by a step): a segment is (A, B), A its aggregate and B that of
    all but its last step, (xA (+) yA, xA (+) yB) with x the earlier segment; the leaf is (x_t, e)."""
    xa, xb, ya, yb = ([f"{p}_{f}" for f in ir.fields] for p in ("xa", "xb", "ya", "yb"))
    body = (K.Assign(tuple(f"a_{f}" for f in ir.fields), K.expr(f"combine({', '.join(xa + ya)})")),
            K.Assign(tuple(f"b_{f}" for f in ir.fields), K.expr(f"combine({', '.join(xa + yb)})")),
            K.Return(tuple(K.expr(f"{p}_{f}") for p in "ab" for f in ir.fields)))
    return K.Kernel("prefix_pair_combine", tuple(K.Param(p) for p in xa + xb + ya + yb), body,
                    doc="(A, B) = (the aggregate, that of all but the last step); x the earlier segment.")


def to_acc_kernel() -> K.Kernel:
    """`to_acc(x, FP64)`: the accumulation dtype, float64 when FP64, else float32."""
    return K.Kernel("to_acc", (K.Param("x"), K.Param("FP64", constexpr=True)),
                    (K.If(K.expr("FP64"), (K.Return((K.expr("x.to(tl.float64)"),)),),
                          (K.Return((K.expr("x.to(tl.float32)"),)),)),),
                    doc="The accumulation dtype: float64 when FP64, else float32.")


def lane_offsets_kernel() -> K.Kernel:
    """`lane_offsets`: the memory offset of flattened lane indices over four lane dims, last fastest."""
    body = (K.assign("i3", "lane % D3"), K.assign("rest", "lane // D3"), K.assign("i2", "rest % D2"),
            K.assign("rest", "rest // D2"), K.assign("i1", "rest % D1"), K.assign("i0", "rest // D1"),
            K.Return((K.expr("i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3"),)))
    params = tuple(K.Param(p) for p in ("lane", "D1", "D2", "D3", "s0", "s1", "s2", "s3"))
    return K.Kernel("lane_offsets", params, body,
                    doc="Memory offset of flattened lane indices over lane dims (D0, D1, D2, D3), last fastest.")
