"""The delta rule's forward kernels (docs/spec/kaczmarz.md, "Chunkwise algorithm") on the kernel IR.

    prep(C)            delta_prep: gcum, beta, Tm = (I + A)^-1 (its merge of the C/16 row blocks
                       unrolled for the chunk size), w, u, the output's in-chunk matrix, non-finite rows
    wy()               wy_block, split_scaled, wy_block_split, nan_rows, wy_factors: w = Tm diag(beta e^G) K
                       and u = Tm diag(beta) V by column blocks, and delta_wu (the backward's recomputation)
    state()            state_pass and its two entry points delta_state_fwd / delta_state_output
    recurrent()        delta_recurrent, the token loop (decode / short inputs)
"""
from __future__ import annotations

from ..triton.kernel import ir as K
from .parts import (CHUNK_MAT, STATE_BLOCK, TOK, Hooks, aug, call, chunk_from_bounds, chunk_rows, const, fp32,
                    g_last, guard, jit, load_tm, loop, mm, note, per_token, ret, rnd, seq_bounds, state_program,
                    step_to_beta, store, store_final, tile, tile_off, when)

BLOCK = 16
# exp(-200) underflows to 0 in float32 (below about -103.9), and 200 per reset keeps the cumsum's rounding
# (|G| * 2^-24) near 1e-5 relative in the decays
LOG_DECAY_FLOOR = -200.0
SHAPE = "H, K:, V:, BK:, BV:, C:"
PRECS = "PREC:, IN_PREC:, UPCAST:"
KEY_TILE = "ok[:, None] & (kk[None, :] < K)"


