"""The per-key delta-rule matrix-state kernels (KDA's structure), rendered on the kernel IR from a
`scanlang.MatrixState` with decay "per_key", correction "delta" and one step.

Token recurrence (docs/spec/linear.md): S_t = diag(e^(g_t)) S_{t-1}, then S_t <- S_t + beta_t k_t (v_t -
S_t^T k_t)^T, o_t = scale S_t^T q_t, with g_t = log_decay(inputs) and beta_t = beta(inputs, n2 = ||k_t||^2).
Per chunk of C rows with start state S0 and the chunk-local cumulative log-decay G (the WY / UT form of
backends/delta/template.py, with the pairwise decay per key column as in kernels.py):

    A_ij  = beta_i sum_k k_ik k_jk e^(G_ik - G_jk)  (i > j, else 0),      Tm = (I + A)^-1
    w     = Tm diag(beta) (K * e^G),   u = Tm diag(beta) V,   U = u - w S0 = Tm diag(beta) (V - (K * e^G) S0)
    O     = scale ((Q * e^G) S0 + Aqk U),   Aqk_ij = sum_k q_ik k_jk e^(G_ik - G_jk)  (i >= j, else 0)
    S_end = diag(e^(G_L)) S0 + (K * e^(G_L - G))^T U

Every exponent is <= 0 for log-decays <= 0 (kernels.py's tree of the pairwise products), so
g = -20 per token stays finite. The backward, per chunk, with R = diag(beta) (V - (K * e^G) S0), U = Tm R:

    dU    = scale Aqk^T dO + (K * e^(G_L - G)) dS_end          dS0 = e^(G_L) dS_end + scale (Q * e^G)^T dO - w^T dU
    dR    = Tm^T dU:  dV = diag(beta) dR,  dbeta += rowsum(dR * (V - (K * e^G) S0)),  d(K * e^G) = -diag(beta) dR S0^T
    dTm   = dU R^T:   dA = -Tm^T dTm Tm^T (i > j),  dbeta += rowsum(dA * P),  dP = diag(beta) dA  (A = diag(beta) P)

then the pairwise gradients of Aqk and P (kernels.py's `pairwise_grads`, whose decay part sums the pairs j < t <= i
that straddle t rather than cancelling diagonal terms), dg_t = sum_(i >= t) (q dq_S0 + (K e^G) d(K e^G))_i + the
pairs + e^(G_L) rowsum(S0 dS_end) + the writes j < t into S_end, and the hook inputs' gradients through the hooks'
sympy derivatives (beta's n2 adds dbeta dbeta/dn2 2 k to dk). A zero key's beta is 0 where the hook is not finite
for it (0/0 at eps = 0), as on the host (recipes/linear/family.py `_host_beta`).

Kernels (one module per declaration; C, K, V, BK, BV, BS are constexprs), fla's organisation of the work:
    {name}_decay_cumsum  per (chunk, head): G, before the prep kernel (kernels.py's)
    {name}_prep      per (chunk, head): beta, Tm (the blocked inverse, `inverse_unit_lower`),
                     w, Aqk, P and u (stored; the backward reads them too); P and Aqk summed over key blocks of
                     BK = tuning.linear_delta_key_block columns, so that a few [C, BK] tiles are alive at a time
                     (over all 128 keys at once it took 22.7 ms of a 27.5 ms forward on an H100; in key blocks
                     with the pairwise tree 4.1 ms: BENCHMARKS_HISTORY.md "Session 19")
    {name}_fwd       the state pass, per (sequence, head, value block), chunks in order, two products a chunk:
                     U = u - w S0 and the state update; it keeps U (STORE_U) and the state entering every chunk
                     (STORE_H: the forward's in the input dtype, the backward's recomputation in fp32)
    {name}_fwd_o     per (chunk, head, value block), every chunk at once: the outputs from U and the states
    {name}_bwd_dh    per (sequence, head, value block), chunks in reverse: dS_end of every chunk, d(initial state)
    {name}_bwd_v     per (chunk, head), every key (X0 and dU sum over them): dv, U, dAqk, dP = diag(beta) dA,
                     dbeta and beta's hook inputs' gradients
    {name}_bwd       per (chunk, head, key block of BK columns; every product here is per key column): dq, dk,
                     dg and the log-decay's hook inputs' gradients, from U, dv, dAqk and dP
The backward is two per-chunk kernels, not one, so that no program holds every [C, K] tile at once: the single
kernel spilled 17 KB a thread in bf16 and asked for 256 KB of shared memory in fp32, over an SM's 227 KB
(offline sm_90, Triton 3.6; BENCHMARKS_HISTORY.md "Session 18"). The forward's outputs left the serial state
pass for the same reason fla's did: on an H100 that pass, with u and the outputs in it, took 3.6 ms a call at
B8 T4096 H16 K = V = 128 against fla's 0.3 ms state pass.
A non-finite key, log-decay, beta or value in row r reaches rows >= r only in the forward: the causal products
(Tm from A, w, u, Aqk U) take that chunk's rows from the first such row on as 0 and only rows from there on use
the raw products (kernels.py's rule). The backward does not guard: a non-finite input may make earlier tokens'
gradients NaN.
"""
from __future__ import annotations

