"""The matrix-state family (docs/spec/linear.md) as a declaration: structure plus traced per-token hooks.

Every member maps a [K, V] state S, token by token (decay first, read after write), by the affine
element (P_t, R_t): S -> P_t S + R_t, with

    D_t = I | exp(g_t) I | diag(exp(g_t))                    decay:      none | per_head | per_key
    P_t = H_t D_t,  H_t = I | I - beta_t k_t k_t^T | H_t,n ... H_t,1         correction: plain | delta | householder
    R_t = k_t v_t^T | beta_t k_t v_t^T | sum_j (H_t,n ... H_t,j+1) beta_t,j k_t,j v_t,j^T
    o_t = scale S_t^T q_t

Composition (a then b) is (P_b P_a, P_b R_a + R_b), identity (I, 0). A member is one point of the
(decay, correction, steps) grid plus two elementwise hooks, traced into sympy like monoid bodies
(`+ - * /`, sl.exp, sl.log, sl.sigmoid, sl.softplus, sl.logsigmoid, ...) and differentiated with
sympy:

    beta(t)      -> beta_t from the declared per-token inputs, t.n2 = ||k_t||^2 and the constants
    log_decay(t) -> g_t    from the declared inputs (per-token, per-token-per-key, per-head) and constants

>>> import scanlang as sl
>>> kda_kaczmarz = sl.matrix_state("kda_kaczmarz", decay="per_key", correction="delta",
...     inputs={"a": "token_key", "eta": "token"}, constants={"eps": 1e-6},
...     beta=lambda t: t.eta / (t.n2 + t.eps), log_decay=lambda t: sl.logsigmoid(t.a))
>>> kda_kaczmarz.log_decay.expr, kda_kaczmarz.log_decay.grads["a"]
(LogSigmoid(a), Sigmoid(-a))
>>> print(kda_kaczmarz.proof)  # doctest: +ELLIPSIS
matrix state kda_kaczmarz (decay per_key, correction delta, 1 step): ...

What a kernel generator reads: `decay`, `correction`, `steps`, `inputs` (name -> kind), `rows`
(which inputs live on the T*n sub-token rows), `constants`, and the hooks (`Hook.expr`,
`Hook.grads`, printable by scanlang.expr.render); `key` hashes all of it. The structure decides the
stages: plain writes need no WY stage, per-head decay is one scalar per row, n steps unroll.
"""
from __future__ import annotations

import hashlib
import numbers
from typing import Callable

import sympy
import torch

from . import expr as E
from .delta import Hook, _matrix, combine, prove_affine_matrix_monoid, trace_hook
from .traced import BuiltOutsideTheTrace

DECAYS = ("none", "per_head", "per_key")
CORRECTIONS = ("plain", "delta", "householder")
INPUT_KINDS = {"token": "[B, T, H]", "token_key": "[B, T, H, K]", "head": "[H]"}
KEY_NORM = "n2"   # ||k_t||^2, a built-in field of the beta hook
REFERENCE_CHUNK = 32   # chunk_size=None: the reference's chunk (and the plain-write kernels')
RESERVED = ("q", "k", "v", KEY_NORM, "scale", "initial_state", "output_final_state", "cu_seqlens",
            "backend", "chunk_size", "cp_group", "num_householder")
# Names an input or constant must not take because the generated kernels (backends/linear) already use what
# they derive from it: input n becomes x_n, dx_n, y_n, dy_n and the pointers n_ptr, dn_ptr, constant c
# becomes c_c, and these are the n whose n_ptr / dn_ptr / x_n is one of the kernels' own (q_ptr, dh0_ptr,
# x_j, ...). The decode module (decode.py) is generated for every structure, the chunk module (kernels.py,
# kernels_delta.py) for those `has_chunk_kernels` names (the delta-rule kernels never see these names).
# tests/test_linear_family.py derives both sets from the rendered modules and checks they are exactly these.
DECODE_NAMES = ("cu", "h0", "ht", "k", "o", "q", "v")
CHUNK_NAMES = ("G", "bw_U", "bw_daqk", "bw_dn2", "bw_dp", "chunk_len", "chunk_seq", "chunk_tok", "dh", "dh0", "dht", "dk",
               "do", "dq", "dv", "fw_U", "h", "h0", "hs", "ht", "k", "o", "q", "seq_chunk0", "v", "wy_aqk", "wy_beta",
               "wy_p", "wy_tm", "wy_u", "wy_w")
_PROOFS: "dict[tuple, str]" = {}   # (decay, correction, steps) -> report: the proof depends on the structure only


# --------------------------------------------------------------------------------------------------
# The structure's token element, the recurrence it must equal, and the proof.

