"""Typed errors. Each is a ValueError or TypeError so plain `except ValueError` still works."""
from __future__ import annotations


class NotAssociativeError(ValueError):
    """The combine is not associative: `counterexample = (x, y, z)` makes the groupings differ.

    Each of x, y, z is a tuple of Python floats, one per field; `left` and `right` hold the values
    of (x+y)+z and x+(y+z) at that point.

    Law: raised when combine(combine(x, y), z) != combine(x, combine(y, z)) at `counterexample`.

    >>> import scanlang as sl
    >>> @sl.monoid(fields=("a", "b"), identity=(1, 0))
    ... def typo(x, y):                   # a stray cross term x.a * y.b
    ...     return y.a * x.a, y.a * x.b + y.b + x.a * y.b
    >>> try:
    ...     typo.verify()
    ... except sl.NotAssociativeError as exc:
    ...     print(exc.left != exc.right)
    True
    """

    def __init__(self, message, counterexample=None, left=None, right=None):
        super().__init__(message)
        self.counterexample = counterexample
        self.left = left
        self.right = right


class IdentityError(ValueError):
    """The declared identity is not a two-sided identity of the combine.

    Law: raised when combine(e, x) != x or combine(x, e) != x at `counterexample` x.

    >>> import scanlang as sl
    >>> @sl.monoid(fields=("s",), identity=(1,))   # the identity of + is 0, not 1
    ... def add(x, y):
    ...     return x.s + y.s
    >>> try:
    ...     add.verify()
    ... except sl.IdentityError as exc:
    ...     print(exc.counterexample)
    (0.0,)
    """

    def __init__(self, message, counterexample=None):
        super().__init__(message)
        self.counterexample = counterexample


class UnsupportedOperationError(TypeError):
    """A combine, lift or readout body used an operation the DSL cannot trace or generate.

    Law: bodies are built from + - * /, numeric constants and sl.exp/log/sqrt/abs/maximum/minimum;
    anything else (math.sin, torch functions, comparisons) is refused when the monoid is declared.

    >>> import math, scanlang as sl
    >>> try:
    ...     @sl.monoid(fields=("s",), identity=(0,))
    ...     def bad(x, y):
    ...         return math.sin(x.s) + y.s
    ... except sl.UnsupportedOperationError as exc:
    ...     print("refused:", "math.* functions need concrete numbers" in str(exc))
    refused: True
    """


class UnprovedWarning(UserWarning):
    """A monoid whose laws were only checked numerically (sympy did not decide) is being scanned.

    Law: issued once per monoid whose associativity or identity holds at random points but has no
    symbolic proof within the time budget (`Proof.symbolic` is False); turn it into an error with
    the warnings filter.

    >>> import warnings, scanlang as sl
    >>> issubclass(sl.UnprovedWarning, UserWarning), sl.verify(sl.Affine).symbolic   # proved: no warning
    (True, True)
    >>> warnings.simplefilter("error", sl.UnprovedWarning)     # refuse unproved monoids from now on
    >>> warnings.resetwarnings()
    """