from scanlang import expr as E
from scanlang.linear import KEY_NORM, MatrixState

from ..delta.parts import inv_unit_lower_blocks
from ..triton.kernel import common
from ..triton.kernel import ir as K
from ..triton.kernel.printer import render as print_module
from .kernels import (INF, QK_MASK, QK_OFF, S_MASK, SHAPE_CONSTS, V_MASK, V_OFF, _axes, _chunk, _decay, _hook_grads,
                      _key_block, _load_hook_inputs, _origin_comments, _params, cumsum_kernel, dot, helper_kernels, load,
                      per_key_G, reverse_state_pass, state_off)

CC_OFF = "(c * H + h).to(tl.int64) * C * C + rows[:, None] * C + cols"
TOK_OFF = "(tok + rows) * H + h"
STRICT = "rows[:, None] > cols"
# what the prep kernel stores: beta, Tm, Aqk, w, P, u
WY = ["wy_beta_ptr", "wy_tm_ptr", "wy_aqk_ptr", "wy_w_ptr", "wy_p_ptr", "wy_u_ptr"]


def dot32(x: str, y: str) -> str:
    """x @ y of fp32 operands (Tm, w, U and their gradients): no rounding to the input dtype."""
    return f"mm({x}, {y}, tl.float32, PREC, UPCAST)"


def supports(decl: MatrixState) -> bool:
    """Whether these kernels run `decl`: per-key decay, the delta correction, one step."""
    return decl.decay == "per_key" and decl.correction == "delta" and decl.steps == 1


def beta_inputs(decl: MatrixState) -> list[str]:
    """The declared inputs beta's hook reads, in declaration order (the prep kernel's input pointers)."""
    used = set(decl.used(decl.beta))
    return [n for n in decl.inputs if n in used]


def hook_inputs(decl: MatrixState) -> list[str]:
    """The declared inputs either hook reads, in declaration order (the kernels' input pointers)."""
    used = set(decl.used(decl.beta)) | set(decl.used(decl.log_decay))
    return [n for n in decl.inputs if n in used]


def _beta_names(decl: MatrixState, n2: str) -> dict:
    names = {E.symbol(n): f"y_{n}" for n in decl.inputs}
    names |= {E.symbol(c): f"c_{c}" for c in decl.constants}
    names[E.symbol(KEY_NORM)] = n2
    return names


def _beta(decl: MatrixState, n2_formed: bool = False) -> tuple:
    """beta [C] from the hook (0 past the chunk's end, and for a zero key where the hook is not finite); n2,
    the key's squared norm, from b_k unless `n2_formed` (the prep kernel sums it over its key blocks)."""
    out = [K.assign("zero_c", "tl.zeros([C], dtype=tl.float32)")]
    for n in (n for n in decl.used(decl.beta) if n in decl.inputs):
        if decl.inputs[n] == "head":
            out.append(K.assign(f"y_{n}", f"tl.load({n}_ptr + h).to(tl.float32)"))
        else:
            out.append(load(f"y_{n}", f"{n}_ptr", TOK_OFF, "ok"))
    out.append(K.Comment(f"beta = {E.docstring_text(str(decl.beta.expr))}"))
    if decl.uses_key_norm:
        out += [*(() if n2_formed else (K.assign("n2", f"tl.sum(tl.where({QK_MASK}, b_k * b_k, 0.0), 1)"),)),
                *common.assign(["beta0"], [decl.beta.expr], _beta_names(decl, "n2"), "_b0", shape_like="zero_c"),
                K.assign("dead", f"(n2 == 0) & ~(tl.abs(beta0) < {INF})"), K.assign("n2_safe", "tl.where(dead, 1.0, n2)"),
                *common.assign(["beta"], [decl.beta.expr], _beta_names(decl, "n2_safe"), "_b", shape_like="zero_c"),
                K.assign("beta", "tl.where(ok & ~dead, beta, 0.0)")]
    else:
        out += [*common.assign(["beta"], [decl.beta.expr], _beta_names(decl, "n2"), "_b", shape_like="zero_c"),
                K.assign("beta", "tl.where(ok, beta, 0.0)")]
    return tuple(out)


def _non_finite_kg() -> str:
    """[C]: how many of the row's key and log-decay entries (b_k, b_G) are not finite."""
    return f"tl.sum(tl.where((tl.abs(b_k) < {INF}) & (tl.abs(b_G) < {INF}), 0, 1), 1)"


