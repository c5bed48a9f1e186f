"""scanlang: declare a recurrence as an associative monoid; get a proof, scans and their gradients.

    import scanlang as sl

    @sl.monoid(fields=("a", "b"), identity=(1, 0))
    def affine(x, y):                      # x = earlier operand, y = later one
        return y.a * x.a, y.a * x.b + y.b

    print(affine.verify())                 # symbolic proof of associativity and identity
    out = sl.scan(affine, (a, b), dim=1)   # inclusive prefixes: out.a, out.b
"""
from __future__ import annotations

from .errors import IdentityError, NotAssociativeError, UnsupportedOperationError
from .expr import abs, exp, log, maximum, minimum, sqrt  # noqa: A004 - DSL names
from .library import Affine, Mobius
from .monoid import Fields, Monoid, monoid

__version__ = "0.1.0"

try:  # the scan front end arrives with the reference backend
    from .scan import scan  # noqa: F401
except ImportError:  # pragma: no cover
    pass

__all__ = [
    "monoid", "Monoid", "Fields", "scan",
    "exp", "log", "sqrt", "abs", "maximum", "minimum",
    "Affine", "Mobius",
    "NotAssociativeError", "IdentityError", "UnsupportedOperationError",
]
