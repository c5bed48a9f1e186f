"""The verify stage: prove a monoid's laws, or refute them with a concrete counterexample.

    combine(combine(x, y), z) == combine(x, combine(y, z))      associativity
    combine(e, x) == x == combine(x, e)                         left and right identity

The proof is symbolic (sympy, see scanlang/analysis.py for the methods) and holds over the reals
wherever the expressions are defined; identity entries of +-inf are read in the extended reals
(sympy's oo, with every field a finite real). Each law gets a time budget (`seconds=`, default
settings.proof_seconds(); enforced with a repeating SIGALRM in the main thread, and elsewhere by
running sympy in a forked child process that is killed past the budget). A cheap seeded random
search for a counterexample over several value ranges runs before sympy. A law sympy decides false
is refused even when that search found nothing: a counterexample is then searched where the
expressions differ (scanlang/witness.py: the kinks of max/min terms, the constants' magnitudes,
large values), and without one the error still carries the leftover. When sympy cannot decide
within the budget, the same search runs, and failing it the random check's evidence is reported as
"numeric, not a proof". An identity must also evaluate to finite values in float64
(inf * x / (inf + x) is nan there, whatever its limit).

Projective monoids (declared with `scale=`): the scale must be nonzero (and finite) at the identity
and not identically zero. When scale is homogeneous of degree 1 and the combine is homogeneous in
each operand, renormalising (dividing by scale) maps a law that holds up to a nonzero factor to an
exact law, so the laws are proved up to scale (all cross-products L_i R_j - L_j R_i vanish).
Otherwise the renormalised combine itself is checked, exactly, and so are the identity laws after
renormalising: renorm(combine(e, x)) == renorm(x).

A failed law raises `NotAssociativeError` or `IdentityError` carrying a counterexample that was
checked by exact (rational or 60-digit) evaluation and in float64; the message shows the leftover
expression, the counterexample and the values of both sides.

Results are cached by the monoid's content hash: in memory and as small JSON files under
settings.cache_dir()/proofs (only symbolic results; see scanlang/cache.py for what is trusted there).
A record is bound to the full hash of the expressions and re-checked by the random search when
first used in a process.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace

import numpy as np
import sympy

from . import analysis as A
from . import budget as B
from . import cache, settings
from . import witness as W
from .errors import IdentityError, NotAssociativeError

_CACHE_VERSION = 2
_SAMPLES = 400          # random samples per value range
_CANDIDATES = 6         # flagged samples re-checked exactly per range
_FLAG = 1e-9            # relative float64 difference that makes a sample suspect
_DIFFER = 1e-6          # relative float64 difference a counterexample must show
_LEFTOVER_SECONDS = 1.0  # budget for simplifying the leftover of a refuted law
ASSOCIATIVITY, LEFT_IDENTITY, RIGHT_IDENTITY = "associativity", "left identity", "right identity"

# (description, sampler(rng, shape)): the value ranges of the random check, simplest first.
RANGES = (
    ("small integers in [-3, 3]", lambda rng, n: rng.integers(-3, 4, n).astype(np.float64)),
    ("uniform [-1, 1]", lambda rng, n: rng.uniform(-1.0, 1.0, n)),
    ("positive log-uniform [1e-3, 1e3]", lambda rng, n: 10.0 ** rng.uniform(-3.0, 3.0, n)),
    ("mixed signs, log-uniform magnitudes [1e-3, 1e3]",
     lambda rng, n: rng.choice([-1.0, 1.0], n) * 10.0 ** rng.uniform(-3.0, 3.0, n)),
)


@dataclass(frozen=True)
class LawResult:
    """How one law was established: method "symbolic" (a proof) or "numeric" (not a proof)."""

    law: str
    method: str
    how: str
    seconds: float
    cached: bool = False

    @property
    def symbolic(self) -> bool:
        return self.method == "symbolic"

    def __str__(self):
        kind = "symbolic proof" if self.symbolic else "numeric, not a proof"
        origin = ", cached" if self.cached else ""
        return f"{self.law}: {kind} ({self.how}) [{self.seconds:.3f} s{origin}]"


@dataclass
class Proof:
    """What verify() established about a monoid, plus what the later stages need.

    `commutative` is True/False, or None when undecided. `sparsity` and `jacobian_x`/`jacobian_y`
    (sympy Matrices, d result_i / d operand_j) describe the combine the scan evaluates (divided by
    scale for projective monoids). `identity_pads_safely` says whether combine(e, e) == e in float64:
    when False (OnlineSoftmax: exp(-inf - (-inf)) is nan) a kernel must not pad with the identity.

    Law: `symbolic` is True only when associativity and both identity laws are proved by sympy.

    >>> import scanlang as sl
    >>> proof = sl.Affine.verify()
    >>> proof.symbolic, proof.commutative, proof.identity_pads_safely
    (True, False, True)
    """

    monoid: object
    associativity: LawResult
    left_identity: LawResult
    right_identity: LawResult
    projective: A.Homogeneity | None
    commutative: bool | None
    sparsity: A.Sparsity
    jacobian_x: sympy.Matrix
    jacobian_y: sympy.Matrix
    seconds: float
    identity_pads_safely: bool = True

    @property
    def laws(self) -> tuple[LawResult, ...]:
        return (self.associativity, self.left_identity, self.right_identity)

    @property
    def symbolic(self) -> bool:
        """True when every law was proved symbolically."""
        return all(law.symbolic for law in self.laws)

    @property
    def method(self) -> str:
        if self.symbolic:
            return "symbolic proof"
        if not any(law.symbolic for law in self.laws):
            return "numeric, not a proof"
        return "partly symbolic; " + ", ".join(law.law for law in self.laws if not law.symbolic) + \
            ": numeric, not a proof"

    @property
    def up_to_scale(self) -> bool:
        return self.projective is not None and self.projective.up_to_scale

    def __str__(self):
        m = self.monoid
        assoc = " up to scale" if self.up_to_scale else ""
        scale = " up to scale" if m.is_projective else ""
        ident = ", ".join(_num(v) for v in m.identity)
        where = "over the reals" + (f" ({_domain(m)})" if _domain(m) else "")
        how = f"{self.method} {where}"
        if not self.symbolic:
            how = self.method + (f"; symbolic results hold {where}" if any(law.symbolic for law in self.laws) else "")
        lines = [f"{m.name}: associative{assoc} with identity ({ident}){scale} -- {how}"]
        lines += [f"  {law}" for law in self.laws]
        if m.is_projective:
            lines.append(f"  projective: {_projective_note(m, self.projective)}")
        if any(math.isinf(v) for v in m.identity):
            lines.append("  identity entries +-inf are read in the extended reals (every field is a finite real)")
        if not self.identity_pads_safely:
            lines.append("  combine(e, e) is not e in float64 (inf - inf): do not pad scans with the identity")
        comm = {True: "yes", False: "no", None: "undecided"}[self.commutative]
        lines.append(f"  commutative: {comm}")
        lines.append(f"  jacobian sparsity: {self.sparsity}")
        lines.append(f"  verified in {self.seconds:.3f} s")
        return "\n".join(lines)


def _num(v: float) -> str:
    return ("-inf" if v < 0 else "inf") if math.isinf(v) else (str(int(v)) if v == int(v) else repr(v))


def _domain(m) -> str:
    exprs = list(m.exprs) + ([m.scale_expr] if m.is_projective else [])
    notes = []
    if any(sympy.denom(sympy.together(e)) != 1 for e in exprs) or m.is_projective:
        notes.append("where denominators" + (" and scale" if m.is_projective else "") + " are nonzero")
    if any(e.has(sympy.log) for e in exprs):
        notes.append("logarithms of positive values")
    if any(not p.exp.is_Integer for e in exprs for p in e.atoms(sympy.Pow)):
        notes.append("square roots of nonnegative values")
    return "; ".join(notes)


def _projective_note(m, h: A.Homogeneity | None) -> str:
    if h is None:
        return "homogeneity undecided within the budget; the renormalised combine was checked directly"
    if h.up_to_scale:
        return (f"scale(m) = {m.scale_expr} is homogeneous of degree 1 and the combine has degree "
                f"{h.x_degree} in x and {h.y_degree} in y, so renormalising keeps the law: elements are "
                f"equal up to a nonzero scale")
    why = "scale is not homogeneous of degree 1" if not h.scale_degree_one else \
        "the combine is not homogeneous in each operand"
    return f"{why} (scale(m) = {m.scale_expr}); the renormalised combine was checked directly"


# ---- float64 and exact evaluation ----------------------------------------------------------------

class _Float64:
    """The monoid's combine on numpy float64 arrays (one array per field), from its expressions."""

    def __init__(self, m):
        self.m = m
        self.raw = sympy.lambdify(list(m.x_symbols + m.y_symbols), list(m.exprs), modules="numpy")
        self.scale = sympy.lambdify(list(m.m_symbols), m.scale_expr, modules="numpy") if m.is_projective else None

    def combine(self, x, y, renormalise: bool = True):
        shape = np.broadcast_shapes(*(np.shape(v) for v in (*x, *y)))
        with np.errstate(all="ignore"):
            out = [np.broadcast_to(np.asarray(v, dtype=np.float64), shape) for v in self.raw(*x, *y)]
            if self.scale is not None and renormalise:
                s = np.broadcast_to(np.asarray(self.scale(*out), dtype=np.float64), shape)
                out = [o / s for o in out]
        return out

    def groupings(self, x, y, z):
        return self.combine(self.combine(x, y), z), self.combine(x, self.combine(y, z))


