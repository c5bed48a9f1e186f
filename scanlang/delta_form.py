"""Family members on the delta-rule kernels (backends/delta): a declaration translated into a DeltaRule.

In the core (not in recipes/linear, which runs it) because it maps one core declaration onto another
and `scanlang show` prints the translation: the core never imports a recipe.

A declaration with correction "delta" and decay "none" or "per_head" is the gated delta rule

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = scale S_t^T q_t

which the delta backend runs on its chunked tensor-core kernels. So is one with n Householder steps
(correction "householder", the same decays), over the interleaved stream of T*n rows: row t*n+j has key
k_tj, value v_tj and beta_tj, log-decay g_t at j = 0 and 0 after, query q_t at j = n-1 and 0 before; o_t is
that stream's output at row t*n+n-1 (recipes/linear/family.py interleaves and de-interleaves). Those take two per-token scalars (s, the
step input, and a, the decay input), per-head parameters [H], one runtime float eps, and a
`scanlang.delta.DeltaRule` whose hooks give beta = step(s, n2, eps) and g = decay(a, *params) inside the
kernels (n2 = ||k_t||^2, fp32). `delta_form(declaration, constants)` maps the declaration's hooks onto it:

    beta       reads at most one per-token input and no per-head one: the kernels' step hook, with that
               input as s, n2 as n2, the first constant it reads as eps (passed at run time, so a call
               may change it) and any further constant as its number; otherwise beta is evaluated on
               the host (the declaration's torch hook, differentiated through its sympy derivatives and
               ||k||^2 by autograd) and passed as s with the step beta = s
    log_decay  reads at most one per-token input: the kernels' decay hook, with that input as a, its
               per-head inputs as the rule's head parameters and its constants as numbers; otherwise g
               is evaluated on the host and passed as a, with the decay g = a. Decay "none": a = 0.

A form whose hooks equal a shipped rule's (`scanlang.delta.RULES`: "given" for deltanet and the gated
delta rule, "kaczmarz" for Kaczmarz's step) runs that rule, i.e. the kernels recipes/kaczmarz and the
Kaczmarz layer run; any other gets a rule of its own, named after the declaration. Forms are built once
per (declaration, values of the constants rendered as numbers) and cached.

>>> import scanlang as sl
>>> d = sl.matrix_state("my_kaczmarz", decay="per_head", correction="delta", inputs={"g": "token", "eta": "token"},
...                     constants={"eps": 1e-6}, beta=lambda t: t.eta / (t.n2 + t.eps), log_decay=lambda t: t.g)
>>> form = delta_form(d, d.constants)
>>> form.rule.name, form.step, form.decay, form.eps
('kaczmarz', 'eta', 'g', 'eps')
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch

from . import backend as registry
from . import expr as E
from .delta import DECAY_INPUTS, HOOK_NAMES, RULES, STEP_INPUTS, DeltaRule
from .linear import MatrixState

DECAYS = ("none", "per_head")
CORRECTIONS = ("delta", "householder")   # one delta write per token, or n (a delta rule over T*n rows)
FORMS: dict = {}   # (declaration key, the constants rendered as numbers with their values) -> DeltaForm
# names a head parameter of the rule must not take (DeltaRule refuses them): the hooks' fields, and the names
# of the generated decay hooks; a declaration's per-head input with one of them is renamed
_TAKEN = STEP_INPUTS + DECAY_INPUTS + HOOK_NAMES


@dataclass(frozen=True)
class DeltaForm:
    """How one declaration runs on the delta kernels (module docstring).

    rule: the DeltaRule the kernels are generated from; step / decay: the declaration's per-token input
    passed as s / a (None: zeros, or the host's beta / g when host_beta / host_decay); params: its
    per-head inputs in the order of rule.head_params; eps: the constant passed as the kernels' eps; baked: the
    constants rendered into the rule as numbers, with their values."""

    rule: DeltaRule
    step: str | None
    decay: str | None
    params: tuple[str, ...]
    eps: str | None
    host_beta: bool
    host_decay: bool
    baked: tuple[tuple[str, float], ...]


def runs_on_delta(decl: MatrixState) -> bool:
    """Whether the delta backend's kernels run this structure: correction delta or n Householder steps (the
    interleaved stream, module docstring), decay none/per_head."""
    return decl.correction in CORRECTIONS and decl.decay in DECAYS


def default_backend(decl: MatrixState, device: torch.device, compute: torch.dtype, chunk_size: int, K: int,
                    V: int, chunk_sizes: tuple, max_dim: int) -> str:
    """The backend a call with backend=None runs on: the delta kernels ("triton", as `scanlang.backend.default`
    picks them: CUDA tensors, float32 compute) for structures and shapes they take, else "reference".

    >>> import scanlang as sl, torch
    >>> d = sl.matrix_state("dn", correction="delta", inputs={"beta": "token"}, beta=lambda t: t.beta)
    >>> [default_backend(d, torch.device(x), torch.float32, 32, 64, 64, (16, 32, 64), 256) for x in ("cpu", "cuda")]
    ['reference', 'triton']
    """
    if not runs_on_delta(decl) or chunk_size not in chunk_sizes or not (K <= max_dim and V <= max_dim):
        return "reference"
    return registry.default(device, compute, triton_dtypes=(torch.float32,))


def _split(decl: MatrixState, hook) -> tuple[list, list, list]:
    """(per-token inputs, per-head inputs, constants) a hook reads, in declaration order."""
    used = decl.used(hook)
    return ([n for n in used if decl.inputs.get(n) == "token"], [n for n in used if decl.inputs.get(n) == "head"],
            [n for n in used if n in decl.constants])


def _param_names(heads: list) -> dict:
    """Head-parameter names for the rule: the input's own, unless a field or the generated hooks have it (`_TAKEN`)."""
    names, used = {}, set()
    for h in heads:
        name = h
        while name in _TAKEN or name in used:
            name += "_"
        names[h] = name
        used.add(name)
    return names


