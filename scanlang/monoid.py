"""The declarative monoid object: `@sl.monoid(fields=..., identity=..., scale=None)`.

A monoid is a set of elements (tuples of scalar fields), an associative combine and an identity:

    combine(combine(x, y), z) == combine(x, combine(y, z))        (associativity)
    combine(e, x) == x == combine(x, e)                           (identity e)

`x` is the EARLIER operand and `y` the LATER one. The body is traced once with sympy symbols
(`x_<field>`, `y_<field>`) into one expression per field: that trace is the single source of truth
for verification, the reference backend and code generation.

Projective monoids (`scale=`) have elements that are equal up to a nonzero factor; `scale(m)` must be
homogeneous of degree 1 and every combine result is divided by it, which keeps the law exactly.
"""
from __future__ import annotations

import hashlib
import inspect
import math
import warnings
from typing import Callable, Sequence

import sympy
import torch

from . import expr as E
from .errors import UnprovedWarning, UnsupportedOperationError
from .traced import BuiltOutsideTheTrace
from .verify import verify

# (key, name) -> the declaration: torch.compile passes these two strings (constants to Dynamo) to the
# trace-time proof check in scan.py, which finds the object here
DECLARED: "dict[tuple[str, str], Monoid]" = {}   # a declaration lives as long as its compiled kernels
_WARNED: set[str] = set()   # keys of monoids already warned about (UnprovedWarning)


class Fields:
    """An element seen by a body: fields by attribute (`x.a`), by name (`x["a"]`) or position (`x[0]`).

    Law: x.<name> == x["<name>"] == x[i] for the i-th declared field; elements are read-only.

    >>> import scanlang as sl
    >>> x = sl.Fields(("a", "b"), (2.0, 3.0))
    >>> x.a, x["b"], x[0], len(x)
    (2.0, 3.0, 2.0, 2)
    """

    __slots__ = ("_names", "_values")

    def __init__(self, names: Sequence[str], values: Sequence):
        object.__setattr__(self, "_names", tuple(names))
        object.__setattr__(self, "_values", tuple(values))

    def __getattr__(self, name):
        try:
            return self._values[self._names.index(name)]
        except ValueError:
            raise AttributeError(f"element has no field {name!r}; fields are {self._names}") from None

    def __getitem__(self, key):
        if isinstance(key, str):
            return getattr(self, key)
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self):
        return len(self._values)

    def __setattr__(self, name, value):
        raise AttributeError("elements are read-only inside a body; return new values instead")


def _check_fields(fields) -> tuple[str, ...]:
    if isinstance(fields, str) or not isinstance(fields, (tuple, list)) or not fields:
        raise TypeError(f"fields must be a non-empty tuple of names, e.g. ('a', 'b'); got {fields!r}")
    out = tuple(fields)
    for f in out:
        if not isinstance(f, str) or not f.isidentifier() or f.startswith("_"):
            raise ValueError(f"fields: {f!r} is not a valid field name (a Python identifier not starting with '_')")
    if len(set(out)) != len(out):
        raise ValueError(f"fields: names must be distinct, got {out}")
    return out


def _check_identity(identity, fields) -> tuple[float, ...]:
    if isinstance(identity, (int, float)) and len(fields) == 1:
        identity = (identity,)
    if not isinstance(identity, (tuple, list)) or len(identity) != len(fields):
        raise ValueError(f"identity must be a tuple of {len(fields)} numbers (one per field {fields}); got {identity!r}")
    out = []
    for v in identity:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"identity: {v!r} is not a number")
        if math.isnan(v):
            raise ValueError("identity: NaN is not a valid identity value")
        out.append(float(v))
    return tuple(out)


def trace_body(fn: Callable, names: Sequence[str], operands: Sequence[Sequence[sympy.Symbol]], what: str,
               n_results: int | None, result_names: Sequence[str] | None = None):
    """Run `fn` on Traced operands and return its results as sympy expressions.

    `result_names` name the results in an error about their number (default: `names`, the fields
    of a combine, which returns one value per field)."""
    args = [Fields(names, [E.Traced(s) for s in syms]) for syms in operands]
    try:
        out = fn(*args)
    except UnsupportedOperationError as exc:
        raise UnsupportedOperationError(f"{what}: {exc}") from None
    except TypeError as exc:
        raise UnsupportedOperationError(
            f"{what} used an operation scanlang cannot trace ({exc}); supported: {E.SUPPORTED}") from None
    if n_results is None:
        return E.Traced._of(out) if not isinstance(out, E.Traced) else out.expr
    if n_results == 1 and not isinstance(out, (tuple, list)):
        out = (out,)
    if not isinstance(out, (tuple, list)) or len(out) != n_results:
        got = len(out) if isinstance(out, (tuple, list)) else type(out).__name__
        expected = tuple(names if result_names is None else result_names)
        raise ValueError(f"{what} must return a tuple of {n_results} values (one per field {expected}); got {got}")
    return tuple(o.expr if isinstance(o, E.Traced) else E.constant(o) for o in out)