def _exact(v: float) -> sympy.Expr:
    return sympy.oo if v == math.inf else (-sympy.oo if v == -math.inf else sympy.Rational(v))


def _exact_groupings(m, x, y, z):
    x, y, z = ([_exact(v) for v in e] for e in (x, y, z))
    c = lambda a, b: A.combine_exprs(m, a, b, renormalise=True)  # noqa: E731
    return c(c(x, y), z), c(x, c(y, z))


def _exact_nonzero(d) -> bool | None:
    """Is the exact number d nonzero? None when undefined (division by zero, log of a negative...)."""
    d = sympy.sympify(d)
    if d.has(sympy.nan, sympy.zoo, sympy.oo, -sympy.oo, sympy.I):
        return None
    if d.is_Rational:
        return d != 0
    v = sympy.N(d, 60)
    if not v.is_real or v.has(sympy.nan, sympy.zoo):
        return None
    return abs(v) > sympy.Float("1e-45", 60)


def _exact_differ(left, right, up_to_scale: bool) -> bool | None:
    """Do the exact tuples differ (or fail to be proportional)? None when a value is undefined."""
    if up_to_scale:
        if all(_exact_nonzero(v) is False for v in left) or all(_exact_nonzero(v) is False for v in right):
            return None  # a zero element is proportional to everything
        n = len(left)
        terms = [left[i] * right[j] - left[j] * right[i] for i in range(n) for j in range(i + 1, n)]
    else:
        terms = [lo - ro for lo, ro in zip(left, right)]
    verdicts = [_exact_nonzero(t) for t in terms]
    if None in verdicts:
        return None
    return any(verdicts)


