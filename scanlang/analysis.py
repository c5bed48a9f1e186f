"""Symbolic analysis of a traced monoid: deciding equalities, commutativity, Jacobians, sparsity.

The verifier (scanlang/verify.py) and the later stages (lower, differentiate) both use these. Every
symbol is a real, finite scalar; equalities are decided over the reals wherever the expressions are
defined (denominators and scales nonzero, logarithms of positive values).

`decide_equal(lhs, rhs)` tries, in order:
  1. rational simplification: expand, combine exponentials (powsimp), cancel. A nonzero result
     with no Max/Min/Abs/exp/log left is a nonzero rational function: the equality is false.
  2. a max/min normal form: `+`, scalings by factors of known sign (constants, squares, exp, Abs),
     exp and log are monotone and are pushed through Max/Min (nonpositive factors swap them), the result is flattened to a Max of Mins of atoms and
     dominated atoms are dropped; equal normal forms prove the equality (tropical algebra). When
     both sides are a Max (or a Min) of affine terms, equality is decided exactly by linear
     programming: a <= max(B) everywhere iff a convex combination of B matches a's linear part
     with a constant at least a's.
  3. sympy.simplify of the difference (only when a long step can be interrupted: see Deadline).
It returns True, False or None (undecided) together with the leftover expression. Callers bound its
running time (see verify.py); it checks a cooperative deadline between steps.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import sympy

from . import expr as E

_TRANSCENDENTAL = (sympy.Max, sympy.Min, sympy.Abs, sympy.exp, sympy.log, sympy.Heaviside)


class ProofTimeout(BaseException):
    """The symbolic budget ran out (a BaseException so that sympy's `except Exception` lets it pass)."""


class Deadline:
    """A point in time after which symbolic work stops; `check()` raises ProofTimeout past it."""

    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.monotonic() + max(0.0, seconds)
        # whether a long step can be interrupted (an alarm is armed, or there is no limit at all)
        self.interruptible = seconds is None

    def remaining(self) -> float | None:
        return None if self.end is None else self.end - time.monotonic()

    def check(self):
        if self.end is not None and time.monotonic() >= self.end:
            raise ProofTimeout()


NO_DEADLINE = Deadline(None)


@dataclass
class Decision:
    """Outcome of deciding lhs == rhs: `equal` is True, False or None; `how` names the method."""

    equal: bool | None
    how: str
    leftover: sympy.Expr = sympy.S.Zero


# ---- substitution helpers -------------------------------------------------------------------------

def z_symbols(monoid) -> tuple[sympy.Symbol, ...]:
    """Symbols for a third operand `z` (the latest of three)."""
    return tuple(E.symbol(f"z_{f}") for f in monoid.fields)


def apply(exprs, x_syms, y_syms, x_vals, y_vals) -> tuple:
    """Substitute operand values (expressions or numbers) for the x and y symbols of `exprs`."""
    rep = dict(zip(x_syms, x_vals))
    rep.update(zip(y_syms, y_vals))
    return tuple(sympy.sympify(e).xreplace(rep) for e in exprs)


def renormalised_exprs(monoid) -> tuple[sympy.Expr, ...]:
    """The combine the scan evaluates: the traced one, divided by scale(result) when projective."""
    if not monoid.is_projective:
        return tuple(monoid.exprs)
    s = monoid.scale_expr.xreplace(dict(zip(monoid.m_symbols, monoid.exprs)))
    return tuple(e / s for e in monoid.exprs)


def combine_exprs(monoid, x_vals, y_vals, renormalise: bool = False) -> tuple:
    """combine(x, y) as expressions in the given operand values (renormalised if asked and projective)."""
    exprs = renormalised_exprs(monoid) if renormalise else monoid.exprs
    return apply(exprs, monoid.x_symbols, monoid.y_symbols, x_vals, y_vals)


# ---- deciding equalities -----------------------------------------------------------------------

def _has_transcendental(e: sympy.Expr) -> bool:
    """Anything beyond a rational function: Max/Min/Abs/exp/log, or a root (non-integer power)."""
    return any(e.has(f) for f in _TRANSCENDENTAL) or any(not p.exp.is_Integer for p in e.atoms(sympy.Pow))


def _bad(e: sympy.Expr) -> bool:
    return e.has(sympy.nan, sympy.zoo) or e.has(sympy.oo) or e.has(-sympy.oo)


def rational_simplify(e: sympy.Expr) -> sympy.Expr:
    """expand -> combine exponentials -> cancel: a canonical form for rational functions.

    Zero is detected first from the expanded numerator over a common denominator, which is much
    cheaper than cancel's polynomial gcds.
    """
    if e.has(sympy.exp):
        e = sympy.expand(sympy.powsimp(sympy.expand(e), combine="exp"))
    if sympy.expand(sympy.numer(sympy.together(e))) == 0:
        return sympy.S.Zero
    return sympy.cancel(e)


def decide_equal(lhs, rhs, deadline: Deadline = NO_DEADLINE, use_simplify: bool = True) -> Decision:
    """Decide lhs == rhs over the reals (see the module docstring for the methods, in order)."""
    lhs, rhs = sympy.sympify(lhs), sympy.sympify(rhs)
    deadline.check()
    if lhs == rhs:
        return Decision(True, "identical expressions")
    deadline.check()
    diff = rational_simplify(lhs - rhs)
    if diff == 0:
        return Decision(True, "rational simplification (expand, powsimp, cancel)")
    if not _has_transcendental(diff) and not _bad(diff):
        return Decision(False, "rational simplification leaves a nonzero rational function", diff)
    deadline.check()
    if lhs.has(sympy.Max, sympy.Min) or rhs.has(sympy.Max, sympy.Min):
        try:
            left, right = lattice_normal_form(lhs, deadline), lattice_normal_form(rhs, deadline)
        except _NotLattice:
            left = right = None
        if left is not None and left == right:
            return Decision(True, "max/min normal form (tropical algebra)")
        if left is not None:
            diff = lattice_expr(left) - lattice_expr(right)
            same = _same_max_of_affine(left, right, deadline)
            if same is not None:
                how = "max/min of affine terms, compared by exact linear programming"
                return Decision(same, how, sympy.S.Zero if same else diff)
    deadline.check()
    if use_simplify and deadline.interruptible:
        simplified = sympy.simplify(lhs - rhs)
        if simplified == 0:
            return Decision(True, "sympy.simplify")
    return Decision(None, "undecided", diff)


# ---- max/min normal form ---------------------------------------------------------------------------
# A normal form is a frozenset of frozensets of atoms, read as Max over the outer set of Min over
# each inner set. Atoms are expanded expressions free of Max/Min at their top level.

class _NotLattice(Exception):
    """The expression has Max/Min in a position where they cannot be pushed out."""


_LIMIT = 4096  # largest normal form considered (distribution can blow up)


def _atom(e) -> frozenset:
    return frozenset([frozenset([sympy.expand(e)])])


def _dominates(a, b) -> bool:
    """a >= b everywhere (their difference is a nonnegative constant)."""
    d = sympy.expand(a - b)
    return d.is_number and bool(d >= 0)


def _prune(nf: frozenset) -> frozenset:
    """Drop redundant atoms: in a Min, the ones above another; in the Max, Min-sets dominated."""
    mins = []
    for s in nf:
        atoms = list(s)
        keep = [a for a in atoms if not any(b is not a and b != a and _dominates(a, b) for b in atoms)]
        mins.append(frozenset(keep))
    mins = set(mins)
    out = []
    for s in mins:
        redundant = False
        for t in mins:
            if t == s:
                continue
            if t < s:  # Min over a superset is smaller
                redundant = True
            elif len(s) == 1 and len(t) == 1 and _dominates(next(iter(t)), next(iter(s))):
                redundant = True
            if redundant:
                break
        if not redundant:
            out.append(s)
    return frozenset(out)


def _sum(a: frozenset, b: frozenset) -> frozenset:
    if len(a) * len(b) > _LIMIT:
        raise _NotLattice("normal form too large")
    return frozenset(frozenset(sympy.expand(p + q) for p in s for q in t) for s in a for t in b)


def _min_of(forms) -> frozenset:
    """Min of several normal forms, distributed back into a Max of Mins."""
    out = {frozenset()}
    for nf in forms:
        if len(out) * len(nf) > _LIMIT:
            raise _NotLattice("normal form too large")
        out = {s | t for s in out for t in nf}
    return frozenset(out)


def _negate(nf: frozenset) -> frozenset:
    """-Max_i Min_j a_ij = Min_i Max_j (-a_ij), distributed back."""
    return _min_of([frozenset(frozenset([sympy.expand(-a)]) for a in s) for s in nf])


def _map_monotone(nf: frozenset, fn) -> frozenset:
    return frozenset(frozenset(sympy.expand(fn(a)) for a in s) for s in nf)


def lattice_normal_form(e: sympy.Expr, deadline: Deadline = NO_DEADLINE) -> frozenset:
    """Max-of-Mins normal form of `e` (see above); raises _NotLattice when Max/Min are stuck inside."""
    deadline.check()
    if not e.has(sympy.Max, sympy.Min):
        return _atom(e)
    if isinstance(e, sympy.Max):
        return _prune(frozenset().union(*(lattice_normal_form(a, deadline) for a in e.args)))
    if isinstance(e, sympy.Min):
        return _prune(_min_of([lattice_normal_form(a, deadline) for a in e.args]))
    if isinstance(e, sympy.Add):
        parts = [lattice_normal_form(a, deadline) for a in e.args]
        out = parts[0]
        for p in parts[1:]:
            out = _prune(_sum(out, p))
        return out
    if isinstance(e, sympy.Mul):
        # one Max/Min factor times a factor of known sign (a constant, a square, exp, Abs):
        # k * Max(u, v) = Max(k u, k v) for k >= 0, and Min(k u, k v) for k <= 0
        lattice = [f for f in e.args if f.has(sympy.Max, sympy.Min)]
        k = sympy.Mul(*[f for f in e.args if not f.has(sympy.Max, sympy.Min)])
        if len(lattice) == 1:
            inner = lattice_normal_form(lattice[0], deadline)
            if k.is_nonnegative:
                return _prune(_map_monotone(inner, lambda a: k * a))
            if k.is_nonpositive:
                return _prune(_map_monotone(_negate(inner), lambda a: -k * a))
        raise _NotLattice(f"Max/Min under a product with a factor of unknown sign: {e}")
    if isinstance(e, (sympy.exp, sympy.log)):
        fn = type(e)
        return _map_monotone(lattice_normal_form(e.args[0], deadline), fn)
    if isinstance(e, sympy.Pow) and e.base is sympy.E:
        return _map_monotone(lattice_normal_form(e.exp, deadline), sympy.exp)
    raise _NotLattice(f"Max/Min inside {type(e).__name__}: {e}")


def _same_max_of_affine(left: frozenset, right: frozenset, deadline: Deadline) -> bool | None:
    """Decide Max(A) == Max(B) (or Min(A) == Min(B)) for affine atoms; None for other shapes.

    a <= max(B) everywhere iff some convex combination of B has a's linear part and a constant at
    least a's (LP duality), so equality is two such membership tests per atom.
    """
    def form(nf):
        if len(nf) == 1 and len(next(iter(nf))) == 1:
            return "atom"   # one affine term: a Max of one and a Min of one alike
        if all(len(s) == 1 for s in nf):
            return "max"
        return "min" if len(nf) == 1 else None

    forms = {form(left), form(right)}
    if None in forms or {"max", "min"} <= forms:
        return None
    as_min = "min" in forms

    def atoms(nf):
        # sorted: frozenset order follows str hashes, which change per process (PYTHONHASHSEED),
        # and sympy's simplex can cycle on some orders of these degenerate LPs
        if as_min:  # a single Min: compare the Max of the negated atoms
            return sorted((-a for a in next(iter(nf))), key=sympy.default_sort_key)
        return sorted((next(iter(s)) for s in nf), key=sympy.default_sort_key)

    a_atoms, b_atoms = atoms(left), atoms(right)
    syms = sorted(set().union(*(a.free_symbols for a in a_atoms + b_atoms)), key=sympy.default_sort_key)
    try:
        a_aff = [_affine(a, syms) for a in a_atoms]
        b_aff = [_affine(b, syms) for b in b_atoms]
    except _NotLattice:
        return None
    for one, others in ((a_aff, b_aff), (b_aff, a_aff)):
        for atom in one:
            deadline.check()
            below = _below_max(atom, others)
            if below is not True:
                return below
    return True


def _affine(e, syms) -> tuple[list, sympy.Expr]:
    poly = sympy.Poly(e, *syms) if syms else None
    if poly is not None and (poly.total_degree() > 1 or not all(c.is_Rational for c in poly.coeffs())):
        raise _NotLattice(f"{e} is not affine with rational coefficients")
    coeffs = [e.coeff(s) for s in syms]
    const = e.subs({s: 0 for s in syms})
    if not const.is_Rational:
        raise _NotLattice(f"{e} has a non-rational constant")
    return coeffs, const


def _below_max(atom, others) -> bool | None:
    """a(v) <= max_i b_i(v) for all v: exact LP over the simplex of weights.

    The best weights are checked against every constraint exactly: sympy 1.14's matrix `linprog`
    returns infeasible points for some of these small degenerate LPs (w <= 0 and w >= 1 gave w = 1,
    "proving" max(x, -1e6) == x), so the LP is stated with relations (`lpmin`) and a point that
    does not satisfy them leaves the question undecided (None)."""
    from sympy.solvers.simplex import InfeasibleLPError, UnboundedLPError, lpmin
    coeffs, const = atom
    weights = sympy.symbols(f"w_lp0:{len(others)}", real=True)
    constraints = [sympy.Eq(sum(w * b[0][k] for w, b in zip(weights, others)), coeffs[k]) for k in range(len(coeffs))]
    constraints.append(sympy.Eq(sum(weights), 1))
    constraints += [w >= 0 for w in weights]
    if any(c is sympy.false for c in constraints):
        return False   # a linear part no weighting of the others has
    constraints = [c for c in constraints if c is not sympy.true]
    objective = -sum(w * b[1] for w, b in zip(weights, others))
    try:
        best, point = lpmin(objective, constraints)
    except InfeasibleLPError:
        return False
    except UnboundedLPError:
        return None
    values = {w: point.get(w, sympy.S.Zero) for w in weights}
    if any(c.xreplace(values) is not sympy.true for c in constraints):
        return None
    return bool(-best >= const)


def lattice_expr(nf: frozenset) -> sympy.Expr:
    """A normal form back as a sympy expression (Max of Mins)."""
    return sympy.Max(*[sympy.Min(*s) for s in nf]) if nf else sympy.S.NegativeInfinity


# ---- properties the later stages need ------------------------------------------------------------

def projective_mode(monoid, deadline: Deadline = NO_DEADLINE) -> "Homogeneity":
    """How a projective monoid's law is checked: up to scale (homogeneous) or on the renormalised combine."""
    scale_ok = _scale_degree_one(monoid, deadline)
    kx = _degree(monoid, monoid.x_symbols, deadline)
    ky = _degree(monoid, monoid.y_symbols, deadline)
    return Homogeneity(scale_ok, kx, ky)


@dataclass(frozen=True)
class Homogeneity:
    """scale homogeneous of degree 1? and the combine's degree in x and in y (None: not homogeneous)."""

    scale_degree_one: bool
    x_degree: int | None
    y_degree: int | None

    @property
    def up_to_scale(self) -> bool:
        """Renormalising preserves a law that holds up to scale (the projective argument applies)."""
        return self.scale_degree_one and self.x_degree is not None and self.y_degree is not None


def _scale_degree_one(monoid, deadline) -> bool:
    """scale(t * m) == t * scale(m) for every nonzero real t (negative t included: signs matter)."""
    t = sympy.Symbol("t_scale", real=True, nonzero=True)
    s = monoid.scale_expr
    scaled = s.xreplace({m: t * m for m in monoid.m_symbols})
    return decide_equal(scaled, t * s, deadline, use_simplify=False).equal is True


def _degree(monoid, syms, deadline) -> int | None:
    """k such that combine(t * operand) == t**k * combine for every field, else None."""
    t = sympy.Symbol("t_scale", real=True, nonzero=True)
    degree = None
    for e in monoid.exprs:
        if e == 0:
            continue
        deadline.check()
        ratio = sympy.cancel(e.xreplace({s: t * s for s in syms}) / e)
        k = _power_of(ratio, t)
        if k is None or (degree is not None and k != degree):
            return None
        degree = k
    return degree if degree is not None else 0


def _power_of(ratio, t) -> int | None:
    if ratio == 1:
        return 0
    if ratio == t:
        return 1
    if isinstance(ratio, sympy.Pow) and ratio.base == t and ratio.exp.is_Integer:
        return int(ratio.exp)
    return None


def law_sides(monoid, up_to_scale: bool):
    """The two groupings' expressions over x, y, z: ((x+y)+z, x+(y+z)), raw if up_to_scale."""
    x, y, z = monoid.x_symbols, monoid.y_symbols, z_symbols(monoid)
    renorm = monoid.is_projective and not up_to_scale
    left = combine_exprs(monoid, combine_exprs(monoid, x, y, renorm), z, renorm)
    right = combine_exprs(monoid, x, combine_exprs(monoid, y, z, renorm), renorm)
    return left, right


def equal_tuples(left, right, up_to_scale: bool, fields, deadline: Deadline = NO_DEADLINE,
                 use_simplify: bool = True) -> tuple[Decision, list[tuple[str, sympy.Expr]]]:
    """Decide left == right field by field (or proportionality: all cross-products vanish).

    Returns the weakest decision and the nonzero leftovers as (label, expression) pairs, labelled
    by field (`b`) or by pair of fields for cross-products (`a*b`: left.a*right.b - left.b*right.a).
    """
    deadline.check()
    pairs = []
    if up_to_scale:
        for i, j in itertools.combinations(range(len(left)), 2):
            pairs.append((f"{fields[i]}*{fields[j]}", left[i] * right[j], left[j] * right[i]))
    else:
        pairs = [(f, lo, ro) for f, lo, ro in zip(fields, left, right)]
    hows, leftovers, result = [], [], True
    for label, lo, ro in pairs:
        d = decide_equal(lo, ro, deadline, use_simplify=use_simplify)
        if d.equal is True:
            hows.append(d.how)
            continue
        leftovers.append((label, d.leftover))
        if d.equal is False:
            result = False
            hows.append(d.how)
        elif result is True:
            result = None
            hows.append(d.how)
    how = "; ".join(dict.fromkeys(hows)) or "no terms to compare"
    return Decision(result, how), leftovers


def commutative(monoid, deadline: Deadline = NO_DEADLINE) -> bool | None:
    """Whether combine(x, y) == combine(y, x) symbolically (up to scale for projective monoids).

    None when sympy cannot decide (verify() then searches for a numeric witness of False).
    """
    up = monoid.is_projective and projective_mode(monoid, deadline).up_to_scale
    renorm = monoid.is_projective and not up
    x, y = monoid.x_symbols, monoid.y_symbols
    d, _ = equal_tuples(combine_exprs(monoid, x, y, renorm), combine_exprs(monoid, y, x, renorm), up,
                        monoid.fields, deadline, use_simplify=False)
    return d.equal


def jacobians(monoid, renormalised: bool = True) -> tuple[sympy.Matrix, sympy.Matrix]:
    """(d combine / d x, d combine / d y): row i = result field i, column j = operand field j.

    With renormalised=True (the default) a projective monoid's combine is taken after dividing by
    scale, which is what the scan evaluates. Max/Min differentiate to Heaviside steps.
    """
    exprs = renormalised_exprs(monoid) if renormalised else tuple(monoid.exprs)
    out = sympy.Matrix(exprs)
    return out.jacobian(list(monoid.x_symbols)), out.jacobian(list(monoid.y_symbols))


@dataclass
class Sparsity:
    """Which operand fields each result field depends on (from the expressions' free symbols).

    `x["b"] == ("b",)` reads: result field b depends on field b of the earlier operand x only.
    """

    fields: tuple[str, ...]
    x: dict[str, tuple[str, ...]] = field(default_factory=dict)
    y: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def mask(self, operand: str) -> tuple[tuple[bool, ...], ...]:
        """Boolean matrix [result field][operand field] for operand "x" or "y"."""
        deps = {"x": self.x, "y": self.y}[operand]
        return tuple(tuple(f in deps[r] for f in self.fields) for r in self.fields)

    def __str__(self):
        rows = [f"{r} <- x.{{{', '.join(self.x[r])}}}, y.{{{', '.join(self.y[r])}}}" for r in self.fields]
        return "; ".join(rows)


def sparsity(monoid, renormalised: bool = True) -> Sparsity:
    """The Jacobian sparsity pattern of the combine (see `jacobians` for `renormalised`)."""
    exprs = renormalised_exprs(monoid) if renormalised else tuple(monoid.exprs)
    out = Sparsity(monoid.fields)
    for f, e in zip(monoid.fields, exprs):
        free = e.free_symbols
        out.x[f] = tuple(g for g, s in zip(monoid.fields, monoid.x_symbols) if s in free)
        out.y[f] = tuple(g for g, s in zip(monoid.fields, monoid.y_symbols) if s in free)
    return out
