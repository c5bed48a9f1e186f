"""Tracing and printing of elementwise expressions.

A combine (or lift, readout, scale) body is ordinary Python. It is run once on `Traced` values that
wrap sympy expressions, which records one sympy expression per result. The supported operations are
`+ - * /`, unary minus, numeric constants (including +-inf) and the functions below; everything else
raises `UnsupportedOperationError` (a TypeError) naming the operation.

The same functions (`exp`, `log`, ...) work on torch tensors and Python numbers, so one body can be
traced symbolically and also run directly on tensors (the sequential oracle does that).

`render` prints expressions as Python source for a `Dialect` (torch, Triton), after common
subexpression elimination; the output is deterministic.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import sympy
import torch

from .errors import UnsupportedOperationError

SUPPORTED = "+ - * /, unary minus, numeric constants and sl.exp, sl.log, sl.sqrt, sl.abs, sl.maximum, sl.minimum"


def symbol(name: str) -> sympy.Symbol:
    """A real, finite scalar symbol: every field of every element is one."""
    return sympy.Symbol(name, real=True, finite=True)


def constant(value) -> sympy.Expr:
    """A Python number as an exact sympy constant (floats are converted exactly, inf to oo)."""
    if isinstance(value, bool):
        raise UnsupportedOperationError(f"a bool ({value}) is not a numeric constant; use 0 or 1")
    if isinstance(value, int):
        return sympy.Integer(value)
    if isinstance(value, float):
        if math.isnan(value):
            raise UnsupportedOperationError("NaN is not a usable constant in a traced expression")
        if math.isinf(value):
            return sympy.oo if value > 0 else -sympy.oo
        return sympy.Rational(value)
    if isinstance(value, sympy.Expr):
        return value
    raise UnsupportedOperationError(
        f"{type(value).__name__} value {value!r} cannot enter a traced expression; only fields of "
        f"the operands and numeric constants can (supported: {SUPPORTED})")


class Traced:
    """A value seen while tracing: wraps one sympy expression and supports only the DSL's operations."""

    __slots__ = ("expr",)
    __array_priority__ = 1000  # let `2.0 * traced` reach __rmul__ even through numpy scalars

    def __init__(self, expr):
        self.expr = constant(expr) if not isinstance(expr, sympy.Basic) else expr

    @staticmethod
    def _of(other):
        return other.expr if isinstance(other, Traced) else constant(other)

    def __add__(self, o): return Traced(self.expr + self._of(o))
    def __radd__(self, o): return Traced(self._of(o) + self.expr)
    def __sub__(self, o): return Traced(self.expr - self._of(o))
    def __rsub__(self, o): return Traced(self._of(o) - self.expr)
    def __mul__(self, o): return Traced(self.expr * self._of(o))
    def __rmul__(self, o): return Traced(self._of(o) * self.expr)
    def __truediv__(self, o): return Traced(self.expr / self._of(o))
    def __rtruediv__(self, o): return Traced(self._of(o) / self.expr)
    def __neg__(self): return Traced(-self.expr)
    def __pos__(self): return self
    def __abs__(self): return Traced(sympy.Abs(self.expr))

    def _refuse(name):  # noqa: N805 - builds methods below
        def method(self, *args, **kwargs):
            raise UnsupportedOperationError(
                f"operation '{name}' is not supported in a traced body (supported: {SUPPORTED})")
        method.__name__ = name
        return method

    __pow__ = _refuse("**")
    __rpow__ = _refuse("**")
    __floordiv__ = _refuse("//")
    __rfloordiv__ = _refuse("//")
    __mod__ = _refuse("%")
    __rmod__ = _refuse("%")
    __matmul__ = _refuse("@")
    __rmatmul__ = _refuse("@")
    def _compare(name):  # noqa: N805 - builds methods below
        def method(self, *args, **kwargs):
            raise UnsupportedOperationError(
                f"comparison '{name}' is not supported in a traced body: the builtin max() and min() (and "
                f"`if` on values) compare; use sl.maximum(a, b) / sl.minimum(a, b) instead (supported: {SUPPORTED})")
        method.__name__ = name
        return method

    __lt__ = _compare("<")
    __le__ = _compare("<=")
    __gt__ = _compare(">")
    __ge__ = _compare(">=")
    del _compare
    __bool__ = _refuse("bool() (data-dependent control flow such as `if`, `and`, `or`; use sl.maximum/sl.minimum)")
    __float__ = _refuse("float() (math.* functions need concrete numbers; use sl.exp, sl.log, ...)")
    __int__ = _refuse("int()")
    __index__ = _refuse("int()")
    __getitem__ = _refuse("indexing")
    __iter__ = _refuse("iteration")
    __and__ = _refuse("&")
    __or__ = _refuse("|")
    __xor__ = _refuse("^")
    __invert__ = _refuse("~")
    __round__ = _refuse("round()")
    del _refuse

    def __eq__(self, other):
        raise UnsupportedOperationError(f"operation '==' is not supported in a traced body (supported: {SUPPORTED})")

    __hash__ = object.__hash__

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        raise UnsupportedOperationError(
            f"torch.{name} is not supported in a traced body; use the sl.* functions (supported: {SUPPORTED})")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        raise UnsupportedOperationError(
            f"numpy.{ufunc.__name__} is not supported in a traced body; use the sl.* functions "
            f"(supported: {SUPPORTED})")

    def __repr__(self):
        return f"Traced({self.expr})"


