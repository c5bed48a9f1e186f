"""`lower`: the small scan IR every code generator consumes.

A fused scan program is

    x_t   = lift(u_t)                                   (per token: inputs -> one monoid element)
    y_t   = y_{t-1} (+) x_t,   y_{-1} = initial or e    (the inclusive prefix; `(+)` renormalised
                                                         for projective monoids)
    out_t = readout(y_t, u_t, y_{t-1})                  (per token; optionally summed over the
                                                         trailing state axis of the lanes)

with every expression a traced sympy expression. A plain `sl.scan` is the special case lift =
identity (one input per field) and readout = the prefix itself. Symbols: inputs `u_<name>`, prefix
`p_<field>`, previous prefix `q_<field>`; the combine keeps the monoid's `x_*` (earlier) and `y_*`
(later) symbols.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Callable, Sequence

import sympy

from . import expr as E
from .errors import UnsupportedOperationError
from .monoid import Fields, Monoid, trace_body


@dataclass(frozen=True)
class ScanIR:
    """A lowered fused scan: fields, per-field expressions, inputs, outputs and the reduction flag."""

    name: str
    fields: tuple[str, ...]
    identity: tuple[float, ...]
    combine: tuple[sympy.Expr, ...]          # over earlier/later symbols, NOT renormalised
    scale: sympy.Expr | None                 # over scale symbols; None unless projective
    earlier: tuple[sympy.Symbol, ...]
    later: tuple[sympy.Symbol, ...]
    scale_symbols: tuple[sympy.Symbol, ...]
    inputs: tuple[str, ...]
    input_symbols: tuple[sympy.Symbol, ...]
    lift: tuple[sympy.Expr, ...]             # one per field, over input symbols
    outputs: tuple[str, ...]
    prefix_symbols: tuple[sympy.Symbol, ...]
    previous_symbols: tuple[sympy.Symbol, ...]
    readout: tuple[sympy.Expr, ...]          # one per output, over prefix/previous/input symbols
    reduce_state: bool                       # outputs summed over the last lane axis
    constants: tuple[tuple[str, float], ...] = ()   # carry fields fixed at every step (`specialize_carry`)
    # (what, file, line) of the user's lift and readout functions, for the generated code's comments;
    # not part of the key or of equality: the same expressions are the same program wherever declared
    declared_at: tuple[tuple[str, str, int], ...] = dataclasses.field(default=(), compare=False)

    @property
    def sequential_only(self) -> bool:
        """A specialised carry (`specialize_carry`) is valid for carry (+) element only: lane-sequential."""
        return bool(self.constants)

    @property
    def is_projective(self) -> bool:
        return self.scale is not None

    @property
    def uses_previous(self) -> bool:
        prev = set(self.previous_symbols)
        return any(e.free_symbols & prev for e in self.readout)

    @property
    def is_plain(self) -> bool:
        """True for `sl.scan`: identity lift, readout = every prefix field, no reduction."""
        return (self.lift == self.input_symbols and self.readout == self.prefix_symbols
                and not self.reduce_state)

    def step(self) -> tuple[sympy.Expr, ...]:
        """F(prev, elem) = renormalised combine: the exact per-step map the adjoint differentiates."""
        if self.scale is None:
            return self.combine
        s = self.scale.subs(dict(zip(self.scale_symbols, self.combine)), simultaneous=True)
        return tuple(c / s for c in self.combine)

    @property
    def key(self) -> str:
        """Content hash of everything the generated code depends on."""
        text = repr((self.fields, self.identity, [sympy.srepr(e) for e in self.combine],
                     sympy.srepr(self.scale) if self.scale is not None else None, self.inputs,
                     [sympy.srepr(e) for e in self.lift], self.outputs,
                     [sympy.srepr(e) for e in self.readout], self.reduce_state, self.constants))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _names(names, what: str) -> tuple[str, ...]:
    if isinstance(names, str) or not isinstance(names, (tuple, list)) or not names:
        raise TypeError(f"{what}: expected a non-empty tuple of names, got {names!r}")
    out = tuple(names)
    for n in out:
        if not isinstance(n, str) or not n.isidentifier() or n.startswith("_"):
            raise ValueError(f"{what}: {n!r} is not a valid name (a Python identifier not starting with '_')")
    if len(set(out)) != len(out):
        raise ValueError(f"{what}: names must be distinct, got {out}")
    return out


def lower(monoid: Monoid, inputs: Sequence[str] | None = None, lift: Callable | None = None,
          outputs: Sequence[str] | None = None, readout: Callable | None = None,
          reduce_state: bool = False) -> ScanIR:
    """Lower a monoid (plus an optional lift and readout) to a `ScanIR`.

    `lift(u)` gets the inputs by name (`u.v`, `u.k`) and returns one value per monoid field.
    `readout(p, u, q)` gets the prefix `p`, the inputs `u` and the previous prefix `q` (fields by
    name) and returns one value per output. Without them: a plain scan (inputs = fields, outputs =
    the prefix fields).
    """
    if not isinstance(monoid, Monoid):
        raise TypeError(f"monoid: expected a scanlang Monoid, got {type(monoid).__name__}")
    fields = monoid.fields
    in_names = fields if inputs is None else _names(inputs, "inputs")
    out_names = fields if outputs is None else _names(outputs, "outputs")
    u = tuple(E.symbol(f"u_{n}") for n in in_names)
    p = tuple(E.symbol(f"p_{f}") for f in fields)
    q = tuple(E.symbol(f"q_{f}") for f in fields)
    if lift is None:
        if inputs is not None and tuple(in_names) != fields:
            raise ValueError(f"lift: needed because inputs {in_names} are not the monoid's fields {fields}")
        lift_exprs = u
    else:
        lift_exprs = trace_body(lift, in_names, (u,), f"lift (inputs {tuple(in_names)} -> the fields of monoid "
                                f"'{monoid.name}')", len(fields), result_names=fields)
    if readout is None:
        if outputs is not None and tuple(out_names) != fields:
            raise ValueError(f"readout: needed because outputs {out_names} are not the monoid's fields {fields}")
        readout_exprs = p
    else:
        def body(prefix, ins, prev):
            return readout(prefix, Fields(in_names, list(ins)), prev)
        args = (Fields(fields, [E.Traced(s) for s in p]), [E.Traced(s) for s in u], Fields(fields, [E.Traced(s) for s in q]))
        readout_exprs = _trace_readout(body, args, len(out_names))
    if not isinstance(reduce_state, bool):
        raise TypeError(f"reduce_state: expected a bool, got {type(reduce_state).__name__}")
    return ScanIR(name=monoid.name, fields=fields, identity=monoid.identity, combine=monoid.exprs,
                  scale=monoid.scale_expr, earlier=monoid.x_symbols, later=monoid.y_symbols,
                  scale_symbols=monoid.m_symbols, inputs=in_names, input_symbols=u, lift=tuple(lift_exprs),
                  outputs=out_names, prefix_symbols=p, previous_symbols=q, readout=tuple(readout_exprs),
                  reduce_state=reduce_state,
                  declared_at=tuple(w for w in (_declared_at(lift, f"lift of {monoid.name}"),
                                                _declared_at(readout, f"readout of {monoid.name}")) if w))


def _declared_at(fn, what: str):
    """(what, file, line) of a user function, or None (no function, or Python cannot tell: a builtin)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    return what, code.co_filename, code.co_firstlineno