def _relative(left, right, up_to_scale: bool) -> np.ndarray:
    """Per sample: relative float64 difference of two tuples of arrays (inf where undefined)."""
    L, R = np.stack(left), np.stack(right)
    with np.errstate(all="ignore"):
        if up_to_scale:
            L = L / np.linalg.norm(L, axis=0)
            R = R / np.linalg.norm(R, axis=0)
            rel = np.minimum(np.abs(L - R).max(axis=0), np.abs(L + R).max(axis=0))
        else:
            rel = (np.abs(L - R) / np.maximum(np.abs(L), np.abs(R))).max(axis=0)
            rel = np.where((L == R).all(axis=0), 0.0, rel)
    finite = np.isfinite(L).all(axis=0) & np.isfinite(R).all(axis=0)
    return np.where(finite & np.isfinite(rel), rel, np.inf)


# ---- the random check and the counterexample search -----------------------------------------------

@dataclass
class _Search:
    """Outcome of a random check: a verified counterexample, or the evidence that none was found."""

    counterexample: tuple | None
    left: tuple | None = None
    right: tuple | None = None
    samples: int = 0
    worst: float = 0.0


def _rounded(point, q):
    return tuple(tuple(float(np.round(v / q) * q) for v in e) for e in point)


def _search(m, n_operands: int, evaluate, exact, up_to_scale: bool, seed: int) -> _Search:
    """Random check of `evaluate` (float64 arrays -> (left, right)) over every value range.

    `exact(point) -> (left, right)` gives the exact sides; a flagged sample becomes a counterexample
    only if its exact sides differ and its float64 sides differ by more than _DIFFER. Simpler (rounded)
    versions of a counterexample are preferred.
    """
    k = len(m.fields)
    result = _Search(None)
    for r, (_, sampler) in enumerate(RANGES):
        rng = np.random.default_rng(seed * 7919 + r)
        point = [tuple(sampler(rng, _SAMPLES) for _ in range(k)) for _ in range(n_operands)]
        found = _first_counterexample(point, evaluate, exact, up_to_scale, result, smallest_first=r == 0)
        if found is not None:
            return found
    return result


