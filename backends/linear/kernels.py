"""The plain-write matrix-state kernels, rendered on the kernel IR from a `scanlang.MatrixState`.

A plain-write member (correction "plain") maps the [K, V] state S by S_t = D_t S_{t-1} + k_t v_t^T,
o_t = scale S_t^T q_t, with D_t = I (decay none), exp(g_t) I (per head) or diag(exp(g_t)) (per key),
g_t = log_decay(inputs) (docs/spec/linear.md). Per chunk of C rows with start state S0 and the
chunk-local cumulative log-decay G (G_i = g_0 + ... + g_i inside the chunk):

    O     = scale ((Q * e^G) S0 + A V),       A_ij = sum_k q_ik k_jk e^(G_ik - G_jk)  (i >= j, else 0)
    S_end = e^(G_L) S0 + (K * e^(G_L - G))^T V                                     (L = the last row)

Every exponent used is a difference G_i - G_j with i >= j, G_i, or G_L - G_j: all <= 0 for log-decays
<= 0, so g = -20 per token cannot overflow at any chunk size. Per head, A = (Q K^T) * e^(G_i - G_j)
is one tl.dot and a [C, C] mask. Per key the pairwise decay differs per key column: the pairs form a
tree (`pairwise_kernels`), where a pair between the halves of a 2s-block factors through the block's
row r = s - 1, e^(G_i - G_r) e^(G_r - G_j) with both factors <= 1 (one masked tl.dot per level s = C/2,
..., BS = tuning.linear_pairwise_block), and a pair inside a block of BS rows is formed exactly (BS steps
over [C, BK] tiles; none but the diagonal at BS = 1, the default). Every product over V is a tl.dot. The
structure decides what exists: without decay there is no G, no cumulative-sum kernel and no decay
gradient.

Kernels (one module per declaration; C, K, V, BK, BV are constexprs):
    {name}_decay_cumsum   per (chunk, head): g from the hook, G = its cumulative sum in the chunk
    {name}_fwd            the state pass: per (sequence, head, value block), chunks in order: the
                          state entering every chunk (STORE_H: slot c + n, slot c_end + n the final
                          state) and the final state (STORE_FINAL, fp32)
    {name}_fwd_o          per (chunk, head), every chunk at once: the outputs from the stored states
                          (A formed once per chunk, not once per value block on the serial path)
    {name}_bwd_dh         per (sequence, head, value block), chunks in reverse: dS_end of every chunk
                          (dS0 = e^(G_L) dS_end + scale (Q * e^G)^T dO) and d(initial state)
    {name}_bwd            per (chunk, head): dq, dk, dv and, with decay, dg_t = dL/dg_t (each pair
                          (i, j) of rows, e^(G_i - G_j), depends on g_t for j < t <= i: the reverse
                          cumsum of q X - k Y over the pairs i > j alone, never through q dq - k dk,
                          whose diagonal terms i = j cancel: at g = -20 that difference is all
                          rounding), then d(hook inputs) =
                          dg * the hook's sympy derivative.
Masks are selects (tl.where), never products with a 0/1 mask: a NaN or inf in a later row must not
reach an earlier one. The one product that would carry it back, A V (0 * NaN), takes V with rows from
the chunk's first non-finite value on zeroed, and only rows from there on use the raw product.
"""
from __future__ import annotations

from scanlang import expr as E
from scanlang.linear import MatrixState

from ..triton.kernel import common
from ..triton.kernel import ir as K
from ..triton.kernel.printer import render as print_module

INF = "float('inf')"
QK_OFF = "((tok + rows[:, None]) * H + h) * K + kk[None, :]"
QK_MASK = "ok[:, None] & okk[None, :]"
V_OFF = "((tok + rows[:, None]) * H + h) * V + vv[None, :]"
V_MASK = "ok[:, None] & okv[None, :]"
S_MASK = "okk[:, None] & okv[None, :]"
SHAPE_CONSTS = ("K", "V", "BK", "BV", "C", "BS", "PREC", "UPCAST")


def dot(x: str, y: str) -> str:
    """x @ y with fp32 accumulation, operands rounded to the input dtype DT (`mm`)."""
    return f"mm({x}, {y}, DT, PREC, UPCAST)"


def state_off(slot: str) -> str:
    """Offsets of rows kk, columns vv of the [K, V] state at `slot` (of a [slots, H, K, V] tensor)."""
    return f"(({slot}) * H + h).to(tl.int64) * K * V + kk[:, None] * V + vv[None, :]"


def load(target: str, ptr: str, off: str, mask: str) -> K.Assign:
    return K.assign(target, f"tl.load({ptr} + {off}, mask={mask}, other=0.0).to(tl.float32)")


def g_off(decay: str) -> tuple[str, str]:
    return ("(tok + rows) * H + h", "ok") if decay == "per_head" else (QK_OFF, QK_MASK)


# ---- helpers every module holds ------------------------------------------------------------------

