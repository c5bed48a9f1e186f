"""Typed errors. Each is a ValueError or TypeError so plain `except ValueError` still works."""
from __future__ import annotations


class NotAssociativeError(ValueError):
    """The combine is not associative: `counterexample = (x, y, z)` makes the groupings differ.

    Each of x, y, z is a tuple of Python floats, one per field; `left` and `right` hold the values
    of (x+y)+z and x+(y+z) at that point.
    """

    def __init__(self, message, counterexample=None, left=None, right=None):
        super().__init__(message)
        self.counterexample = counterexample
        self.left = left
        self.right = right


class IdentityError(ValueError):
    """The declared identity is not a two-sided identity of the combine."""

    def __init__(self, message, counterexample=None):
        super().__init__(message)
        self.counterexample = counterexample


class UnsupportedOperationError(TypeError):
    """A combine, lift or readout body used an operation the DSL cannot trace or generate."""


class UnprovedWarning(UserWarning):
    """A monoid whose laws were only checked numerically (sympy did not decide) is being scanned."""