def _first_counterexample(point, evaluate, exact, up_to_scale: bool, result: _Search, smallest_first: bool,
                          limit: int = _CANDIDATES) -> _Search | None:
    """The first confirmed counterexample among the samples `point` (per operand, per field, arrays),
    the most suspect first (the smallest, with `smallest_first`); None, updating `result`'s evidence."""
    left, right = evaluate(*point)
    rel = _relative(left, right, up_to_scale)
    valid = np.isfinite(rel)
    result.samples += int(valid.sum())
    flagged = np.flatnonzero(valid & (rel > _FLAG))
    if smallest_first:  # small integers: the smallest counterexample first
        size = sum(np.abs(f) for e in point for f in e)
        flagged = flagged[np.argsort(size[flagged], kind="stable")]
    else:
        flagged = flagged[np.argsort(-rel[flagged], kind="stable")]
    for i in flagged[:limit]:
        candidate = tuple(tuple(float(f[i]) for f in e) for e in point)
        found = _confirm(candidate, evaluate, exact, up_to_scale)
        if found is None:
            continue
        for q in (1.0, 0.5, 0.25, 0.125):  # prefer a simpler, exactly representable point
            trial = _rounded(candidate, q)
            if trial == candidate:
                break
            simpler = _confirm(trial, evaluate, exact, up_to_scale)
            if simpler is not None:
                return _Search(trial, *simpler, samples=result.samples)
        return _Search(candidate, *found, samples=result.samples)
    unflagged = valid & (rel <= _FLAG)
    if unflagged.any():
        result.worst = max(result.worst, float(rel[unflagged].max()))
    return None


def _witness(m, n_operands: int, symbols, evaluate, exact, up_to_scale: bool, exprs, seed: int) -> _Search:
    """A counterexample for a law sympy decided false, searched where its expressions differ
    (scanlang/witness.py proposes the points; each is confirmed as in the random check)."""
    k = len(m.fields)
    result = _Search(None)
    for batch in W.candidates(exprs, symbols, np.random.default_rng(seed)):
        if batch.shape[1] == 0:
            continue
        point = [tuple(batch[o * k + f] for f in range(k)) for o in range(n_operands)]
        found = _first_counterexample(point, evaluate, exact, up_to_scale, result, smallest_first=False,
                                      limit=4 * _CANDIDATES)
        if found is not None:
            return found
    return result


def _confirm(point, evaluate, exact, up_to_scale: bool):
    """(left, right) float tuples if `point` is a counterexample in float64 and exactly, else None."""
    arrays = [tuple(np.array([v]) for v in e) for e in point]
    left, right = evaluate(*arrays)
    rel = _relative(left, right, up_to_scale)[0]
    if not (np.isfinite(rel) and rel > _DIFFER):
        return None
    try:
        exact_left, exact_right = exact(point)
        if _exact_differ(exact_left, exact_right, up_to_scale) is not True:
            return None
        numeric = _exact_values(exact_left), _exact_values(exact_right)
    except (ZeroDivisionError, TypeError, ValueError):
        return None
    if None in numeric:
        return None
    # the gap must be real, not rounding: the exact sides differ by more than _DIFFER too, and the
    # float64 sides (what is reported) are within a tenth of that gap of the exact ones
    gap = _relative([np.array([v]) for v in numeric[0]], [np.array([v]) for v in numeric[1]], up_to_scale)[0]
    if not gap > _DIFFER:
        return None
    for f64, ex in zip((left, right), numeric):
        if not _relative(f64, [np.array([v]) for v in ex], up_to_scale)[0] <= gap / 10:
            return None
    return tuple(float(v[0]) for v in left), tuple(float(v[0]) for v in right)


def _exact_values(values) -> tuple | None:
    """The exact numbers as float64 (60 digits first, so rounding happens once); None if one is not finite."""
    out = []
    for v in values:
        f = sympy.N(sympy.sympify(v), 60)
        if not f.is_real or not f.is_finite:
            return None
        out.append(float(f))
    return tuple(out)


def _seed(m, law: str) -> int:
    return int(m.key[:8], 16) ^ sum(map(ord, law))


# ---- the laws -------------------------------------------------------------------------------------

def _fmt_point(p) -> str:
    return "(" + ", ".join(repr(v) for v in p) + ("," if len(p) == 1 else "") + ")"


def _fmt_leftovers(leftovers, limit: int = 400) -> str:
    lines = []
    for label, e in leftovers:
        text = str(e)
        lines.append(f"    {label}: {text if len(text) <= limit else text[:limit] + ' ...'}")
    return "\n".join(lines)


def _raw_leftovers(m, left, right, up_to_scale: bool):
    if up_to_scale:
        n = len(left)
        return [(f"{m.fields[i]}*{m.fields[j]}", left[i] * right[j] - left[j] * right[i])
                for i in range(n) for j in range(i + 1, n)]
    return [(f, lo - ro) for f, lo, ro in zip(m.fields, left, right) if lo != ro]