def helper_kernels(decay: str = "per_key") -> list[K.Kernel]:
    """rnd and mm, and (per-key decay) the pairwise products' helpers (`pairwise_kernels`)."""
    rnd = K.Kernel("rnd", (K.Param("x"), K.Param("DT", constexpr=True), K.Param("EMULATE", constexpr=True)), (
        K.If(K.expr("EMULATE and DT == tl.bfloat16"), (
            K.assign("bits", "x.to(tl.float32).to(tl.uint32, bitcast=True)"),
            K.assign("bits", "(bits + 32767 + (bits >> 16 & 1)) & 4294901760"),
            K.Return((K.expr("bits.to(tl.float32, bitcast=True).to(DT)"),))),
            (K.Return((K.expr("x.to(DT)"),)),)),),
        doc="x rounded to DT. EMULATE: Triton's CPU interpreter truncates fp32 -> bf16; round to nearest even.")
    mm = K.Kernel("mm", tuple(K.Param(p) for p in ("x", "y")) + tuple(
        K.Param(p, constexpr=True) for p in ("DT", "PREC", "UPCAST")), (
        K.assign("xr", "rnd(x, DT, UPCAST)"), K.assign("yr", "rnd(y, DT, UPCAST)"),
        K.If(K.expr("UPCAST"), (K.Return((K.expr(
            "tl.dot(xr.to(tl.float32), yr.to(tl.float32), input_precision='ieee')"),)),),
             (K.Return((K.expr("tl.dot(xr, yr, input_precision=PREC)"),)),)),),
        doc="x @ y, operands in the input dtype DT, fp32 accumulation. UPCAST: the CPU interpreter "
            "multiplies bf16 as integers, so the rounded operands are widened first.")
    return [rnd, mm, *(pairwise_kernels() if decay == "per_key" else ())]


def pairwise_kernels() -> list[K.Kernel]:
    """The per-key products with the pairwise decay e^(G_ik - G_jk) (i >= j), as a tree over the chunk's rows
    down to blocks of BS (tuning.linear_pairwise_block). At level s (s = C / 2, C / 4, ..., BS) the pairs with
    i in the second half of a 2s-block and j in its first factor through the block's reference row r = its
    row s - 1: e^(G_i - G_r) e^(G_r - G_j), both factors <= 1 (every pair i > j of different BS-blocks lies
    in exactly one level: the one of the highest bit in which i and j differ), so a level is one fp32
    tensor-core product for every block at once, masked to its pairs. A pair inside one BS-block is formed
    exactly, column jj of every block at once (BS steps over [C, BK] tiles), the exponent selected to 0
    where i < j before exp and the term selected to 0 after (BS = 1 leaves the diagonal alone). The
    gradients step twice through a block: over its columns j (dq's part, row i gathers) and over its rows i
    (dk's part, column j gathers), so no step sums across the rows of a block.

    The rows a step broadcasts (G_r, G_j, k_j, q_i) are loaded from the tensors the tiles came from (L1
    hits), given q_ptr (the gradients), k_ptr, G_ptr and the chunk's tok, h, H, kk, okk, n_rows, G_last: G
    is in memory before any of these kernels runs (`{name}_decay_cumsum`). Picking them out of the register
    tiles instead (a cross-row reduction or a reshape each) made KDA's prep kernel 6.2 ms against 4.1 on an
    H100 (BENCHMARKS_HISTORY.md "Session 19"), and was removed."""
    return [_exclusive_add(), _level(), _qk(), _grads(), grads_pair_kernel()]


_ROWS = ("k_ptr", "G_ptr", "tok", "h", "H", "kk", "okk", "n_rows", "G_last")


def _params_of(names: tuple) -> tuple:
    blocks = tuple(K.Param(p, constexpr=True) for p in ("K", "C", "BS", "BK", "PREC", "UPCAST"))
    return tuple(K.Param(p) for p in names) + tuple(K.Param(p) for p in _ROWS) + blocks


def _pre() -> tuple:
    return (K.assign("rows", "tl.arange(0, C)"), K.assign("cols", "tl.arange(0, C)[None, :]"),
            K.assign("j0", "rows // BS * BS"))


def _level() -> K.Kernel:
    """Level S of the pairs' tree (`pairwise_kernels`): G_r, the reference row of each row's 2S-block (its
    row S - 1: the last of the block's first half), the factors e_q (second half: e^(G - G_r)) and e_k
    (first half: e^(G_r - G)), both <= 1, and `pair`, the pairs (i, j) with i in a block's second half and
    j in its first."""
    params = (K.Param("G"), *(K.Param(p) for p in _ROWS[1:]), *(K.Param(p, constexpr=True) for p in ("K", "C", "S", "BK")))
    return K.Kernel("tree_level", params, (
        K.assign("rows", "tl.arange(0, C)"), K.assign("cols", "tl.arange(0, C)[None, :]"),
        K.assign("ref", "rows // (2 * S) * (2 * S) + S - 1"), K.assign("r_ok", "(ref < n_rows)[:, None]"),
        K.assign("G_r", "tl.where(r_ok, tl.load(G_ptr + ((tok + ref)[:, None] * H + h) * K + kk[None, :], "
                        "mask=r_ok & okk[None, :], other=0.0), G_last[None, :])"),
        K.assign("late", "((rows // S) % 2 == 1)[:, None]"), K.assign("e", "tl.exp(tl.where(late, G - G_r, G_r - G))"),
        K.Return((K.expr("tl.where(late, e, 0.0)"), K.expr("tl.where(late, 0.0, e)"),
                  K.expr("late & (rows[:, None] // (2 * S) == cols // (2 * S)) & ((cols // S) % 2 == 0)")))),
        doc="(e_q, e_k, pair) of level S: e^(G_i - G_r) on each 2S-block's second half, e^(G_r - G_j) on its first "
            "(r its row S - 1), and the pairs between the halves.")


def _levels(body: tuple) -> K.For:
    """`body` once per level of the tree, S = C / 2, C / 4, ..., BS, after e_q, e_k, pair of the level."""
    call = K.Assign(("e_q", "e_k", "pair"), K.expr(f"tree_level(G, {', '.join(_ROWS[1:])}, K, C, C // (2 << lv), BK)"))
    return K.For("lv", None, K.expr("8"), (K.If(K.expr("C // (2 << lv) >= BS"), (call, *body)),), static=True)


