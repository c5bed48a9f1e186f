"""The delta-rule family: a matrix-state monoid plus two symbolic per-token hooks.

A gated delta rule maps a [K, V] state S, token by token (decay first, read after write):

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T

so token t is the element (P_t, R_t) = (exp(g_t)(I - beta_t k_t k_t^T), beta_t k_t v_t^T) acting by
S -> P S + R. Composing a then b is (P_b P_a, P_b R_a + R_b), with identity (I, 0): the affine monoid
over matrices. `verify_delta_monoid` proves the law with sympy over symbolic matrices.

A family member is declared by two elementwise hooks, traced like monoid bodies (`+ - * /`, `sl.exp`,
...) into sympy, rendered into the generated kernels and differentiated symbolically for the chain rule:

    step(t)  -> beta_t   from t.s (the per-token step input), t.n2 = ||k_t||^2 (fp32) and t.eps
    decay(t) -> g_t      from t.a (the per-token decay input) and optional per-head parameters

>>> from scanlang.delta import KACZMARZ
>>> KACZMARZ.step.expr
s/(eps + n2)
>>> sorted(str(v) for v in KACZMARZ.step.grads.values())
['-s/(eps + n2)**2', '1/(eps + n2)']

A zero key writes nothing whatever its step (beta k = 0); kernels therefore set beta = 0 where
||k|| = 0, which keeps a rule like Kaczmarz's with eps = 0 free of 0/0.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable

import sympy
import torch

from . import expr as E
from .monoid import trace_body
from .traced import BuiltOutsideTheTrace

STEP_INPUTS = ("s", "n2", "eps")
# (name, key) -> the rule: torch.compile passes these strings (constants to Dynamo) to the trace-time
# kernel build (backends/delta/ops.py `program_key`), which finds the object here
DECLARED: "dict[tuple[str, str], DeltaRule]" = {}   # a declaration lives as long as its compiled kernels
DECAY_INPUTS = ("a",)
# Names a head parameter must not take: the generated decay hooks (backends/delta/codegen.py: decay_hook(a,
# hp_ptr, h, H) and store_decay_grads(dg, a, hp_ptr, h, H, da_ptr, dhp_ptr, offs, TTH, mask)) load each
# parameter into a local of its own name beside these arguments and read `tl`. tests/test_delta_dsl.py
# derives the set from the rendered hooks and checks it is exactly this one.
HOOK_NAMES = ("H", "TTH", "da_ptr", "dg", "dhp_ptr", "h", "hp_ptr", "mask", "offs", "tl")
# What the generated delta-rule kernels take (backends/delta): their chunk sizes (each rendered as its own
# module), the default one (their launch configs are tuned at 64) and the largest head dim K, V. Here, with
# the rule, so the recipes that launch them and `scanlang show` read one definition without the core
# importing a recipe.
CHUNK_SIZES = (16, 32, 64)
DELTA_CHUNK = 64
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Hook:
    """One traced per-token expression and its partial derivatives (sympy), keyed by input name."""

    name: str
    inputs: tuple[str, ...]
    expr: sympy.Expr
    grads: dict = field(default_factory=dict)

    @property
    def symbols(self) -> dict:
        return {n: E.symbol(n) for n in self.inputs}


def trace_hook(fn: Callable, name: str, inputs: tuple[str, ...], differentiate: tuple[str, ...]) -> Hook:
    """Trace `fn(t)` (t has one attribute per input) and differentiate it w.r.t. `differentiate`."""
    if not callable(fn):
        raise TypeError(f"{name} must be a function of one token (fields {inputs}), got {type(fn).__name__}")
    syms = [E.symbol(n) for n in inputs]
    expr = trace_body(fn, inputs, (syms,), name, None)
    if not isinstance(expr, sympy.Expr):
        expr = E.constant(expr)
    unknown = expr.free_symbols - set(syms)
    if unknown:
        raise ValueError(f"{name} uses unknown symbols {sorted(map(str, unknown))}; inputs are {inputs}")
    grads = {n: sympy.diff(expr, s) for n, s in zip(inputs, syms) if n in differentiate}
    return Hook(name, inputs, expr, grads)


class DeltaRule(BuiltOutsideTheTrace):
    """A member of the gated delta-rule family: a step-size hook and a decay hook.

    `step(t)` returns beta from `t.s`, `t.n2` (squared key norm) and `t.eps`; `decay(t)` returns the
    log-decay g from `t.a` and the per-head parameters named in `head_params` (one value per head,
    e.g. Mamba2's A_log and dt_bias). The default decay is g = a (the op's `g` argument as given).
    Declared inside a torch.compile'd function, it is traced at trace time, outside the graph
    (`scanlang.traced`).
    """

    def __init__(self, name: str, step: Callable, decay: Callable | None = None, head_params: tuple[str, ...] = ()):
        if torch.compiler.is_dynamo_compiling():
            return   # built outside the trace by BuiltOutsideTheTrace.__new__
        if not name.isidentifier():
            raise ValueError(f"name must be an identifier (it names generated kernels), got {name!r}")
        head_params = tuple(head_params)
        for p in head_params:
            if not isinstance(p, str) or not p.isidentifier() or p in STEP_INPUTS + DECAY_INPUTS or p.startswith("_"):
                raise ValueError(f"head_params: {p!r} is not a usable parameter name")
            if p in HOOK_NAMES:
                raise ValueError(f"head_params: {p!r} would shadow a name of the generated decay hooks; choose "
                                 f"another name (the taken ones: {', '.join(HOOK_NAMES)})")
        self.name = name
        self.head_params = head_params
        self.step = trace_hook(step, f"step hook of delta rule '{name}'", STEP_INPUTS, ("s", "n2"))
        inputs = DECAY_INPUTS + head_params
        self.decay = trace_hook(decay or (lambda t: t.a), f"decay hook of delta rule '{name}'", inputs, inputs)
        # a plain attribute (not a cached_property, whose lock torch.compile cannot enter): the
        # content hash of the declaration (name and both traced hooks); it names the generated kernels
        text = repr((self.name, sympy.srepr(self.step.expr), sympy.srepr(self.decay.expr), self.head_params))
        self.key = hashlib.sha256(text.encode()).hexdigest()[:16]
        if DECLARED.get((self.name, self.key)) is None:
            DECLARED[(self.name, self.key)] = self

    def trace_identity(self) -> str:
        """Equal for rules that behave the same: the name and the content hash."""
        return f"{self.name}:{self.key}"

    @property
    def uses_key_norm(self) -> bool:
        return E.symbol("n2") in self.step.expr.free_symbols

    def __repr__(self):
        return f"<delta rule {self.name}: beta = {self.step.expr}, g = {self.decay.expr}>"


# --------------------------------------------------------------------------------------------------
# The monoid over (P, R) and its proof.

def combine(a: tuple, b: tuple) -> tuple:
    """(P_a, R_a) then (P_b, R_b): S -> P_b (P_a S + R_a) + R_b = (P_b P_a) S + (P_b R_a + R_b)."""
    Pa, Ra = a
    Pb, Rb = b
    return Pb @ Pa, Pb @ Ra + Rb


def token_element(k, v, g, beta):
    """(P, R) of one token; works on sympy matrices (k, v column vectors) and on torch tensors [K], [V]."""
    if isinstance(k, sympy.MatrixBase):
        eye = sympy.eye(k.shape[0])
        return sympy.exp(g) * (eye - beta * k * k.T), beta * k * v.T
    eye = torch.eye(k.shape[0], dtype=k.dtype, device=k.device)
    return torch.exp(g) * (eye - beta * torch.outer(k, k)), beta * torch.outer(k, v)


def _matrix(prefix: str, rows: int, cols: int) -> sympy.Matrix:
    return sympy.Matrix(rows, cols, lambda i, j: E.symbol(f"{prefix}_{i}{j}"))


def prove_affine_matrix_monoid(K: int = 2, V: int = 2) -> None:
    """Prove, over the reals with symbolic K x K and K x V matrices, that the (P, R) combine is
    associative with identity (I, 0) (every matrix-state member shares this monoid; see
    scanlang/linear.py). Raises AssertionError with the leftover expression if a law fails."""
    x, y, z = [(_matrix(f"P{n}", K, K), _matrix(f"R{n}", K, V)) for n in "xyz"]
    left = combine(combine(x, y), z)
    right = combine(x, combine(y, z))
    for part, l, r in zip(("P", "R"), left, right):
        diff = (l - r).applyfunc(sympy.expand)
        if diff != sympy.zeros(*diff.shape):
            raise AssertionError(f"associativity fails in {part}: leftover {diff}")
    e = (sympy.eye(K), sympy.zeros(K, V))
    for side, got in (("left", combine(e, x)), ("right", combine(x, e))):
        if any((g - w).applyfunc(sympy.expand) != sympy.zeros(*w.shape) for g, w in zip(got, x)):
            raise AssertionError(f"(I, 0) is not a {side} identity")


def verify_delta_monoid(K: int = 2, V: int = 2) -> str:
    """Prove, over the reals with symbolic K x K and K x V matrices, that the (P, R) combine is
    associative with identity (I, 0), and that a token element applied to S is the spec's update
    (decay first, residual read from the decayed state, then the write). Returns a short report;
    raises AssertionError with the leftover expression if a law fails."""
    prove_affine_matrix_monoid(K, V)
    k, v, S = _matrix("k", K, 1), _matrix("v", V, 1), _matrix("S", K, V)
    g, beta = E.symbol("g"), E.symbol("beta")
    P, R = token_element(k, v, g, beta)
    decayed = sympy.exp(g) * S
    residual = v - decayed.T * k
    spec = decayed + beta * k * residual.T
    diff = (P * S + R - spec).applyfunc(sympy.expand)
    if diff != sympy.zeros(K, V):
        raise AssertionError(f"token element does not match the recurrence: leftover {diff}")
    return (f"delta-rule monoid over ({K}x{K}, {K}x{V}) matrices: associative, identity (I, 0), "
            f"token element = decay-first/read-after-write update; symbolic proof over the reals")


def softplus(x):
    """log(1 + e^x) written so that it never overflows: max(x, 0) + log(1 + e^-|x|)."""
    return E.maximum(x, 0) + E.log(1 + E.exp(-E.abs(x)))


def mamba2_decay(t):
    """Mamba2's gate g = -exp(A_log) softplus(a + dt_bias), A_log and dt_bias per head."""
    return -E.exp(t.A_log) * softplus(t.a + t.dt_bias)


GIVEN = DeltaRule("given", step=lambda t: t.s)
KACZMARZ = DeltaRule("kaczmarz", step=lambda t: t.s / (t.n2 + t.eps))
GDN_SIGMOID = DeltaRule("gdn_sigmoid", step=lambda t: 1 / (1 + E.exp(-t.s)))
GIVEN_MAMBA2 = DeltaRule("given_mamba2", step=lambda t: t.s, decay=mamba2_decay, head_params=("A_log", "dt_bias"))
KACZMARZ_MAMBA2 = DeltaRule("kaczmarz_mamba2", step=lambda t: t.s / (t.n2 + t.eps), decay=mamba2_decay,
                            head_params=("A_log", "dt_bias"))
RULES = {r.name: r for r in (GIVEN, KACZMARZ, GDN_SIGMOID, GIVEN_MAMBA2, KACZMARZ_MAMBA2)}
