"""Render the delta-rule kernels for one family member (`scanlang.delta.DeltaRule`) and chunk size.

    render_hooks(rule)          -> Triton source of step_hook, step_hook_grad, decay_hook, decay_hook_grad,
                                   printed from the rule's sympy expressions and derivatives
    render_prep(chunk_size)     -> the chunk preparation kernel, its merge of the C/16 row blocks of
                                   Tm = (I + A)^-1 unrolled
    kernel_source(rule, C)      -> the whole module: template.SOURCE with both slots filled
    load(rule, C)               -> the imported module, from a content-addressed file in the cache dir

Rendering is deterministic (sorted, CSE'd expressions; no ids), so two processes write the same bytes.
"""
from __future__ import annotations

import ast
import sys

import sympy

from scanlang import expr as E
from scanlang import settings
from scanlang.delta import DeltaRule

from ..triton import runtime
from . import template

BLOCK = 16
_LOADED: dict = {}


_STEPS = {  # sympy's step functions, printed as selects (Heaviside(0) = 1/2 as in sympy, sign(0) = 0)
    sympy.Heaviside: ("_hv", "tl.where({u} > 0, 1.0, tl.where({u} < 0, 0.0, 0.5))"),
    sympy.sign: ("_sg", "tl.where({u} > 0, 1.0, tl.where({u} < 0, -1.0, 0.0))"),
}


def _render(exprs: list, args: tuple[str, ...], tensors: tuple[str, ...] | None = None) -> tuple[list[str], list[str]]:
    """Lines and result expressions (CSE'd) of `exprs` over the symbols named `args`, of which `tensors`
    (default: the first) are per-token tensors and the rest scalars.

    Derivatives of max/abs contain Heaviside/sign, which the expression printer does not know: each is
    bound to a temporary computed by a select first."""
    per_token = {E.symbol(a) for a in (args[:1] if tensors is None else tensors)}
    scalar = [not (sympy.sympify(e).free_symbols & per_token) for e in exprs]
    names = {E.symbol(a): a for a in args}
    steps = sorted({atom for e in exprs for kind in _STEPS for atom in sympy.sympify(e).atoms(kind)},
                   key=sympy.default_sort_key)
    lines, subs = [], {}
    if steps:
        arg_lines, arg_outs = E.render([st.args[0] for st in steps], names, E.TRITON, temp_prefix="_u")
        lines += arg_lines
        for i, (st, u) in enumerate(zip(steps, arg_outs)):
            prefix, fmt = _STEPS[type(st)]
            sym = E.symbol(f"{prefix}{i}")
            lines.append(f"{sym.name} = {fmt.format(u=u)}")
            names[sym] = sym.name
            subs[st] = sym
    exprs = [sympy.sympify(e).xreplace(subs) for e in exprs]
    body, outs = E.render(exprs, names, E.TRITON, temp_prefix="_t")
    # a result of constants and scalars only (a number, eps, a per-head parameter) still has to be a tensor of
    # the first argument's shape
    outs = [f"tl.zeros_like({args[0]}) + {o}" if sc else o for sc, o in zip(scalar, outs)]
    return lines + body, outs


def _param_loads(rule: DeltaRule) -> list[str]:
    return [f"    {p} = tl.load(hp_ptr + {i} * H + h)" for i, p in enumerate(rule.head_params)]


def render_hooks(rule: DeltaRule) -> str:
    """step_hook, step_hook_grad, decay_hook and store_decay_grads as Triton source."""
    step, decay = rule.step, rule.decay
    out = []
    lines, outs = _render([step.expr], ("s", "n2", "eps"), tensors=("s", "n2"))
    out += ["@triton.jit", "def step_hook(s, n2, eps):", f'    """beta = {step.expr}"""']
    out += [f"    {ln}" for ln in lines] + [f"    return {outs[0]}", "", ""]
    lines, outs = _render([step.grads["s"], step.grads["n2"]], ("s", "n2", "eps"), tensors=("s", "n2"))
    out += ["@triton.jit", "def step_hook_grad(s, n2, eps):", '    """(d beta / d s, d beta / d n2)"""']
    out += [f"    {ln}" for ln in lines] + [f"    return {', '.join(outs)}", "", ""]
    inputs = ("a",) + rule.head_params
    lines, outs = _render([decay.expr], inputs)
    out += ["@triton.jit", "def decay_hook(a, hp_ptr, h, H):",
            f'    """g = {decay.expr}; per-head parameters {rule.head_params} from hp_ptr [P, H]"""']
    out += _param_loads(rule) + [f"    {ln}" for ln in lines] + [f"    return {outs[0]}", "", ""]
    lines, outs = _render([decay.grads[n] for n in inputs], inputs)
    out += ["@triton.jit", "def store_decay_grads(dg, a, hp_ptr, h, H, da_ptr, dhp_ptr, offs, TTH, mask):",
            '    """dL/da = dg dg/da per token; dL/d(parameter) per token into dhp_ptr [P, TT, H] (summed later)."""']
    out += _param_loads(rule) + [f"    {ln}" for ln in lines]
    out.append(f"    tl.store(da_ptr + offs, dg * ({outs[0]}), mask=mask)")
    for i, o in enumerate(outs[1:]):
        out.append(f"    tl.store(dhp_ptr + {i} * TTH + offs, dg * ({o}), mask=mask)")
    return "\n".join(out).rstrip() + "\n"