def _qk() -> K.Kernel:
    return K.Kernel("pairwise_qk", _params_of(("q", "k", "G")), (
        *_pre(), K.assign("A", "tl.zeros([C, C], dtype=tl.float32)"),
        _levels((K.assign("A", "A + tl.where(pair, mm(q * e_q, tl.trans(k * e_k), tl.float32, PREC, UPCAST), 0.0)"),)),
        *_in_block_qk()),
        doc="A_ij = sum_k q_ik k_jk exp(G_ik - G_jk) for i >= j, else 0 (`pairwise_kernels`).")


def _in_block_qk() -> tuple:
    """The pairs inside a block, column jj of every block a step, and the return of A. BS >= 16: the columns
    gather into A_in [C, BS], placed once by a one-hot product (exact in fp32: one nonzero term per entry)
    rather than by a [C, C] select each step (gla_fwd_o's step 338 -> 298 SASS instructions, no spills;
    offline sm_90); below 16 (tl.dot's least size) the select."""
    step = (*_rows_at("j", "jj"), K.assign("live", "(rows >= s_j)[:, None]"),
            K.assign("e", "tl.exp(tl.where(live, G - G_j, 0.0))"),
            K.assign("col", "tl.sum(tl.where(live, q * e * k_j, 0.0), 1)"))
    select = (K.For("jj", K.expr("0"), K.expr("BS"), (*step, K.assign("A", "tl.where(cols == s_j[:, None], col[:, None], A)"))),)
    place = (K.assign("lanes", "tl.arange(0, BS)[None, :]"), K.assign("A_in", "tl.zeros([C, BS], dtype=tl.float32)"),
             K.For("jj", K.expr("0"), K.expr("BS"), (*step, K.assign("A_in", "tl.where(lanes == jj, col[:, None], A_in)"))),
             K.assign("place", "((tl.arange(0, C)[None, :] % BS) == tl.arange(0, BS)[:, None]).to(tl.float32)"),
             K.assign("A", "tl.where(rows[:, None] // BS == cols // BS, tl.dot(A_in, place, input_precision='ieee'), A)"))
    return (K.If(K.expr("BS >= 16"), place, select), K.Return((K.expr("A"),)))


def _rows_at(what: str, step: str, src: str = "") -> tuple:
    """The rows one step of an in-block loop broadcasts, loaded: s_<what> = row `step` of each row's block, and
    G and k there (`what` "j", the pairs' columns: G_j, k_j) or G and q (`what` "i", their rows: G_i, q_i;
    `src` names another tile, and its pointer, for q)."""
    src = src or ("k" if what == "j" else "q")
    return (K.assign(f"s_{what}", f"j0 + {step}"), K.assign("s_ok", f"(s_{what} < n_rows)[:, None]"),
            K.assign("off_s", f"((tok + s_{what})[:, None] * H + h) * K + kk[None, :]"),
            K.assign(f"G_{what}", "tl.where(s_ok, tl.load(G_ptr + off_s, mask=s_ok & okk[None, :], other=0.0), "
                                  "G_last[None, :])"),
            K.assign(f"{src}_{what}", f"tl.load({src}_ptr + off_s, mask=s_ok & okk[None, :], other=0.0).to(tl.float32)"))


def _grads_body(pairs: tuple, with_w: bool = True) -> tuple:
    """X, Y of each (dA, q, X, Y) of `pairs` (sharing k, G and the tree's levels; pairs may share a Y, which
    then sums both): X_ik = sum_(j < i) dA_ij k_jk e^(G_ik - G_jk), Y_jk = sum_(i > j) dA_ij q_ik e^(G_ik - G_jk)."""
    level = [K.assign("k_e", "k * e_k")]
    for dA, q, X, Y in pairs:
        level += [K.assign("dA_s", f"tl.where(pair, {dA}, 0.0)"),
                  K.assign(X, f"{X} + e_q * mm(dA_s, k_e, tl.float32, PREC, UPCAST)"),
                  K.assign(Y, f"{Y} + e_k * mm(tl.trans(dA_s), {q} * e_q, tl.float32, PREC, UPCAST)")]
    block = []
    for dA, q, X, Y in pairs:
        block += [K.For("jj", K.expr("0"), K.expr("BS"), (
                      *_rows_at("j", "jj"), K.assign("live", "(rows > s_j)[:, None]"),
                      K.assign("e", "tl.exp(tl.where(live, G - G_j, 0.0))"),
                      K.assign("dA_j", f"tl.sum(tl.where(cols == s_j[:, None], {dA}, 0.0), 1)"),
                      K.assign(X, f"{X} + tl.where(live, dA_j[:, None] * k_j * e, 0.0)"))),
                  K.assign("dA_t", f"tl.trans({dA})"),
                  K.For("ii", K.expr("0"), K.expr("BS"), (
                      *_rows_at("i", "ii", q), K.assign("live", "(s_i > rows)[:, None]"),
                      K.assign("e", "tl.exp(tl.where(live, G_i - G, 0.0))"),
                      K.assign("dA_i", "tl.sum(tl.where(cols == s_i[:, None], dA_t, 0.0), 1)"),
                      K.assign(Y, f"{Y} + tl.where(live, dA_i[:, None] * {q}_i * e, 0.0)")))]
    zeros = tuple(K.assign(t, "tl.zeros_like(k)") for t in dict.fromkeys(t for _, _, X, Y in pairs for t in (X, Y)))
    return (*_pre(), *zeros, _levels(tuple(level)),
            K.Comment("pairs inside a block, i > j: X over the columns j of each row, Y over the rows i of each column"),
            K.If(K.expr("BS > 1"), tuple(block)),
            K.Comment("dg_t: the pairs j < t <= i, as the reverse cumsum of q X - k Y over the pairs i > j (a pair"),
            K.Comment("with both rows >= t adds and takes the same term; no diagonal term, which would cancel),"),
            *((K.Comment("and the writes j < t: an exclusive cumsum of W, formed as a sum, not a difference"),
               K.Assign(("W_x", "W_all"), K.expr("tl.associative_scan((tl.zeros_like(W), W), 0, exclusive_add)")))
              if with_w else ()))