def _law(m, law: str, seconds, sides, up_to_scale: bool, n_operands: int, symbols, evaluate, exact,
         compare_up_to_scale: bool, fail, cached: LawResult | None = None) -> LawResult:
    """Establish one law `left == right` (or proportional, `up_to_scale`) for `sides()`.

    A cheap random search for a counterexample runs first: a confirmed one calls
    `fail(search, leftovers, None)` with the leftover simplified within a short budget. A `cached`
    symbolic result is trusted only after that search (a forged or stale proof record of a false law
    is caught here). Otherwise sympy gets `seconds`: a proof is returned; a law it decides false calls
    `fail(witness, leftovers, how)` with a counterexample searched where the expressions differ (or
    none, when no point shows the difference in float64); when it cannot decide, the random check's
    evidence is reported as numeric.
    """
    start = time.perf_counter()

    def attempt(deadline):
        left, right = sides()
        return A.equal_tuples(left, right, up_to_scale, m.fields, deadline)

    search = _search(m, n_operands, evaluate, exact, compare_up_to_scale, _seed(m, law))
    if search.counterexample is not None:
        short = _LEFTOVER_SECONDS if seconds is None else min(seconds, _LEFTOVER_SECONDS)
        out, why = B.symbolic(attempt, short)
        if out is not None and out[1]:
            leftovers = out[1]
        else:
            leftovers = _raw_leftovers(m, *sides(), up_to_scale)
            leftovers = [(f"{label} (not simplified: {why or 'sympy undecided'})", e) for label, e in leftovers]
        fail(search, leftovers, None)
    if cached is not None:
        return cached
    out, why = B.symbolic(attempt, seconds)
    if out is not None and out[0].equal is True:
        how = out[0].how + ("; compared up to scale: all cross-products L_i R_j - L_j R_i vanish" if up_to_scale else "")
        return LawResult(law, "symbolic", how, time.perf_counter() - start)
    decided_false = out is not None and out[0].equal is False
    leftovers = out[1] if out is not None and out[1] else \
        [(f"{label} (not simplified: {why or 'sympy undecided'})", e) for label, e in _raw_leftovers(m, *sides(), up_to_scale)]
    # decided false, or undecided: look where the expressions differ (kinks, constants, magnitudes)
    exprs = [e for _, e in leftovers] + [e for side in sides() for e in side]
    witness = _witness(m, n_operands, symbols, evaluate, exact, compare_up_to_scale, exprs, _seed(m, law))
    if decided_false or witness.counterexample is not None:
        fail(witness, leftovers, out[0].how if decided_false else None)
    if search.samples == 0:
        raise ValueError(f"verify: monoid '{m.name}': the {law} law could neither be proved by sympy "
                         f"({why or 'undecided'}) nor tested: every random sample evaluated to inf/nan")
    if why is None:
        leftover = str(out[1][0][1]) if out[1] else "?"
        why = f"sympy did not decide whether {leftover[:200]} == 0"
    ranges = "; ".join(name for name, _ in RANGES)
    how = (f"{why}; random check of {search.samples} seeded samples over {ranges}: no counterexample, "
           f"largest relative difference {search.worst:.1e}")
    return LawResult(law, "numeric", how, time.perf_counter() - start)


def _decided(how: str | None, what: str) -> str:
    """The line a refutation adds about how sympy decided it (empty for a counterexample found first)."""
    if how is None:
        return ""
    return f"  sympy decided that {what} is not zero ({how})\n"


def _no_witness(what: str) -> str:
    return (f"  no point was found where float64 shows the difference (searched the kinks of max/min terms, "
            f"the constants' magnitudes and up to 1e15), so no numeric counterexample is given; the law is "
            f"false over the reals: {what} above is not identically zero")


def _associativity(m, seconds, up_to_scale: bool, cached: LawResult | None = None) -> LawResult:
    """(x (+) y) (+) z == x (+) (y (+) z); counterexamples always on the renormalised combine."""
    def fail(search, leftovers, decided):
        what = "(x (+) y) (+) z - x (+) (y (+) z)" if not up_to_scale else \
            "the cross-products of (x (+) y) (+) z and x (+) (y (+) z) (the law up to scale)"
        renorm = " (renormalised by scale, as the scan evaluates it)" if m.is_projective else ""
        if m.is_projective and not up_to_scale:
            renorm += f"; {_why_not_projective(m)}"
        msg = (f"combine of monoid '{m.name}' is not associative{renorm}: {what} leaves\n"
               f"{_fmt_leftovers(leftovers)}\n" + _decided(decided, "this leftover"))
        if search.counterexample is None:
            raise NotAssociativeError(msg + _no_witness("the leftover"))
        x, y, z = search.counterexample
        msg += (f"  counterexample (fields {m.fields}): x = {_fmt_point(x)}, y = {_fmt_point(y)}, z = {_fmt_point(z)}\n"
                f"    (x (+) y) (+) z = {_fmt_point(search.left)}\n"
                f"    x (+) (y (+) z) = {_fmt_point(search.right)}")
        raise NotAssociativeError(msg, counterexample=search.counterexample, left=search.left, right=search.right)

    f64 = _Float64(m)
    symbols = m.x_symbols + m.y_symbols + A.z_symbols(m)
    return _law(m, ASSOCIATIVITY, seconds, lambda: A.law_sides(m, up_to_scale), up_to_scale, 3, symbols,
                f64.groupings, lambda p: _exact_groupings(m, *p), False, fail, cached)