# exp(-200) underflows to 0 in float32 (below about -103.9), and 200 per reset keeps the cumsum's rounding
# (|G| * 2^-24) near 1e-5 relative in the decays
LOG_DECAY_FLOOR = -200.0


def render_prep(chunk_size: int) -> str:
    """The prep kernel for C = chunk_size.

    Tm = (I + A)^-1 with A = Ad + Ao (Ad: the 16x16 diagonal blocks, Ao: strictly below them). With
    Td = (I + Ad)^-1 (`inv_unit_lower_blocks`), I + A = (I + Ad)(I - N) for N = -Td Ao, strictly block-lower
    with N^(C/16) = 0, so Tm = (I - N)^-1 Td = (I + N)(I + N^2)(I + N^4)... Td, the product unrolled here
    (log2(C/16) factors), applied right to left as Tm <- Tm + N^(2^j) Tm: every term added is strictly
    block-lower, so the diagonal blocks of Tm are exactly Td, and only the powers and Tm stay live."""
    nb = chunk_size // BLOCK
    L = []
    a = L.append
    a("@triton.jit")
    a("def delta_prep(q_ptr, k_ptr, v_ptr, a_ptr, hp_ptr, s_ptr, eps, chunk_tok, chunk_len, w_ptr, u_ptr, tm_ptr,")
    a("               gcum_ptr, beta_ptr, mq_ptr, nonfinite_ptr,")
    a("               H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,")
    a("               BKS: tl.constexpr, PREC: tl.constexpr, IN_PREC: tl.constexpr, UPCAST: tl.constexpr):")
    a("    \"\"\"gcum, beta, Tm = (I + A)^-1, w, u and the output's in-chunk matrix (Q K^T * Dec, causal) for one chunk")
    a(f"    of {chunk_size} tokens ({nb} blocks of {BLOCK} rows), and the chunk's first row whose key, step, decay")
    a('    or value is not finite (C if none; a decay of -inf is a reset), which the later kernels read."""')
    a("    eps = tl.cast(eps, tl.float32)   # torch.compile types a Python float as fp64")
    a("    c = tl.program_id(0)")
    a("    h = tl.program_id(1)")
    a("    rows = tl.arange(0, C)")
    a("    kk = tl.arange(0, BK)")
    a("    t0, nv, tok, ok = chunk_tokens(chunk_tok, chunk_len, c, rows)")
    a("    km = ok[:, None] & (kk[None, :] < K)")
    a("    k = tl.load(k_ptr + (tok[:, None] * H + h) * K + kk[None, :], mask=km, other=0.0)")
    a("    a = tl.load(a_ptr + tok * H + h, mask=ok, other=0.0).to(tl.float32)")
    # log-decays floored at LOG_DECAY_FLOOR: exp of it is 0 in float32 (a reset stays exact) and G stays finite,
    # so G_i - G_j is never -inf - (-inf) for g = -inf (a hard reset)
    a("    g = decay_hook(a, hp_ptr, h, H)")
    a("    # the first row whose decay is NaN or +inf (not a reset: -inf), before the floor hides a NaN (on the GPU)")
    a("    first = tl.min(tl.where(ok & ~(g < float(\"inf\")), rows, C))")
    a(f"    G = tl.cumsum(tl.where(ok, tl.maximum(g, {LOG_DECAY_FLOOR}), 0.0), 0)")
    a("    s = tl.load(s_ptr + tok * H + h, mask=ok, other=0.0).to(tl.float32)")
    a("    tl.store(gcum_ptr + tok * H + h, G, mask=ok)")
    a("    # A_ij = beta_i (k_i . k_j) Dec_ij, strictly lower; Dec_ij = exp(G_i - G_j) for j <= i")
    a("    causal = rows[:, None] >= rows[None, :]")
    a("    strict = rows[:, None] > rows[None, :]")
    a("    Dec = tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0))")
    a("    # the state pass's (Q K^T * Dec) over rows < nv, in the input dtype as its product reads it; every element")
    a("    # (before K K^T: 168 registers, against 207 with A live across it; Triton 3.6, K = 128)")
    a("    q = tl.load(q_ptr + (tok[:, None] * H + h) * K + kk[None, :], mask=km, other=0.0)")
    a("    Mq = tl.where(causal & ok[:, None], mm(q, tl.trans(k), IN_PREC, UPCAST) * Dec, 0.0)")
    a("    tl.store(mq_ptr + ((c * H + h) * C + rows[:, None]).to(tl.int64) * C + rows[None, :],")
    a("             rnd(Mq, mq_ptr.dtype.element_ty, UPCAST))")
    a("    # ||k_i||^2 (fp32) read off the diagonal of K K^T, the product A needs anyway")
    a("    KK = mm(k, tl.trans(k), IN_PREC, UPCAST)")
    a("    n2 = tl.sum(tl.where(rows[:, None] == rows[None, :], KK, 0.0), 1)")
    a("    beta, _ = step_beta(s, n2, eps)")
    a("    tl.store(beta_ptr + tok * H + h, beta, mask=ok)")
    a("    A = tl.where(strict, beta[:, None] * KK * Dec, 0.0)")
    a("    # and the first whose decay, key (||k||^2) or step is not: Tm is formed with A's rows from it on as 0, then is")
    a("    # NaN there (row i of (I + A)^-1 depends on A's rows <= i only; the products below would carry 0 * NaN into")
    a("    # the earlier rows)")
    a("    first = tl.minimum(first, tl.min(tl.where(ok & ~(finite(n2) & finite(beta) & finite(G)), rows, C)))")
    a("    nonfinite = first < nv")
    a("    if nonfinite:")
    a("        A = tl.where(rows[:, None] < first, A, 0.0)")
    a("    # diagonal blocks in fp32 (\"ieee\") for fp32 inputs, on tensor cores at about fp32's accuracy otherwise")
    a("    if PREC == \"ieee\":")
    a("        Tm = inv_unit_lower_blocks(A, C, \"ieee\")")
    a("    else:")
    a("        Tm = inv_unit_lower_blocks(A, C, \"tf32x3\")")
    if nb > 1:
        a(f"    below = (rows[:, None] // {BLOCK}) > (rows[None, :] // {BLOCK})")
        powers = (nb - 1).bit_length()             # N, N^2, ..., N^(2^(powers-1)); N^nb = 0
        a("    N0 = -mm(Tm, tl.where(below, A, 0.0), PREC, UPCAST)")
        for j in range(1, powers):
            a(f"    N{j} = mm(N{j - 1}, N{j - 1}, PREC, UPCAST)")
        for j in reversed(range(powers)):
            a(f"    Tm = Tm + mm(N{j}, Tm, PREC, UPCAST)")
    a("    if nonfinite:")
    a("        Tm = tl.where(rows[:, None] < first, Tm, float(\"nan\"))")
    a("    tl.store(tm_ptr + ((c * H + h) * C + rows[:, None]).to(tl.int64) * C + rows[None, :], Tm)")
    a("    first_v = wy_factors(k_ptr, v_ptr, w_ptr, u_ptr, Tm, beta, beta * tl.exp(G), tok, ok, h, H, K, V, BKS, BV,")
    a("                         PREC, UPCAST, nonfinite, C, True)")
    a("    tl.store(nonfinite_ptr + c * H + h, tl.minimum(first, first_v))")
    return "\n".join(L)