_GRADS_DOC = ("X_ik = sum_(j <= i) dA_ij k_jk exp(G_ik - G_jk) (dq's part), Y_jk = sum_(i >= j) dA_ij q_ik "
              "exp(G_ik - G_jk) (dk's part) and Z_tk = sum_(j < t <= i) q_ik k_jk dA_ij exp(G_ik - G_jk) + "
              "sum_(j < t) W_jk: the decay gradient's pairs that straddle t and the writes before it, summed "
              "without the diagonal terms that would cancel")


def _grads() -> K.Kernel:
    params = _params_of(("dA", "q", "k", "G", "W", "q_ptr"))
    return K.Kernel("pairwise_grads", params, (
        *_grads_body((("dA", "q", "X", "Y"),)),
        K.assign("Z", "tl.cumsum(q * X - k * Y, 0, reverse=True)"),
        K.assign("diag", "tl.sum(tl.where(cols == rows[:, None], dA, 0.0), 1)[:, None]"),
        K.Return((K.expr("X + diag * k"), K.expr("Y + diag * q"), K.expr("Z + W_x")))),
        doc=_GRADS_DOC + " (`pairwise_kernels`).")


def grads_pair_kernel() -> K.Kernel:
    """`pairwise_grads_pair`: the per-key delta backward's two pairwise gradients at once (Aqk's with q, P's
    with k in both roles), sharing the tree's factors and one reverse cumsum; without the writes W (the
    caller adds their exclusive cumsum, so that its inputs need not be alive here)."""
    return K.Kernel("pairwise_grads_pair", _params_of(("dA", "dB", "q", "k", "G", "q_ptr")), (
        *_grads_body((("dA", "q", "X", "Y"), ("dB", "k", "X2", "Y")), with_w=False),
        K.assign("Z", "tl.cumsum(q * X + k * X2 - k * Y, 0, reverse=True)"),
        K.assign("diag", "tl.sum(tl.where(cols == rows[:, None], dA, 0.0), 1)[:, None]"),
        K.Return((K.expr("X + diag * k"), K.expr("Y + X2 + diag * q"), K.expr("Z")))),
        doc="pairwise_grads of (dA, q, k) and of (dB, k, k) (dB strictly lower), summed where both reach dk "
            "and dg, W = 0: (X of dA, Y of dA + X and Y of dB, Z of both). " + _GRADS_DOC + ".")


def _exclusive_add() -> K.Kernel:
    return K.Kernel("exclusive_add", tuple(K.Param(p) for p in ("e1", "s1", "e2", "s2")), (
        K.Return((K.expr("s1 + e2"), K.expr("s1 + s2"))),),
        doc="Combine of (exclusive, inclusive) sums: a scan of (0, x) gives each row the sum of the rows before it.")


# ---- shared statement groups ---------------------------------------------------------------------

def _chunk(c: str = "c") -> tuple:
    return (K.assign("tok", f"tl.load(chunk_tok_ptr + {c}).to(tl.int64)"), K.assign("n_rows", f"tl.load(chunk_len_ptr + {c})"),
            K.assign("ok", "rows < n_rows"))


def _axes(values: bool) -> tuple:
    out = [K.assign("rows", "tl.arange(0, C)"), K.assign("kk", "tl.arange(0, BK)"), K.assign("okk", "kk < K"),
           K.assign("causal", "rows[:, None] >= rows[None, :]"), K.assign("DT", "q_ptr.dtype.element_ty")]
    if values:
        out += [K.assign("vv", "vb * BV + tl.arange(0, BV)"), K.assign("okv", "vv < V")]
    return tuple(out)


def _decay(decay: str, with_pairwise: bool = True, with_q: bool = True) -> tuple:
    """G and what the chunk formulas need of it: q_dec = Q * e^G (with_q), k_end = K * e^(G_L - G),
    s_dec = e^(G_L) and (with_pairwise) the masked intra-chunk matrix A; b_q (with_q), b_k loaded."""
    if decay == "none":
        out = [K.assign("k_end", "b_k")]
    elif decay == "per_key":
        out = list(per_key_G())
    else:
        out = [load("b_G", "G_ptr", *g_off(decay))]
    if decay == "per_head":
        out += [K.assign("G_last", "tl.sum(tl.where(rows == n_rows - 1, b_G, 0.0), 0)"),
                K.assign("b_G", "tl.where(ok, b_G, G_last)"),   # rows past the end: no decay, so no exponent > 0
                K.assign("k_end", "tl.where(ok[:, None], b_k * tl.exp(G_last - b_G)[:, None], 0.0)"),
                K.assign("s_dec", "tl.exp(G_last)")]
    elif decay == "per_key":
        out += [K.assign("k_end", "tl.where(ok[:, None], b_k * tl.exp(G_last[None, :] - b_G), 0.0)"),
                K.assign("s_dec", "tl.exp(G_last)[:, None]")]
    return tuple(out) + (_q_dec(decay) if with_q else ()) + (_pairwise(decay) if with_pairwise else ())


def per_key_G() -> tuple:
    """b_G of the program's key columns and G_last, the chunk's last row of it; rows past the chunk's end take
    G_last, as per head (no decay there, so no exponent > 0)."""
    return (load("b_G", "G_ptr", QK_OFF, QK_MASK),
            K.assign("G_last", "tl.sum(tl.where((rows == n_rows - 1)[:, None], b_G, 0.0), 0)"),
            K.assign("b_G", "tl.where(ok[:, None], b_G, G_last[None, :])"))


