"""`differentiate`: the adjoint of a fused scan, from symbolic Jacobians.

For y_t = F(y_{t-1}, x_t) (F the renormalised combine), x_t = lift(u_t) and
out_t = readout(y_t, u_t, y_{t-1}), with upstream gradients g_t = dL/dout_t:

    dy_t   = (d readout_t / d y_t)^T g_t          direct use of the prefix
    c_t    = (d readout_t / d y_{t-1})^T g_t      use of the previous prefix
    B_t    = J1(y_{t-1}, x_t)^T = (dF/dy_{t-1})^T
    gbar_t = dy_t + c_{t+1} + B_{t+1} gbar_{t+1}, gbar_T = 0 (+ dL/dy_{T-1} of a returned final
             prefix): a REVERSE affine scan over (B_{t+1}, dy_t + c_{t+1}); gbar_t = dL/dy_t
    dx_t   = J2(y_{t-1}, x_t)^T gbar_t             (J2 = dF/dx_t)
    du_t   = (d lift / d u)^T dx_t + (d readout_t / d u_t)^T g_t
    dL/dinitial = c_0 + B_0 gbar_0

B_{t+1} = J1(y_t, x_{t+1})^T needs the prefix at t and the element at t+1, so a kernel tile loads
the next step's inputs (a shifted load, not a shift of registers) and replays y_{t-1} as the scan of
the elements shifted by one. B_t is stored in its sparsest form closed under products: one scalar
when it is a multiple of the identity (the affine monoid: B = a_t I), else the non-zero pattern of
its closure (diagonal included).

Projective monoids whose combine is homogeneous of degree 1 in the earlier operand (matrix products)
are differentiated through the unnormalised chain z_t = m(z_{t-1}, x_t), y_t = z_t / s(z_t): with
h_t = s(z_t) dL/dz_t and sigma_t = s(m(y_{t-1}, x_t)) (y normalised),

    h_t  = J_N(y_t)^T (dy_t + c_{t+1}) + (dm/dq(y_t, x_{t+1}))^T h_{t+1} / sigma_{t+1}
    dx_t = (dm/dx(y_{t-1}, x_t))^T h_t / sigma_t,   dL/dinitial = c_0 + (dm/dq(y_{-1}, x_0))^T h_0 / sigma_0

where J_N is the Jacobian of m -> m / s(m). The transition keeps the combine's sparsity (for 2x2
matrices: two 2x2 blocks, 8 entries instead of a dense 4x4), and no renormalised quotient is ever
differentiated.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from . import expr as E
from .errors import UnsupportedOperationError
from .ir import ScanIR


@dataclass(frozen=True)
class Adjoint:
    """The symbolic backward of a `ScanIR` (symbols: `g_<output>`, `dy_<field>`, `gbar_<field>`, `dx_<field>`)."""

    g: tuple[sympy.Symbol, ...]             # upstream gradient per output
    dy: tuple[sympy.Expr, ...]              # per field, over p, q, u, g
    c: tuple[sympy.Expr, ...]               # per field, over p, q, u, g
    scalar: bool                            # B = b * I
    pattern: tuple[tuple[int, int], ...]    # positions of B's (closed) non-zero entries
    b_entries: tuple[sympy.Expr, ...]       # one per pattern position (one total when scalar), over q, x
    gbar: tuple[sympy.Symbol, ...]
    direct: tuple[sympy.Expr, ...]          # per field, over p, d: what a direct gradient d adds to gbar
    d: tuple[sympy.Symbol, ...]
    dx: tuple[sympy.Expr, ...]              # per field, over q, x, gbar
    dx_symbols: tuple[sympy.Symbol, ...]
    du: tuple[sympy.Expr, ...]              # per input, over u, dx, p, q, g

    def matrix(self, entries) -> list[list]:
        """B as an n x n nested list given one value per stored entry (0 elsewhere)."""
        n = len(self.dy)
        m = [[0] * n for _ in range(n)]
        if self.scalar:
            for i in range(n):
                m[i][i] = entries[0]
        else:
            for (i, j), v in zip(self.pattern, entries):
                m[i][j] = v
        return m


    def entries(self, m) -> list:
        """The stored entries of an n x n nested list in B's sparse form (the inverse of `matrix`)."""
        return [m[0][0]] if self.scalar else [m[i][j] for i, j in self.pattern]


def matmul(a, b) -> list[list]:
    """a b for n x n nested lists of expressions."""
    n = len(a)
    return [[sum((a[i][k] * b[k][j] for k in range(n)), sympy.Integer(0)) for j in range(n)] for i in range(n)]


def matvec(m, v) -> list:
    """m v for an n x n nested list and a length-n list of expressions."""
    return [sum((m[i][k] * v[k] for k in range(len(v))), sympy.Integer(0)) for i in range(len(v))]


def _closure(pattern: set[tuple[int, int]], n: int) -> set[tuple[int, int]]:
    """Smallest pattern containing `pattern` and closed under matrix products."""
    closed = set(pattern)
    while True:
        grown = closed | {(i, j) for (i, k) in closed for (k2, j) in closed if k == k2}
        if grown == closed:
            return closed
        closed = grown