def _why_not_projective(m) -> str:
    t = sympy.Symbol("t", real=True, nonzero=True)
    s = m.scale_expr
    gap = sympy.expand(s.xreplace({v: t * v for v in m.m_symbols}) - t * s)
    if gap != 0:
        return (f"scale(m) = {s} is not homogeneous of degree 1 (scale(t*m) - t*scale(m) = {gap}), "
                f"so renormalising does not preserve the law")
    return "the combine is not homogeneous in each operand, so renormalising does not preserve the law"


def _identity(m, side: str, seconds, up_to_scale: bool | None = None, cached: LawResult | None = None) -> LawResult:
    """combine(e, x) == x (left) or combine(x, e) == x (right).

    Projective monoids: up to scale when renormalising is known to keep the law (`up_to_scale`,
    default: whenever the monoid is projective); otherwise exactly after renormalising both sides,
    renorm(combine(e, x)) == renorm(x), which is what a scan padded with e computes.
    """
    projective = m.is_projective
    up_to_scale = projective if up_to_scale is None else up_to_scale
    renorm = projective and not up_to_scale
    e = m.identity_exprs
    law = LEFT_IDENTITY if side == "left" else RIGHT_IDENTITY
    expr = "combine(e, x)" if side == "left" else "combine(x, e)"
    if renorm:
        expr = f"renorm({expr})"

    def sides(x=m.x_symbols):
        out = A.combine_exprs(m, e, x, renorm) if side == "left" else A.combine_exprs(m, x, e, renorm)
        if renorm:
            s = m.scale_expr.xreplace(dict(zip(m.m_symbols, x)))
            return out, tuple(v / s for v in x)
        return out, tuple(x)

    f64 = _Float64(m)
    ident = tuple(np.float64(v) for v in m.identity)

    def evaluate(x):
        got = f64.combine(ident, x, renorm) if side == "left" else f64.combine(x, ident, renorm)
        want = [np.broadcast_to(v, np.shape(got[0])) for v in x]
        if renorm:
            with np.errstate(all="ignore"):
                s = np.broadcast_to(np.asarray(f64.scale(*want), dtype=np.float64), np.shape(got[0]))
                want = [v / s for v in want]
        return got, want

    def fail(search, leftovers, decided):
        scale = " (up to scale)" if up_to_scale else (" (after renormalising by scale)" if renorm else "")
        msg = (f"identity {_fmt_point(m.identity)} of monoid '{m.name}' is not a {side} identity{scale}: "
               f"{expr} - {'renorm(x)' if renorm else 'x'} leaves\n{_fmt_leftovers(leftovers)}\n"
               + _decided(decided, "this leftover"))
        if search.counterexample is None:
            err = IdentityError(msg + _no_witness("the leftover"))
        else:
            (x,) = search.counterexample
            msg += (f"  counterexample (fields {m.fields}): x = {_fmt_point(x)}\n"
                    f"    {expr} = {_fmt_point(search.left)}\n    {'renorm(x)' if renorm else 'x'} = "
                    f"{_fmt_point(search.right)}")
            err = IdentityError(msg, counterexample=x)
        err.side = side
        raise err

    _identity_is_finite(m, side, expr, evaluate)
    return _law(m, law, seconds, sides, up_to_scale, 1, m.x_symbols, evaluate,
                lambda p: sides(tuple(_exact(v) for v in p[0])), up_to_scale, fail, cached)


def _identity_is_finite(m, side: str, expr: str, evaluate):
    """Raise IdentityError when combining with the identity gives inf/nan in float64 for every
    simple finite x (e.g. inf * x / (inf + x)): the scan would produce exactly that."""
    probes = [tuple(np.array([v]) for _ in m.fields) for v in (1.0, 2.0, -1.0, 0.5, 3.0)]
    results = [evaluate(x)[0] for x in probes]
    if any(all(np.isfinite(v[0]) for v in got) for got in results):
        return
    x = tuple(float(v[0]) for v in probes[0])
    got = tuple(float(v[0]) for v in results[0])
    err = IdentityError(
        f"identity {_fmt_point(m.identity)} of monoid '{m.name}' is not a {side} identity in floating point: "
        f"{expr} evaluates to inf/nan for every finite x tried (an inf entry meets 0*inf, inf-inf or "
        f"inf/inf); e.g. x = {_fmt_point(x)}: {expr} = {_fmt_point(got)}. The scan would compute the same.",
        counterexample=x)
    err.side = side
    raise err


