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

import hashlib
from dataclasses import dataclass
from typing import Callable, Sequence

import sympy

from . import expr as E
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
                     [sympy.srepr(e) for e in self.readout], self.reduce_state))
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
        lift_exprs = trace_body(lift, in_names, (u,), "lift", len(fields))
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
                  reduce_state=reduce_state)


def _trace_readout(body, args, n_results: int):
    from .errors import UnsupportedOperationError
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