def prep(chunk_size: int, hooks: Hooks = Hooks()):
    """The prep kernel for C = chunk_size, for a rule whose hooks need `hooks`.

    Tm = (I + A)^-1 with A = Ad + Ao (Ad: the 16x16 diagonal blocks, Ao: strictly below them). With
    Td = (I + Ad)^-1 (`inv_unit_lower_blocks`), I + A = (I + Ad)(I - N) for N = -Td Ao, strictly block-lower
    with N^(C/16) = 0, so Tm = (I - N)^-1 Td = (I + N)(I + N^2)(I + N^4)... Td, the product unrolled here
    (log2(C/16) factors), applied right to left as Tm <- Tm + N^(2^j) Tm: every term added is strictly
    block-lower, so the diagonal blocks of Tm are exactly Td, and only the powers and Tm stay live."""
    nb = chunk_size // BLOCK
    merge = []
    if nb > 1:
        powers = (nb - 1).bit_length()             # N, N^2, ..., N^(2^(powers-1)); N^nb = 0
        merge = [K.assign("below", f"(rows[:, None] // {BLOCK}) > (rows[None, :] // {BLOCK})"),
                 K.assign("N0", "-" + mm("Tm", "tl.where(below, A, 0.0)", "PREC"))]
        merge += [K.assign(f"N{j}", mm(f"N{j - 1}", f"N{j - 1}", "PREC")) for j in range(1, powers)]
        merge += [K.assign("Tm", "Tm + " + mm(f"N{j}", "Tm", "PREC")) for j in reversed(range(powers))]
    body = [
        *fp32(*hooks.eps_cast),
        K.assign("c", "tl.program_id(0)"), K.assign("h", "tl.program_id(1)"),
        K.assign("rows", "tl.arange(0, C)"), K.assign("kk", "tl.arange(0, BK)"),
        K.assign("t0, nv, tok, ok", "chunk_tokens(chunk_tok, chunk_len, c, rows)"),
        K.assign("km", KEY_TILE),
        K.assign("k", tile("k_ptr", "K", "kk", "km")),
        K.assign("a", per_token("a_ptr") + ".to(tl.float32)"),
        # log-decays floored at LOG_DECAY_FLOOR: exp of it is 0 in float32 (a reset stays exact) and G stays
        # finite, so G_i - G_j is never -inf - (-inf) for g = -inf (a hard reset)
        K.assign("g", f"decay_hook({hooks.decay_args})"),
        note("the first row whose decay is NaN or +inf (not a reset: -inf), before the floor hides a NaN (on the GPU)"),
        K.assign("first", "tl.min(tl.where(ok & ~(g < float('inf')), rows, C))"),
        K.assign("G", f"tl.cumsum(tl.where(ok, tl.maximum(g, {LOG_DECAY_FLOOR}), 0.0), 0)"),
        K.assign("s", per_token("s_ptr") + ".to(tl.float32)"),
        store(f"gcum_ptr + {TOK}", "G", "ok"),
        note("A_ij = beta_i (k_i . k_j) Dec_ij, strictly lower; Dec_ij = exp(G_i - G_j) for j <= i"),
        K.assign("causal", "rows[:, None] >= rows[None, :]"),
        K.assign("strict", "rows[:, None] > rows[None, :]"),
        K.assign("Dec", "tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0))"),
        note("the state pass's (Q K^T * Dec) over rows < nv, in the input dtype as its product reads it; every "
             "element"),
        note("(before K K^T: 168 registers, against 207 with A live across it; Triton 3.6, K = 128)"),
        K.assign("q", tile("q_ptr", "K", "kk", "km")),
        K.assign("Mq", f"tl.where(causal & ok[:, None], {mm('q', 'tl.trans(k)')} * Dec, 0.0)"),
        store(f"mq_ptr + {CHUNK_MAT}", rnd("Mq", "mq_ptr.dtype.element_ty")),
        note("||k_i||^2 (fp32) read off the diagonal of K K^T, the product A needs anyway"),
        K.assign("KK", mm("k", "tl.trans(k)")),
        K.assign("n2", "tl.sum(tl.where(rows[:, None] == rows[None, :], KK, 0.0), 1)"),
        step_to_beta(hooks),
        store(f"beta_ptr + {TOK}", "beta", "ok"),
        K.assign("A", "tl.where(strict, beta[:, None] * KK * Dec, 0.0)"),
        note("and the first whose decay, key (||k||^2) or step is not: Tm is formed with A's rows from it on as 0, "
             "then is"),
        note("NaN there (row i of (I + A)^-1 depends on A's rows <= i only; the products below would carry 0 * NaN "
             "into"),
        note("the earlier rows)"),
        K.assign("first", "tl.minimum(first, tl.min(tl.where(ok & ~(finite(n2) & finite(beta) & finite(G)), rows, C)))"),
        K.assign("nonfinite", "first < nv"),
        when("nonfinite", [K.assign("A", "tl.where(rows[:, None] < first, A, 0.0)")]),
        note("diagonal blocks in fp32 (\"ieee\") for fp32 inputs, on tensor cores at about fp32's accuracy otherwise"),
        when("PREC == 'ieee'", [K.assign("Tm", "inv_unit_lower_blocks(A, C, 'ieee')")],
             [K.assign("Tm", "inv_unit_lower_blocks(A, C, 'tf32x3')")]),
        *merge,
        when("nonfinite", [K.assign("Tm", "tl.where(rows[:, None] < first, Tm, float('nan'))")]),
        store(f"tm_ptr + {CHUNK_MAT}", "Tm"),
        K.assign("first_v", "wy_factors(k_ptr, v_ptr, w_ptr, u_ptr, Tm, beta, beta * tl.exp(G), tok, ok, h, H, K, V, BKS, "
                     "BV, PREC, UPCAST, nonfinite, C, True)"),
        store("nonfinite_ptr + c * H + h", "tl.minimum(first, first_v)")]
    return jit("delta_prep", f"q_ptr, k_ptr, v_ptr, a_ptr, {hooks.hp_param}s_ptr, {hooks.eps_param}chunk_tok, "
                             "chunk_len, w_ptr, u_ptr, tm_ptr, gcum_ptr, beta_ptr, mq_ptr, nonfinite_ptr, "
                             f"{SHAPE}, BKS:, {PRECS}", body, f"""
        gcum, beta, Tm = (I + A)^-1, w, u and the output's in-chunk matrix (Q K^T * Dec, causal) for one chunk
        of {chunk_size} tokens ({nb} blocks of {BLOCK} rows), and the chunk's first row whose key, step, decay
        or value is not finite (C if none; a decay of -inf is a reset), which the later kernels read.""")