def _check_printable(exprs, what: str):
    for e in exprs:
        bad = e.atoms(sympy.Derivative, sympy.Subs, sympy.DiracDelta, sympy.Piecewise)
        if bad:
            raise UnsupportedOperationError(
                f"{what}: the derivative contains {sorted(map(str, bad))}, which scanlang cannot generate")


def differentiate(ir: ScanIR) -> Adjoint:
    """Derive the adjoint of `ir` symbolically (see the module docstring for the equations)."""
    n = len(ir.fields)
    prev, elem = ir.previous_symbols, ir.later
    step = ir.step()
    # F written over (q = y_{t-1}, x = x_t): the combine's earlier operand is the previous prefix.
    step = tuple(s.subs(dict(zip(ir.earlier, prev)), simultaneous=True) for s in step)
    g = tuple(E.symbol(f"g_{o}") for o in ir.outputs)
    dy = tuple(sum((gi * sympy.diff(r, p) for gi, r in zip(g, ir.readout)), sympy.Integer(0))
               for p in ir.prefix_symbols)
    c = tuple(sum((gi * sympy.diff(r, q) for gi, r in zip(g, ir.readout)), sympy.Integer(0)) for q in prev)

    gbar = tuple(E.symbol(f"gbar_{f}") for f in ir.fields)
    d = tuple(E.symbol(f"d_{f}") for f in ir.fields)
    m = tuple(e.subs(dict(zip(ir.earlier, prev)), simultaneous=True) for e in ir.combine)
    if ir.is_projective and _homogeneous_in(m, prev):
        # Projective adjoint (module docstring): differentiate the UNnormalised chain z_t = m(z_{t-1}, x_t),
        # y_t = z_t / s(z_t), carrying h_t = s(z_t) dL/dz_t. Its transition (dm/dq)^T / s(m) keeps the
        # sparsity of the combine (block structure of a matrix product) that renormalising destroys.
        sigma = ir.scale.subs(dict(zip(ir.scale_symbols, m)), simultaneous=True)
        b = [[sympy.diff(m[i], prev[j]) / sigma for i in range(n)] for j in range(n)]
        p = ir.prefix_symbols
        s_p = ir.scale.subs(dict(zip(ir.scale_symbols, p)), simultaneous=True)
        normalised = [pi / s_p for pi in p]
        direct = tuple(sum((d[i] * sympy.diff(normalised[i], p[j]) for i in range(n)), sympy.Integer(0))
                       for j in range(n))
        dx = tuple(sum((gbar[i] * sympy.diff(m[i], elem[j]) for i in range(n)), sympy.Integer(0)) / sigma
                   for j in range(n))
    else:
        b = [[sympy.diff(step[i], prev[j]) for i in range(n)] for j in range(n)]   # B[j][i] = dF_i / dq_j
        direct = d
        dx = tuple(sum((gbar[i] * sympy.diff(step[i], elem[j]) for i in range(n)), sympy.Integer(0))
                   for j in range(n))
    b = [[sympy.simplify(v) if v.count_ops() < 40 else v for v in row] for row in b]
    off_diagonal_zero = all(b[i][j] == 0 for i in range(n) for j in range(n) if i != j)
    scalar = off_diagonal_zero and all(sympy.simplify(b[i][i] - b[0][0]) == 0 for i in range(n))
    if scalar:
        pattern, b_entries = ((0, 0),), (b[0][0],)
    else:
        nonzero = {(i, j) for i in range(n) for j in range(n) if b[i][j] != 0}
        pattern = tuple(sorted(_closure(nonzero | {(i, i) for i in range(n)}, n)))
        b_entries = tuple(b[i][j] for i, j in pattern)

    dx_symbols = tuple(E.symbol(f"dx_{f}") for f in ir.fields)
    du = tuple(sum((dx_symbols[f] * sympy.diff(ir.lift[f], u) for f in range(n)), sympy.Integer(0))
               + sum((gi * sympy.diff(r, u) for gi, r in zip(g, ir.readout)), sympy.Integer(0))
               for u in ir.input_symbols)
    _check_printable(dy + c + b_entries + direct + dx + du, f"backward of '{ir.name}'")
    return Adjoint(g=g, dy=dy, c=c, scalar=scalar, pattern=pattern, b_entries=b_entries, gbar=gbar,
                   direct=direct, d=d, dx=dx, dx_symbols=dx_symbols, du=du)


def _homogeneous_in(exprs, symbols) -> bool:
    """True when every expression is homogeneous of degree 1 in `symbols` (e.g. a product M_x @ q)."""
    lam = sympy.Symbol("_lambda", positive=True)
    scaled = dict(zip(symbols, [lam * s for s in symbols]))
    return all(sympy.simplify(e.subs(scaled, simultaneous=True) - lam * e) == 0 for e in exprs)