def _q_dec(decay: str) -> tuple:
    """q_dec = Q * e^G, once b_q and (with decay) b_G are loaded."""
    return (K.assign("q_dec", {"none": "b_q", "per_head": "b_q * tl.exp(b_G)[:, None]",
                               "per_key": "b_q * tl.exp(b_G)"}[decay]),)


def _key_block(decay: str) -> tuple:
    """Per-key decay: the per-chunk output and backward kernels' program takes key block tl.program_id(2)
    (BK keys; every pairwise product and gradient is per key column, so blocks are independent but for
    the sums over keys: o and dv)."""
    if decay != "per_key":
        return ()
    return (K.assign("kk", "tl.program_id(2) * BK + tl.arange(0, BK)"), K.assign("okk", "kk < K"))


def _hook_inputs(decl: MatrixState, decay: str) -> list[tuple[str, str]]:
    """(input, kind) of the log-decay hook's inputs, in declaration order."""
    return [(n, decl.inputs[n]) for n in decl.used(decl.log_decay) if n in decl.inputs]


def _hook_names(decl: MatrixState) -> dict:
    names = {E.symbol(n): f"x_{n}" for n in decl.inputs}
    names |= {E.symbol(c): f"c_{c}" for c in decl.constants}
    return names


def _load_hook_inputs(decl: MatrixState) -> tuple:
    """x_<input> for the hook: [C] (per head), [C, BK] (per key; per-token inputs broadcast over K), a
    scalar for a per-head parameter ([H])."""
    out = []
    for n, kind in _hook_inputs(decl, decl.decay):
        if kind == "head":
            out.append(K.assign(f"x_{n}", f"tl.load({n}_ptr + h).to(tl.float32)"))
        elif kind == "token":
            out.append(load(f"x_{n}", f"{n}_ptr", "(tok + rows) * H + h", "ok"))
            if decl.decay == "per_key":
                out.append(K.assign(f"x_{n}", f"x_{n}[:, None] + tl.zeros([C, BK], dtype=tl.float32)"))
        else:
            out.append(load(f"x_{n}", f"{n}_ptr", QK_OFF, QK_MASK))
    return tuple(out)


def _shape_like(decl: MatrixState) -> str:
    return "tl.zeros([C], dtype=tl.float32)" if decl.decay == "per_head" else "tl.zeros([C, BK], dtype=tl.float32)"


def _origin_comments(decl: MatrixState) -> tuple:
    text = f"from matrix state {E.docstring_text(decl.name)}: decay {decl.decay}, correction {decl.correction}"
    if decl.log_decay is not None:
        text += f"; log_decay = {E.docstring_text(str(decl.log_decay.expr))}"
    return (K.Comment(text),)


def _params(names, consts) -> tuple:
    return tuple(K.Param(p) for p in names) + tuple(K.Param(c, constexpr=True) for c in consts)


# ---- the kernels ---------------------------------------------------------------------------------

def cumsum_kernel(decl: MatrixState) -> K.Kernel:
    inputs = [f"{n}_ptr" for n, _ in _hook_inputs(decl, decl.decay)]
    consts = [f"c_{c}" for c in decl.constants]
    params = _params(inputs + ["G_ptr", "chunk_tok_ptr", "chunk_len_ptr", *consts, "H"], ("K", "BK", "C"))
    off, mask = g_off(decl.decay)
    rows = (K.assign("rows", "tl.arange(0, C)"), K.assign("kk", "tl.arange(0, BK)"), K.assign("okk", "kk < K"))
    body = (K.assign("c", "tl.program_id(0)"), K.assign("h", "tl.program_id(1)"), *rows, *_chunk(), *_load_hook_inputs(decl),
            *_origin_comments(decl),
            *common.assign(["g"], [decl.log_decay.expr], _hook_names(decl), "_g", shape_like=_shape_like(decl)),
            K.assign("g", f"tl.where({mask}, g, 0.0)"),
            K.Store(K.expr(f"G_ptr + {off}"), K.expr("tl.cumsum(g, 0)"), K.expr(mask)))
    return K.Kernel(f"{decl.name}_decay_cumsum", params, body,
                    doc="G = the cumulative sum, inside each chunk, of g = log_decay(inputs) (0 past the chunk's end).")