# ---- w and u by column blocks --------------------------------------------------------------------

def _col_block():
    """Columns col0 .. col0 + BD of the chunk's rows of a [TT, H, D] tensor: mask m, offsets offs."""
    return [K.assign("cols", "col0 + tl.arange(0, BD)"), K.assign("rows", "tl.arange(0, C)"),
            K.assign("m", "ok[:, None] & (cols[None, :] < D)"), K.assign("offs", tile_off("D", "cols"))]


def _detect_and_guard():
    """DETECT: x's own first non-finite row (C if none) joins `nonfinite`; then x's guard."""
    return [K.assign("found", "C"),
            when("DETECT", [K.assign("found", "tl.min(tl.where(finite(x), C, rows[:, None]))"),
                            K.assign("nonfinite", "nonfinite | (found < C)")]),
            guard("x")]


BLOCK_ARGS = "tok, ok, h, H, col0, D:, BD:, PREC:, UPCAST:, nonfinite, C:, DETECT:"


def _wy_call(kind: str, x: str, out: str, factors: str, col0: str, D: str, BD: str, detect: str = "False") -> str:
    """A call of wy_block (factors 'Tm, scale') or wy_block_split (factors 'Th, Tl')."""
    return (f"{kind}({x}_ptr, {out}_ptr, {factors}, tok, ok, h, H, {col0}, {D}, {BD}, PREC, UPCAST, nonfinite, C, "
            f"{detect})")


def _nan_rows_call(x: str, out: str, col0: str, D: str, BD: str) -> str:
    return f"nan_rows({x}_ptr, {out}_ptr, tok, ok, h, H, {col0}, {D}, {BD}, C)"