def _unary(name: str, sym_fn, torch_name: str, math_fn):
    def fn(x):
        if isinstance(x, Traced):
            return Traced(sym_fn(x.expr))
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return math_fn(x)
        if isinstance(x, torch.Tensor):
            return getattr(torch, torch_name)(x)
        raise UnsupportedOperationError(f"sl.{name} takes a traced value, a tensor or a number, not {type(x).__name__}")
    fn.__name__ = name
    fn.__qualname__ = name
    fn.__doc__ = f"Elementwise {name}: traced symbolically in a body, torch.{torch_name} on tensors."
    return fn


def _binary(name: str, sym_fn, torch_name: str, py_fn):
    def fn(x, y):
        if isinstance(x, Traced) or isinstance(y, Traced):
            return Traced(sym_fn(Traced._of(x), Traced._of(y)))
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            x_t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=y.dtype, device=y.device)
            y_t = y if isinstance(y, torch.Tensor) else torch.as_tensor(y, dtype=x.dtype, device=x.device)
            return getattr(torch, torch_name)(x_t, y_t)
        if isinstance(x, (int, float)) and isinstance(y, (int, float)):
            return py_fn(x, y)
        raise UnsupportedOperationError(f"sl.{name} takes traced values, tensors or numbers")
    fn.__name__ = name
    fn.__qualname__ = name
    fn.__doc__ = f"Elementwise {name} of two values: sympy {sym_fn.__name__} when traced, torch.{torch_name} on tensors."
    return fn


def _safe_log(x):
    return math.log(x) if x > 0 else (-math.inf if x == 0 else math.nan)


exp = _unary("exp", sympy.exp, "exp", math.exp)
log = _unary("log", sympy.log, "log", _safe_log)
sqrt = _unary("sqrt", sympy.sqrt, "sqrt", math.sqrt)
abs = _unary("abs", sympy.Abs, "abs", lambda v: v if v >= 0 else -v)  # noqa: A001 - public DSL name
maximum = _binary("maximum", sympy.Max, "maximum", max)
minimum = _binary("minimum", sympy.Min, "minimum", min)


# --------------------------------------------------------------------------------------------------
# Printing expressions as source code.

@dataclass(frozen=True)
class Dialect:
    """How one target spells the DSL's operations. Names are format strings over the arguments."""

    name: str
    exp: str
    log: str
    sqrt: str
    abs: str
    maximum: str
    minimum: str
    inf: str

    def number(self, value: sympy.Expr) -> str:
        if value is sympy.oo:
            return self.inf
        if value is -sympy.oo:
            return f"(-{self.inf})"
        if isinstance(value, sympy.Integer):
            return f"{int(value)}.0" if int(value) >= 0 else f"({int(value)}.0)"
        f = float(value)
        return repr(f) if f >= 0 else f"({f!r})"


# The torch dialect calls this module's functions (they accept tensors and numbers alike).
TORCH = Dialect("torch", exp="exp({})", log="log({})", sqrt="sqrt({})", abs="abs({})",
                maximum="maximum({}, {})", minimum="minimum({}, {})", inf="math.inf")
TRITON = Dialect("triton", exp="tl.exp({})", log="tl.log({})", sqrt="tl.sqrt({})",
                 abs="tl.abs({})", maximum="tl.maximum({}, {})", minimum="tl.minimum({}, {})",
                 inf="float('inf')")