def _first_bad(with_v: bool, non_finite_kg: str = "") -> tuple:
    """first_bad: the chunk's first row with a non-finite key, log-decay, beta (or value); C if none.
    `non_finite_kg`: the count of non-finite key and log-decay entries per row, if summed already."""
    bad = f"({non_finite_kg or _non_finite_kg()} > 0) | ~(tl.abs(beta) < {INF})"
    if with_v:
        bad += f" | (tl.sum(tl.where(tl.abs(b_v) < {INF}, 0, 1), 1) > 0)"
    return (K.assign("bad", f"({bad}) & ok"), K.assign("first_bad", "tl.min(tl.where(bad, rows, C), 0)"))


def _causal_dot(target: str, m: str, x: str, first: str = "first_bad") -> tuple:
    """target = m @ x for a lower-triangular m, rows of x from row `first` on kept from earlier rows."""
    return (K.assign(target, dot32(m, f"tl.where(rows[:, None] < {first}, {x}, 0.0)")),
            K.If(K.expr(f"{first} < n_rows"), (
                K.assign(target, f"tl.where(rows[:, None] < {first}, {target}, {dot32(m, x)})"),)))


def _pairwise_kk_qk() -> tuple:
    """P and Aqk (i >= j) of key block kk added (kernels.py `pairwise_kernels`, loading the rows they broadcast:
    G is in memory, from `{name}_decay_cumsum`)."""
    rows = "k_ptr, G_ptr, tok, h, H, kk, okk, n_rows, G_last, K, C, BS, BK, PREC, UPCAST"
    return (K.assign("P", f"P + pairwise_qk(b_k, b_k, b_G, {rows})"),
            K.assign("Aqk", f"Aqk + pairwise_qk(b_q, b_k, b_G, {rows})"))


def _load_cc(target: str, ptr: str) -> K.Assign:
    return K.assign(target, f"tl.load({ptr} + {CC_OFF})")


def inverse_kernel() -> K.Kernel:
    """`inverse_unit_lower(A, C, PRECISION)`: (I + A)^-1 for a strictly lower [C, C] A in fp32 products."""
    params = (K.Param("A"), K.Param("C", constexpr=True), K.Param("PRECISION", constexpr=True))
    return K.Kernel("inverse_unit_lower", params, (
        K.assign("rows", "tl.arange(0, C)"),
        K.assign("Tm", "inv_unit_lower_blocks(A, C, PRECISION)"),
        K.assign("N", "-tl.dot(Tm, tl.where((rows[:, None] // 16) > (rows[None, :] // 16), A, 0.0), "
                      "input_precision=PRECISION)"),
        K.For("j", None, K.expr("8"), (K.If(K.expr("(C // 16) >> j > 1"), (
            K.assign("Tm", "Tm + tl.dot(N, Tm, input_precision=PRECISION)"),
            K.assign("N", "tl.dot(N, N, input_precision=PRECISION)"))),), static=True),
        K.Return((K.expr("Tm"),))),
        doc="(I + A)^-1 for a strictly lower [C, C] A (C / 16 <= 256 blocks of 16 rows): with Ad the 16x16 diagonal "
            "blocks, Ao the rest and Td = (I + Ad)^-1 (inv_unit_lower_blocks), I + A = (I + Ad)(I - N) for N = -Td Ao, "
            "strictly block-lower, N^(C/16) = 0, so (I + A)^-1 = (I + N)(I + N^2)(I + N^4)... Td: log2(C/16) steps of "
            "two [C, C] products (the factors commute), in place of C dependent row steps. PRECISION: 'ieee' (FMA) or "
            "'tf32x3' (tensor cores, about fp32's accuracy).")


def _key_block_G() -> tuple:
    """Key block kb (BK columns): kk, okk, b_k, and b_G, G_last as kernels.py's `_decay` leaves them."""
    return (K.assign("kk", "kb * BK + tl.arange(0, BK)"), K.assign("okk", "kk < K"),
            load("b_k", "k_ptr", QK_OFF, QK_MASK), *per_key_G())