def commutativity(m, seconds=None) -> bool | None:
    """combine(x, y) == combine(y, x)? True/False when decided (symbolically, or False by a numeric
    witness confirmed exactly), None otherwise. Projective monoids: of the renormalised combine."""
    seconds = _budget(seconds)
    decided, _ = B.symbolic(lambda dl: A.commutative(m, dl), seconds)
    if decided is not None:
        return decided
    f64 = _Float64(m)
    swap = lambda x, y: (f64.combine(x, y), f64.combine(y, x))  # noqa: E731
    exact = lambda p: (A.combine_exprs(m, [_exact(v) for v in p[0]], [_exact(v) for v in p[1]], True),  # noqa: E731
                       A.combine_exprs(m, [_exact(v) for v in p[1]], [_exact(v) for v in p[0]], True))
    return False if _search(m, 2, swap, exact, False, _seed(m, "commutative")).counterexample else None


# ---- cache ----------------------------------------------------------------------------------------
# A record on disk is untrusted input: it is bound to the full hash of the expressions it speaks for
# (another declaration's record, or a stale one, is ignored), and the cheap facts are re-checked when
# it is first used in a process: the law's random counterexample search runs as if nothing were
# cached (so a forged record cannot mark `x - y` proved), and a cached "commutative" is tested too.

_MEMORY: dict[str, dict] = {}  # key -> {"laws": {law: LawResult}, "commutative": bool, "checked": bool}


def clear_memory_cache():
    """Forget the proofs cached in this process (the files on disk stay)."""
    _MEMORY.clear()


def _cache_file(key: str):
    return cache.directory("proofs") / f"{key}-v{_CACHE_VERSION}.json"


def _load(m) -> dict:
    """What is known about monoid `m`: symbolic law results and a decided commutativity (memory, then disk)."""
    if m.key in _MEMORY:
        return _MEMORY[m.key]
    entry = {"laws": {}, "commutative": None, "checked": False}
    try:
        raw = cache.read_bytes(_cache_file(m.key))
        data = json.loads(raw.decode()) if raw is not None else {}
        if data and data.get("digest") == m.digest and data.get("version") == _CACHE_VERSION:
            for law, r in data["laws"].items():
                if law in (ASSOCIATIVITY, LEFT_IDENTITY, RIGHT_IDENTITY) and r["method"] == "symbolic":
                    entry["laws"][law] = LawResult(law, "symbolic", str(r["how"]), float(r["seconds"]), cached=True)
            if isinstance(data.get("commutative"), bool):
                entry["commutative"] = data["commutative"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, cache.CacheUnusable):
        pass  # no file, or an unreadable one: derive again (and rewrite it)
    _MEMORY[m.key] = entry
    return entry


def _store(m, results, commutative: bool | None):
    """Remember the symbolic results (and a decided commutativity); write them atomically to disk."""
    entry = _load(m)
    entry["checked"] = True
    new = [r for r in results if r.symbolic and not r.cached]
    fresh_commutative = commutative is not None and entry["commutative"] is None
    if not new and not fresh_commutative:
        return
    for r in new:
        entry["laws"][r.law] = replace(r, cached=True)
    if commutative is not None:
        entry["commutative"] = commutative
    data = {"monoid": m.name, "version": _CACHE_VERSION, "digest": m.digest, "commutative": entry["commutative"],
            "laws": {law: {"method": r.method, "how": r.how, "seconds": r.seconds}
                     for law, r in entry["laws"].items()}}
    try:
        cache.write_atomic(_cache_file(m.key), json.dumps(data, indent=1, sort_keys=True).encode())
    except (OSError, cache.CacheUnusable):
        pass  # a read-only cache directory only costs re-proving next time


def _commutativity_holds_numerically(m) -> bool:
    """No numeric witness against a cached "commutative: true" (the check of a record read from disk)."""
    f64 = _Float64(m)
    swap = lambda x, y: (f64.combine(x, y), f64.combine(y, x))  # noqa: E731
    exact = lambda p: (A.combine_exprs(m, [_exact(v) for v in p[0]], [_exact(v) for v in p[1]], True),  # noqa: E731
                       A.combine_exprs(m, [_exact(v) for v in p[1]], [_exact(v) for v in p[0]], True))
    return _search(m, 2, swap, exact, False, _seed(m, "commutative")).counterexample is None


# ---- the stage ------------------------------------------------------------------------------------