def wy():
    wy_block = jit("wy_block", f"x_ptr, out_ptr, Tm, scale, {BLOCK_ARGS}", [
        *_col_block(),
        K.assign("x", "scale[:, None] * tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)"),
        *_detect_and_guard(),
        K.assign("y", mm("Tm", "x", "PREC")),
        store("out_ptr + offs", rnd("y", "out_ptr.dtype.element_ty"), "m"),
        ret("found")], """
        out = Tm diag(scale) x on columns col0 .. col0 + BD of one chunk's rows `tok` (valid where `ok`) of the
        [TT, H, D] tensors x and out: a block of w (x = K, scale = beta e^G) or of u (x = V, scale = beta).
        `nonfinite`: the chunk holds a non-finite token (Tm is NaN from its key, step or decay on), so diag(scale) x
        enters as `finite_or_zero` (`nan_rows` then makes the stored block NaN where the token loop's is); DETECT
        (delta_prep) also finds x's own non-finite rows here, and returns the first (C if none). Only the guard
        branches, not the product (one copy of its code).""")
    split_scaled = jit("split_scaled", "Tm, scale, UPCAST:", [
        K.assign("Ts", "Tm * scale[None, :]"),
        K.assign("hi", rnd("Ts", "tl.bfloat16")),
        ret("hi", rnd("Ts - hi.to(tl.float32)", "tl.bfloat16"))], """
        Tm diag(scale) as hi + lo, two bf16 matrices (hi the rounded product, lo the rounded remainder): together
        about 16 significant bits (tf32 keeps 11), multiplied by bf16 inputs as stored in two bf16 tensor-core
        products, which cost what one tf32 product of the same shape costs.""")
    wy_block_split = jit("wy_block_split", f"x_ptr, out_ptr, Th, Tl, {BLOCK_ARGS}", [
        *_col_block(),
        K.assign("x", "tl.load(x_ptr + offs, mask=m, other=0.0)"),
        *_detect_and_guard(),
        K.assign("y", f"{mm('Th', 'x', 'PREC')} + {mm('Tl', 'x', 'PREC')}"),
        store("out_ptr + offs", rnd("y", "out_ptr.dtype.element_ty"), "m"),
        ret("found")], """
        `wy_block` for bf16 x: out = (Th + Tl) x with (Th, Tl) = split_scaled(Tm, scale); x enters the tensor
        cores as loaded, with no fp32 copy. `nonfinite`, DETECT and the result as in `wy_block` (the scale's
        non-finite entries are 0 in Th and Tl, and their rows NaN through Tm's).""")
    nan_rows = jit("nan_rows", "x_ptr, out_ptr, tok, ok, h, H, col0, D:, BD:, C:", [
        *_col_block(),
        K.assign("y", "nan_from(tl.load(out_ptr + offs, mask=m, other=0.0), tl.load(x_ptr + offs, mask=m, other=0.0), rows, "
               "C)"),
        store("out_ptr + offs", "y", "m")], """
        After a block of w or u was stored from x's finite entries (`wy_block`): its columns NaN from x's first
        non-finite row in them on (`nan_from`; the rows of a non-finite scale are NaN through Tm's). A pass of its own
        after the products, in chunks with a non-finite token only: inside their loop the reduction's registers would
        be live with the split factors, and delta_prep's register count (every chunk's) would grow.""")
    key_blocks, value_blocks = "tl.cdiv(K, BKS)", "tl.cdiv(V, BV)"
    wy_factors = jit("wy_factors", "k_ptr, v_ptr, w_ptr, u_ptr, Tm, beta, bG, tok, ok, h, H, K:, V:, BKS:, BV:, "
                                   "PREC:, UPCAST:, nonfinite, C:, DETECT:", [
        K.assign("found", "tl.full([], C, tl.int32)"),
        when("k_ptr.dtype.element_ty == tl.bfloat16", [
            when("nonfinite", [
                note("a non-finite scale would reach the rows before its own through Tm's zeros"),
                K.assign("bG", "finite_or_zero(bG)"), K.assign("beta", "finite_or_zero(beta)")]),
            K.assign("Wh, Wl", "split_scaled(Tm, bG, UPCAST)"),
            loop("kb", key_blocks, [call(_wy_call("wy_block_split", "k", "w", "Wh, Wl", "kb * BKS", "K", "BKS"))]),
            K.assign("Uh, Ul", "split_scaled(Tm, beta, UPCAST)"),
            loop("iv", value_blocks, [K.assign("found", "tl.minimum(found, " + _wy_call(
                "wy_block_split", "v", "u", "Uh, Ul", "iv * BV", "V", "BV", "DETECT") + ")")])], [
            loop("kb", key_blocks, [call(_wy_call("wy_block", "k", "w", "Tm, bG", "kb * BKS", "K", "BKS"))]),
            loop("iv", value_blocks, [K.assign("found", "tl.minimum(found, " + _wy_call(
                "wy_block", "v", "u", "Tm, beta", "iv * BV", "V", "BV", "DETECT") + ")")])]),
        when("nonfinite | (found < C)", [
            note("the blocks are read back by other threads than those that stored them"),
            call("tl.debug_barrier()"),
            loop("kb", key_blocks, [call(_nan_rows_call("k", "w", "kb * BKS", "K", "BKS"))]),
            loop("iv", value_blocks, [call(_nan_rows_call("v", "u", "iv * BV", "V", "BV"))])]),
        ret("found")], """
        w = Tm diag(bG) K (bG = beta e^G) and u = Tm diag(beta) V of one chunk, BKS / BV columns at a time:
        bf16 inputs through `split_scaled` (Tm diag(scale) split once per factor), others by `wy_block`.
        `nonfinite` and DETECT as in `wy_block` (DETECT on V's blocks), then `nan_rows` where either holds; returns V's
        first non-finite row (or C).""")
    return [wy_block, split_scaled, wy_block_split, nan_rows, wy_factors, _delta_wu()]