def prep_kernel(decl: MatrixState) -> K.Kernel:
    ins = [f"{n}_ptr" for n in beta_inputs(decl)]
    consts = [f"c_{c}" for c in decl.constants]
    params = _params(["q_ptr", "k_ptr", "v_ptr", *ins, "G_ptr", *WY, "chunk_tok_ptr", "chunk_len_ptr", *consts, "H"],
                     ("K", "V", "BK", "BV", "C", "BS", "PREC", "UPCAST"))
    sums = (K.assign("P", "tl.zeros([C, C], dtype=tl.float32)"), K.assign("Aqk", "tl.zeros([C, C], dtype=tl.float32)"),
            K.assign("n2", "tl.zeros([C], dtype=tl.float32)"), K.assign("non_finite", "tl.zeros([C], dtype=tl.int32)"))
    products = (*_key_block_G(), load("b_q", "q_ptr", QK_OFF, QK_MASK), *_pairwise_kk_qk(),
                K.assign("n2", f"n2 + tl.sum(tl.where({QK_MASK}, b_k * b_k, 0.0), 1)"),
                K.assign("non_finite", f"non_finite + {_non_finite_kg()}"))
    w_block = (*_key_block_G(), *_causal_dot("w", "Tm", "beta[:, None] * b_k * tl.exp(b_G)"),
               K.Store(K.expr(f"wy_w_ptr + {QK_OFF}"), K.expr("w"), K.expr(QK_MASK)))
    vloop = (K.assign("vv", "vb * BV + tl.arange(0, BV)"), K.assign("okv", "vv < V"), load("b_v", "v_ptr", V_OFF, V_MASK),
             K.assign("bad_v", f"(tl.sum(tl.where(tl.abs(b_v) < {INF}, 0, 1), 1) > 0) & ok"),
             K.assign("first_v", "tl.minimum(first_bad, tl.min(tl.where(bad_v, rows, C), 0))"),
             *_causal_dot("u", "Tm", "beta[:, None] * b_v", "first_v"),
             K.Store(K.expr(f"wy_u_ptr + {V_OFF}"), K.expr("u"), K.expr(V_MASK)))
    body = (K.assign("c", "tl.program_id(0)"), K.assign("h", "tl.program_id(1)"), *_axes(False),
            K.assign("cols", "tl.arange(0, C)[None, :]"), *_origin_comments(decl), *_chunk(),
            K.Comment("P and Aqk sum over the keys: key blocks of BK columns hold a few [C, BK] tiles at a time"),
            *sums, K.For("kb", K.expr("0"), K.expr("tl.cdiv(K, BK)"), products),
            K.assign("P", f"tl.where({STRICT}, P, 0.0)"),
            *_beta(decl, n2_formed=True),
            K.Store(K.expr(f"wy_beta_ptr + {TOK_OFF}"), K.expr("beta"), K.expr("ok")),
            *_first_bad(False, "non_finite"),
            K.Store(K.expr(f"wy_p_ptr + {CC_OFF}"), K.expr("P"), None),
            K.Comment("Tm = (I + A)^-1 (inverse_unit_lower), A's rows from the first non-finite one on as 0, Tm's NaN"),
            K.Comment("there (row i of the inverse depends on A's rows <= i only; the products would carry 0 * NaN up)"),
            K.assign("A", f"tl.where(({STRICT}) & (rows[:, None] < first_bad), beta[:, None] * P, 0.0)"),
            K.If(K.expr("PREC == 'ieee'"), (K.assign("Tm", "inverse_unit_lower(A, C, 'ieee')"),),
                 (K.assign("Tm", "inverse_unit_lower(A, C, 'tf32x3')"),)),
            K.assign("Tm", "tl.where(rows[:, None] < first_bad, Tm, float('nan'))"),
            K.Store(K.expr(f"wy_tm_ptr + {CC_OFF}"), K.expr("Tm"), None),
            K.Store(K.expr(f"wy_aqk_ptr + {CC_OFF}"), K.expr("Aqk"), None),
            K.Comment("w = Tm diag(beta) (K * e^G), a key block at a time"),
            K.For("kb", K.expr("0"), K.expr("tl.cdiv(K, BK)"), w_block),
            K.Comment("u = Tm diag(beta) V, rows from the first non-finite one on (values included) kept from earlier rows"),
            K.For("vb", K.expr("0"), K.expr("tl.cdiv(V, BV)"), vloop))
    return K.Kernel(f"{decl.name}_prep", params, body,
                    doc="Chunk c, G as `{name}_decay_cumsum` stored it: beta, Tm = (I + A)^-1, w, Aqk, P (A = diag(beta) P, "
                        "for the backward's dbeta) and u = Tm diag(beta) V.")


def _chunk_loads() -> tuple:
    """q, k, G (and what kernels.py's `_decay` forms of them), beta, Aqk, w and dO of chunk c (`{name}_bwd_dh`)."""
    return (load("b_q", "q_ptr", QK_OFF, QK_MASK), load("b_k", "k_ptr", QK_OFF, QK_MASK), *_decay("per_key", False),
            load("beta", "wy_beta_ptr", TOK_OFF, "ok"), _load_cc("Aqk", "wy_aqk_ptr"),
            load("w", "wy_w_ptr", QK_OFF, QK_MASK), load("b_do", "do_ptr", V_OFF, V_MASK))


