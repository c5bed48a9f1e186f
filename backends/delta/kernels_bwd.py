"""The delta rule's backward kernels on the kernel IR (their roles: codegen.py's module docstring).

    local()        delta_dU_local and local_dU: the outputs' in-chunk part of dU
    state_bwd()    delta_state_bwd: the reverse pass over a sequence's chunks (dS_end, dU, dS0)
    dqk()          delta_bwd_dqk: dq, and dk / dTm / dG / dbeta by key blocks (or all of it under WY)
    through()      mm_lowp, u_grads, through_inverse, through_keys, hook_grads: the chain rule's pieces
    wy()           delta_bwd_wy: dv, dk and the hooks' gradients per chunk from dqk's shares
"""
from __future__ import annotations

from ..triton.kernel import ir as K
from .parts import (STATE_BLOCK, TOK, Hooks, aug, call, chunk_from_bounds, chunk_rows, const, fp32, g_last,
                    jit, load_tm, loop, mm, nan_after, note, per_token, ret, rnd, seq_bounds, state_program,
                    store, store_final, tile, tile_off, when)

SHAPE = "H, K:, V:, BK:, BV:, C:"
PRECS = "PREC:, IN_PREC:, UPCAST:"
KEY_TILE = "ok[:, None] & (kk[None, :] < K)"
VALUE_TILE = "ok[:, None] & (vv[None, :] < V)"
CAUSAL = "(rows[:, None] >= rows[None, :]) & ok[:, None] & ok[None, :]"


def local():
    dU_local = jit("delta_dU_local", "q_ptr, k_ptr, gcum_ptr, do_ptr, dul_ptr, doq_ptr, chunk_tok, chunk_len, scale, "
                                     f"{SHAPE}, STORE_DO:, {PRECS}", [
        *fp32("scale"),
        note("a chunk's value blocks run back to back: q, k from L2"),
        const("NVB", "(V + BV - 1) // BV"),
        K.assign("c", "tl.program_id(0) // NVB"), K.assign("h", "tl.program_id(1)"),
        K.assign("vv", "tl.program_id(0) % NVB * BV + tl.arange(0, BV)"), K.assign("kk", "tl.arange(0, BK)"),
        *chunk_rows(),
        K.assign("km", KEY_TILE), K.assign("vm", VALUE_TILE),
        K.assign("q", tile("q_ptr", "K", "kk", "km")), K.assign("k", tile("k_ptr", "K", "kk", "km")),
        K.assign("G", per_token("gcum_ptr")),
        K.assign("do", tile("do_ptr", "V", "vv", "vm")),
        when("STORE_DO", [store("doq_ptr + " + tile_off("V", "vv"), rnd("do", "doq_ptr.dtype.element_ty"), "vm")]),
        K.assign("dU", "local_dU(q, k, G, do, ok, rows, scale, IN_PREC, UPCAST)"),
        store("dul_ptr + " + tile_off("V", "vv"), "dU", "vm")], """
        dU from the outputs within each chunk, scale (Q K^T * D)^T dO (fp32), for delta_state_bwd without
        LOCAL_DU: per chunk and block of BV value columns, in parallel. With STORE_DO, also dO rounded to doq's
        dtype (the input dtype, to which every later use of dO rounds it: the same bits, half the reads).""")
    local_dU = jit("local_dU", "q, k, G, do, ok, rows, scale, IN_PREC:, UPCAST:", [
        K.assign("causal_t", "(rows[None, :] >= rows[:, None]) & ok[None, :]"),
        K.assign("Dt", "tl.where(causal_t, tl.exp(tl.where(causal_t, G[None, :] - G[:, None], 0.0)), 0.0)"),
        K.assign("Mt", mm("k", "tl.trans(q)") + " * Dt"),
        ret(mm(rnd("Mt", "q.dtype"), rnd("do", "q.dtype")) + " * scale")],
        "scale (Q K^T * D)^T dO for one chunk (row j: key, column i: query of the causal mask's transpose).")
    return [dU_local, local_dU]


