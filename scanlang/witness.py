"""Where to look for a counterexample once sympy has decided that a law is false.

sympy decides `left == right` false when the difference is a nonzero rational function, or when
linear programming separates two max/min forms. The seeded random search of verify.py only samples
|v| <= 1e3, so a difference that lives elsewhere is invisible to it: beyond a large constant
(`min(x + y, 1e6)` differs only once x + y passes 1e6), on one side of a kink, or at magnitudes where
a tiny coefficient (`1e-12 * x * y`) finally shows in float64. `candidates` proposes points there,
built from the expressions themselves; verify.py confirms each one (float64 and exact evaluation)
before it is reported, so a candidate is only ever a place to look.

- constants: every number in the expressions with its multiples and neighbours (+-c, 2c, 3c, c/2,
  c +- 1), drawn independently per variable;
- kinks: each pair of arguments of a Max/Min (and each Abs argument against 0), where linear in one
  variable, solved for that variable at random values of the others, then stepped off the kink on
  both sides (the two pieces of a piecewise expression meet there);
- magnitudes: log-uniform over [1e-3, 1e15] with mixed signs, and the constants times uniform [-3, 3].

>>> import numpy as np, sympy
>>> x, y = sympy.symbols("x y", real=True)
>>> batches = candidates([sympy.Min(x + y, 10**6) - x - y], [x, y], np.random.default_rng(0))
>>> any(((b[0] + b[1]) > 10**6).any() for b in batches)     # points beyond the kink are proposed
True
"""
from __future__ import annotations

import itertools
import math
from typing import Sequence

import numpy as np
import sympy

_POOL_SAMPLES = 4096     # points drawn from the constants' pool
_MAGNITUDE_SAMPLES = 2048
_KINK_BASES = 32         # random placements of the other variables per kink
_MAX_KINKS = 64          # (pair of arguments, variable) combinations tried


def constants(exprs: Sequence[sympy.Expr]) -> list[float]:
    """The magnitudes of the finite nonzero numbers in `exprs`, sorted."""
    found = set()
    for e in exprs:
        for n in sympy.sympify(e).atoms(sympy.Number):
            if n.is_finite and n != 0:
                v = abs(float(n))
                if math.isfinite(v) and v > 0:
                    found.add(v)
    return sorted(found)


def _pool(consts: list[float]) -> np.ndarray:
    values = {0.0, 0.5, 1.0, 2.0, 3.0}
    for c in consts:
        values.update((c, 2 * c, 3 * c, c / 2, c + 1, abs(c - 1)))
    arr = np.array(sorted(values))
    return np.concatenate([arr, -arr[arr != 0]])


def kinks(exprs: Sequence[sympy.Expr], symbols: Sequence[sympy.Symbol]) -> list[tuple]:
    """(variable index, root as a function of all variables) for each kink linear in one variable."""
    out, seen = [], set()
    for e in exprs:
        nodes = sorted(sympy.sympify(e).atoms(sympy.Max, sympy.Min, sympy.Abs, sympy.Heaviside),
                       key=sympy.default_sort_key)
        for node in nodes:
            if isinstance(node, (sympy.Abs, sympy.Heaviside)):
                pairs = [(node.args[0], sympy.S.Zero)]
            else:
                pairs = itertools.combinations(sorted(node.args, key=sympy.default_sort_key), 2)
            for a, b in pairs:
                gap = sympy.expand(a - b)
                if gap in seen or gap.is_number:
                    continue
                seen.add(gap)
                for i, s in enumerate(symbols):
                    if not gap.has(s):
                        continue
                    slope = sympy.diff(gap, s)
                    rest = sympy.expand(gap - slope * s)
                    if slope.has(s) or rest.has(s) or slope == 0:
                        continue
                    root = sympy.lambdify(list(symbols), -rest / slope, modules="numpy")
                    out.append((i, root))
                    if len(out) >= _MAX_KINKS:
                        return out
    return out


def candidates(exprs: Sequence[sympy.Expr], symbols: Sequence[sympy.Symbol], rng) -> list[np.ndarray]:
    """Batches of candidate points, each an array [len(symbols), n]; see the module docstring."""
    n = len(symbols)
    consts = constants(exprs)
    pool = _pool(consts)
    batches = [rng.choice(pool, size=(n, _POOL_SAMPLES))]
    signs = rng.choice([-1.0, 1.0], size=(n, _MAGNITUDE_SAMPLES))
    batches.append(signs * 10.0 ** rng.uniform(-3.0, 15.0, size=(n, _MAGNITUDE_SAMPLES)))
    scale = np.array(consts or [1.0])
    batches.append(rng.choice(scale, size=(n, _MAGNITUDE_SAMPLES)) * rng.uniform(-3.0, 3.0, size=(n, _MAGNITUDE_SAMPLES)))
    big = max(consts or [1.0])
    for i, root in kinks(exprs, symbols):
        base = rng.choice(pool, size=(n, _KINK_BASES))
        with np.errstate(all="ignore"):
            at = np.broadcast_to(np.asarray(root(*base), dtype=np.float64), (_KINK_BASES,))
        steps = []
        with np.errstate(all="ignore"):
            for d in (1.0, np.maximum(1.0, np.abs(at) / 2), big):
                for sign in (-1.0, 1.0):
                    point = base.copy()
                    point[i] = at + sign * d
                    steps.append(point)
        batch = np.concatenate(steps, axis=1)
        batches.append(batch[:, np.isfinite(batch).all(axis=0)])
    return batches


__all__ = ["candidates", "constants", "kinks"]