def _delta_wu():
    w_blk = ("k", "w", "j * BKS", "K", "BKS")          # program j's block: of w for j < NKB, else of u
    u_blk = ("v", "u", "(j - NKB) * BV", "V", "BV")

    def w_or_u(kind, factors):
        """`if j < NKB:` the w block `else:` the u block, by wy_block (kind) or wy_block_split."""
        return when("j < NKB", [call(_wy_call(kind, *w_blk[:2], factors, *w_blk[2:]))],
                    [call(_wy_call(kind, *u_blk[:2], factors, *u_blk[2:]))])

    blocks = [
        when("j < NKB", [K.assign("G", per_token("gcum_ptr")), K.assign("scale", "beta * tl.where(ok, tl.exp(G), 0.0)")],
             [K.assign("scale", "beta")]),
        when("k_ptr.dtype.element_ty == tl.bfloat16", [
            note("as delta_prep computes them (`wy_factors`)"),
            guard("scale"),
            K.assign("Th, Tl", "split_scaled(Tm, scale, UPCAST)"),
            w_or_u("wy_block_split", "Th, Tl")], [
            w_or_u("wy_block", "Tm, scale")]),
        when("nonfinite", [
            note("as in wy_factors"),
            call("tl.debug_barrier()"),
            when("j < NKB", [call(_nan_rows_call(*w_blk))], [call(_nan_rows_call(*u_blk))])])]
    body = [
        const("NKB", "(K + BKS - 1) // BKS"), const("NJ", "1 if PER_CHUNK else NKB + (V + BV - 1) // BV"),
        K.assign("c", "tl.program_id(0) // NJ"), K.assign("j", "tl.program_id(0) % NJ"), K.assign("h", "tl.program_id(1)"),
        *chunk_rows(),
        K.assign("beta", per_token("beta_ptr")),
        K.assign("causal", "(rows[:, None] >= rows[None, :]) & ok[:, None] & ok[None, :]"),
        note("an unmasked (vectorised) load: delta_prep wrote every element"),
        load_tm(),
        K.assign("nonfinite", "tl.load(nonfinite_ptr + c * H + h) < nv"),
        when("PER_CHUNK", [
            K.assign("G", per_token("gcum_ptr")),
            call("wy_factors(k_ptr, v_ptr, w_ptr, u_ptr, Tm, beta, beta * tl.where(ok, tl.exp(G), 0.0), tok, ok, h, H, "
                 "K, V, BKS, BV, PREC, UPCAST, nonfinite, C, False)")], blocks)]
    return jit("delta_wu", f"k_ptr, v_ptr, gcum_ptr, beta_ptr, tm_ptr, w_ptr, u_ptr, nonfinite_ptr, chunk_tok, "
                           f"chunk_len, {SHAPE}, BKS:, {PRECS}, PER_CHUNK:=False", body, """
        w = Tm diag(beta e^G) K and u = Tm diag(beta) V from a saved Tm (the backward's recomputation).
        Program (c * NJ + j, h) writes column block j of chunk c: of w (BKS columns) for j < cdiv(K, BKS), else of
        u (BV columns). Short programs (one load of Tm and one of K or V) keep many in flight; a chunk's NJ
        programs are launched one after another, so all but the first find Tm in L2. With PER_CHUNK, program (c, h)
        writes all of chunk c's blocks as delta_prep does (`wy_factors`): Tm read and split once per chunk. A chunk
        with a non-finite token (`nonfinite`, from delta_prep) takes the guarded products, as delta_prep did.""")


# ---- the sequential state pass -------------------------------------------------------------------