def fwd_kernel(decl: MatrixState) -> K.Kernel:
    """The state pass: two products a chunk on the serial path, U = u - w S0 and S_end = diag(e^(G_L)) S0 + (K *
    e^(G_L - G))^T U (u, w from the prep kernel; the outputs come from `{name}_fwd_o`, every chunk at once)."""
    params = _params(["q_ptr", "k_ptr", "G_ptr", "wy_w_ptr", "wy_u_ptr", "h0_ptr", "fw_U_ptr", "ht_ptr", "hs_ptr",
                      "chunk_tok_ptr", "chunk_len_ptr", "seq_chunk0_ptr", "H"],
                     SHAPE_CONSTS + ("HAS_H0", "STORE_U", "STORE_FINAL", "STORE_H"))
    loop = (*_chunk(), K.If(K.expr("STORE_H"), (K.Store(K.expr(f"hs_ptr + {state_off('c + n')}"),
                                                         K.expr("rnd(S, hs_ptr.dtype.element_ty, UPCAST)"),
                                                         K.expr(S_MASK)),)),
            load("b_k", "k_ptr", QK_OFF, QK_MASK), *_decay("per_key", with_pairwise=False, with_q=False),
            load("w", "wy_w_ptr", QK_OFF, QK_MASK), load("u", "wy_u_ptr", V_OFF, V_MASK),
            K.assign("U", f"u - {dot32('w', 'S')}"),
            K.If(K.expr("STORE_U"), (K.Store(K.expr(f"fw_U_ptr + {V_OFF}"), K.expr("U"), K.expr(V_MASK)),)),
            K.assign("S", f"S * s_dec + {dot32('tl.trans(k_end)', 'U')}"))
    body = (K.assign("n", "tl.program_id(0)"), K.assign("h", "tl.program_id(1)"), K.assign("vb", "tl.program_id(2)"),
            *_axes(True),
            *_origin_comments(decl),
            K.assign("c0", "tl.load(seq_chunk0_ptr + n)"), K.assign("c1", "tl.load(seq_chunk0_ptr + n + 1)"),
            K.If(K.expr("HAS_H0"), (load("S", "h0_ptr", state_off("n"), S_MASK),),
                 (K.assign("S", "tl.zeros([BK, BV], dtype=tl.float32)"),)),
            K.For("c", K.expr("c0"), K.expr("c1"), loop),
            K.If(K.expr("STORE_H"), (K.Store(K.expr(f"hs_ptr + {state_off('c1 + n')}"),
                                             K.expr("rnd(S, hs_ptr.dtype.element_ty, UPCAST)"), K.expr(S_MASK)),)),
            K.If(K.expr("STORE_FINAL"), (K.Store(K.expr(f"ht_ptr + {state_off('n')}"), K.expr("S"), K.expr(S_MASK)),)))
    return K.Kernel(f"{decl.name}_fwd", params, body,
                    doc="Chunks of sequence n in order: U of each chunk (STORE_U), the state entering each chunk "
                        "(STORE_H, rounded to hs's dtype), the final state (STORE_FINAL, fp32).")


def out_kernel(decl: MatrixState) -> K.Kernel:
    """The outputs, per (chunk, head, value block), every chunk at once: O = scale ((Q * e^G) S0 + Aqk U)."""
    params = _params(["q_ptr", "k_ptr", "v_ptr", "G_ptr", "wy_beta_ptr", "wy_aqk_ptr", "fw_U_ptr", "hs_ptr", "o_ptr",
                      "chunk_tok_ptr", "chunk_len_ptr", "chunk_seq_ptr", "scale", "H"], SHAPE_CONSTS)
    body = (K.assign("c", "tl.program_id(0)"), K.assign("h", "tl.program_id(1)"), K.assign("vb", "tl.program_id(2)"),
            *_axes(True), K.assign("cols", "tl.arange(0, C)[None, :]"), *_origin_comments(decl), *_chunk(),
            K.assign("n", "tl.load(chunk_seq_ptr + c)"),
            load("b_q", "q_ptr", QK_OFF, QK_MASK), load("b_k", "k_ptr", QK_OFF, QK_MASK),
            *_decay("per_key", with_pairwise=False), load("beta", "wy_beta_ptr", TOK_OFF, "ok"),
            load("b_v", "v_ptr", V_OFF, V_MASK), *_first_bad(True), _load_cc("Aqk", "wy_aqk_ptr"),
            load("U", "fw_U_ptr", V_OFF, V_MASK), load("S0", "hs_ptr", state_off("c + n"), S_MASK),
            K.Comment("Aqk U with rows from the first non-finite one on kept from earlier rows"),
            *_causal_dot("o_c", "Aqk", "U"),
            K.Store(K.expr(f"o_ptr + {V_OFF}"), K.expr(f"scale * ({dot('q_dec', 'S0')} + o_c)"), K.expr(V_MASK)))
    return K.Kernel(f"{decl.name}_fwd_o", params, body,
                    doc="Chunk c: O = scale ((Q * e^G) S0 + Aqk U), S0 the state entering it (hs slot c + n).")


