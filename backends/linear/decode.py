"""The recurrent (token-by-token) forward kernel of a matrix-state declaration: decoding and short inputs.

Every member (docs/spec/linear.md) is the token recurrence, decay first, read after write:

    S <- D_t S                                   D_t = I | exp(g_t) (per head) | diag(exp(g_t)) (per key)
    plain:       S <- S + k_t v_t^T
    delta:       S <- S + beta_t k_t (v_t - S^T k_t)^T
    n steps:     the delta write once per sub-row j = 0 .. n-1 (k, v, beta rows t*n + j), in order
    o_t = scale S^T q_t                          (once per token, after its writes)

with g_t = log_decay(inputs) and beta = beta(inputs, n2 = ||k||^2) evaluated in the kernel from the
declared inputs (their sympy expressions through the one expression printer). One program per
(sequence, head, value block) keeps its [BK, BV] slice of the state in registers and walks the
sequence's tokens: no chunk, no pairwise decay, so no exponent but g_t itself (<= 0) is ever taken,
and a strong decay (g = -20 per token) or a zero key stays finite. A zero key's n2 is taken as 1 for the
hook and its beta as 0, as the reference does (a zero key writes nothing).

The structure decides the statements: without decay there is no hook and no multiply, per head the
decay is one scalar, per key a [BK] column (0 past K, so the padding rows stay 0); a plain write has
no beta and no read of S before the write; n Householder steps are a static loop of n delta writes.

Kernel (one module per declaration; K, V, BK, BV, HAS_H0, STORE_FINAL are constexprs):
    {name}_decode(q, k, v, <hook inputs>, h0, o, ht, cu, <constants>, scale, H)
      q [TT, H, K], k [TT*n, H, K], v [TT*n, H, V] (the packed stream), cu [N + 1] the token offsets of
      the N sequences; o [TT, H, V] and ht [N, H, K, V] in fp32. Forward only (no gradients).
"""
from __future__ import annotations

from scanlang import expr as E
from scanlang.linear import KEY_NORM, MatrixState

from ..triton.kernel import common
from ..triton.kernel import ir as K
from ..triton.kernel.printer import render as print_module

STATE_MASK = "okk[:, None] & okv[None, :]"


def _load(target: str, ptr: str, off: str, mask: str | None = None) -> K.Assign:
    masked = f", mask={mask}, other=0.0" if mask else ""
    return K.assign(target, f"tl.load({ptr} + {off}{masked}).to(tl.float32)")


def _state_off(slot: str) -> str:
    return f"(({slot}) * H + h).to(tl.int64) * K * V + kk[:, None] * V + vv[None, :]"


def hook_inputs(decl: MatrixState) -> list[str]:
    """The declared inputs either hook reads, in declaration order: the kernel's input pointers."""
    used = set(decl.used(decl.beta)) | set(decl.used(decl.log_decay))
    return [n for n in decl.inputs if n in used]


def _names(decl: MatrixState) -> dict:
    names = {E.symbol(n): f"x_{n}" for n in decl.inputs}
    names |= {E.symbol(c): f"c_{c}" for c in decl.constants}
    names[E.symbol(KEY_NORM)] = "n2_safe"
    return names


def _load_inputs(decl: MatrixState, names, row: str, per_key: bool) -> tuple:
    """x_<input> for the per-token inputs among `names` at token row `row` (a scalar; [BK] for per-key
    inputs, 0 past K). Per-head parameters are loaded once, before the token loop (`_head_inputs`)."""
    out = []
    for n in (n for n in names if n in decl.inputs and decl.inputs[n] != "head"):   # constants: c_<name>
        kind = decl.inputs[n]
        if kind == "token":
            out.append(_load(f"x_{n}", f"{n}_ptr", f"{row} * H + h"))
        else:
            out.append(_load(f"x_{n}", f"{n}_ptr", f"({row} * H + h) * K + kk", "okk"))
    return tuple(out)


def _decay(decl: MatrixState) -> tuple:
    """S <- D_t S, the log-decay from the hook at token t."""
    if decl.decay == "none":
        return ()
    per_key = decl.decay == "per_key"
    like = "zero_k" if per_key else "zero"
    out = [*_load_inputs(decl, decl.used(decl.log_decay), "t", per_key),
           K.Comment(f"log_decay = {E.docstring_text(str(decl.log_decay.expr))}"),
           *common.assign(["g"], [decl.log_decay.expr], _names(decl), "_g", shape_like=like)]
    if per_key:   # a column of exp(g_k), 1 past K (those state rows are 0)
        out += [K.assign("g", "tl.where(okk, g + zero_k, 0.0)"), K.assign("S", "S * tl.exp(g)[:, None]")]
    else:
        out.append(K.assign("S", "S * tl.exp(g)"))
    return tuple(out)