def state_bwd():
    loop_body = [
        K.assign("c", "c1 - 1 - i"),
        when("SEQ_BOUNDS", [note("no address in the loop waits on a load"), *chunk_from_bounds()],
             [K.assign("t0, nv, tok, ok", "chunk_tokens(chunk_tok, chunk_len, c, rows)")]),
        store(f"dh_ptr + {STATE_BLOCK}", rnd("dS", "dh_ptr.dtype.element_ty"), "sm"),
        K.assign("km", KEY_TILE), K.assign("vm", VALUE_TILE),
        K.assign("q", tile("q_ptr", "K", "kk", "km")), K.assign("k", tile("k_ptr", "K", "kk", "km")),
        K.assign("w", tile("w_ptr", "K", "kk", "km")),
        K.assign("G", per_token("gcum_ptr")), g_last(),
        K.assign("do", tile("do_ptr", "V", "vv", "vm")),
        when("LOCAL_DU", [note("off the loop's dependency chain (it does not depend on dS)"),
                          K.assign("dU", "local_dU(q, k, G, do, ok, rows, scale, IN_PREC, UPCAST)")],
             [K.assign("dU", tile("dul_ptr", "V", "vv", "vm"))]),
        K.assign("tail", "tl.where(ok, tl.exp(G_last - G), 0.0)"),
        when("DECAY_V", [
            note("the decays scale [C, BV] tiles (dU's rows, dO's rows); q and k enter the dots as loaded"),
            aug("dU", "tail[:, None] * " + mm("k", rnd("dS", "k.dtype")))], [
            K.assign("kt", rnd("k.to(tl.float32) * tail[:, None]", "k.dtype")),
            aug("dU", mm("kt", rnd("dS", "k.dtype")))]),
        store("dU_ptr + " + tile_off("V", "vv"), rnd("dU", "dU_ptr.dtype.element_ty"), "vm"),
        K.assign("eG", "tl.where(ok, tl.exp(G), 0.0)"),
        when("DECAY_V", [
            K.assign("dS", "dS * tl.exp(G_last) + scale * " + mm("tl.trans(q)", rnd("do * eG[:, None]", "q.dtype")))], [
            K.assign("qg", rnd("q.to(tl.float32) * eG[:, None]", "q.dtype")),
            K.assign("dS", "dS * tl.exp(G_last) + scale * " + mm("tl.trans(qg)", rnd("do", "q.dtype")))]),
        aug("dS", mm("tl.trans(w)", rnd("dU", "w.dtype")), "-")]
    return jit("delta_state_bwd", "q_ptr, k_ptr, w_ptr, gcum_ptr, do_ptr, dul_ptr, dht_ptr, chunk_tok, chunk_len, "
                                  f"seq_chunk0, dh_ptr, dU_ptr, dh0_ptr, scale, {SHAPE}, HAS_DHT:, STORE_DH0:, "
                                  f"LOCAL_DU:, {PRECS}, SEQ_BOUNDS:=False, DECAY_V:=False", [
        *fp32("scale"),
        *state_program(),
        K.assign("rows", "tl.arange(0, C)"),
        K.assign("sm", "(kk[:, None] < K) & (vv[None, :] < V)"),
        K.assign("dS", "initial_state(dht_ptr, n, h, H, kk, vv, sm, HAS_DHT, K, V, BK, BV)"),
        K.assign("c0", "tl.load(seq_chunk0 + n)"), K.assign("c1", "tl.load(seq_chunk0 + n + 1)"),
        when("SEQ_BOUNDS", [note("chunks' first tokens and lengths from the sequence's bounds, as in the forward's "
                                 "state_pass"), *seq_bounds()]),
        loop("i", "c1 - c0", loop_body),
        store_final("STORE_DH0", "dh0_ptr", "dS")], """
        Reverse over a sequence's chunks with dS [K, BV] (fp32) in registers: stores dS_end per chunk (dh) and
        dU = scale (Q K^T * D)^T dO + K~ dS_end (the local part formed here with LOCAL_DU, else loaded from dul,
        where delta_dU_local stored it), stored in dU's dtype (fp32, or the input dtype: the host's LOWP_DU, the bits
        every later dot of dU but bwd_wy's at PREC takes); dS0 = e^G_last dS_end + scale (e^G Q)^T dO - w^T dU.
        SEQ_BOUNDS: chunk addresses from the sequence's bounds (no table loads in the loop). DECAY_V: K~ dS_end as
        e^(G_last - G) (K dS_end) and (e^G Q)^T dO as Q^T (e^G dO), scaling [C, BV] tiles instead of [C, K] ones.""")


def _zeros(name: str, shape: str):
    return K.assign(name, f"tl.zeros([{shape}], dtype=tl.float32)")