def _fill(src: str, slot: str, text: str) -> str:
    marker = f"# @slot {slot}"
    if src.count(marker) != 1:
        raise RuntimeError(f"template has {src.count(marker)} '{marker}' slots, expected 1")
    return src.replace(marker, text)


def kernel_source(rule: DeltaRule, chunk_size: int) -> str:
    """The complete generated module for `rule` at `chunk_size`; parses as Python (checked)."""
    if chunk_size % BLOCK or chunk_size < BLOCK:
        raise ValueError(f"chunk_size must be a positive multiple of {BLOCK}, got {chunk_size}")
    src = _fill(template.SOURCE, "hooks", f"# delta rule '{rule.name}': {rule!r}\n\n" + render_hooks(rule))
    src = _fill(src, "prep", render_prep(chunk_size))
    ast.parse(src)
    return src


def load(rule: DeltaRule, chunk_size: int):
    """Import the generated module through the shared content-addressed kernel cache."""
    cache_key = (rule.key, chunk_size)
    if cache_key not in _LOADED:
        src = kernel_source(rule, chunk_size)
        if settings.debug():
            print(f"# scanlang: delta-rule kernels for {rule.name}, C={chunk_size}\n{src}", file=sys.stderr)
        _LOADED[cache_key] = runtime.load(src)
    return _LOADED[cache_key]