def _vanishes(expr, tok: list) -> bool:
    """Whether the log-decay `expr` is 0 where its one per-token input `tok` is 0, for every value of the other
    symbols (the rows of the interleaved stream after a token's first take a = 0, module docstring)."""
    if len(tok) != 1:
        return False
    return sympy.simplify(sympy.sympify(expr).xreplace({E.symbol(tok[0]): sympy.S.Zero})) == 0


def _plan(decl: MatrixState) -> tuple:
    """The translation that depends on the declaration only: (step input, eps constant, beta's baked constants,
    host_beta, decay input, decay's per-head inputs, decay's constants, host_decay)."""
    tok, head, consts = _split(decl, decl.beta)
    host_beta = len(tok) > 1 or bool(head)
    step = None if host_beta or not tok else tok[0]
    eps = None if host_beta or not consts else consts[0]
    beta_baked = () if host_beta else tuple(consts[1:])
    if decl.decay == "none":
        return step, eps, beta_baked, host_beta, None, (), (), False
    tok, head, consts = _split(decl, decl.log_decay)
    host_decay = len(tok) > 1 or (decl.steps > 1 and not _vanishes(decl.log_decay.expr, tok))
    if host_decay:
        return step, eps, beta_baked, host_beta, None, (), (), True
    return step, eps, beta_baked, host_beta, (tok[0] if tok else None), tuple(head), tuple(consts), False


def delta_form(decl: MatrixState, constants: dict) -> DeltaForm:
    """The DeltaForm of `decl` (module docstring); `constants` are the call's values (the declaration's
    defaults overridden), of which those rendered as numbers key the cache."""
    if not isinstance(decl, MatrixState):
        raise TypeError(f"declaration: expected a MatrixState, got {type(decl).__name__}")
    if not runs_on_delta(decl):
        raise ValueError(f"matrix state {decl.name!r} (decay {decl.decay}, correction {decl.correction}, "
                         f"{decl.steps} step(s)) is not a structure the delta kernels run")
    step, eps, beta_baked, host_beta, decay, heads, decay_consts, host_decay = _plan(decl)
    baked = tuple((c, float(constants[c])) for c in beta_baked + decay_consts)
    key = (decl.key, baked)
    found = FORMS.get(key)
    if found is not None:
        return found
    sym, values = E.symbol, dict(baked)
    if host_beta:
        step_expr = sym("s")
    else:
        subs = {sym(c): E.constant(values[c]) for c in beta_baked}
        subs.update({sym(step): sym("s")} if step else {})
        subs.update({sym(eps): sym("eps")} if eps else {})
        step_expr = decl.beta.expr.xreplace(subs)
    names = _param_names(list(heads))
    if decl.decay == "none" or host_decay:
        decay_expr = sym("a")
    else:
        subs = {sym(c): E.constant(values[c]) for c in decay_consts}
        subs.update({sym(decay): sym("a")} if decay else {})
        subs.update({sym(h): sym(n) for h, n in names.items()})
        decay_expr = decl.log_decay.expr.xreplace(subs)
    params = tuple(names[h] for h in heads)
    rule = next((r for r in RULES.values() if r.head_params == params and r.step.expr == step_expr
                 and r.decay.expr == decay_expr), None)
    if rule is None:
        rule = DeltaRule(decl.name, step=lambda t: E.Traced(step_expr), decay=lambda t: E.Traced(decay_expr),
                         head_params=params)
    found = FORMS[key] = DeltaForm(rule, step, decay, heads, eps, host_beta, host_decay, baked)
    return found


def describe(form: DeltaForm) -> str:
    """One line: the rule and where each of its inputs comes from."""
    s = "beta from the host" if form.host_beta else f"s = {form.step or 0}"
    a = "g from the host" if form.host_decay else f"a = {form.decay or 0}"
    return f"delta rule {form.rule.name} (beta = {form.rule.step.expr}, g = {form.rule.decay.expr}); {s}, {a}"


__all__ = ["DeltaForm", "delta_form", "runs_on_delta", "default_backend", "describe"]