def fwd_kernel(decl: MatrixState) -> K.Kernel:
    """The state pass: per (sequence, head, value block), the sequence's chunks in order (with STORE_O
    also the outputs: the fused forward)."""
    d = decl.decay
    g = ["G_ptr"] if d != "none" else []
    params = _params(["q_ptr", "k_ptr", "v_ptr", *g, "h0_ptr", "o_ptr", "ht_ptr", "hs_ptr", "chunk_tok_ptr",
                      "chunk_len_ptr", "seq_chunk0_ptr", "scale", "H"],
                     SHAPE_CONSTS + ("HAS_H0", "STORE_O", "STORE_FINAL", "STORE_H"))
    store_h = lambda slot: K.If(K.expr("STORE_H"), (  # noqa: E731
        K.Store(K.expr(f"hs_ptr + {state_off(slot)}"), K.expr("rnd(S, hs_ptr.dtype.element_ty, UPCAST)"),
                K.expr(S_MASK)),))
    loop = [*_chunk(), store_h("c + n"), load("b_k", "k_ptr", QK_OFF, QK_MASK), load("b_v", "v_ptr", V_OFF, V_MASK),
            *_decay(d, with_pairwise=False, with_q=False),
            K.If(K.expr("STORE_O"), (load("b_q", "q_ptr", QK_OFF, QK_MASK), *_q_dec(d), *_pairwise(d), *_outputs()))]
    update = dot("tl.trans(k_end)", "b_v")
    loop.append(K.assign("S", f"S * s_dec + {update}" if d != "none" else f"S + {update}"))
    body = (K.assign("n", "tl.program_id(0)"), K.assign("h", "tl.program_id(1)"), K.assign("vb", "tl.program_id(2)"),
            *_axes(True), *_origin_comments(decl),
            K.assign("c0", "tl.load(seq_chunk0_ptr + n)"), K.assign("c1", "tl.load(seq_chunk0_ptr + n + 1)"),
            K.If(K.expr("HAS_H0"), (load("S", "h0_ptr", state_off("n"), S_MASK),),
                 (K.assign("S", "tl.zeros([BK, BV], dtype=tl.float32)"),)),
            K.For("c", K.expr("c0"), K.expr("c1"), tuple(loop)),
            store_h("c1 + n"),
            K.If(K.expr("STORE_FINAL"), (K.Store(K.expr(f"ht_ptr + {state_off('n')}"), K.expr("S"), K.expr(S_MASK)),)))
    return K.Kernel(f"{decl.name}_fwd", params, body,
                    doc="Chunks of sequence n in order: the state entering each chunk (STORE_H, slot c + n, rounded to "
                        "hs's dtype; slot c1 + n: the final state), the outputs (STORE_O: the fused forward, A "
                        "formed here on the serial path) and the final state (STORE_FINAL, fp32).")


def out_kernel(decl: MatrixState) -> K.Kernel:
    """The outputs: per (chunk, head), every chunk at once from the states the state pass stored; the
    intra-chunk matrix A is formed once and serves every value block."""
    d = decl.decay
    g = ["G_ptr"] if d != "none" else []
    params = _params(["q_ptr", "k_ptr", "v_ptr", *g, "hs_ptr", "o_ptr", "chunk_tok_ptr", "chunk_len_ptr",
                      "chunk_seq_ptr", "scale", "H"], SHAPE_CONSTS + (("SPLIT_K",) if d == "per_key" else ()))
    vloop = (K.assign("vv", "vb * BV + tl.arange(0, BV)"), K.assign("okv", "vv < V"),
             load("b_v", "v_ptr", V_OFF, V_MASK), load("S", "hs_ptr", state_off("c + n"), S_MASK),
             *_outputs(split=d == "per_key"))
    body = (K.assign("c", "tl.program_id(0)"), K.assign("h", "tl.program_id(1)"), *_axes(False), *_key_block(d),
            *_origin_comments(decl),
            *_chunk(), K.assign("n", "tl.load(chunk_seq_ptr + c)"),
            load("b_q", "q_ptr", QK_OFF, QK_MASK), load("b_k", "k_ptr", QK_OFF, QK_MASK), *_decay(d),
            K.For("vb", K.expr("0"), K.expr("tl.cdiv(V, BV)"), vloop))
    return K.Kernel(f"{decl.name}_fwd_o", params, body,
                    doc="Chunk c: O = scale ((Q * e^G) S0 + A V), S0 = the state entering it (hs slot c + n).")


def _store_share(ptr: str, value: str, split: bool):
    """Store `value` at ptr + V_OFF; `split` (per-key decay, whose kernels run in key blocks): it is one key
    block's share, added to the other blocks' under SPLIT_K and stored when there is one block."""
    store = K.Store(K.expr(f"{ptr} + {V_OFF}"), K.expr(value), K.expr(V_MASK))
    if not split:
        return store
    return K.If(K.expr("SPLIT_K"), (K.AtomicAdd(K.expr(f"{ptr} + {V_OFF}"), K.expr(value), K.expr(V_MASK)),), (store,))


def _outputs(split: bool = False) -> tuple:
    """O = scale ((Q * e^G) S + A V) of the chunk's value block, stored; S its start state, A formed.
    `split`: a key block's share (A and Q S over its keys), added to the other blocks' under SPLIT_K."""
    return (K.Comment("A V without a later non-finite row reaching an earlier one (module docstring)"),
            K.assign("bad", f"(tl.sum(tl.where(tl.abs(b_v) < {INF}, 0, 1), 1) > 0) & ok"),
            K.assign("first_bad", "tl.min(tl.where(bad, rows, C), 0)"),
            K.assign("o_inter", dot("q_dec", "S")),
            K.assign("o_c", f"o_inter + {dot('A', 'tl.where(rows[:, None] < first_bad, b_v, 0.0)')}"),
            K.If(K.expr("first_bad < n_rows"), (
                K.assign("o_c", f"tl.where(rows[:, None] < first_bad, o_c, o_inter + {dot('A', 'b_v')})"),)),
            _store_share("o_ptr", "scale * o_c", split))


def _pairwise(decay: str) -> tuple:
    """A, the masked intra-chunk matrix, once G and b_q, b_k are loaded (`_decay` without it first)."""
    if decay == "none":
        return (K.assign("A", f"tl.where(causal, {dot('b_q', 'tl.trans(b_k)')}, 0.0)"),)
    if decay == "per_head":
        return (K.assign("D", "tl.where(causal, tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], 0.0)), 0.0)"),
                K.assign("A", f"tl.where(causal, {dot('b_q', 'tl.trans(b_k)')} * D, 0.0)"))
    return (K.assign("A", "pairwise_qk(b_q, b_k, b_G, k_ptr, G_ptr, tok, h, H, kk, okk, n_rows, G_last, K, "
                          "C, BS, BK, PREC, UPCAST)"),)