def _decay_matrix(decay: str, g, K: int) -> sympy.Matrix:
    if decay == "none":
        return sympy.eye(K)
    if decay == "per_head":
        return sympy.exp(g) * sympy.eye(K)
    return sympy.diag(*[sympy.exp(g[i]) for i in range(K)])


def token_element(decay: str, correction: str, ks, vs, g, betas) -> tuple:
    """(P, R) of one token as sympy matrices: ks, vs, betas hold one entry per step (one for plain
    and delta); g is a symbol (per head), a list of K symbols (per key) or None."""
    K = ks[0].shape[0]
    D = _decay_matrix(decay, g, K)
    if correction == "plain":
        return D, ks[0] * vs[0].T
    P, R = D, sympy.zeros(K, vs[0].shape[0])
    for k, v, beta in zip(ks, vs, betas):            # H_j applied after the earlier steps
        Hj = sympy.eye(K) - beta * k * k.T
        P, R = Hj * P, Hj * R + beta * k * v.T
    return P, R


def recurrence(decay: str, correction: str, S, ks, vs, g, betas) -> sympy.Matrix:
    """The token step as the spec states it: decay first, then each write reads the current state."""
    S = _decay_matrix(decay, g, S.shape[0]) * S
    if correction == "plain":
        return S + ks[0] * vs[0].T
    for k, v, beta in zip(ks, vs, betas):
        S = S + beta * k * (v - S.T * k).T
    return S


def _zero(m: sympy.Matrix) -> bool:
    return m.applyfunc(sympy.expand) == sympy.zeros(*m.shape)


def prove_structure(decay: str, correction: str, steps: int = 1, K: int = 2, V: int = 2) -> str:
    """Prove over the reals, with symbolic K x K / K x V matrices and symbolic tokens:
    1. the (P, R) monoid is associative with identity (I, 0);
    2. the action law: (a then b) applied to S is b applied to (a applied to S), for generic a, b;
    3. each sub-step's element applied to a symbolic state is the recurrence's step (the first
       sub-step decays, later ones of n Householder steps do not), so the token element, their
       ordered product, is the token step for every n (by 2), and a chunked or parallel
       evaluation of the elements is the token loop;
    4. for one-step structures, end to end: two tokens composed equal two recurrence steps.
    Raises AssertionError naming the law that fails."""
    prove_affine_matrix_monoid(K, V)
    S = _matrix("S", K, V)
    (Pa, Ra), (Pb, Rb) = [(_matrix(f"P{n}", K, K), _matrix(f"R{n}", K, V)) for n in "ab"]
    P, R = combine((Pa, Ra), (Pb, Rb))
    if not _zero(P * S + R - (Pb * (Pa * S + Ra) + Rb)):
        raise AssertionError("the action law fails: composing two elements is not applying them in turn")

    def token(tag, sub_decay):
        g = (None if sub_decay == "none" else E.symbol(f"g{tag}") if sub_decay == "per_head"
             else [E.symbol(f"g{tag}_{i}") for i in range(K)])
        return [_matrix(f"k{tag}", K, 1)], [_matrix(f"v{tag}", V, 1)], g, [E.symbol(f"beta{tag}")]

    step = "delta" if correction == "householder" else correction
    subs = [decay] + (["none"] if correction == "householder" and steps > 1 else [])
    for i, sub_decay in enumerate(subs):
        tok = token(f"s{i}", sub_decay)
        P, R = token_element(sub_decay, step, *tok)
        if not _zero(P * S + R - recurrence(sub_decay, step, S, *tok)):
            raise AssertionError(f"{decay}/{correction}: sub-step {i + 1}'s element does not match the recurrence")
    if steps == 1:
        a, b = token("a", decay), token("b", decay)
        P, R = combine(token_element(decay, correction, *a), token_element(decay, correction, *b))
        if not _zero(P * S + R - recurrence(decay, correction, recurrence(decay, correction, S, *a), *b)):
            raise AssertionError(f"{decay}/{correction}: composing two tokens differs from two steps")
    return (f"associative, identity (I, 0), action law, token element = recurrence step"
            f"{' (each of the n sub-steps)' if correction == 'householder' else ''}; "
            f"symbolic over ({K}x{K}, {K}x{V}) matrices, over the reals")


# --------------------------------------------------------------------------------------------------
# The declaration.