def _store_dk():
    return store("dk_ptr + " + tile_off("K", "kk"), rnd("dk", "dk_ptr.dtype.element_ty"), "km")


def _hook_grads_call(hooks: Hooks, n2: str):
    """dn2 = hook_grads(...) (d||k||^2, `n2` the keys' squared norms), or the call alone for a step without n2 (which
    still passes `n2` for the zero-key guard where the rule needs it)."""
    args = f"dG, dbeta, {n2 + ', ' if hooks.takes_n2 else ''}a_ptr, {hooks.hp_param}s_ptr, {hooks.eps_param}da_ptr, " \
           f"{hooks.dhp_param}ds_ptr, tok, h, H, {'TTH, ' if hooks.params else ''}ok, rows, bad_row"
    return K.assign("dn2", f"hook_grads({args})") if hooks.n2 else call(f"hook_grads({args})")


def dqk(hooks: Hooks = Hooks()):
    value_loop = [
        K.assign("vv", "iv * BV + tl.arange(0, BV)"), K.assign("vm", VALUE_TILE), K.assign("sm", "(kk[:, None] < K) & (vv[None, :] < V)"),
        K.assign("S0", f"tl.load(h_ptr + {STATE_BLOCK}, mask=sm, other=0.0)"),
        K.assign("dSe", f"tl.load(dh_ptr + {STATE_BLOCK}, mask=sm, other=0.0)"),
        note("h, dh and U are stored in the input dtype; dU and dO (fp32) are rounded to it for the dots"),
        K.assign("U", tile("U_ptr", "V", "vv", "vm")),
        when("bad_row < nv", [
            note("else 0 * NaN through the causal mask and the chunk end's sums (terms that cancel in dg)"),
            K.assign("U", "finite_or_zero(U)")]),
        K.assign("dU", tile("dU_ptr", "V", "vv", "vm")),
        K.assign("do", rnd(tile("do_ptr", "V", "vv", "vm"), "S0.dtype")),
        aug("dOU", mm("do", "tl.trans(U)")),
        aug("dq1", mm("do", "tl.trans(S0)")),
        aug("dks", mm("U", "tl.trans(dSe)")),
        aug("dw", mm(rnd("dU", "S0.dtype"), "tl.trans(S0)"), "-"),
        aug("dlast", "tl.sum(S0.to(tl.float32) * dSe.to(tl.float32), 1)"),
        when("WY", [K.assign("dbeta, dTm", "u_grads(v_ptr, dv_ptr, Tm, dU, beta, dbeta, dTm, tok, vv, vm, h, H, V, LOWP, "
                                    "PREC, IN_PREC, UPCAST, bad_row < nv)")])]
    epilogue = [
        note("the epilogue consumes the loop's tiles one by one: dOU, dq1, dks, dw"),
        K.assign("G", per_token("gcum_ptr")), g_last(),
        K.assign("eG", "tl.where(ok, tl.exp(G), 0.0)"),
        K.assign("q", tile("q_ptr", "K", "kk", "km")), K.assign("k", tile("k_ptr", "K", "kk", "km")),
        K.assign("kf", "k.to(tl.float32)"),
        note("outputs (every dG term below is a sum over key columns: each block adds its share)"),
        K.assign("dM", "dOU * tl.where(causal, tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0)), 0.0) * scale"),
        K.assign("dMq", rnd("dM", "q.dtype")),
        K.assign("dq1", "dq1 * (scale * eG)[:, None]"),
        when("DG_SUMS", [K.assign("dq", "dq1 + " + mm("dMq", "k")), K.assign("dG", "tl.sum(dq * q.to(tl.float32), 1)")], [
            K.assign("PM", "dM * " + mm("q", "tl.trans(k)")),
            K.assign("dG", "tl.sum(PM, 1) - tl.sum(PM, 0)"),
            aug("dG", "tl.sum(dq1 * q.to(tl.float32), 1)"),
            K.assign("dq", "dq1 + " + mm("dMq", "k"))]),
        nan_after("dq"),
        store("dq_ptr + " + tile_off("K", "kk"), rnd("dq", "dq_ptr.dtype.element_ty"), "km"),
        note("w = Tm X on this block's columns: dTm += dw X^T, dX = Tm^T dw (fp32 operands: PREC)"),
        K.assign("bG", "beta * eG"),
        when("LOWP", [note("dw X^T = (dw K^T) diag(bG): the keys enter as loaded"),
                      K.assign("dTm_blk", mm(rnd("dw", "k.dtype"), "tl.trans(k)") + " * bG[None, :]")],
             [K.assign("dTm_blk", mm("dw", "tl.trans(bG[:, None] * kf)", "PREC"))]),
        when("WY", [aug("dTm", "dTm_blk")], [
            store("dTm_ptr + (((c * H + h) * NKB + kb) * C + rows[:, None]).to(tl.int64) * C + rows[None, :]",
                  rnd("dTm_blk", "dTm_ptr.dtype.element_ty")),
            load_tm()]),
        K.assign("dX", "mm_lowp(tl.trans(Tm), dw, k.dtype, LOWP, PREC, IN_PREC, UPCAST)"),
        K.assign("sx", "tl.sum(dX * kf, 1)"),
        aug("dG", "bG * sx"),
        note("chunk end state: S_end = e^G_last S0 + (K e^(G_last - G))^T U"),
        K.assign("dk", "dks * tl.where(ok, tl.exp(G_last - G), 0.0)[:, None]"),
        K.assign("cj", "tl.sum(dk * kf, 1)"),
        aug("dG", "cj", "-"),
        aug("dG", "tl.where(rows == nv - 1, tl.sum(dlast, 0) * tl.exp(G_last) + tl.sum(cj, 0), 0.0)"),
        when("DG_SUMS", [K.assign("dkM", mm("tl.trans(dMq)", "q")), aug("dG", "tl.sum(dkM * kf, 1)", "-"),
                         aug("dk", "dkM")],
             [aug("dk", mm("tl.trans(dMq)", "q"))]),
        aug("dk", "bG[:, None] * dX"),
        when("WY", [
            aug("dbeta", "eG * sx"),
            K.assign("E", "through_inverse(Tm, dTm, G, ok, rows, k.dtype, LOWP, PREC, IN_PREC, UPCAST)"),
            K.assign("KK", mm("k", "tl.trans(k)")),
            aug("dbeta", "tl.sum(E * KK, 1)"),
            *_through_A(),
            _hook_grads_call(hooks, "tl.sum(kf * kf, 1)"),
            aug("dk", "through_keys(E, k, beta, LOWP, PREC, IN_PREC, UPCAST)"),
            *([aug("dk", "dn2[:, None] * kf")] if hooks.n2 else []),
            nan_after("dk"),
            _store_dk()], [
            store(f"dbeta_ptr + kb * TTH + {TOK}", "eG * sx", "ok"),
            note("the dk share (and the dTm share above): fp32, or the input dtype (the host's choice, LOWP_DK / "
                 "LOWP_DTM)"),
            _store_dk(),
            store(f"dG_ptr + kb * TTH + {TOK}", "dG", "ok")])]
    body = [
        *fp32(*hooks.eps_cast, "scale"),
        note("a chunk's key blocks run back to back: U, dU, dO from L2"),
        const("NKB", "(K + BKS - 1) // BKS"),
        K.assign("c", "tl.program_id(0) // NKB"), K.assign("h", "tl.program_id(1)"), K.assign("kb", "tl.program_id(0) % NKB"),
        K.assign("kk", "kb * BKS + tl.arange(0, BKS)"),
        *chunk_rows(),
        K.assign("km", KEY_TILE), K.assign("causal", CAUSAL),
        _zeros("dq1", "C, BKS"), _zeros("dks", "C, BKS"), _zeros("dw", "C, BKS"), _zeros("dOU", "C, C"),
        _zeros("dlast", "BKS"),
        K.assign("beta", per_token("beta_ptr")),
        _zeros("dTm", "C, C"), _zeros("dbeta", "C"),
        K.assign("bad_row", "tl.load(nonfinite_ptr + c * H + h)"),
        when("WY", [note("Tm is needed in the value loop (u = Tm diag(beta) V); an unmasked load: delta_prep wrote "
                         "it all"), load_tm()]),
        loop("iv", "tl.cdiv(V, BV)", value_loop),
        *epilogue]
    return jit("delta_bwd_dqk", f"q_ptr, k_ptr, v_ptr, a_ptr, {hooks.hp_param}s_ptr, {hooks.eps_param}gcum_ptr, "
                                "beta_ptr, tm_ptr, nonfinite_ptr, h_ptr, dh_ptr, U_ptr, dU_ptr, do_ptr, dq_ptr, "
                                f"dk_ptr, dv_ptr, dTm_ptr, dG_ptr, dbeta_ptr, da_ptr, {hooks.dhp_param}ds_ptr, "
                                f"chunk_tok, chunk_len, scale, TTH, {SHAPE}, BKS:, WY:, {PRECS}, DG_SUMS:=False, "
                                "LOWP:=False", body, """
    Per chunk and block of BKS key columns, through O = scale (e^G Q S0 + (Q K^T * D) U), S_end,
    U = u - w S0 and w = Tm X, X = diag(beta e^G) K: dq (final); this block's shares (fp32) of dk, of dTm
    = dw X^T, of dG and of dbeta. dw = -dU S0^T is used where it is formed (dX = Tm^T dw), never stored.
    With WY (one block of all K columns) the program also does delta_bwd_wy's work for its chunk, from the
    same loads and without the shares' round trip: dv, dk, d step input, d decay input (final).
    DG_SUMS: the outputs' in-chunk part of dG as row sums of its dq and dk terms, q . (dM K) - k . (dM^T Q)
    (= rowsum - colsum of dM * Q K^T, without forming Q K^T). LOWP: the dots of fp32 operands (dw, Tm, and
    under WY dTm, E) take them rounded to the input dtype, as the input dtype's tensor cores need. In a chunk with
    a non-finite token (nonfinite_ptr [NC, H]: its row, else C) U's and V's non-finite entries enter as 0 and dq (under
    WY dk and the step and decay gradients too, `hook_grads`) are NaN from that row on, as the token loop's are.""")