def state():
    loop_body = [
        *chunk_from_bounds(),
        when("not OUTPUT", [store(f"h_ptr + {STATE_BLOCK}", rnd("S", "h_ptr.dtype.element_ty"), "sm")]),
        K.assign("km", KEY_TILE), K.assign("vm", "ok[:, None] & (vv[None, :] < V)"),
        K.assign("w", tile("w_ptr", "K", "kk", "km")),
        K.assign("k", tile("k_ptr", "K", "kk", "km")),
        K.assign("u", tile("u_ptr", "V", "vv", "vm") + ".to(tl.float32)"),
        K.assign("G", per_token("gcum_ptr")),
        g_last(),
        K.assign("Sq", rnd("S", "w.dtype")),
        K.assign("U", "u - " + mm("w", "Sq")),
        K.assign("Uq", rnd("U", "k.dtype")),
        when("OUTPUT", [
            K.assign("q", tile("q_ptr", "K", "kk", "km")),
            note("an unmasked (vectorised) load: delta_prep wrote every element"),
            K.assign("M", f"tl.load(mq_ptr + {CHUNK_MAT})"),
            note("U is not finite from some rows on (a non-finite S0: all of them); only the guards branch (U is live"),
            note("for the state's update anyway), the products are shared"),
            K.assign("nonfinite", "tl.load(nonfinite_ptr + c * H + h) < nv"),
            guard("Uq"),
            K.assign("o", mm("q", "Sq") + " * tl.exp(G)[:, None]"),
            aug("o", mm("M", "Uq")),
            when("nonfinite", [K.assign("o", "nan_from(o, U, rows, C)")]),
            store("o_ptr + " + tile_off("V", "vv"), "o * scale", "vm")], [
            store("U_ptr + " + tile_off("V", "vv"), rnd("U", "U_ptr.dtype.element_ty"), "vm")]),
        note("(K e^(G_last - G))^T U as K^T (e^(G_last - G) U): the decay scales the [C, BV] innovations, not the"),
        note("[C, K] keys, which enter the tensor cores as loaded"),
        K.assign("tail", "tl.where(ok, tl.exp(G_last - G), 0.0)"),
        K.assign("S", "S * tl.exp(G_last) + " + mm("tl.trans(k)", rnd("U * tail[:, None]", "k.dtype")))]
    state_pass = jit("state_pass", "q_ptr, k_ptr, w_ptr, u_ptr, gcum_ptr, h0_ptr, chunk_tok, chunk_len, seq_chunk0, "
                                   "h_ptr, U_ptr, ht_ptr, o_ptr, mq_ptr, nonfinite_ptr, scale, "
                                   f"{SHAPE}, HAS_H0:, STORE_FINAL:, OUTPUT:, {PRECS}", [
        *state_program(),
        K.assign("rows", "tl.arange(0, C)"),
        K.assign("sm", "(kk[:, None] < K) & (vv[None, :] < V)"),
        K.assign("S", "initial_state(h0_ptr, n, h, H, kk, vv, sm, HAS_H0, K, V, BK, BV)"),
        K.assign("c0", "tl.load(seq_chunk0 + n)"), K.assign("c1", "tl.load(seq_chunk0 + n + 1)"),
        note("A sequence's chunks are consecutive runs of C tokens: their first tokens and lengths follow from the"),
        note("sequence's bounds, so no address in the loop waits on a load and the next chunk's loads can be issued "
             "early."),
        *seq_bounds(),
        loop("c", "c1", loop_body, start="c0"),
        store_final("STORE_FINAL", "ht_ptr", "S")], """
    Sequential over a sequence's chunks with the fp32 state S [K, BV] in registers: U = u - w S0,
    S_end = e^G_last S0 + (K e^(G_last - G))^T U. Stores S0 per chunk and U (h_ptr, U_ptr), or with OUTPUT
    the chunk's output O = scale (e^G Q S0 + (Q K^T * Dec) U) instead (o_ptr; all the forward needs), from
    S0 and U rounded as they would have been stored, and (Q K^T * Dec) as delta_prep stored it (mq_ptr [NC, H, C, C]:
    state-independent work stays in the parallel kernel); in a chunk with a non-finite token (nonfinite_ptr [NC, H])
    through `finite_or_zero` and `nan_from`.""")
    fwd = jit("delta_state_fwd", "k_ptr, w_ptr, u_ptr, gcum_ptr, h0_ptr, chunk_tok, chunk_len, seq_chunk0, h_ptr, "
                                 f"U_ptr, ht_ptr, {SHAPE}, HAS_H0:, STORE_FINAL:, {PRECS}", [
        call("state_pass(k_ptr, k_ptr, w_ptr, u_ptr, gcum_ptr, h0_ptr, chunk_tok, chunk_len, seq_chunk0, h_ptr, U_ptr, "
             "ht_ptr, ht_ptr, k_ptr, chunk_len, 1.0, H, K, V, BK, BV, C, HAS_H0, STORE_FINAL, False, PREC, IN_PREC, "
             "UPCAST)")])
    output = jit("delta_state_output", "q_ptr, k_ptr, w_ptr, u_ptr, gcum_ptr, h0_ptr, chunk_tok, chunk_len, "
                                       f"seq_chunk0, ht_ptr, o_ptr, mq_ptr, nonfinite_ptr, scale, {SHAPE}, HAS_H0:, "
                                       f"STORE_FINAL:, {PRECS}", [
        *fp32("scale"),
        call("state_pass(q_ptr, k_ptr, w_ptr, u_ptr, gcum_ptr, h0_ptr, chunk_tok, chunk_len, seq_chunk0, o_ptr, o_ptr, "
             "ht_ptr, o_ptr, mq_ptr, nonfinite_ptr, scale, H, K, V, BK, BV, C, HAS_H0, STORE_FINAL, True, PREC, "
             "IN_PREC, UPCAST)")])
    return [state_pass, fwd, output]