class MatrixState(BuiltOutsideTheTrace):
    """A declared member of the matrix-state family (module docstring). Build it with `matrix_state`.

    Law: S_t = P_t S_{t-1} + R_t (the affine element (P_t, R_t) of the declared decay and correction,
    module docstring), o_t = scale S_t^T q_t; elements compose as (P_b P_a, P_b R_a + R_b), identity (I, 0).

    inputs: name -> kind, "token" [B,T,H], "token_key" [B,T,H,K] or "head" [H] (a per-head
    parameter); constants: name -> default float (a call may override it). With n Householder
    steps the inputs that `beta` reads carry T*n rows like k and v, those of `log_decay` T rows.

    >>> import scanlang as sl
    >>> delta = sl.MatrixState("my_delta", correction="delta", inputs={"beta": "token"},
    ...                        beta=lambda t: t.beta)
    >>> delta.correction, sorted(delta.inputs)
    ('delta', ['beta'])
    """

    def __init__(self, name: str, *, decay: str = "none", correction: str = "plain", steps: int = 1,
                 inputs=None, constants=None, beta: Callable | None = None, log_decay: Callable | None = None):
        if torch.compiler.is_dynamo_compiling():
            return   # built (proved, hooks traced) outside a torch.compile trace: scanlang.traced
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"name must be an identifier (it names generated kernels), got {name!r}")
        if decay not in DECAYS:
            raise ValueError(f"decay must be one of {DECAYS}, got {decay!r}")
        if correction not in CORRECTIONS:
            raise ValueError(f"correction must be one of {CORRECTIONS}, got {correction!r}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        if steps != 1 and correction != "householder":
            raise ValueError(f"steps = {steps} needs correction='householder' (n Householder steps per token)")
        self.name, self.decay, self.correction, self.steps = name, decay, correction, steps
        self.inputs = _check_inputs(inputs)
        self.constants = _check_constants(constants, self.inputs)
        _check_not_generated(self)
        self.beta = self._hook("beta", beta, needed=correction != "plain", extra=(KEY_NORM,))
        self.log_decay = self._hook("log_decay", log_decay, needed=decay != "none", extra=())
        self.rows = self._rows()
        self.proof = f"matrix state {name} (decay {decay}, correction {correction}, {steps} step" \
                     f"{'s' if steps > 1 else ''}): " + _proof(decay, correction, steps)
        text = repr((name, decay, correction, steps, sorted(self.inputs.items()), sorted(self.constants.items()),
                     *(sympy.srepr(h.expr) if h else None for h in (self.beta, self.log_decay))))
        self.key = hashlib.sha256(text.encode()).hexdigest()[:16]

    def trace_identity(self) -> str:
        """Equal for declarations that behave the same: the name and the content hash."""
        return f"{self.name}:{self.key}"

    def _hook(self, role: str, fn, needed: bool, extra: tuple) -> Hook | None:
        what = f"{role} hook of matrix state '{self.name}'"
        if fn is None:
            if needed:
                raise ValueError(f"{what}: required (decay {self.decay}, correction {self.correction}); "
                                 f"pass {role}=lambda t: ...")
            return None
        if not needed:
            raise ValueError(f"{what}: not used by decay {self.decay!r} / correction {self.correction!r}; "
                             f"leave {role}=None")
        fields = tuple(self.inputs) + extra + tuple(self.constants)
        try:
            hook = trace_hook(fn, what, fields, differentiate=fields)
        except AttributeError as exc:
            raise ValueError(f"{what} reads a field it does not declare ({exc}); declare it in inputs= "
                             f"or constants=") from None
        used = self.used(hook)
        if role == "beta":
            wide = [n for n in used if self.inputs.get(n) == "token_key"]
            if wide:
                raise ValueError(f"{what}: beta is one value per token and head, but reads per-key inputs {wide}")
        if role == "log_decay" and self.decay == "per_head":
            wide = [n for n in used if self.inputs.get(n) == "token_key"]
            if wide:
                raise ValueError(f"{what}: per-head decay is one value per token and head, but reads per-key "
                                 f"inputs {wide}; use decay='per_key'")
        return hook

    @staticmethod
    def used(hook: Hook | None) -> tuple[str, ...]:
        """The fields a hook reads, in declaration order."""
        if hook is None:
            return ()
        free = {s.name for s in hook.expr.free_symbols}
        return tuple(n for n in hook.inputs if n in free)

    def _rows(self) -> dict:
        """input -> "token" (T rows) or "sub" (T*n rows, with k and v), for per-token inputs."""
        in_beta, in_decay = set(self.used(self.beta)), set(self.used(self.log_decay))
        rows = {}
        for name, kind in self.inputs.items():
            if kind == "head":
                continue
            if self.correction == "householder" and name in in_beta and name in in_decay:
                raise ValueError(f"input {name!r} is read by both hooks, but with Householder steps beta's "
                                 f"inputs carry T*n rows and log_decay's T rows; declare two inputs")
            rows[name] = "sub" if (self.correction == "householder" and name in in_beta) else "token"
        return rows

    @property
    def uses_key_norm(self) -> bool:
        return KEY_NORM in self.used(self.beta)

    def structure(self) -> dict:
        """The data a generator renders from: structure, hooks and their derivatives (sympy)."""
        return {"decay": self.decay, "correction": self.correction, "steps": self.steps,
                "inputs": dict(self.inputs), "rows": dict(self.rows), "constants": dict(self.constants),
                "beta": self.beta, "log_decay": self.log_decay}

    def __repr__(self):
        hooks = ", ".join(f"{r} = {h.expr}" for r, h in (("beta", self.beta), ("g", self.log_decay)) if h)
        return (f"<matrix state {self.name}: decay {self.decay}, correction {self.correction}"
                f"{f' x{self.steps}' if self.steps > 1 else ''}{'; ' + hooks if hooks else ''}>")


def _check_inputs(inputs) -> dict:
    if inputs is None:
        return {}
    if isinstance(inputs, (tuple, list)):
        inputs = {n: "token" for n in inputs}
    if not isinstance(inputs, dict):
        raise TypeError(f"inputs must be a dict name -> kind ({tuple(INPUT_KINDS)}) or a tuple of names, "
                        f"got {type(inputs).__name__}")
    for n, kind in inputs.items():
        if not isinstance(n, str) or not n.isidentifier() or n.startswith("_") or n in RESERVED:
            raise ValueError(f"inputs: {n!r} is not a usable input name (identifiers, not {RESERVED})")
        if kind not in INPUT_KINDS:
            raise ValueError(f"inputs: {n!r} has kind {kind!r}; kinds are "
                             + ", ".join(f"{k!r} {s}" for k, s in INPUT_KINDS.items()))
    return dict(inputs)


def has_chunk_kernels(decay: str, correction: str, steps: int) -> bool:
    """Whether backends/linear generates chunk kernels for the structure: plain writes, and per-key decay with
    the delta correction (the delta correction and Householder steps with decay none or per head run on the
    delta-rule kernels instead, scanlang/delta_form.py)."""
    return correction == "plain" or (decay == "per_key" and correction == "delta" and steps == 1)


def _check_not_generated(decl: "MatrixState") -> None:
    """A ValueError naming the argument when an input or constant would shadow a generated kernel's name."""
    taken = DECODE_NAMES + tuple(n for n in CHUNK_NAMES if n not in DECODE_NAMES) if has_chunk_kernels(
        decl.decay, decl.correction, decl.steps) else DECODE_NAMES
    for arg, names in (("inputs", decl.inputs), ("constants", decl.constants)):
        for n in names:
            if n in taken:
                raise ValueError(f"{arg}: {n!r} would shadow a name of the generated kernels (their own {n}_ptr, "
                                 f"d{n}_ptr or x_{n}); choose another name (the taken ones: {', '.join(taken)})")


def _check_constants(constants, inputs) -> dict:
    if constants is None:
        return {}
    if not isinstance(constants, dict):
        raise TypeError(f"constants must be a dict name -> default value, got {type(constants).__name__}")
    for n, value in constants.items():
        if not isinstance(n, str) or not n.isidentifier() or n.startswith("_") or n in RESERVED or n in inputs:
            raise ValueError(f"constants: {n!r} is not a usable name (an identifier, not an input, not {RESERVED})")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"constants: {n!r} must default to a real number, got {value!r}")
    return {n: float(v) for n, v in constants.items()}