def docstring_text(text: str) -> str:
    r"""`text` (a user's monoid name) made safe inside a generated triple-quoted docstring or comment:
    backslashes, quotes, newlines and other control characters are escaped, so no name can end the
    docstring or the line early.

    >>> print(docstring_text('say "hi"\nbye'))
    say \"hi\"\nbye
    """
    return repr(str(text))[1:-1].replace('"', '\\"')


def print_expr(expr: sympy.Expr, names: dict, dialect: Dialect) -> str:
    """One expression as source; `names` maps symbols to the variable names to print."""
    p = lambda e: print_expr(e, names, dialect)  # noqa: E731
    if expr in names:
        return names[expr]
    if isinstance(expr, sympy.Symbol):
        raise UnsupportedOperationError(f"symbol {expr} has no name in this context")
    if expr.is_Number or expr in (sympy.oo, -sympy.oo):
        return dialect.number(expr)
    if isinstance(expr, sympy.Add):
        terms = sorted(expr.args, key=sympy.default_sort_key)
        out = p(terms[0])
        for t in terms[1:]:
            coeff, rest = t.as_coeff_Mul()
            if coeff.is_Number and coeff < 0:
                out += " - " + p(-t)
            else:
                out += " + " + p(t)
        return f"({out})"
    if isinstance(expr, sympy.Mul):
        num, den = [], []
        for f in sorted(expr.args, key=sympy.default_sort_key):
            if isinstance(f, sympy.Pow) and f.exp.is_Number and f.exp < 0:
                den.append(sympy.Pow(f.base, -f.exp))
            elif f.is_Rational and not f.is_Integer and f.p == 1:
                den.append(sympy.Integer(f.q))
            else:
                num.append(f)
        neg = False
        if num and num[0].is_Number and num[0] < 0:
            neg = True
            num[0] = -num[0]
            if num[0] == 1:
                num.pop(0)
        top = " * ".join(p(f) for f in num) if num else "1.0"
        out = top if not den else f"{top} / ({' * '.join(p(f) for f in den)})"
        return f"(-{out})" if neg else f"({out})"
    if isinstance(expr, sympy.Pow):
        base, e = expr.base, expr.exp
        if e.is_Integer and int(e) > 0:
            return "(" + " * ".join([p(base)] * int(e)) + ")"
        if e.is_Integer and int(e) < 0:
            return f"(1.0 / {p(sympy.Pow(base, -e))})"
        if e == sympy.Rational(1, 2):
            return dialect.sqrt.format(p(base))
        if e == -sympy.Rational(1, 2):
            return f"(1.0 / {dialect.sqrt.format(p(base))})"
        if base is sympy.E:
            return dialect.exp.format(p(e))
        raise UnsupportedOperationError(f"power {expr} (non-integer exponent) cannot be printed")
    if isinstance(expr, sympy.exp):
        return dialect.exp.format(p(expr.args[0]))
    if isinstance(expr, sympy.log):
        return dialect.log.format(p(expr.args[0]))
    if isinstance(expr, sympy.Abs):
        return dialect.abs.format(p(expr.args[0]))
    if isinstance(expr, (sympy.Max, sympy.Min)):
        fmt = dialect.maximum if isinstance(expr, sympy.Max) else dialect.minimum
        args = sorted(expr.args, key=sympy.default_sort_key)
        out = p(args[0])
        for a in args[1:]:
            out = fmt.format(out, p(a))
        return out
    raise UnsupportedOperationError(f"expression {expr} ({type(expr).__name__}) cannot be printed")


def render(exprs, names: dict, dialect: Dialect, temp_prefix: str = "_t") -> tuple[list[str], list[str]]:
    """Print several expressions with shared subexpressions hoisted into temporaries.

    Returns (assignment lines, one source expression per input expression). Deterministic.
    """
    exprs = list(exprs)
    replacements, reduced = sympy.cse(exprs, symbols=sympy.numbered_symbols(temp_prefix, real=True),
                                      optimizations=None, order="canonical")
    names = dict(names)
    lines = []
    for sym, sub in replacements:
        lines.append(f"{sym.name} = {print_expr(sub, names, dialect)}")
        names[sym] = sym.name
    return lines, [print_expr(e, names, dialect) for e in reduced]
