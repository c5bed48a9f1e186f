"""scanlang: declare a recurrence as an associative monoid; get a proof, scans and their gradients.

    import scanlang as sl

    @sl.monoid(fields=("a", "b"), identity=(1, 0))
    def affine(x, y):                      # x = earlier operand, y = later one
        return y.a * x.a, y.a * x.b + y.b

    print(affine.verify())                 # symbolic proof of associativity and identity
    out = sl.scan(affine, (a, b), dim=1)   # inclusive prefixes: out.a, out.b
"""
from __future__ import annotations

from .errors import IdentityError, NotAssociativeError, UnprovedWarning, UnsupportedOperationError
from .expr import abs, exp, log, logsigmoid, maximum, minimum, sigmoid, softplus, sqrt  # noqa: A004 - DSL names
from .linear import LinearFamily, MatrixState, matrix_state
from .library import (LIBRARY, Add, Affine, ComplexMul, LogAffine, LogSumExp, Matrix2, Max, MaxPlus, MinPlus,
                      Mobius, OnlineSoftmax, Welford)
from .monoid import Fields, Monoid, monoid
from . import tuning  # noqa: F401  (sl.tuning.override: knobs for tests and benchmarks)
from .scan import scan
from .verify import Proof, verify

__version__ = "0.1.0"

from .mixer import mixer  # noqa: E402  (the function shadows the submodule's name on purpose)

__all__ = [
    "monoid", "Monoid", "Fields", "scan", "mixer", "verify", "Proof",
    "exp", "log", "sqrt", "abs", "maximum", "minimum", "sigmoid", "softplus", "logsigmoid",
    "matrix_state", "MatrixState", "LinearFamily",
    "LIBRARY", "Affine", "Mobius", "Matrix2", "MaxPlus", "MinPlus", "ComplexMul", "LogAffine", "LogSumExp",
    "OnlineSoftmax", "Welford", "Add", "Max",
    "NotAssociativeError", "IdentityError", "UnsupportedOperationError", "UnprovedWarning",
]