def bwd_dh_kernel(decl: MatrixState) -> K.Kernel:
    params = _params(["q_ptr", "k_ptr", "G_ptr", "wy_beta_ptr", "wy_aqk_ptr", "wy_w_ptr", "do_ptr", "dht_ptr", "dh_ptr",
                      "dh0_ptr", "chunk_tok_ptr", "chunk_len_ptr", "seq_chunk0_ptr", "scale", "H"],
                     SHAPE_CONSTS + ("HAS_DHT", "STORE_DH0"))
    loop = (K.assign("c", "c1 - 1 - i"), *_chunk(),
            K.Store(K.expr(f"dh_ptr + {state_off('c')}"), K.expr("dS"), K.expr(S_MASK)),
            *_chunk_loads(),
            K.assign("dU", f"scale * {dot32('tl.trans(Aqk)', 'b_do')} + {dot32('k_end', 'dS')}"),
            K.assign("dS", f"dS * s_dec + scale * {dot('tl.trans(q_dec)', 'b_do')} - {dot32('tl.trans(w)', 'dU')}"))
    body = reverse_state_pass(decl, loop, setup=(K.assign("cols", "tl.arange(0, C)[None, :]"),))
    return K.Kernel(f"{decl.name}_bwd_dh", params, body,
                    doc="Chunks of sequence n in reverse: dS_end of each chunk (dh slot c), then d(initial state): "
                        "dS0 = e^(G_L) dS_end + scale (Q e^G)^T dO - w^T dU.")


def summed(decl: MatrixState, n: str) -> bool:
    """Whether d(input n) is added atomically into a zeroed buffer: a per-head parameter (every chunk adds), or a
    per-token input of the log-decay (each key block of `{name}_bwd` adds its keys' sum, and `{name}_bwd_v`
    adds beta's part when beta reads it too). A per-token input of beta alone is stored by `{name}_bwd_v`, a
    per-key one by `{name}_bwd`."""
    return decl.inputs[n] == "head" or (decl.inputs[n] == "token" and n in decl.used(decl.log_decay))


def beta_adds_first(decl: MatrixState) -> bool:
    """Whether a per-token input's gradient gets beta's share (`{name}_bwd_v`) before the key blocks add theirs: then
    more than one key block adds three or more terms, whose fp32 sum depends on their order."""
    beta_inputs = set(decl.used(decl.beta))
    return any(decl.inputs[n] == "token" and summed(decl, n) and n in beta_inputs for n in hook_inputs(decl))


def _beta_input_grads(decl: MatrixState) -> tuple:
    """beta's part of d(input) for its hook's inputs (dbeta times the hook's sympy derivative), and with the
    key norm n2 the coefficient of k in dk's part through n2 (2 dbeta dbeta/dn2, stored for `{name}_bwd`)."""
    b_used = [n for n in hook_inputs(decl) if n in set(decl.used(decl.beta))]
    n2 = "n2_safe" if decl.uses_key_norm else "n2"
    out = [*_beta(decl), *common.assign([f"dy_{n}" for n in b_used], [decl.beta.grads[n] for n in b_used],
                                        _beta_names(decl, n2), "_db", shape_like="zero_c")]
    live = "ok & ~dead" if decl.uses_key_norm else "ok"
    for n in b_used:
        value = f"tl.where({live}, dbeta * dy_{n}, 0.0)"
        if decl.inputs[n] == "head":
            out.append(K.AtomicAdd(K.expr(f"d{n}_ptr + h"), K.expr(f"tl.sum({value})")))
        elif summed(decl, n):
            out.append(K.AtomicAdd(K.expr(f"d{n}_ptr + {TOK_OFF}"), K.expr(value), K.expr("ok")))
        else:
            out.append(K.Store(K.expr(f"d{n}_ptr + {TOK_OFF}"), K.expr(value), K.expr("ok")))
    if decl.uses_key_norm:
        out += [*common.assign(["dbeta_n2"], [decl.beta.grads[KEY_NORM]], _beta_names(decl, "n2_safe"), "_dn",
                               shape_like="zero_c"),
                K.Store(K.expr(f"bw_dn2_ptr + {TOK_OFF}"), K.expr("tl.where(ok & ~dead, 2.0 * dbeta * dbeta_n2, 0.0)"),
                        K.expr("ok"))]
    return tuple(out)


def _hook_params(decl: MatrixState) -> list[str]:
    names = hook_inputs(decl)
    return [f"{n}_ptr" for n in names] + [f"d{n}_ptr" for n in names] + [f"c_{c}" for c in decl.constants]


