"""Triton source of the chunkwise gated delta rule's backward kernels (part of `template.SOURCE`).

See template.py for the kernels' roles; these use its helpers (`mm`, `rnd`, `step_beta`, the hooks).
"""

BACKWARD = '''\
@triton.jit
def delta_dU_local(q_ptr, k_ptr, gcum_ptr, do_ptr, dul_ptr, doq_ptr, chunk_tok, chunk_len, scale,
                   H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                   STORE_DO: tl.constexpr, PREC: tl.constexpr, IN_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """dU from the outputs within each chunk, scale (Q K^T * D)^T dO (fp32), for delta_state_bwd without
    LOCAL_DU: per chunk and block of BV value columns, in parallel. With STORE_DO, also dO rounded to doq's
    dtype (the input dtype, to which every later use of dO rounds it: the same bits, half the reads)."""
    scale = tl.cast(scale, tl.float32)   # torch.compile types a Python float as fp64
    NVB: tl.constexpr = (V + BV - 1) // BV     # a chunk's value blocks run back to back: q, k from L2
    c = tl.program_id(0) // NVB
    h = tl.program_id(1)
    vv = tl.program_id(0) % NVB * BV + tl.arange(0, BV)
    kk = tl.arange(0, BK)
    rows = tl.arange(0, C)
    t0, nv, tok, ok = chunk_tokens(chunk_tok, chunk_len, c, rows)
    km = ok[:, None] & (kk[None, :] < K)
    vm = ok[:, None] & (vv[None, :] < V)
    q = tl.load(q_ptr + (tok[:, None] * H + h) * K + kk[None, :], mask=km, other=0.0)
    k = tl.load(k_ptr + (tok[:, None] * H + h) * K + kk[None, :], mask=km, other=0.0)
    G = tl.load(gcum_ptr + tok * H + h, mask=ok, other=0.0)
    do = tl.load(do_ptr + (tok[:, None] * H + h) * V + vv[None, :], mask=vm, other=0.0)
    if STORE_DO:
        tl.store(doq_ptr + (tok[:, None] * H + h) * V + vv[None, :], rnd(do, doq_ptr.dtype.element_ty, UPCAST), mask=vm)
    dU = local_dU(q, k, G, do, ok, rows, scale, IN_PREC, UPCAST)
    tl.store(dul_ptr + (tok[:, None] * H + h) * V + vv[None, :], dU, mask=vm)


@triton.jit
def local_dU(q, k, G, do, ok, rows, scale, IN_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """scale (Q K^T * D)^T dO for one chunk (row j: key, column i: query of the causal mask's transpose)."""
    causal_t = (rows[None, :] >= rows[:, None]) & ok[None, :]
    Dt = tl.where(causal_t, tl.exp(tl.where(causal_t, G[None, :] - G[:, None], 0.0)), 0.0)
    Mt = mm(k, tl.trans(q), IN_PREC, UPCAST) * Dt
    return mm(rnd(Mt, q.dtype, UPCAST), rnd(do, q.dtype, UPCAST), IN_PREC, UPCAST) * scale


@triton.jit
def delta_state_bwd(q_ptr, k_ptr, w_ptr, gcum_ptr, do_ptr, dul_ptr, dht_ptr, chunk_tok, chunk_len, seq_chunk0,
                    dh_ptr, dU_ptr, dh0_ptr, scale,
                    H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, LOCAL_DU: tl.constexpr, PREC: tl.constexpr,
                    IN_PREC: tl.constexpr, UPCAST: tl.constexpr, SEQ_BOUNDS: tl.constexpr = False,
                    DECAY_V: tl.constexpr = False):
    """Reverse over a sequence's chunks with dS [K, BV] (fp32) in registers: stores dS_end per chunk (dh) and
    dU = scale (Q K^T * D)^T dO + K~ dS_end (the local part formed here with LOCAL_DU, else loaded from dul,
    where delta_dU_local stored it), stored in dU's dtype (fp32, or the input dtype: the host's LOWP_DU, the bits
    every later dot of dU but bwd_wy's at PREC takes); dS0 = e^G_last dS_end + scale (e^G Q)^T dO - w^T dU.
    SEQ_BOUNDS: chunk addresses from the sequence's bounds (no table loads in the loop). DECAY_V: K~ dS_end as
    e^(G_last - G) (K dS_end) and (e^G Q)^T dO as Q^T (e^G dO), scaling [C, BV] tiles instead of [C, K] ones."""
    scale = tl.cast(scale, tl.float32)   # torch.compile types a Python float as fp64
    n = tl.program_id(0)
    h = tl.program_id(1)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    kk = tl.arange(0, BK)
    rows = tl.arange(0, C)
    sm = (kk[:, None] < K) & (vv[None, :] < V)
    dS = initial_state(dht_ptr, n, h, H, kk, vv, sm, HAS_DHT, K, V, BK, BV)
    c0 = tl.load(seq_chunk0 + n)
    c1 = tl.load(seq_chunk0 + n + 1)
    if SEQ_BOUNDS:   # chunks' first tokens and lengths from the sequence's bounds, as in the forward's state_pass
        some = c1 > c0
        first = tl.load(chunk_tok + c0, mask=some, other=0).to(tl.int64)
        end = (tl.load(chunk_tok + c1 - 1, mask=some, other=0).to(tl.int64)
               + tl.load(chunk_len + c1 - 1, mask=some, other=0))
    for i in range(0, c1 - c0):
        c = c1 - 1 - i
        if SEQ_BOUNDS:   # no address in the loop waits on a load
            t0 = first + (c - c0) * C
            nv = tl.minimum(end - t0, C).to(tl.int32)
            ok = rows < nv
            tok = t0 + rows
        else:
            t0, nv, tok, ok = chunk_tokens(chunk_tok, chunk_len, c, rows)
        tl.store(dh_ptr + ((c * H + h) * K + kk[:, None]).to(tl.int64) * V + vv[None, :],
                 rnd(dS, dh_ptr.dtype.element_ty, UPCAST), mask=sm)
        km = ok[:, None] & (kk[None, :] < K)
        vm = ok[:, None] & (vv[None, :] < V)
        q = tl.load(q_ptr + (tok[:, None] * H + h) * K + kk[None, :], mask=km, other=0.0)
        k = tl.load(k_ptr + (tok[:, None] * H + h) * K + kk[None, :], mask=km, other=0.0)
        w = tl.load(w_ptr + (tok[:, None] * H + h) * K + kk[None, :], mask=km, other=0.0)
        G = tl.load(gcum_ptr + tok * H + h, mask=ok, other=0.0)
        G_last = tl.load(gcum_ptr + (t0 + nv - 1) * H + h)
        do = tl.load(do_ptr + (tok[:, None] * H + h) * V + vv[None, :], mask=vm, other=0.0)
        if LOCAL_DU:    # off the loop's dependency chain (it does not depend on dS)
            dU = local_dU(q, k, G, do, ok, rows, scale, IN_PREC, UPCAST)
        else:
            dU = tl.load(dul_ptr + (tok[:, None] * H + h) * V + vv[None, :], mask=vm, other=0.0)
        tail = tl.where(ok, tl.exp(G_last - G), 0.0)
        if DECAY_V:     # the decays scale [C, BV] tiles (dU's rows, dO's rows); q and k enter the dots as loaded
            dU += tail[:, None] * mm(k, rnd(dS, k.dtype, UPCAST), IN_PREC, UPCAST)
        else:
            kt = rnd(k.to(tl.float32) * tail[:, None], k.dtype, UPCAST)
            dU += mm(kt, rnd(dS, k.dtype, UPCAST), IN_PREC, UPCAST)
        tl.store(dU_ptr + (tok[:, None] * H + h) * V + vv[None, :], rnd(dU, dU_ptr.dtype.element_ty, UPCAST),
                 mask=vm)
        eG = tl.where(ok, tl.exp(G), 0.0)
        if DECAY_V:
            dS = dS * tl.exp(G_last) + scale * mm(tl.trans(q), rnd(do * eG[:, None], q.dtype, UPCAST), IN_PREC, UPCAST)
        else:
            qg = rnd(q.to(tl.float32) * eG[:, None], q.dtype, UPCAST)
            dS = dS * tl.exp(G_last) + scale * mm(tl.trans(qg), rnd(do, q.dtype, UPCAST), IN_PREC, UPCAST)
        dS -= mm(tl.trans(w), rnd(dU, w.dtype, UPCAST), IN_PREC, UPCAST)
    if STORE_DH0:
        tl.store(dh0_ptr + state_offsets(n, h, H, kk, vv, K, V), dS, mask=sm)


@triton.jit
def delta_bwd_dqk(q_ptr, k_ptr, v_ptr, a_ptr, hp_ptr, s_ptr, eps, gcum_ptr, beta_ptr, tm_ptr, nonfinite_ptr, h_ptr,
                  dh_ptr, U_ptr,
                  dU_ptr, do_ptr, dq_ptr, dk_ptr, dv_ptr, dTm_ptr, dG_ptr, dbeta_ptr, da_ptr, dhp_ptr, ds_ptr,
                  chunk_tok, chunk_len, scale, TTH,
                  H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                  BKS: tl.constexpr, WY: tl.constexpr, PREC: tl.constexpr, IN_PREC: tl.constexpr,
                  UPCAST: tl.constexpr, DG_SUMS: tl.constexpr = False, LOWP: tl.constexpr = False):
    """Per chunk and block of BKS key columns, through O = scale (e^G Q S0 + (Q K^T * D) U), S_end,
    U = u - w S0 and w = Tm X, X = diag(beta e^G) K: dq (final); this block's shares (fp32) of dk, of dTm
    = dw X^T, of dG and of dbeta. dw = -dU S0^T is used where it is formed (dX = Tm^T dw), never stored.
    With WY (one block of all K columns) the program also does delta_bwd_wy's work for its chunk, from the
    same loads and without the shares' round trip: dv, dk, d step input, d decay input (final).
    DG_SUMS: the outputs' in-chunk part of dG as row sums of its dq and dk terms, q . (dM K) - k . (dM^T Q)
    (= rowsum - colsum of dM * Q K^T, without forming Q K^T). LOWP: the dots of fp32 operands (dw, Tm, and
    under WY dTm, E) take them rounded to the input dtype, as the input dtype's tensor cores need. In a chunk with
    a non-finite token (nonfinite_ptr [NC, H]: its row, else C) U's and V's non-finite entries enter as 0 and dq (under
    WY dk and the step and decay gradients too, `hook_grads`) are NaN from that row on, as the token loop's are."""
    eps = tl.cast(eps, tl.float32)   # torch.compile types a Python float as fp64
    scale = tl.cast(scale, tl.float32)   # torch.compile types a Python float as fp64
    NKB: tl.constexpr = (K + BKS - 1) // BKS     # a chunk's key blocks run back to back: U, dU, dO from L2
    c = tl.program_id(0) // NKB
    h = tl.program_id(1)
    kb = tl.program_id(0) % NKB
    kk = kb * BKS + tl.arange(0, BKS)
    rows = tl.arange(0, C)
    t0, nv, tok, ok = chunk_tokens(chunk_tok, chunk_len, c, rows)
    km = ok[:, None] & (kk[None, :] < K)
    causal = (rows[:, None] >= rows[None, :]) & ok[:, None] & ok[None, :]
    dq1 = tl.zeros([C, BKS], dtype=tl.float32)
    dks = tl.zeros([C, BKS], dtype=tl.float32)
    dw = tl.zeros([C, BKS], dtype=tl.float32)
    dOU = tl.zeros([C, C], dtype=tl.float32)
    dlast = tl.zeros([BKS], dtype=tl.float32)
    beta = tl.load(beta_ptr + tok * H + h, mask=ok, other=0.0)
    dTm = tl.zeros([C, C], dtype=tl.float32)
    dbeta = tl.zeros([C], dtype=tl.float32)
    bad_row = tl.load(nonfinite_ptr + c * H + h)
    if WY:   # Tm is needed in the value loop (u = Tm diag(beta) V); an unmasked load: delta_prep wrote it all
        Tm = tl.where(causal, tl.load(tm_ptr + ((c * H + h) * C + rows[:, None]).to(tl.int64) * C + rows[None, :]),
                      0.0)
    for iv in range(0, tl.cdiv(V, BV)):
        vv = iv * BV + tl.arange(0, BV)
        vm = ok[:, None] & (vv[None, :] < V)
        sm = (kk[:, None] < K) & (vv[None, :] < V)
        S0 = tl.load(h_ptr + ((c * H + h) * K + kk[:, None]).to(tl.int64) * V + vv[None, :], mask=sm, other=0.0)
        dSe = tl.load(dh_ptr + ((c * H + h) * K + kk[:, None]).to(tl.int64) * V + vv[None, :], mask=sm, other=0.0)
        # h, dh and U are stored in the input dtype; dU and dO (fp32) are rounded to it for the dots
        U = tl.load(U_ptr + (tok[:, None] * H + h) * V + vv[None, :], mask=vm, other=0.0)
        if bad_row < nv:   # else 0 * NaN through the causal mask and the chunk end's sums (terms that cancel in dg)
            U = finite_or_zero(U)
        dU = tl.load(dU_ptr + (tok[:, None] * H + h) * V + vv[None, :], mask=vm, other=0.0)
        do = rnd(tl.load(do_ptr + (tok[:, None] * H + h) * V + vv[None, :], mask=vm, other=0.0), S0.dtype, UPCAST)
        dOU += mm(do, tl.trans(U), IN_PREC, UPCAST)
        dq1 += mm(do, tl.trans(S0), IN_PREC, UPCAST)
        dks += mm(U, tl.trans(dSe), IN_PREC, UPCAST)
        dw -= mm(rnd(dU, S0.dtype, UPCAST), tl.trans(S0), IN_PREC, UPCAST)
        dlast += tl.sum(S0.to(tl.float32) * dSe.to(tl.float32), 1)
        if WY:
            dbeta, dTm = u_grads(v_ptr, dv_ptr, Tm, dU, beta, dbeta, dTm, tok, vv, vm, h, H, V, LOWP, PREC, IN_PREC,
                                 UPCAST, bad_row < nv)
    # the epilogue consumes the loop's tiles one by one: dOU, dq1, dks, dw
    G = tl.load(gcum_ptr + tok * H + h, mask=ok, other=0.0)
    G_last = tl.load(gcum_ptr + (t0 + nv - 1) * H + h)
    eG = tl.where(ok, tl.exp(G), 0.0)
    q = tl.load(q_ptr + (tok[:, None] * H + h) * K + kk[None, :], mask=km, other=0.0)
    k = tl.load(k_ptr + (tok[:, None] * H + h) * K + kk[None, :], mask=km, other=0.0)
    kf = k.to(tl.float32)
    # outputs (every dG term below is a sum over key columns: each block adds its share)
    dM = dOU * tl.where(causal, tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0)), 0.0) * scale
    dMq = rnd(dM, q.dtype, UPCAST)
    dq1 = dq1 * (scale * eG)[:, None]
    if DG_SUMS:
        dq = dq1 + mm(dMq, k, IN_PREC, UPCAST)
        dG = tl.sum(dq * q.to(tl.float32), 1)
    else:
        PM = dM * mm(q, tl.trans(k), IN_PREC, UPCAST)
        dG = tl.sum(PM, 1) - tl.sum(PM, 0)
        dG += tl.sum(dq1 * q.to(tl.float32), 1)
        dq = dq1 + mm(dMq, k, IN_PREC, UPCAST)
    if bad_row < nv:
        dq = tl.where(rows[:, None] < bad_row, dq, float("nan"))
    tl.store(dq_ptr + (tok[:, None] * H + h) * K + kk[None, :], rnd(dq, dq_ptr.dtype.element_ty, UPCAST), mask=km)
    # w = Tm X on this block's columns: dTm += dw X^T, dX = Tm^T dw (fp32 operands: PREC)
    bG = beta * eG
    if LOWP:    # dw X^T = (dw K^T) diag(bG): the keys enter as loaded
        dTm_blk = mm(rnd(dw, k.dtype, UPCAST), tl.trans(k), IN_PREC, UPCAST) * bG[None, :]
    else:
        dTm_blk = mm(dw, tl.trans(bG[:, None] * kf), PREC, UPCAST)
    if WY:
        dTm += dTm_blk
    else:
        tl.store(dTm_ptr + (((c * H + h) * NKB + kb) * C + rows[:, None]).to(tl.int64) * C + rows[None, :],
                 rnd(dTm_blk, dTm_ptr.dtype.element_ty, UPCAST))
        Tm = tl.where(causal, tl.load(tm_ptr + ((c * H + h) * C + rows[:, None]).to(tl.int64) * C + rows[None, :]),
                      0.0)
    dX = mm_lowp(tl.trans(Tm), dw, k.dtype, LOWP, PREC, IN_PREC, UPCAST)
    sx = tl.sum(dX * kf, 1)
    dG += bG * sx
    # chunk end state: S_end = e^G_last S0 + (K e^(G_last - G))^T U
    dk = dks * tl.where(ok, tl.exp(G_last - G), 0.0)[:, None]
    cj = tl.sum(dk * kf, 1)
    dG -= cj
    dG += tl.where(rows == nv - 1, tl.sum(dlast, 0) * tl.exp(G_last) + tl.sum(cj, 0), 0.0)
    if DG_SUMS:
        dkM = mm(tl.trans(dMq), q, IN_PREC, UPCAST)
        dG -= tl.sum(dkM * kf, 1)
        dk += dkM
    else:
        dk += mm(tl.trans(dMq), q, IN_PREC, UPCAST)
    dk += bG[:, None] * dX
    if WY:
        dbeta += eG * sx
        E = through_inverse(Tm, dTm, G, ok, rows, k.dtype, LOWP, PREC, IN_PREC, UPCAST)
        KK = mm(k, tl.trans(k), IN_PREC, UPCAST)
        dbeta += tl.sum(E * KK, 1)
        PA = E * KK * beta[:, None]
        dG += tl.sum(PA, 1) - tl.sum(PA, 0)
        dn2 = hook_grads(dG, dbeta, tl.sum(kf * kf, 1), a_ptr, hp_ptr, s_ptr, eps, da_ptr, dhp_ptr, ds_ptr, tok, h,
                         H, TTH, ok, rows, bad_row)
        dk += through_keys(E, k, beta, LOWP, PREC, IN_PREC, UPCAST)
        dk += dn2[:, None] * kf
        if bad_row < nv:
            dk = tl.where(rows[:, None] < bad_row, dk, float("nan"))
        tl.store(dk_ptr + (tok[:, None] * H + h) * K + kk[None, :], rnd(dk, dk_ptr.dtype.element_ty, UPCAST),
                 mask=km)
    else:
        tl.store(dbeta_ptr + kb * TTH + tok * H + h, eG * sx, mask=ok)
        # the dk share (and the dTm share above): fp32, or the input dtype (the host's choice, LOWP_DK / LOWP_DTM)
        tl.store(dk_ptr + (tok[:, None] * H + h) * K + kk[None, :], rnd(dk, dk_ptr.dtype.element_ty, UPCAST),
                 mask=km)
        tl.store(dG_ptr + kb * TTH + tok * H + h, dG, mask=ok)


@triton.jit
def mm_lowp(a, b, dtype: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr, IN_PREC: tl.constexpr,
            UPCAST: tl.constexpr):
    """a @ b of fp32 operands: at PREC, or with LOWP both rounded to `dtype` (the input dtype: for fp32 inputs
    the same product) and multiplied at IN_PREC."""
    if LOWP:
        return mm(rnd(a, dtype, UPCAST), rnd(b, dtype, UPCAST), IN_PREC, UPCAST)
    else:
        return mm(a, b, PREC, UPCAST)


@triton.jit
def u_grads(v_ptr, dv_ptr, Tm, dU, beta, dbeta, dTm, tok, vv, vm, h, H, V: tl.constexpr, LOWP: tl.constexpr,
            PREC: tl.constexpr, IN_PREC: tl.constexpr, UPCAST: tl.constexpr, nonfinite):
    """Through u = Tm diag(beta) V on one block of value columns (dU as stored: fp32 or the input dtype):
    stores dv; returns dbeta and dTm updated. `nonfinite` (the chunk holds a non-finite token): V's non-finite
    entries enter as 0 (a NaN in dTm's column j would reach every row of dA through Tm's zeros)."""
    v = tl.load(v_ptr + (tok[:, None] * H + h) * V + vv[None, :], mask=vm, other=0.0)
    if nonfinite:
        v = finite_or_zero(v)
    dY = mm_lowp(tl.trans(Tm), dU.to(tl.float32), v.dtype, LOWP, PREC, IN_PREC, UPCAST)
    tl.store(dv_ptr + (tok[:, None] * H + h) * V + vv[None, :],
             rnd(beta[:, None] * dY, dv_ptr.dtype.element_ty, UPCAST), mask=vm)
    vf = v.to(tl.float32)
    if LOWP:    # dU (diag(beta) V)^T = (dU V^T) diag(beta): the values enter as loaded
        dTm += mm(rnd(dU, v.dtype, UPCAST), tl.trans(v), IN_PREC, UPCAST) * beta[None, :]
    else:
        dTm += mm(dU.to(tl.float32), tl.trans(beta[:, None] * vf), PREC, UPCAST)
    return dbeta + tl.sum(dY * vf, 1), dTm


@triton.jit
def through_inverse(Tm, dTm, G, ok, rows, dtype: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
                    IN_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Tm = (I + A)^-1, A = strictly_lower(diag(beta) K K^T * D): E = dA * D = -(Tm^T dTm Tm^T) * D, strictly
    lower (dA's part that reaches beta K K^T)."""
    strict = (rows[:, None] > rows[None, :]) & ok[:, None] & ok[None, :]
    inner = mm_lowp(dTm, tl.trans(Tm), dtype, LOWP, PREC, IN_PREC, UPCAST)
    dA = -mm_lowp(tl.trans(Tm), inner, dtype, LOWP, PREC, IN_PREC, UPCAST)
    return tl.where(strict, dA * tl.exp(tl.where(strict, G[:, None] - G[None, :], 0.0)), 0.0)


@triton.jit
def through_keys(E, k, beta, LOWP: tl.constexpr, PREC: tl.constexpr, IN_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """dk's part through A = strictly_lower(diag(beta) K K^T * D), given E: diag(beta) E K + E^T diag(beta) K."""
    if LOWP:    # E^T diag(beta) K: beta scales E's columns; the keys enter as loaded
        return (beta[:, None] * mm(rnd(E, k.dtype, UPCAST), k, IN_PREC, UPCAST)
                + mm(rnd(tl.trans(E) * beta[None, :], k.dtype, UPCAST), k, IN_PREC, UPCAST))
    else:
        kf = k.to(tl.float32)
        return beta[:, None] * mm(E, kf, PREC, UPCAST) + mm(tl.trans(E), beta[:, None] * kf, PREC, UPCAST)


@triton.jit
def hook_grads(dG, dbeta, n2, a_ptr, hp_ptr, s_ptr, eps, da_ptr, dhp_ptr, ds_ptr, tok, h, H, TTH, ok, rows, bad_row):
    """From dG (G = cumsum(g) in the chunk: dg_t = sum over i >= t of dG_i) and dbeta through the hooks' chain
    rule: stores the decay input's and parameters' gradients and the step input's; returns d||k||^2. Row `bad_row`
    (C if none) holds the chunk's first non-finite token: the token loop's decay gradients are NaN after it (the
    decay acts before the token's value), its step gradients from it on."""
    dg = tl.sum(dG, 0) - tl.cumsum(dG, 0) + dG
    dg = tl.where(rows > bad_row, float("nan"), dg)
    dbeta = tl.where(rows < bad_row, dbeta, float("nan"))
    a = tl.load(a_ptr + tok * H + h, mask=ok, other=0.0).to(tl.float32)
    store_decay_grads(dg, a, hp_ptr, h, H, da_ptr, dhp_ptr, tok * H + h, TTH, ok)
    s = tl.load(s_ptr + tok * H + h, mask=ok, other=0.0).to(tl.float32)
    dbeta_ds, dbeta_dn2 = step_hook_grad(s, n2, eps)
    _, dead = step_beta(s, n2, eps)
    tl.store(ds_ptr + tok * H + h, tl.where(dead, 0.0, dbeta * dbeta_ds), mask=ok)
    return tl.where(dead, 0.0, 2.0 * dbeta * dbeta_dn2)


@triton.jit
def delta_bwd_wy(k_ptr, v_ptr, a_ptr, hp_ptr, s_ptr, eps, gcum_ptr, beta_ptr, tm_ptr, nonfinite_ptr, dU_ptr,
                 dTm_part_ptr, dk_part_ptr, dG_part_ptr, dbeta_part_ptr, dk_ptr, dv_ptr, da_ptr, dhp_ptr, ds_ptr,
                 chunk_tok, chunk_len, TTH, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 C: tl.constexpr, BKS: tl.constexpr, NKQ: tl.constexpr, PREC: tl.constexpr, IN_PREC: tl.constexpr,
                 UPCAST: tl.constexpr, LOWP: tl.constexpr = False):
    """Per chunk, through u = Tm diag(beta) V, Tm = (I + A)^-1 and the hooks: dv, dk (final), d decay input,
    d step input. The w = Tm diag(beta e^G) K terms arrive from delta_bwd_dqk as NKQ key-block shares of dTm,
    dk, dG and dbeta; keys are visited in blocks of BKS columns after dA (K K^T, ||k||^2, then dk). LOWP: the dots
    of fp32 operands (Tm, dU, dTm, E) take them rounded to the input dtype. A chunk with a non-finite token
    (nonfinite_ptr) as in delta_bwd_dqk: V's non-finite entries as 0, dk and the hooks' gradients NaN from its row."""
    eps = tl.cast(eps, tl.float32)   # torch.compile types a Python float as fp64
    c = tl.program_id(0)
    h = tl.program_id(1)
    rows = tl.arange(0, C)
    t0, nv, tok, ok = chunk_tokens(chunk_tok, chunk_len, c, rows)
    G = tl.load(gcum_ptr + tok * H + h, mask=ok, other=0.0)
    beta = tl.load(beta_ptr + tok * H + h, mask=ok, other=0.0)
    causal = (rows[:, None] >= rows[None, :]) & ok[:, None] & ok[None, :]
    # an unmasked (vectorised) load: delta_prep wrote every element
    Tm = tl.where(causal, tl.load(tm_ptr + ((c * H + h) * C + rows[:, None]).to(tl.int64) * C + rows[None, :]), 0.0)
    bad_row = tl.load(nonfinite_ptr + c * H + h)
    dTm = tl.zeros([C, C], dtype=tl.float32)
    dbeta = tl.zeros([C], dtype=tl.float32)
    dG = tl.zeros([C], dtype=tl.float32)
    for kb in range(0, NKQ):
        dTm += tl.load(dTm_part_ptr + (((c * H + h) * NKQ + kb) * C + rows[:, None]).to(tl.int64) * C
                       + rows[None, :]).to(tl.float32)
        dG += tl.load(dG_part_ptr + kb * TTH + tok * H + h, mask=ok, other=0.0)
        dbeta += tl.load(dbeta_part_ptr + kb * TTH + tok * H + h, mask=ok, other=0.0)
    # u = Tm diag(beta) V
    for iv in range(0, tl.cdiv(V, BV)):
        vv = iv * BV + tl.arange(0, BV)
        vm = ok[:, None] & (vv[None, :] < V)
        dU = tl.load(dU_ptr + (tok[:, None] * H + h) * V + vv[None, :], mask=vm, other=0.0)
        dbeta, dTm = u_grads(v_ptr, dv_ptr, Tm, dU, beta, dbeta, dTm, tok, vv, vm, h, H, V, LOWP, PREC, IN_PREC,
                             UPCAST, bad_row < nv)
    E = through_inverse(Tm, dTm, G, ok, rows, k_ptr.dtype.element_ty, LOWP, PREC, IN_PREC, UPCAST)
    n2 = tl.zeros([C], dtype=tl.float32)
    KK = tl.zeros([C, C], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BKS)):
        kk = kb * BKS + tl.arange(0, BKS)
        k = tl.load(k_ptr + (tok[:, None] * H + h) * K + kk[None, :], mask=ok[:, None] & (kk[None, :] < K), other=0.0)
        n2 += tl.sum(k.to(tl.float32) * k.to(tl.float32), 1)
        KK += mm(k, tl.trans(k), IN_PREC, UPCAST)
    dbeta += tl.sum(E * KK, 1)
    PA = E * KK * beta[:, None]
    dG += tl.sum(PA, 1) - tl.sum(PA, 0)
    dn2 = hook_grads(dG, dbeta, n2, a_ptr, hp_ptr, s_ptr, eps, da_ptr, dhp_ptr, ds_ptr, tok, h, H, TTH, ok, rows,
                     bad_row)
    for kb in range(0, tl.cdiv(K, BKS)):
        kk = kb * BKS + tl.arange(0, BKS)
        km = ok[:, None] & (kk[None, :] < K)
        k = tl.load(k_ptr + (tok[:, None] * H + h) * K + kk[None, :], mask=km, other=0.0)
        dk = tl.load(dk_part_ptr + (tok[:, None] * H + h) * K + kk[None, :], mask=km, other=0.0).to(tl.float32)
        dk += through_keys(E, k, beta, LOWP, PREC, IN_PREC, UPCAST)
        dk += dn2[:, None] * k.to(tl.float32)
        if bad_row < nv:
            dk = tl.where(rows[:, None] < bad_row, dk, float("nan"))
        tl.store(dk_ptr + (tok[:, None] * H + h) * K + kk[None, :], rnd(dk, dk_ptr.dtype.element_ty, UPCAST),
                 mask=km)


'''