def _trace_readout(body, args, n_results: int):
    try:
        out = body(*args)
    except UnsupportedOperationError as exc:
        raise UnsupportedOperationError(f"readout: {exc}") from None
    except TypeError as exc:
        raise UnsupportedOperationError(f"readout used an operation scanlang cannot trace ({exc}); "
                                        f"supported: {E.SUPPORTED}") from None
    if n_results == 1 and not isinstance(out, (tuple, list)):
        out = (out,)
    if not isinstance(out, (tuple, list)) or len(out) != n_results:
        raise ValueError(f"readout must return {n_results} values (one per output); got {out!r}")
    return tuple(o.expr if isinstance(o, E.Traced) else E.constant(o) for o in out)


def specialize_carry(ir: ScanIR, constants: dict[str, float]) -> ScanIR:
    """The step specialised to a carry whose fields in `constants` keep those values forever.

    Given initial values for some fields (numbers known when the program is built), find the largest
    subset K of them that every step preserves: with the carry's K fields set to their values, the
    renormalised combine `ir.step()` returns exactly those values for every element (decided by
    sympy). Example: the Kalman 3x3 monoid started from the constant map (a, c, d, e, g) = (0, 0, 1,
    0, 0) stays of that form, so only (b, f) = (lam, eta) are carried and one step costs one
    reciprocal instead of a 3x3 product and a renormalisation.

    The result's combine is that step with K substituted (no longer a monoid: it is only valid as
    carry (+) element, so `sequential_only` is set and only the lane-sequential schedule runs it);
    its readout sees the constants; its adjoint (scanlang/autodiff.py) then carries gradients for
    the free fields alone. Returns `ir` unchanged when K is empty.
    """
    unknown = [f for f in constants if f not in ir.fields]
    if unknown:
        raise ValueError(f"constants: {unknown} are not fields of {ir.name} {ir.fields}")
    if ir.constants:
        raise ValueError("specialize_carry: the IR is already specialised")
    step = ir.step()
    kept = dict(constants)
    while kept:
        subs = {ir.earlier[ir.fields.index(f)]: E.constant(v) for f, v in kept.items()}
        fixed = {f: sympy.cancel(step[ir.fields.index(f)].subs(subs, simultaneous=True)) for f in kept}
        broken = [f for f in kept if sympy.simplify(fixed[f] - E.constant(kept[f])) != 0]
        if not broken:
            break
        for f in broken:
            del kept[f]
    if not kept:
        return ir
    subs = {ir.earlier[ir.fields.index(f)]: E.constant(v) for f, v in kept.items()}
    combine = tuple(E.constant(kept[f]) if f in kept else sympy.cancel(e.subs(subs, simultaneous=True))
                    for f, e in zip(ir.fields, step))
    rsubs = {}
    for f, v in kept.items():
        i = ir.fields.index(f)
        rsubs[ir.prefix_symbols[i]] = E.constant(v)
        rsubs[ir.previous_symbols[i]] = E.constant(v)
    readout = tuple(e.subs(rsubs, simultaneous=True) for e in ir.readout)
    order = tuple((f, float(kept[f])) for f in ir.fields if f in kept)
    return dataclasses.replace(ir, combine=combine, scale=None, readout=readout, constants=order)