def bwd_v_kernel(decl: MatrixState) -> K.Kernel:
    """The backward's products over the values, every key at once (the sums over keys of X0 and dU need them):
    per value block U, dU and dR; dv, U kept for `{name}_bwd`; then dAqk and dP = diag(beta) dA of the chunk,
    dbeta and beta's hook inputs' gradients."""
    params = _params(["q_ptr", "k_ptr", "v_ptr", "G_ptr", *WY, "hs_ptr", "dh_ptr", "do_ptr", "dv_ptr", "bw_U_ptr",
                      "bw_daqk_ptr", "bw_dp_ptr", "bw_dn2_ptr", "chunk_tok_ptr", "chunk_len_ptr", "chunk_seq_ptr",
                      *_hook_params(decl), "scale", "H"], SHAPE_CONSTS)
    vloop = (K.assign("vv", "vb * BV + tl.arange(0, BV)"), K.assign("okv", "vv < V"),
             load("b_v", "v_ptr", V_OFF, V_MASK), load("b_do", "do_ptr", V_OFF, V_MASK),
             load("S0", "hs_ptr", state_off("c + n"), S_MASK), load("dSe", "dh_ptr", state_off("c"), S_MASK),
             K.assign("X0", f"b_v - {dot32('k_dec', 'S0')}"), K.assign("R", "beta[:, None] * X0"),
             K.assign("U", dot32("Tm", "R")),
             K.assign("dU", f"scale * {dot32('tl.trans(Aqk)', 'b_do')} + {dot32('k_end', 'dSe')}"),
             K.assign("dR", dot32("tl.trans(Tm)", "dU")),
             K.assign("dAqk", f"dAqk + {dot32('b_do', 'tl.trans(U)')}"),
             K.assign("dTm", f"dTm + {dot32('dU', 'tl.trans(R)')}"),
             K.assign("dbeta", "dbeta + tl.sum(dR * X0, 1)"),
             K.Store(K.expr(f"dv_ptr + {V_OFF}"), K.expr("beta[:, None] * dR"), K.expr(V_MASK)),
             K.Store(K.expr(f"bw_U_ptr + {V_OFF}"), K.expr("U"), K.expr(V_MASK)))
    body = (K.assign("c", "tl.program_id(0)"), K.assign("h", "tl.program_id(1)"), *_axes(False),
            K.assign("cols", "tl.arange(0, C)[None, :]"), *_origin_comments(decl), *_chunk(),
            K.assign("n", "tl.load(chunk_seq_ptr + c)"), load("b_k", "k_ptr", QK_OFF, QK_MASK),
            *_decay("per_key", with_pairwise=False, with_q=False),
            load("beta", "wy_beta_ptr", TOK_OFF, "ok"), _load_cc("Aqk", "wy_aqk_ptr"), _load_cc("Tm", "wy_tm_ptr"),
            K.assign("k_dec", "b_k * tl.exp(b_G)"),
            K.assign("dAqk", "tl.zeros([C, C], dtype=tl.float32)"), K.assign("dTm", "tl.zeros([C, C], dtype=tl.float32)"),
            K.assign("dbeta", "tl.zeros([C], dtype=tl.float32)"),
            K.For("vb", K.expr("0"), K.expr("tl.cdiv(V, BV)"), vloop),
            K.Store(K.expr(f"bw_daqk_ptr + {CC_OFF}"), K.expr("tl.where(causal, scale * dAqk, 0.0)"), None),
            K.Comment("through Tm = (I + A)^-1 and A = diag(beta) P"),
            K.assign("dA", f"tl.where({STRICT}, -{dot32('tl.trans(Tm)', dot32('dTm', 'tl.trans(Tm)'))}, 0.0)"),
            _load_cc("P", "wy_p_ptr"),
            K.assign("dbeta", f"dbeta + tl.sum(tl.where({STRICT}, dA * P, 0.0), 1)"),
            K.Store(K.expr(f"bw_dp_ptr + {CC_OFF}"), K.expr(f"tl.where({STRICT}, beta[:, None] * dA, 0.0)"), None),
            *_beta_input_grads(decl))
    return K.Kernel(f"{decl.name}_bwd_v", params, body,
                    doc="Chunk c, every key: dv, U, dAqk, dP and beta's hook inputs' gradients (module docstring).")