def bwd_dh_kernel(decl: MatrixState) -> K.Kernel:
    d = decl.decay
    g = ["G_ptr"] if d != "none" else []
    params = _params(["q_ptr", *g, "do_ptr", "dht_ptr", "dh_ptr", "dh0_ptr", "chunk_tok_ptr", "chunk_len_ptr",
                      "seq_chunk0_ptr", "scale", "H"], SHAPE_CONSTS + ("HAS_DHT", "STORE_DH0"))
    b_k = (K.assign("b_k", "tl.zeros_like(b_q)"),)   # k_end is unused here; a zero tile keeps _decay's shapes
    step = dot("tl.trans(q_dec)", "b_do")
    loop = (K.assign("c", "c1 - 1 - i"), *_chunk(),
            K.Store(K.expr(f"dh_ptr + {state_off('c')}"), K.expr("rnd(dS, dh_ptr.dtype.element_ty, UPCAST)"),
                    K.expr(S_MASK)),
            load("b_q", "q_ptr", QK_OFF, QK_MASK), *b_k, load("b_do", "do_ptr", V_OFF, V_MASK),
            *_decay(d, with_pairwise=False),
            K.assign("dS", f"dS * s_dec + scale * {step}" if d != "none" else f"dS + scale * {step}"))
    return K.Kernel(f"{decl.name}_bwd_dh", params, reverse_state_pass(decl, loop),
                    doc="Chunks of sequence n in reverse: dS_end of each chunk (dh slot c), then d(initial state).")


def reverse_state_pass(decl: MatrixState, loop: tuple, setup: tuple = ()) -> tuple:
    """The body of a `{name}_bwd_dh` kernel: per (sequence n, head, value block), dS from dht (or 0), `loop`
    over the sequence's chunks in reverse (i = 0 .. c1 - c0 - 1; it stores dS_end and steps dS back), then
    d(initial state) under STORE_DH0. `setup`: statements after the axes."""
    return (K.assign("n", "tl.program_id(0)"), K.assign("h", "tl.program_id(1)"), K.assign("vb", "tl.program_id(2)"), *_axes(True),
            *setup, *_origin_comments(decl),
            K.assign("c0", "tl.load(seq_chunk0_ptr + n)"), K.assign("c1", "tl.load(seq_chunk0_ptr + n + 1)"),
            K.If(K.expr("HAS_DHT"), (load("dS", "dht_ptr", state_off("n"), S_MASK),),
                 (K.assign("dS", "tl.zeros([BK, BV], dtype=tl.float32)"),)),
            K.For("i", K.expr("0"), K.expr("c1 - c0"), loop),
            K.If(K.expr("STORE_DH0"), (K.Store(K.expr(f"dh0_ptr + {state_off('n')}"), K.expr("dS"), K.expr(S_MASK)),)))


def _hook_grads(decl: MatrixState) -> tuple:
    """d(input) = dg * d log_decay / d input, stored per token (summed over K for a per-token input of
    a per-key hook); a per-head parameter's, summed over the chunk, is added atomically (chunks of
    every sequence add to one [H] entry; fp32 atomics, so its bits depend on their order)."""
    hook, out = decl.log_decay, []
    names = _hook_names(decl)
    used = _hook_inputs(decl, decl.decay)
    targets = [f"dx_{n}" for n, _ in used]
    out += common.assign(targets, [hook.grads[n] for n, _ in used], names, "_dg", shape_like=_shape_like(decl))
    for n, kind in used:
        value = f"dg * dx_{n}"
        if kind == "head":
            mask = "ok" if decl.decay == "per_head" else QK_MASK
            out.append(K.AtomicAdd(K.expr(f"d{n}_ptr + h"), K.expr(f"tl.sum(tl.where({mask}, {value}, 0.0))")))
        elif decl.decay == "per_key" and kind == "token":   # summed over this program's key block
            out.append(K.AtomicAdd(K.expr(f"d{n}_ptr + (tok + rows) * H + h"),
                                   K.expr(f"tl.sum(tl.where({QK_MASK}, {value}, 0.0), 1)"), K.expr("ok")))
        else:
            off, mask = g_off(decl.decay)
            out.append(K.Store(K.expr(f"d{n}_ptr + {off}"), K.expr(value), K.expr(mask)))
    return tuple(out)