def _through_A():
    """dG's part through A = strictly_lower(diag(beta) K K^T * D), given E and K K^T."""
    return [K.assign("PA", "E * KK * beta[:, None]"), aug("dG", "tl.sum(PA, 1) - tl.sum(PA, 0)")]


def _step_grads(hooks: Hooks) -> list:
    """Store d(step input) and return d||k||^2 (a step that reads n2), zero where `step_beta` took beta as 0 (a
    rule that needs the guard)."""
    grads = K.assign("dbeta_ds, dbeta_dn2" if hooks.n2 else "dbeta_ds", f"step_hook_grad({hooks.step_args})")
    if not hooks.guard:
        return [grads, store(f"ds_ptr + {TOK}", "dbeta * dbeta_ds", "ok"),
                *([ret("2.0 * dbeta * dbeta_dn2")] if hooks.n2 else [])]
    return [grads, K.assign("_, dead", f"step_beta({hooks.step_args})"),
            store(f"ds_ptr + {TOK}", "tl.where(dead, 0.0, dbeta * dbeta_ds)", "ok"),
            *([ret("tl.where(dead, 0.0, 2.0 * dbeta * dbeta_dn2)")] if hooks.n2 else [])]


def through(hooks: Hooks = Hooks()):
    mm_lowp = jit("mm_lowp", "a, b, dtype:, LOWP:, PREC:, IN_PREC:, UPCAST:", [
        when("LOWP", [ret(mm(rnd("a", "dtype"), rnd("b", "dtype")))], [ret(mm("a", "b", "PREC"))])], """
        a @ b of fp32 operands: at PREC, or with LOWP both rounded to `dtype` (the input dtype: for fp32 inputs
        the same product) and multiplied at IN_PREC.""")
    u_grads = jit("u_grads", "v_ptr, dv_ptr, Tm, dU, beta, dbeta, dTm, tok, vv, vm, h, H, V:, LOWP:, PREC:, IN_PREC:, "
                             "UPCAST:, nonfinite", [
        K.assign("v", tile("v_ptr", "V", "vv", "vm")),
        when("nonfinite", [K.assign("v", "finite_or_zero(v)")]),
        K.assign("dY", "mm_lowp(tl.trans(Tm), dU.to(tl.float32), v.dtype, LOWP, PREC, IN_PREC, UPCAST)"),
        store("dv_ptr + " + tile_off("V", "vv"), rnd("beta[:, None] * dY", "dv_ptr.dtype.element_ty"), "vm"),
        K.assign("vf", "v.to(tl.float32)"),
        when("LOWP", [note("dU (diag(beta) V)^T = (dU V^T) diag(beta): the values enter as loaded"),
                      aug("dTm", mm(rnd("dU", "v.dtype"), "tl.trans(v)") + " * beta[None, :]")],
             [aug("dTm", mm("dU.to(tl.float32)", "tl.trans(beta[:, None] * vf)", "PREC"))]),
        ret("dbeta + tl.sum(dY * vf, 1)", "dTm")], """
        Through u = Tm diag(beta) V on one block of value columns (dU as stored: fp32 or the input dtype):
        stores dv; returns dbeta and dTm updated. `nonfinite` (the chunk holds a non-finite token): V's non-finite
        entries enter as 0 (a NaN in dTm's column j would reach every row of dA through Tm's zeros).""")
    lowp = "dtype, LOWP, PREC, IN_PREC, UPCAST"
    through_inverse = jit("through_inverse", "Tm, dTm, G, ok, rows, dtype:, LOWP:, PREC:, IN_PREC:, UPCAST:", [
        K.assign("strict", "(rows[:, None] > rows[None, :]) & ok[:, None] & ok[None, :]"),
        K.assign("inner", f"mm_lowp(dTm, tl.trans(Tm), {lowp})"),
        K.assign("dA", f"-mm_lowp(tl.trans(Tm), inner, {lowp})"),
        ret("tl.where(strict, dA * tl.exp(tl.where(strict, G[:, None] - G[None, :], 0.0)), 0.0)")], """
        Tm = (I + A)^-1, A = strictly_lower(diag(beta) K K^T * D): E = dA * D = -(Tm^T dTm Tm^T) * D, strictly
        lower (dA's part that reaches beta K K^T).""")
    through_keys = jit("through_keys", "E, k, beta, LOWP:, PREC:, IN_PREC:, UPCAST:", [
        when("LOWP", [
            note("E^T diag(beta) K: beta scales E's columns; the keys enter as loaded"),
            ret(f"beta[:, None] * {mm(rnd('E', 'k.dtype'), 'k')} + "
                + mm(rnd("tl.trans(E) * beta[None, :]", "k.dtype"), "k"))], [
            K.assign("kf", "k.to(tl.float32)"),
            ret(f"beta[:, None] * {mm('E', 'kf', 'PREC')} + {mm('tl.trans(E)', 'beta[:, None] * kf', 'PREC')}")])],
        "dk's part through A = strictly_lower(diag(beta) K K^T * D), given E: diag(beta) E K + E^T diag(beta) K.")
    returns = "; returns d||k||^2" if hooks.n2 else " (the step does not read ||k||^2)"
    hook_grads = jit("hook_grads", f"dG, dbeta, {'n2, ' if hooks.takes_n2 else ''}a_ptr, {hooks.hp_param}s_ptr, "
                                   f"{hooks.eps_param}da_ptr, {hooks.dhp_param}ds_ptr, tok, h, H, "
                                   f"{'TTH, ' if hooks.params else ''}ok, rows, bad_row", [
        K.assign("dg", "tl.sum(dG, 0) - tl.cumsum(dG, 0) + dG"),
        K.assign("dg", "tl.where(rows > bad_row, float('nan'), dg)"),
        K.assign("dbeta", "tl.where(rows < bad_row, dbeta, float('nan'))"),
        K.assign("a", per_token("a_ptr") + ".to(tl.float32)"),
        call(f"store_decay_grads(dg, a, hp_ptr, h, H, da_ptr, dhp_ptr, {TOK}, TTH, ok)" if hooks.params
             else f"store_decay_grads(dg, a, da_ptr, {TOK}, ok)"),
        K.assign("s", per_token("s_ptr") + ".to(tl.float32)"),
        *_step_grads(hooks)], f"""
        From dG (G = cumsum(g) in the chunk: dg_t = sum over i >= t of dG_i) and dbeta through the hooks' chain
        rule: stores the decay input's and parameters' gradients and the step input's{returns}. Row `bad_row`
        (C if none) holds the chunk's first non-finite token: the token loop's decay gradients are NaN after it (the
        decay acts before the token's value), its step gradients from it on.""")
    return [mm_lowp, u_grads, through_inverse, through_keys, hook_grads]