def recurrent(hooks: Hooks = Hooks()):
    def vec(name, ptr, D, cols, mask):
        return K.assign(name, f"tl.load({ptr} + (t * H + h) * {D} + {cols}, mask={mask}, other=0.0).to(tl.float32)")

    body = [
        vec("k", "k_ptr", "K", "kk", "kmask"), vec("q", "q_ptr", "K", "kk", "kmask"),
        vec("v", "v_ptr", "V", "vv", "vmask"),
        K.assign("a", "tl.load(a_ptr + t * H + h).to(tl.float32)"), K.assign("s", "tl.load(s_ptr + t * H + h).to(tl.float32)"),
        *([K.assign("n2", "tl.sum(k * k, 0)")] if hooks.takes_n2 else []),
        step_to_beta(hooks),
        K.assign("S", f"S * tl.exp(decay_hook({hooks.decay_args}))"),
        K.assign("e", "v - tl.sum(S * k[:, None], 0)"),
        aug("S", "(beta * k)[:, None] * e[None, :]"),
        store("o_ptr + (t * H + h) * V + vv", "scale * tl.sum(S * q[:, None], 0)", "vmask")]
    return jit("delta_recurrent", f"q_ptr, k_ptr, v_ptr, a_ptr, {hooks.hp_param}s_ptr, {hooks.eps_param}h0_ptr, o_ptr, "
                                  "ht_ptr, cu_ptr, scale, H, K:, V:, BK:, BV:, HAS_H0:, STORE_FINAL:", [
        *fp32(*hooks.eps_cast, "scale"),
        *state_program(),
        K.assign("kmask", "kk < K"), K.assign("vmask", "vv < V"), K.assign("sm", "kmask[:, None] & vmask[None, :]"),
        K.assign("S", "initial_state(h0_ptr, n, h, H, kk, vv, sm, HAS_H0, K, V, BK, BV)"),
        K.assign("bos", "tl.load(cu_ptr + n).to(tl.int64)"), K.assign("eos", "tl.load(cu_ptr + n + 1).to(tl.int64)"),
        loop("t", "eos", body, start="bos"),
        store_final("STORE_FINAL", "ht_ptr", "S")])
