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

SUPPORTED = ("+ - * /, unary minus, numeric constants and sl.exp, sl.log, sl.sqrt, sl.abs, sl.maximum, sl.minimum, "
             "sl.sigmoid, sl.softplus, sl.logsigmoid")


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

    def _refuse(name, kind="operation", why=""):  # noqa: N805 - builds methods below
        def method(self, *args, **kwargs):
            raise UnsupportedOperationError(
                f"{kind} '{name}' is not supported in a traced body{why} (supported: {SUPPORTED})")
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
    _COMPARES = (": the builtin max() and min() (and `if` on values) compare; use sl.maximum(a, b) / "
                 "sl.minimum(a, b) instead")
    __lt__ = _refuse("<", "comparison", _COMPARES)
    __le__ = _refuse("<=", "comparison", _COMPARES)
    __gt__ = _refuse(">", "comparison", _COMPARES)
    __ge__ = _refuse(">=", "comparison", _COMPARES)
    del _COMPARES
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


def _example(name: str, args: str, result: str) -> str:
    """A doctest for `sl.<name>` on numbers and on a tensor (help() shows it; pytest runs it)."""
    tensors = ", ".join(f"torch.tensor([{a.strip()}])" for a in args.split(","))
    return (f"\n\n>>> import torch, scanlang as sl\n>>> sl.{name}({args}), sl.{name}({tensors}).tolist()\n"
            f"({result}, [{result}])\n")


def _unary(name: str, sym_fn, torch_name: str, math_fn, law: str, example: tuple[str, str]):
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
    fn.__doc__ = (f"Elementwise {name}: traced symbolically in a body, torch.{torch_name} on tensors.\n\n"
                  f"Law: {law}" + _example(name, *example))
    return fn


def _binary(name: str, sym_fn, torch_name: str, py_fn, law: str, example: tuple[str, str]):
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
    fn.__doc__ = (f"Elementwise {name} of two values: sympy {sym_fn.__name__} when traced, torch.{torch_name} on "
                  f"tensors.\n\nLaw: {law}" + _example(name, *example))
    return fn


def _safe_log(x):
    return math.log(x) if x > 0 else (-math.inf if x == 0 else math.nan)


exp = _unary("exp", sympy.exp, "exp", math.exp, "exp(x + y) == exp(x) * exp(y), exp(0) == 1.", ("0.0", "1.0"))
log = _unary("log", sympy.log, "log", _safe_log, "log(x * y) == log(x) + log(y) for x, y > 0; log(0) == -inf.",
             ("1.0", "0.0"))
sqrt = _unary("sqrt", sympy.sqrt, "sqrt", math.sqrt, "sqrt(x) ** 2 == x and sqrt(x) >= 0 for x >= 0.", ("4.0", "2.0"))
abs = _unary("abs", sympy.Abs, "abs", lambda v: v if v >= 0 else -v,  # noqa: A001 - public DSL name
             "abs(x) == maximum(x, -x).", ("-2.0", "2.0"))
maximum = _binary("maximum", sympy.Max, "maximum", max, "maximum(maximum(x, y), z) == maximum(x, maximum(y, z)), "
                  "maximum(x, -inf) == x (the Max monoid).", ("1.0, 2.0", "2.0"))
minimum = _binary("minimum", sympy.Min, "minimum", min, "minimum(minimum(x, y), z) == minimum(x, minimum(y, z)), "
                  "minimum(x, inf) == x.", ("1.0, 2.0", "1.0"))


# --------------------------------------------------------------------------------------------------
# Gates: sigmoid, softplus, logsigmoid. Each is a sympy function of its own (not its exp/log formula):
# its derivative is stated exactly (softplus' = sigmoid, logsigmoid' = sigmoid(-x),
# sigmoid' = sigmoid(x) sigmoid(-x)), so derivatives stay products of gates, which never overflow,
# where differentiating 1 / (1 + e^-x) would give e^-x / (1 + e^-x)^2 = inf / inf at x = -100.
# Printed (and evaluated on numbers) in the overflow-safe forms below, built from exp, abs, min, max:
#   sigmoid(x)    = e^min(x, 0) / (1 + e^-|x|)
#   softplus(x)   = max(x, 0) + log(1 + e^-|x|)
#   logsigmoid(x) = min(x, 0) - log(1 + e^-|x|)

class _Gate(sympy.Function):
    """A one-argument gate; subclasses give `fdiff` and the safe form over (exp, log, abs, min, max)."""

    nargs = 1

    def _eval_is_real(self):
        return self.args[0].is_real

    def _eval_is_finite(self):
        return self.args[0].is_finite

    def _eval_evalf(self, prec):
        return self.safe_form(self.args[0])._eval_evalf(prec)

    def _numpycode(self, printer):  # lambdify(modules="numpy") in the verifier's numeric checks
        a = printer._print(self.args[0])
        np = {f: printer._module_format(f"numpy.{f}") for f in ("exp", "log", "abs", "minimum", "maximum")}
        return self.safe_source(a, lambda f, *xs: f"{np[f]}({', '.join(xs)})")


def _softplus_tail(a, call):
    return call("log", "1.0 + " + call("exp", "-" + call("abs", a)))