def bwd_kernel(decl: MatrixState) -> K.Kernel:
    d = decl.decay
    hooked = _hook_inputs(decl, d) if d != "none" else []
    g = ["G_ptr"] if d != "none" else []
    ins = [f"{n}_ptr" for n, _ in hooked] + [f"d{n}_ptr" for n, _ in hooked] + [f"c_{c}" for c in decl.constants
                                                                                if d != "none"]
    params = _params(["q_ptr", "k_ptr", "v_ptr", *g, "hs_ptr", "dh_ptr", "do_ptr", "dq_ptr", "dk_ptr", "dv_ptr",
                      "chunk_tok_ptr", "chunk_len_ptr", "chunk_seq_ptr", *ins, "scale", "H"],
                     SHAPE_CONSTS + (("SPLIT_K",) if d == "per_key" else ()))
    dv = f"scale * {dot('tl.trans(A)', 'b_do')} + {dot('k_end', 'dSe')}"
    dv_out = _store_share("dv_ptr", dv, d == "per_key")
    vloop = (K.assign("vv", "vb * BV + tl.arange(0, BV)"), K.assign("okv", "vv < V"),
             load("b_v", "v_ptr", V_OFF, V_MASK), load("b_do", "do_ptr", V_OFF, V_MASK),
             load("S0", "hs_ptr", state_off("c + n"), S_MASK), load("dSe", "dh_ptr", state_off("c"), S_MASK),
             K.assign("dA", f"dA + {dot('b_do', 'tl.trans(b_v)')}"),
             K.assign("dq_inter", f"dq_inter + {dot('b_do', 'tl.trans(S0)')}"),
             K.assign("dk_state", f"dk_state + {dot('b_v', 'tl.trans(dSe)')}"),
             *((K.assign("dG_S0", "dG_S0 + tl.sum(S0 * dSe, 1)"),) if d != "none" else ()), dv_out)
    body = [K.assign("c", "tl.program_id(0)"), K.assign("h", "tl.program_id(1)"), *_axes(False), *_key_block(d),
            *_origin_comments(decl),
            *_chunk(), K.assign("n", "tl.load(chunk_seq_ptr + c)"),
            load("b_q", "q_ptr", QK_OFF, QK_MASK), load("b_k", "k_ptr", QK_OFF, QK_MASK), *_decay(d),
            K.assign("dA", "tl.zeros([C, C], dtype=tl.float32)"), K.assign("dq_inter", "tl.zeros([C, BK], dtype=tl.float32)"),
            K.assign("dk_state", "tl.zeros([C, BK], dtype=tl.float32)"), K.assign("dG_S0", "tl.zeros([BK], dtype=tl.float32)"),
            K.For("vb", K.expr("0"), K.expr("tl.cdiv(V, BV)"), vloop),
            K.assign("dA", "tl.where(causal, scale * dA, 0.0)")]
    if d == "none":
        body += [K.assign("dq", f"scale * dq_inter + {dot('dA', 'b_k')}"),
                 K.assign("dk", f"{dot('tl.trans(dA)', 'b_q')} + dk_state")]
    elif d == "per_head":
        body += [K.assign("dAD", "tl.where(causal, dA * D, 0.0)"), K.assign("dq_s0", "scale * tl.exp(b_G)[:, None] * dq_inter"),
                 K.assign("dq", f"dq_s0 + {dot('dAD', 'b_k')}"),
                 K.assign("dk", f"{dot('tl.trans(dAD)', 'b_q')} + tl.exp(G_last - b_G)[:, None] * dk_state")]
    else:
        body += [K.assign("X, Y, Z", "pairwise_grads(dA, b_q, b_k, b_G, k_end * dk_state, q_ptr, k_ptr, G_ptr, tok, h, H, "
                                     "kk, okk, n_rows, G_last, K, C, BS, BK, PREC, UPCAST)"),
                 K.assign("dq_s0", "scale * tl.exp(b_G) * dq_inter"), K.assign("dq", "dq_s0 + X"),
                 K.assign("dk", "Y + tl.exp(G_last[None, :] - b_G) * dk_state")]
    body += [K.Store(K.expr(f"dq_ptr + {QK_OFF}"), K.expr("dq"), K.expr(QK_MASK)),
             K.Store(K.expr(f"dk_ptr + {QK_OFF}"), K.expr("tl.where(ok[:, None], dk, 0.0)"), K.expr(QK_MASK))]
    if d != "none":
        body += [K.Comment("dg_t, summed so that no two large terms cancel (the diagonal pairs i = j and the"),
                 K.Comment("state's own last row drop out of q dq - k dk exactly): the readout of S0 at rows >= t,"),
                 K.Comment("the pairs j < t <= i, e^(G_L) rowsum(S0 dS_end) and the writes j < t into S_end")]
        if d == "per_head":
            body += [K.assign("P", "tl.cumsum(tl.where(causal, A * dA, 0.0), 0, reverse=True)"),
                     K.assign("W", f"tl.sum(tl.where({QK_MASK}, k_end * dk_state, 0.0), 1)"),
                     K.assign("dg", f"tl.cumsum(tl.sum(tl.where({QK_MASK}, b_q * dq_s0, 0.0), 1), 0, reverse=True)"),
                     K.assign("dg", "dg + tl.sum(tl.where(rows[None, :] < rows[:, None], P + W[None, :], 0.0), 1)"),
                     K.assign("dg", "tl.where(ok, dg + tl.exp(G_last) * tl.sum(dG_S0, 0), 0.0)")]
        else:
            body += [K.assign("dg", f"tl.cumsum(tl.where({QK_MASK}, b_q * dq_s0, 0.0), 0, reverse=True) + Z"),
                     K.assign("dg", f"tl.where({QK_MASK}, dg + tl.exp(G_last)[None, :] * dG_S0[None, :], 0.0)")]
        body += [*_load_hook_inputs(decl), *_hook_grads(decl)]
    return K.Kernel(f"{decl.name}_bwd", params, tuple(body),
                    doc="Chunk c: dq, dk, dv" + (" and the hook inputs' gradients" if d != "none" else "") + ".")


def module(decl: MatrixState) -> K.Module:
    """The plain-write kernels of `decl` as one IR module (the structure decides which exist)."""
    if decl.correction != "plain":
        raise ValueError(f"declaration: matrix state {decl.name!r} has correction {decl.correction!r}; the generated "
                         "matrix-state kernels cover plain writes so far")
    kernels = helper_kernels(decl.decay)
    if decl.decay != "none":
        kernels.append(cumsum_kernel(decl))
    kernels += [fwd_kernel(decl), out_kernel(decl), bwd_dh_kernel(decl), bwd_kernel(decl)]
    doc = (f"Generated by scanlang from matrix state {E.docstring_text(decl.name)} (declaration {decl.key}): "
           f"decay {decl.decay}, plain write (backends/linear/kernels.py). Do not edit.")
    return K.Module(doc, tuple(kernels))


def render(decl: MatrixState) -> str:
    """The module's source text (deterministic)."""
    return print_module(module(decl))