def _budget(seconds):
    seconds = settings.proof_seconds() if seconds is None else float(seconds)
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"seconds must be a nonnegative number of seconds, got {seconds}")
    return None if math.isinf(seconds) else seconds


def _check_scale(m, seconds):
    """A projective scale must be usable as a divisor: nonzero (and finite) at the identity, and not
    identically zero; otherwise every prefix would be divided by zero."""
    s = m.scale_expr
    at_identity = s.xreplace(dict(zip(m.m_symbols, m.identity_exprs)))
    nonzero = _exact_nonzero(at_identity)
    if nonzero is not True:
        value = "0" if nonzero is False else f"{at_identity} (not a finite real number)"
        raise IdentityError(
            f"scale of monoid '{m.name}' is zero or undefined at the identity {_fmt_point(m.identity)}: scale(e) = "
            f"{value} with scale(m) = {s}; renormalising the identity (and every scan padded with it) would "
            f"divide by it. Declare a scale that is nonzero at the identity (e.g. the trace of a matrix)",
            counterexample=m.identity)
    decided, _ = B.symbolic(lambda dl: A.decide_equal(s, sympy.S.Zero, dl, use_simplify=False), seconds)
    if decided is not None and decided.equal is True:
        raise ValueError(f"scale of monoid '{m.name}': scale(m) = {s} is identically zero ({decided.how}); "
                         f"renormalising would divide every element by zero")


def verify(monoid, seconds: float | None = None) -> Proof:
    """Prove (or refute) associativity and both identity laws of `monoid`; see the module docstring.

    `seconds` bounds each law's symbolic attempt (default settings.proof_seconds()). Raises
    NotAssociativeError / IdentityError with a counterexample when a law fails (also when sympy
    decides a law false and the random search found no point: the counterexample is then searched
    where the expressions differ; see scanlang/witness.py), and IdentityError or ValueError naming
    `scale` for a projective scale that is zero at the identity or identically zero.

    Law: proves combine(combine(x, y), z) == combine(x, combine(y, z)) and
    combine(e, x) == x == combine(x, e) for the declared identity e (sympy; random points when sympy
    does not decide in time, which `Proof.symbolic` reports).

    >>> import scanlang as sl
    >>> proof = sl.verify(sl.Add)
    >>> proof.symbolic, proof.commutative
    (True, True)
    >>> print(proof)                      # doctest: +ELLIPSIS
    Add: associative with identity (0) -- symbolic proof over the reals
    ...
    """
    start = time.perf_counter()
    seconds = _budget(seconds)
    m = monoid
    known = _load(m)
    trusted = known["checked"]
    cached = dict(known["laws"])
    homogeneity = None
    if m.is_projective:
        _check_scale(m, seconds)
        homogeneity, _ = B.symbolic(lambda dl: A.projective_mode(m, dl), seconds)
    up_to_scale = homogeneity is not None and homogeneity.up_to_scale
    identity_up_to_scale = up_to_scale

    def law(name, prove):
        found = cached.get(name)
        return found if found is not None and trusted else prove(found)

    assoc = law(ASSOCIATIVITY, lambda c: _associativity(m, seconds, up_to_scale, c))
    left = law(LEFT_IDENTITY, lambda c: _identity(m, "left", seconds, identity_up_to_scale, c))
    right = law(RIGHT_IDENTITY, lambda c: _identity(m, "right", seconds, identity_up_to_scale, c))
    commutative = known["commutative"]
    if commutative is True and not trusted and not _commutativity_holds_numerically(m):
        commutative = known["commutative"] = None
    if commutative is None:
        commutative = commutativity(m, seconds)
    _store(m, [assoc, left, right], commutative)
    jx, jy = A.jacobians(m)
    return Proof(monoid=m, associativity=assoc, left_identity=left, right_identity=right,
                 projective=homogeneity, commutative=commutative, sparsity=A.sparsity(m),
                 jacobian_x=jx, jacobian_y=jy, seconds=time.perf_counter() - start,
                 identity_pads_safely=identity_pads_safely(m))


def identity_pads_safely(m) -> bool:
    """combine(e, e) == e in float64 (up to scale for projective monoids)?"""
    e = tuple(np.array([v]) for v in m.identity)
    got = _Float64(m).combine(e, e, renormalise=False)
    if m.is_projective:
        return bool(np.isfinite(np.stack(got)).all() and _relative(got, list(e), True)[0] == 0)
    return all(np.array_equal(g, v) for g, v in zip(got, e))  # -inf == -inf; nan fails


__all__ = ["verify", "Proof", "LawResult", "commutativity", "identity_pads_safely", "clear_memory_cache", "RANGES"]