def _proof(decay: str, correction: str, steps: int) -> str:
    key = (decay, correction, steps)
    if key not in _PROOFS:
        _PROOFS[key] = prove_structure(decay, correction, steps)
    return _PROOFS[key]


def matrix_state(name: str, *, decay: str = "none", correction: str = "plain", steps: int = 1, inputs=None,
                 constants=None, beta: Callable | None = None, log_decay: Callable | None = None) -> MatrixState:
    """Declare a matrix-state member (module docstring): structure, inputs, constants and hooks;
    proves the structure and traces and differentiates the hooks. Run it with
    `scanlang.recipes.linear.op(declaration)`.

    Law: S_t = P_t S_{t-1} + R_t, o_t = scale S_t^T q_t, with (P_t, R_t) from the structure (module
    docstring); the (P, R) monoid is proved symbolically for the structure.

    >>> import scanlang as sl
    >>> gla = sl.matrix_state("my_gla", decay="per_key", inputs={"g": "token_key"},
    ...                       log_decay=lambda t: t.g)
    >>> gla.decay, gla.correction, gla.steps
    ('per_key', 'plain', 1)
    """
    return MatrixState(name, decay=decay, correction=correction, steps=steps, inputs=inputs,
                       constants=constants, beta=beta, log_decay=log_decay)


LinearFamily = MatrixState