class Sigmoid(_Gate):
    @classmethod
    def eval(cls, x):
        if x.is_zero:
            return sympy.Rational(1, 2)
        if x is sympy.oo:
            return sympy.Integer(1)
        if x is -sympy.oo:
            return sympy.Integer(0)

    def fdiff(self, argindex=1):
        x = self.args[0]
        return Sigmoid(x) * Sigmoid(-x)

    @staticmethod
    def safe_form(x):
        return sympy.exp(sympy.Min(x, 0)) / (1 + sympy.exp(-sympy.Abs(x)))

    @staticmethod
    def safe_source(a, call):
        return f"({call('exp', call('minimum', a, '0.0'))} / (1.0 + {call('exp', '-' + call('abs', a))}))"

    def _eval_rewrite_as_exp(self, x, **kwargs):
        return 1 / (1 + sympy.exp(-x))


class Softplus(_Gate):
    @classmethod
    def eval(cls, x):
        if x is sympy.oo:
            return sympy.oo
        if x is -sympy.oo:
            return sympy.Integer(0)

    def fdiff(self, argindex=1):
        return Sigmoid(self.args[0])

    @staticmethod
    def safe_form(x):
        return sympy.Max(x, 0) + sympy.log(1 + sympy.exp(-sympy.Abs(x)))

    @staticmethod
    def safe_source(a, call):
        return f"({call('maximum', a, '0.0')} + {_softplus_tail(a, call)})"

    def _eval_rewrite_as_exp(self, x, **kwargs):
        return sympy.log(1 + sympy.exp(x))


class LogSigmoid(_Gate):
    @classmethod
    def eval(cls, x):
        if x is sympy.oo:
            return sympy.Integer(0)
        if x is -sympy.oo:
            return -sympy.oo

    def fdiff(self, argindex=1):
        return Sigmoid(-self.args[0])

    @staticmethod
    def safe_form(x):
        return sympy.Min(x, 0) - sympy.log(1 + sympy.exp(-sympy.Abs(x)))

    @staticmethod
    def safe_source(a, call):
        return f"({call('minimum', a, '0.0')} - {_softplus_tail(a, call)})"

    def _eval_rewrite_as_exp(self, x, **kwargs):
        return -sympy.log(1 + sympy.exp(-x))


def _py_call(f, *xs):
    return f"{f}({', '.join(xs)})"


def _gate(name: str, cls, torch_fn, doc: str):
    py = eval(compile("lambda x: " + cls.safe_source("x", _py_call), f"<sl.{name}>", "eval"),  # noqa: S307
              {"exp": math.exp, "log": math.log, "abs": lambda v: v if v >= 0 else -v, "minimum": min, "maximum": max})

    def fn(x):
        if isinstance(x, Traced):
            return Traced(cls(x.expr))
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return py(x)
        import torch
        if isinstance(x, torch.Tensor):
            return torch_fn(x)
        raise UnsupportedOperationError(f"sl.{name} takes a traced value, a tensor or a number, not {type(x).__name__}")
    fn.__name__ = name
    fn.__qualname__ = name
    fn.__doc__ = doc
    return fn


def _torch_sigmoid(x):
    import torch
    return torch.sigmoid(x)


def _torch_softplus(x):
    import torch.nn.functional as F
    return F.softplus(x)


def _torch_logsigmoid(x):
    import torch.nn.functional as F
    return F.logsigmoid(x)


sigmoid = _gate("sigmoid", Sigmoid, _torch_sigmoid, """Law: sigmoid(x) = 1 / (1 + e^-x), elementwise; d/dx = sigmoid(x) sigmoid(-x).

Safe at any finite x (printed in an overflow-free form). Works on traced values (inside a monoid or
a hook), tensors and numbers:

>>> import scanlang as sl
>>> sl.sigmoid(0.0), round(sl.sigmoid(100.0), 6), sl.sigmoid(-1000.0)
(0.5, 1.0, 0.0)
""")
softplus = _gate("softplus", Softplus, _torch_softplus, """Law: softplus(x) = log(1 + e^x), elementwise; d/dx = sigmoid(x).

Safe at any finite x (max(x, 0) + log(1 + e^-|x|)):

>>> import scanlang as sl
>>> round(sl.softplus(0.0), 6), sl.softplus(1000.0)
(0.693147, 1000.0)
""")
logsigmoid = _gate("logsigmoid", LogSigmoid, _torch_logsigmoid, """Law: logsigmoid(x) = log sigmoid(x) = -softplus(-x) <= 0, elementwise; d/dx = sigmoid(-x).

A log-decay that is never positive (a gate for the matrix-state family):

>>> import scanlang as sl
>>> round(sl.logsigmoid(0.0), 6), sl.logsigmoid(-1000.0)
(-0.693147, -1000.0)
""")
GATES = (Sigmoid, Softplus, LogSigmoid)


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
    if isinstance(expr, _Gate):
        fields = {"exp": dialect.exp, "log": dialect.log, "abs": dialect.abs,
                  "minimum": dialect.minimum, "maximum": dialect.maximum}
        return expr.safe_source(p(expr.args[0]), lambda f, *xs: fields[f].format(*xs))
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