def _write(decl: MatrixState, row: str, loaded: set) -> tuple:
    """One write at sub-row `row` of k and v: plain, or the delta write with beta from the hook."""
    out = [_load("b_k", "k_ptr", f"({row} * H + h) * K + kk", "okk"),
           _load("b_v", "v_ptr", f"({row} * H + h) * V + vv", "okv")]
    if decl.correction == "plain":
        return tuple(out) + (K.assign("S", "S + b_k[:, None] * b_v[None, :]"),)
    beta_row = {n: row if decl.rows.get(n) == "sub" else "t" for n in decl.used(decl.beta) if n in decl.inputs}
    fresh = [n for n in beta_row if n not in loaded or beta_row[n] != "t"]
    for n in fresh:
        out += _load_inputs(decl, [n], beta_row[n], False)
    if decl.uses_key_norm:
        out += [K.assign("n2", "tl.sum(b_k * b_k, 0)"), K.assign("n2_safe", "tl.where(n2 > 0, n2, 1.0)")]
    out += [K.Comment(f"beta = {E.docstring_text(str(decl.beta.expr))}"),
            *common.assign(["beta"], [decl.beta.expr], _names(decl), "_b", shape_like="zero")]
    if decl.uses_key_norm:   # a zero key writes nothing whatever beta is
        out.append(K.assign("beta", "tl.where(n2 > 0, beta, 0.0)"))
    out += [K.assign("e", "b_v - tl.sum(S * b_k[:, None], 0)"),
            K.assign("S", "S + (beta * b_k)[:, None] * e[None, :]")]
    return tuple(out)


def _head_inputs(decl: MatrixState) -> tuple:
    """x_<input> = the head's entry of each per-head parameter ([H]) a hook reads, once per program."""
    return tuple(_load(f"x_{n}", f"{n}_ptr", "h") for n in hook_inputs(decl) if decl.inputs[n] == "head")


def _zeros(decl: MatrixState) -> tuple:
    """zero_k ([BK]) for a per-key decay, zero (a scalar) for a hook that is a number: what the hooks'
    statements broadcast against."""
    constant = [h for h in (decl.beta, decl.log_decay) if h is not None and not h.expr.free_symbols]
    out = []
    if decl.decay == "per_key" or constant:
        out.append(K.assign("zero_k", "tl.zeros([BK], dtype=tl.float32)"))
    if constant:
        out.append(K.assign("zero", "tl.sum(zero_k, 0)"))
    return tuple(out)


def decode_kernel(decl: MatrixState) -> K.Kernel:
    n = decl.steps
    ins = [f"{x}_ptr" for x in hook_inputs(decl)]
    consts = [f"c_{c}" for c in decl.constants]
    params = tuple(K.Param(p) for p in ["q_ptr", "k_ptr", "v_ptr", *ins, "h0_ptr", "o_ptr", "ht_ptr", "cu_ptr",
                                        *consts, "scale", "H"]) + tuple(
        K.Param(p, constexpr=True) for p in ("K", "V", "BK", "BV", "HAS_H0", "STORE_FINAL"))
    loaded = set(decl.used(decl.log_decay)) if decl.decay != "none" else set()
    if n == 1:
        writes = _write(decl, "t", loaded)
    else:
        writes = (K.For("j", K.expr("0"), K.expr(str(n)), (K.assign("r", f"t * {n} + j"), *_write(decl, "r", loaded)),
                        static=True),)
    token = (*_decay(decl), *writes,
             _load("b_q", "q_ptr", "(t * H + h) * K + kk", "okk"),
             K.Store(K.expr("o_ptr + (t * H + h) * V + vv"), K.expr("scale * tl.sum(S * b_q[:, None], 0)"),
                     K.expr("okv")))
    text = (f"from matrix state {E.docstring_text(decl.name)}: decay {decl.decay}, correction {decl.correction}"
            + (f", {n} steps" if n > 1 else ""))
    body = (K.assign("s", "tl.program_id(0)"), K.assign("h", "tl.program_id(1)"), K.assign("vb", "tl.program_id(2)"),
            K.assign("kk", "tl.arange(0, BK)"), K.assign("okk", "kk < K"),
            K.assign("vv", "vb * BV + tl.arange(0, BV)"), K.assign("okv", "vv < V"),
            *_zeros(decl), K.Comment(text), *_head_inputs(decl),
            K.If(K.expr("HAS_H0"), (_load("S", "h0_ptr", _state_off("s"), STATE_MASK),),
                 (K.assign("S", "tl.zeros([BK, BV], dtype=tl.float32)"),)),
            K.assign("bos", "tl.load(cu_ptr + s).to(tl.int64)"), K.assign("eos", "tl.load(cu_ptr + s + 1).to(tl.int64)"),
            K.For("t", K.expr("bos"), K.expr("eos"), token),
            K.If(K.expr("STORE_FINAL"), (K.Store(K.expr(f"ht_ptr + {_state_off('s')}"), K.expr("S"),
                                                 K.expr(STATE_MASK)),)))
    return K.Kernel(f"{decl.name}_decode", params, body,
                    doc="Tokens of sequence s in order, the state slice in registers: outputs and the final state.")


def module(decl: MatrixState) -> K.Module:
    if not isinstance(decl, MatrixState):
        raise TypeError(f"declaration: expected a MatrixState, got {type(decl).__name__}")
    doc = (f"Generated by scanlang from matrix state {E.docstring_text(decl.name)} (declaration {decl.key}): "
           f"the recurrent decode kernel (backends/linear/decode.py). Do not edit.")
    return K.Module(doc, (decode_kernel(decl),))


def render(decl: MatrixState) -> str:
    """The module's source text (deterministic)."""
    return print_module(module(decl))