def wy(hooks: Hooks = Hooks()):
    k_block = [K.assign("kk", "kb * BKS + tl.arange(0, BKS)")]
    body = [
        *fp32(*hooks.eps_cast),
        K.assign("c", "tl.program_id(0)"), K.assign("h", "tl.program_id(1)"),
        *chunk_rows(),
        K.assign("G", per_token("gcum_ptr")), K.assign("beta", per_token("beta_ptr")),
        K.assign("causal", CAUSAL),
        note("an unmasked (vectorised) load: delta_prep wrote every element"),
        load_tm(),
        K.assign("bad_row", "tl.load(nonfinite_ptr + c * H + h)"),
        _zeros("dTm", "C, C"), _zeros("dbeta", "C"), _zeros("dG", "C"),
        loop("kb", "NKQ", [
            aug("dTm", "tl.load(dTm_part_ptr + (((c * H + h) * NKQ + kb) * C + rows[:, None]).to(tl.int64) * C "
                       "+ rows[None, :]).to(tl.float32)"),
            aug("dG", f"tl.load(dG_part_ptr + kb * TTH + {TOK}, mask=ok, other=0.0)"),
            aug("dbeta", f"tl.load(dbeta_part_ptr + kb * TTH + {TOK}, mask=ok, other=0.0)")]),
        note("u = Tm diag(beta) V"),
        loop("iv", "tl.cdiv(V, BV)", [
            K.assign("vv", "iv * BV + tl.arange(0, BV)"), K.assign("vm", VALUE_TILE),
            K.assign("dU", tile("dU_ptr", "V", "vv", "vm")),
            K.assign("dbeta, dTm", "u_grads(v_ptr, dv_ptr, Tm, dU, beta, dbeta, dTm, tok, vv, vm, h, H, V, LOWP, PREC, "
                            "IN_PREC, UPCAST, bad_row < nv)")]),
        K.assign("E", "through_inverse(Tm, dTm, G, ok, rows, k_ptr.dtype.element_ty, LOWP, PREC, IN_PREC, UPCAST)"),
        *([_zeros("n2", "C")] if hooks.takes_n2 else []), _zeros("KK", "C, C"),
        loop("kb", "tl.cdiv(K, BKS)", [
            *k_block,
            K.assign("k", tile("k_ptr", "K", "kk", "ok[:, None] & (kk[None, :] < K)")),
            *([aug("n2", "tl.sum(k.to(tl.float32) * k.to(tl.float32), 1)")] if hooks.takes_n2 else []),
            aug("KK", mm("k", "tl.trans(k)"))]),
        aug("dbeta", "tl.sum(E * KK, 1)"),
        *_through_A(),
        _hook_grads_call(hooks, "n2"),
        loop("kb", "tl.cdiv(K, BKS)", [
            *k_block, K.assign("km", KEY_TILE),
            K.assign("k", tile("k_ptr", "K", "kk", "km")),
            K.assign("dk", tile("dk_part_ptr", "K", "kk", "km") + ".to(tl.float32)"),
            aug("dk", "through_keys(E, k, beta, LOWP, PREC, IN_PREC, UPCAST)"),
            *([aug("dk", "dn2[:, None] * k.to(tl.float32)")] if hooks.n2 else []),
            nan_after("dk"),
            _store_dk()])]
    return jit("delta_bwd_wy", f"k_ptr, v_ptr, a_ptr, {hooks.hp_param}s_ptr, {hooks.eps_param}gcum_ptr, beta_ptr, "
                               "tm_ptr, nonfinite_ptr, dU_ptr, dTm_part_ptr, dk_part_ptr, dG_part_ptr, dbeta_part_ptr, "
                               f"dk_ptr, dv_ptr, da_ptr, {hooks.dhp_param}ds_ptr, chunk_tok, chunk_len, TTH, {SHAPE}, "
                               f"BKS:, NKQ:, {PRECS}, LOWP:=False",
               body, """
    Per chunk, through u = Tm diag(beta) V, Tm = (I + A)^-1 and the hooks: dv, dk (final), d decay input,
    d step input. The w = Tm diag(beta e^G) K terms arrive from delta_bwd_dqk as NKQ key-block shares of dTm,
    dk, dG and dbeta; keys are visited in blocks of BKS columns after dA (K K^T, ||k||^2, then dk). LOWP: the dots
    of fp32 operands (Tm, dU, dTm, E) take them rounded to the input dtype. A chunk with a non-finite token
    (nonfinite_ptr) as in delta_bwd_dqk: V's non-finite entries as 0, dk and the hooks' gradients NaN from its row.""")


def kernels(hooks: Hooks = Hooks()) -> list:
    """The backward kernels in module order, for a rule whose hooks need `hooks`."""
    return [*local(), state_bwd(), dqk(hooks), *through(hooks), wy(hooks)]