class Monoid(BuiltOutsideTheTrace):
    """A declared monoid: fields, an associative combine of an earlier element x and a later one y,
    and its identity e. Build it with `@sl.monoid(...)`; `help()` of a declared monoid shows its own
    combine's docstring and traced expressions.

    Law: combine(combine(x, y), z) == combine(x, combine(y, z)) and combine(e, x) == x == combine(x, e).

    >>> import scanlang as sl
    >>> sl.Affine.fields, sl.Affine.identity
    (('a', 'b'), (1.0, 0.0))
    >>> print(sl.Affine.describe())
    <monoid Affine fields=('a', 'b') identity=(1.0, 0.0)>
    combine(x, y) with x the earlier operand:
      a = x_a*y_a
      b = x_b*y_a + y_b

    Declared inside a torch.compile'd function, it is built (traced with sympy) at trace time,
    outside the graph (`scanlang.traced`); a scan of it proves it there too.
    """

    def __init__(self, combine: Callable, fields, identity, scale: Callable | None = None, name: str | None = None):
        if torch.compiler.is_dynamo_compiling():
            return   # built outside the trace by BuiltOutsideTheTrace.__new__
        if not callable(combine):
            raise TypeError(f"combine must be a function of two elements, got {type(combine).__name__}")
        if scale is not None and not callable(scale):
            raise TypeError(f"scale must be a function of one element (or None), got {type(scale).__name__}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a string (or None), got {type(name).__name__}")
        self.name = name or getattr(combine, "__name__", "monoid")
        self.fields = _check_fields(fields)
        self.identity = _check_identity(identity, self.fields)
        self.combine_fn = combine
        self.scale_fn = scale
        self.x_symbols = tuple(E.symbol(f"x_{f}") for f in self.fields)
        self.y_symbols = tuple(E.symbol(f"y_{f}") for f in self.fields)
        self.m_symbols = tuple(E.symbol(f"m_{f}") for f in self.fields)
        self.exprs = trace_body(combine, self.fields, (self.x_symbols, self.y_symbols),
                                f"combine of monoid '{self.name}'", len(self.fields))
        self.scale_expr = None
        if scale is not None:
            self.scale_expr = trace_body(scale, self.fields, (self.m_symbols,), f"scale of monoid '{self.name}'", None)
        self._torch_combine = None
        self._torch_scale = None
        self._proof = None
        # plain attributes, not properties that hash on access: torch.compile reads them as constants
        text = repr((self.fields, [sympy.srepr(e) for e in self.exprs], self.identity,
                     sympy.srepr(self.scale_expr) if self.scale_expr is not None else None))
        self.digest = hashlib.sha256(text.encode()).hexdigest()
        self.key = self.digest[:16]
        if DECLARED.get((self.key, self.name)) is None:
            DECLARED[(self.key, self.name)] = self
        self.__doc__ = self._help_text()   # what help(monoid) and pydoc show for this declaration

    def trace_identity(self) -> str:
        """Equal for declarations that behave the same: the content hash and the name."""
        return f"{self.key}:{self.name}"

    def _help_text(self) -> str:
        """This declaration's own docstring: the combine's docstring (its law and examples), then the
        law every monoid satisfies and the traced expressions."""
        own = inspect.getdoc(self.combine_fn) or f"The monoid '{self.name}' (its combine has no docstring)."
        law = ("Law: combine(combine(x, y), z) == combine(x, combine(y, z)); "
               f"identity e = {self.identity}: combine(e, x) == x == combine(x, e).")
        traced = "\n".join(self.describe().splitlines()[1:])   # its first line is repr(self), which help() shows
        return f"{own}\n\n{law}\n\n{traced}\n\nSee help(scanlang.Monoid) for the methods."

    # ---- identity of the declaration ------------------------------------------------------------
    @property
    def is_projective(self) -> bool:
        return self.scale_expr is not None

    @property
    def identity_exprs(self) -> tuple[sympy.Expr, ...]:
        return tuple(E.constant(v) for v in self.identity)

    def __repr__(self):
        kind = "projective monoid" if self.is_projective else "monoid"
        return f"<{kind} {self.name} fields={self.fields} identity={self.identity}>"

    def describe(self) -> str:
        """The traced expressions, one line per field (what `scanlang show` prints first)."""
        lines = [f"{self!r}", "combine(x, y) with x the earlier operand:"]
        for f, e in zip(self.fields, self.exprs):
            lines.append(f"  {f} = {e}")
        if self.is_projective:
            lines.append(f"  renormalised by scale(m) = {self.scale_expr}")
        return "\n".join(lines)

    # ---- evaluation on tensors ------------------------------------------------------------------
    def _compile_torch(self):
        names = {s: f"x[{i}]" for i, s in enumerate(self.x_symbols)}
        names.update({s: f"y[{i}]" for i, s in enumerate(self.y_symbols)})
        lines, outs = E.render(self.exprs, names, E.TORCH)
        src = "def combine(x, y):\n" + "".join(f"    {ln}\n" for ln in lines)
        src += f"    return ({', '.join(outs)},)\n"
        if self.is_projective:
            lines, (out,) = E.render([self.scale_expr], {s: f"m[{i}]" for i, s in enumerate(self.m_symbols)}, E.TORCH)
            src += "def scale(m):\n" + "".join(f"    {ln}\n" for ln in lines) + f"    return {out}\n"
        namespace = {"math": math, "exp": E.exp, "log": E.log, "sqrt": E.sqrt, "abs": E.abs,
                     "maximum": E.maximum, "minimum": E.minimum}
        exec(compile(src, f"<scanlang torch combine {self.name}>", "exec"), namespace)  # noqa: S102
        self._torch_combine = namespace["combine"]
        self._torch_scale = namespace.get("scale")
        self.torch_source = src

    def prepare(self):
        """Build the torch evaluation of the traced expressions now (it is otherwise built on first
        use), so that a torch.compile trace of `combine` sees plain torch code and no sympy."""
        if self._torch_combine is None:
            self._compile_torch()

    def combine(self, x: Sequence, y: Sequence, renormalise: bool = True) -> tuple:
        """combine(x, y) on tuples of tensors (broadcasting), from the traced expressions.

        Projective monoids are divided by `scale` of the result unless `renormalise=False`.
        """
        if self._torch_combine is None:
            self._compile_torch()
        out = self._torch_combine(tuple(x), tuple(y))
        return self.renormalise(out) if renormalise else out

    def renormalise(self, m: Sequence, direct: bool = False) -> tuple:
        """Divide every field by scale(m) (projective monoids); `direct` calls the user's scale body."""
        if not self.is_projective:
            return tuple(m)
        if direct:
            s = self.scale_fn(Fields(self.fields, m))
        else:
            if self._torch_combine is None:
                self._compile_torch()
            s = self._torch_scale(tuple(m))
        return tuple(v / s for v in m)

    def combine_direct(self, x: Sequence, y: Sequence, renormalise: bool = True) -> tuple:
        """combine(x, y) by calling the user's Python body on tensors, bypassing the trace."""
        out = self.combine_fn(Fields(self.fields, x), Fields(self.fields, y))
        out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        return self.renormalise(out, direct=True) if renormalise else out

    # ---- verification ---------------------------------------------------------------------------
    def verify(self, seconds: float | None = None):
        """Prove associativity and both identity laws; return a `Proof` (str() says how).

        Raises `NotAssociativeError` (with `.counterexample = (x, y, z)`) or `IdentityError`.
        """
        self._proof = verify(self, seconds=seconds)
        return self._proof

    def ensure_verified(self):
        """Verify once per object (proofs are also cached on disk); scans call this before running,
        so a non-associative combine is refused with its counterexample, never scanned silently.
        A law established only numerically is scanned with a one-time `UnprovedWarning`."""
        if self._proof is None:
            proof = self.verify()
            if not proof.symbolic and self.key not in _WARNED:
                _WARNED.add(self.key)
                numeric = ", ".join(law.law for law in proof.laws if not law.symbolic)
                warnings.warn(
                    f"monoid '{self.name}': {numeric} checked numerically only, not proved (sympy did not "
                    f"decide); scanning it anyway. To get a proof, give sympy more time "
                    f"(SCANLANG_PROOF_SECONDS, or {self.name}.verify(seconds=...)) or write the combine in a form "
                    f"it can decide (see `scanlang verify MODULE:{self.name}`)", UnprovedWarning, stacklevel=3)
        return self._proof


def monoid(fields, identity, scale: Callable | None = None, name: str | None = None):
    """Decorator: declare a monoid from its combine body `fn(x, y)` (x the earlier element, y the later).

    Law: the combine must be associative, combine(combine(x, y), z) == combine(x, combine(y, z)),
    with `identity` e two-sided, combine(e, x) == x == combine(x, e); `verify()` proves both. With
    `scale`, elements are equal up to a nonzero factor and every combine is divided by scale(result).

    >>> import scanlang as sl
    >>> @sl.monoid(fields=("a", "b"), identity=(1, 0))
    ... def affine(x, y):                 # x earlier, y later: h -> y.a * (x.a * h + x.b) + y.b
    ...     return y.a * x.a, y.a * x.b + y.b
    >>> affine.fields
    ('a', 'b')
    >>> print(affine.verify())            # doctest: +ELLIPSIS
    affine: associative ... symbolic proof ...
    """
    def wrap(fn):
        return Monoid(fn, fields, identity, scale=scale, name=name)
    return wrap