def bwd_kernel(decl: MatrixState) -> K.Kernel:
    """The backward's per-key part, in key blocks of BK columns (every product here is per key column): the sums
    over the values that end in a [C, BK] tile, the pairwise gradients of Aqk and P, dq, dk, dg and the log-decay's
    hook inputs' gradients."""
    params = _params(["q_ptr", "k_ptr", "G_ptr", "hs_ptr", "dh_ptr", "do_ptr", "bw_U_ptr", "dv_ptr", "bw_daqk_ptr",
                      "bw_dp_ptr",
                      "bw_dn2_ptr", "dq_ptr", "dk_ptr", "chunk_tok_ptr", "chunk_len_ptr", "chunk_seq_ptr",
                      *_hook_params(decl), "scale", "H"], SHAPE_CONSTS)
    zeros = lambda *ts: tuple(K.assign(t, f"tl.zeros([{s}], dtype=tl.float32)") for t, s in ts)  # noqa: E731
    vloop = (K.assign("vv", "vb * BV + tl.arange(0, BV)"), K.assign("okv", "vv < V"),
             load("b_do", "do_ptr", V_OFF, V_MASK), load("U", "bw_U_ptr", V_OFF, V_MASK),
             load("dv", "dv_ptr", V_OFF, V_MASK),
             load("S0", "hs_ptr", state_off("c + n"), S_MASK), load("dSe", "dh_ptr", state_off("c"), S_MASK),
             K.assign("dk_state", f"dk_state + {dot32('U', 'tl.trans(dSe)')}"),
             K.assign("dq_inter", f"dq_inter + {dot('b_do', 'tl.trans(S0)')}"),
             K.assign("dk_dec", f"dk_dec - {dot32('dv', 'tl.trans(S0)')}"),
             K.assign("dG_S0", "dG_S0 + tl.sum(S0 * dSe, 1)"))
    body = (K.assign("c", "tl.program_id(0)"), K.assign("h", "tl.program_id(1)"), *_axes(False), *_key_block("per_key"),
            K.assign("cols", "tl.arange(0, C)[None, :]"), *_origin_comments(decl), *_chunk(),
            K.assign("n", "tl.load(chunk_seq_ptr + c)"), load("b_q", "q_ptr", QK_OFF, QK_MASK),
            load("b_k", "k_ptr", QK_OFF, QK_MASK), *_decay("per_key", with_pairwise=False, with_q=False),
            _load_cc("dAqk", "bw_daqk_ptr"), _load_cc("dP", "bw_dp_ptr"),
            K.Comment("the pairwise gradients of Aqk and P first (fewer tiles alive), loading the rows they broadcast"),
            K.assign("X, Y, Z", "pairwise_grads_pair(dAqk, dP, b_q, b_k, b_G, q_ptr, k_ptr, G_ptr, tok, h, H, kk, "
                                "okk, n_rows, G_last, K, C, BS, BK, PREC, UPCAST)"),
            *zeros(("dq_inter", "C, BK"), ("dk_state", "C, BK"), ("dk_dec", "C, BK"), ("dG_S0", "BK")),
            K.For("vb", K.expr("0"), K.expr("tl.cdiv(V, BV)"), vloop),
            K.Comment("the writes j < t into S_end: an exclusive cumsum of W, formed as a sum, not a difference"),
            K.Assign(("W_x", "W_all"), K.expr("tl.associative_scan((tl.zeros_like(b_k), k_end * dk_state), 0, "
                                              "exclusive_add)")),
            K.assign("k_dec", "b_k * tl.exp(b_G)"),
            K.assign("dq_s0", "scale * tl.exp(b_G) * dq_inter"),
            K.assign("dk", "Y + tl.exp(G_last[None, :] - b_G) * dk_state + tl.exp(b_G) * dk_dec"),
            K.Comment("dg_t: the direct terms of rows >= t, the pairs j < t <= i, the writes j < t, e^(G_L) rowsum(S0 dS_end)"),
            K.assign("dg", f"tl.cumsum(tl.where({QK_MASK}, b_q * dq_s0 + k_dec * dk_dec, 0.0), 0, reverse=True) + Z + W_x"),
            K.assign("dg", f"tl.where({QK_MASK}, dg + tl.exp(G_last)[None, :] * dG_S0[None, :], 0.0)"))
    if decl.uses_key_norm:
        body += (load("dn2", "bw_dn2_ptr", TOK_OFF, "ok"), K.assign("dk", "dk + dn2[:, None] * b_k"))
    body += (K.Store(K.expr(f"dq_ptr + {QK_OFF}"), K.expr("dq_s0 + X"), K.expr(QK_MASK)),
             K.Store(K.expr(f"dk_ptr + {QK_OFF}"), K.expr("tl.where(ok[:, None], dk, 0.0)"), K.expr(QK_MASK)),
             *_load_hook_inputs(decl), *_hook_grads(decl))
    return K.Kernel(f"{decl.name}_bwd", params, body,
                    doc="Chunk c, key block tl.program_id(2): dq, dk and the log-decay's hook inputs' gradients "
                        "(module docstring).")


def module(decl: MatrixState) -> K.Module:
    """The per-key delta kernels of `decl` as one IR module."""
    if not supports(decl):
        raise ValueError(f"declaration: matrix state {decl.name!r} (decay {decl.decay}, correction {decl.correction}, "
                         f"{decl.steps} step(s)) is not the per-key delta structure these kernels cover")
    kernels = helper_kernels() + [inv_unit_lower_blocks(), inverse_kernel(), cumsum_kernel(decl), prep_kernel(decl),
                                  fwd_kernel(decl), out_kernel(decl), bwd_dh_kernel(decl), bwd_v_kernel(decl),
                                  bwd_kernel(decl)]
    doc = (f"Generated by scanlang from matrix state {E.docstring_text(decl.name)} (declaration {decl.key}): "
           f"decay per_key, delta correction (backends/linear/kernels_delta.py). Do not edit.")
    return K.Module(doc, tuple(kernels))


def render(decl: MatrixState) -> str:
    """The module's source text (deterministic)."""
    return print_module(module(decl))
