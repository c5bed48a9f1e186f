"""Launch the generated delta-rule kernels and plug them into autograd (backend="triton").

Inputs arrive validated by `scanlang.recipes.kaczmarz.ops`. Tokens are packed into one stream
[TT, H, ...] (an equal-length batch [B, T] is the packed stream with offsets 0, T, 2T, ...), and a
chunk table lists every chunk's first token and length, so equal-length and `cu_seqlens` inputs run
the same kernels.

The chunked path is two `torch.library` ops with registered autograd, `scanlang::delta_chunk_fwd` and
`scanlang::delta_chunk_bwd` (launches through `wrap_triton`, so torch.compile traces them).
Forward: prep (gcum, beta, Tm, w, u, each chunk's first non-finite row) -> state_output (sequential over chunks:
outputs, final state). The backward keeps Tm (and the in-chunk decay cumsum, beta and the non-finite rows) from the
forward, recomputes w, u (delta_wu; or keeps the forward's: tuning.delta_save_wu) and the chunk start states h and
innovations U (state_fwd), then state_bwd (reverse over chunks; dU) -> bwd_dqk (dq; shares of dk, dTm, dG, dbeta
per key block) -> bwd_wy (dv, dk, d step input, d decay input and its parameters).
Short inputs without gradients (every sequence <= RECURRENT_MAX_LEN tokens, e.g. decoding) take the
token-loop kernel instead.

Host overhead. Outside torch.compile (and outside fake/functorch tracing) the chunked path skips the
torch.library dispatcher: `_EagerChunk`, a torch.autograd.Function, runs the same two implementations
(`_chunk_forward`, `_chunk_backward`) with the same kernels and configs, so both paths give identical
bits. Per (program, K, V, dtype, device) a `Plan` holds the constexprs and launch configs, built once;
chunk tables of equal-length batches and the empty parameter tensor are cached per shape.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import torch
import triton
from torch.library import triton_op, wrap_triton
from triton.runtime.errors import OutOfResources

from scanlang import backend, tuning
from scanlang.delta import DECLARED, GIVEN, KACZMARZ, DeltaRule
from scanlang.second_order import refuse_second_order

from ..triton.runtime import CACHE_LIMIT, cached, eager, fit_launch, kernel_defaults, shapes_only
from . import codegen


RECURRENT_MAX_LEN = 16
PREP_VALUE_BLOCK = 64    # value columns per step of u in delta_prep (one [C, C] x [C, 64] product at a time)
# The launch configs per kernel are knobs: scanlang.tuning.DELTA_CONFIGS (the defaults, with why they are what they
# are), changed by `tuning.override(delta_configs=...)`; `plan` reads `tuning.current()`. CONFIG: those defaults,
# read-only (what a launch uses is its plan's `configs`).
CONFIG = tuning.DELTA_CONFIGS
# Configs that need more shared memory than sm_90 gives a block (227 KB = 232448 B), and the change that
# fits, per (kernel, input element bytes, padded K), found by `python -m scanlang.tools.offline_compile --workload
# delta` (ptxas for sm_90a) at the GPU tests' shapes (K = 64, 128, 256; V = 96; fp32/bf16/fp16); every other kernel
# and shape fits (the byte counts: BENCHMARKS_HISTORY.md, "Notes moved from code comments"). What this table misses
# (another Triton version, another shape) `_launch` shrinks at run time, per plan.
SHARED_MEMORY_FITS = {
    ("state_output", 2, 256): dict(BV=64),
    # fp32: 64 value columns, one stage (its dots run on FMA units; shared memory is not what limits it)
    ("state_output", 4, 64): dict(BV=64, num_stages=1),
    ("state_output", 4, 128): dict(BV=64, num_stages=1),
    ("state_output", 4, 256): dict(BV=64, num_stages=1),
    # state_bwd where LOCAL_DU spills (offline, Triton 3.6): the pass with a separate dU_local kernel, on 8 warps.
    # bf16 K=256: 576 B spilled against LOCAL_DU's 2084 B; fp32 (FMA dots): 22.7 KB against 57.6 KB at K=128. Without
    # DECAY_V, as measured then (bf16 K=256 with it: 270852 B of shared memory on 2 stages)
    ("state_bwd", 2, 256): dict(LOCAL_DU=False, BV=64, num_warps=8, num_stages=2, DECAY_V=False),
    ("state_bwd", 4, 64): dict(LOCAL_DU=False, BV=64, num_warps=8, num_stages=2, DECAY_V=False),
    ("state_bwd", 4, 128): dict(LOCAL_DU=False, BV=64, num_warps=8, num_stages=2, DECAY_V=False),
    ("state_bwd", 4, 256): dict(LOCAL_DU=False, BV=64, num_warps=8, num_stages=1, DECAY_V=False),
    # fp32 delta_wu: a block per program (per chunk its FMA products spill 19 KB per thread at K=64, against 1.2 KB)
    ("wu", 4, 64): dict(PER_CHUNK=False),
    ("wu", 4, 128): dict(PER_CHUNK=False),
    ("wu", 4, 256): dict(PER_CHUNK=False),
}
# Config keys the host reads and the kernels never see (dropped from the launch configs). Backward buffers stored in
# bf16 instead of fp32 for bf16 inputs (fp16 keeps fp32, see `plan`; fp32 is fp32 either way): LOWP_DU (state_bwd's
# entry), the dU that state_bwd stores for bwd_dqk and bwd_wy (bwd_dqk rounds it so for its dot anyway); LOWP_DK and
# LOWP_DTM (bwd_dqk's), its shares of dk and of dTm, which bwd_wy adds to its own parts.
HOST_KEYS = ("LOWP_DU", "LOWP_DK", "LOWP_DTM")
# Knobs in scanlang.tuning (launch-time, in PLANS' key): delta_key_block, key columns per program / loop step in
# the backward kernels (and per step of w in prep); delta_save_wu, the forward keeps the w and u that delta_prep
# stored and the backward reads them instead of recomputing them with delta_wu (BENCHMARKS_HISTORY.md, "Notes moved from code comments"), for two more saved
# activations the size of k and v (fla recomputes them to save that memory); delta_eager_fast_path, eager calls
# skip the dispatcher (off: every chunked call goes through the torch.library ops; tests compare the two).
_RULES = {"beta": GIVEN, "kaczmarz": KACZMARZ}
PROGRAMS: dict[str, tuple] = {}     # key -> (generated module, chunk size, codegen.hooks(rule)); keys name rule,
#                                     hooks and C
PLANS: dict = {}                    # (program key, K, V, dtype, device, key block, delta configs) -> Plan
TABLES: dict = {}                   # (B, T, chunk size, device) or (offsets, chunk size, device) -> ChunkTable
_NO_PARAMS: dict = {}               # (H, device) -> the empty [0, H] parameter tensor


def _empty(*shape, device, dtype):
    """Every buffer the kernels fill; tests replace it with a NaN-filled one to prove full coverage."""
    return torch.empty(*shape, device=device, dtype=dtype)


class ChunkTable:
    """Chunks of a packed stream: first token and length of each chunk, first chunk of each sequence.

    The device tensors are built on first use (the recurrent path needs only `seq_tok`)."""

    def __init__(self, B: int, T: int, cu_seqlens, C: int, device):
        """`cu_seqlens`: None (B sequences of T tokens), or the offsets [N + 1] as a tensor or a sequence of ints."""
        self.B, self.T, self.C, self.device = B, T, C, device
        if cu_seqlens is None:
            self.cu = None
            self.n_seq, self.max_len = B, T
        else:
            cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens
            self.cu = [int(x) for x in cu]
            self.n_seq = len(self.cu) - 1
            self.max_len = max((e - s for s, e in zip(self.cu, self.cu[1:])), default=0)

    def _int(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.device)

    # lazily built, by hand rather than with functools.cached_property: its lock (Python < 3.12)
    # is a context manager torch.compile cannot enter
    @property
    def seq_tok(self) -> torch.Tensor:
        """[N + 1] first token of each sequence, then the total."""
        found = self.__dict__.get("_seq_tok")
        if found is None:
            found = self._seq_tok = self._make_seq_tok()
        return found

    @property
    def chunks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(chunk_tok [NC], chunk_len [NC], seq_chunk0 [N + 1]) as int32 device tensors."""
        found = self.__dict__.get("_chunks")
        if found is None:
            found = self._chunks = self._make_chunks()
        return found

    def _make_seq_tok(self) -> torch.Tensor:
        if self.cu is None:
            return torch.arange(self.B + 1, device=self.device, dtype=torch.int32) * self.T
        return self._int(self.cu)

    def _make_chunks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, C = self.B, self.T, self.C
        if self.cu is None:
            nt = triton.cdiv(T, C)
            j = torch.arange(nt, device=self.device, dtype=torch.int32)
            b = torch.arange(B, device=self.device, dtype=torch.int32)
            return ((b[:, None] * T + j[None, :] * C).reshape(-1), torch.clamp(T - j * C, max=C).repeat(B),
                    torch.arange(B + 1, device=self.device, dtype=torch.int32) * nt)
        toks, lens, first = [], [], [0]
        for s, e in zip(self.cu, self.cu[1:]):
            for t in range(s, e, C):
                toks.append(t)
                lens.append(min(C, e - t))
            first.append(len(toks))
        return self._int(toks), self._int(lens), self._int(first)


def _meta(K: int, V: int, C: int, dtype: torch.dtype, device: torch.device) -> dict:
    BK = max(16, triton.next_power_of_2(K))
    fp32 = dtype == torch.float32
    return dict(K=K, V=V, BK=BK, C=C, PREC="ieee" if fp32 else "tf32", IN_PREC="ieee" if fp32 else None,
                UPCAST=device.type == "cpu" and dtype == torch.bfloat16)


def _opts(name: str, V: int) -> dict:
    """The launch config of kernel `name` in effect (tuning.current()) with the value block clamped to the padded V."""
    return _clamp(tuning.current().delta_config(name), V)


def _clamp(cfg: dict, V: int) -> dict:
    """`cfg` with the value block clamped to the padded V."""
    cfg = dict(cfg)
    if "BV" in cfg:
        cfg["BV"] = min(cfg["BV"], max(16, triton.next_power_of_2(V)))
    return cfg


def _smaller(cfg: dict) -> dict | None:
    """The next smaller launch config: fewer pipeline stages first, then half the value block."""
    if cfg.get("num_stages", 1) > 1:
        return {**cfg, "num_stages": cfg["num_stages"] - 1}
    if cfg.get("BV", 16) > 16:
        return {**cfg, "BV": cfg["BV"] // 2}
    return None


@dataclass
class Plan:
    """How to launch one program at one (K, V, input dtype, device), whatever the lengths: the constexprs and
    a launch config per kernel (tuning.current()'s, value block clamped to the padded V). A config shrunk to fit the
    device's shared memory is remembered in `configs`, for this shape only."""

    mod: object
    C: int
    meta: dict          # K, V, BK, C, PREC, IN_PREC, UPCAST
    BKS: int            # key columns per program / loop step in the backward
    NK: int             # key blocks
    configs: dict
    host: dict          # HOST_KEYS found in any kernel's config -> bool (absent: False)
    hooks: object       # codegen.hooks(rule): which of the hooks' inputs the kernels take (eps, hp_ptr / dhp_ptr)


def plan(key: str, K: int, V: int, dtype: torch.dtype, device: torch.device) -> Plan:
    """The cached Plan of program `key` (see `program_key`) for this shape, built on first use."""
    knobs = tuning.current()
    key_block = knobs.delta_key_block
    pk = (key, K, V, dtype, device, key_block, knobs.delta_configs)
    found = PLANS.get(pk)
    if found is None:
        mod, C, hooks = PROGRAMS[key]
        meta = _meta(K, V, C, dtype, device)
        BKS = min(key_block, meta["BK"])
        if len(PLANS) >= CACHE_LIMIT:
            PLANS.clear()
        given = knobs.delta_launch_configs()
        configs = {name: {**_clamp(cfg, V), **SHARED_MEMORY_FITS.get((name, dtype.itemsize, meta["BK"]), {})}
                   for name, cfg in given.items()}
        # delta_bwd_dqk's key block: its config's BKS (else the key block), at most the padded K; all of K with WY
        # (delta_bwd_wy's work in the same program), which is taken up to K = 128 only (registers)
        dqk = configs["bwd_dqk"]
        dqk["WY"] = bool(dqk.get("WY", False)) and meta["BK"] <= 128
        dqk["BKS"] = meta["BK"] if dqk["WY"] else min(dqk.get("BKS", BKS), meta["BK"])
        configs["state_bwd"] = {"LOCAL_DU": False, **configs["state_bwd"]}
        host = {key: bool(cfg.pop(key)) for cfg in configs.values() for key in HOST_KEYS if key in cfg}
        if dtype == torch.float16:   # fp16's range is too narrow for gradients in it: its buffers and dots stay fp32
            host = {}
            for name in ("bwd_dqk", "bwd_wy"):
                configs[name]["LOWP"] = False
        found = PLANS[pk] = Plan(mod, C, meta, BKS, triton.cdiv(K, BKS), configs, host, hooks)
    return found


def _launch(name: str, kernel, grid, args: tuple, meta: dict, V: int, configs: dict, direct: bool = False):
    """Launch `kernel` with `configs[name]` (a plan's); `grid(cfg)` gives the grid. A config that needs
    more shared memory than the device has is shrunk until it fits and remembered in `configs` by the
    Triton backend's runtime.fit_launch. `direct` launches the kernel itself (eager); otherwise through
    wrap_triton, which torch.compile traces."""
    if not direct:   # wrap_triton's mutation analysis needs every parameter, the defaulted variant flags too
        meta = {**kernel_defaults(kernel), **meta}
    cfg = configs[name]              # the common case first, without fit_launch's bookkeeping
    try:
        (kernel if direct else wrap_triton(kernel))[grid(cfg)](*args, **{**meta, **cfg})
        return
    except OutOfResources:
        if _smaller(cfg) is None:
            raise
        configs[name] = _smaller(cfg)

    def attempt(cfg):
        opts = _clamp(cfg, V)
        (kernel if direct else wrap_triton(kernel))[grid(opts)](*args, **{**meta, **opts})
    fit_launch(name, configs[name], attempt, _smaller, remembered=configs)


def _eps(p: Plan, eps) -> tuple:
    """The kernels' eps argument where the rule's step reads eps (they declare it then only)."""
    return (eps,) if p.hooks.eps else ()


def _hp(p: Plan, hp: torch.Tensor) -> tuple:
    """The kernels' per-head parameter pointer (hp [P, H] or dhp [P, TT, H]) where the rule's decay has parameters
    (they declare it then only)."""
    return (hp,) if p.hooks.params else ()



def _states(p: Plan, k, v, hp, h0, chunk_tok, chunk_len, seq_chunk0, tm, gcum, beta, nonfinite, direct=False, w=None,
            u=None):
    """The backward's recomputation from the forward's (Tm, gcum, beta, nonfinite): w and u by delta_wu (unless the
    forward's are given: tuning.delta_save_wu), then the chunk start states h and innovations U by delta_state_fwd.
    Returns (w, h, U)."""
    TT, H, K = k.shape
    V = v.shape[-1]
    NC, N, dev = chunk_tok.numel(), seq_chunk0.numel() - 1, k.device
    recompute = w is None or u is None
    if recompute:
        w = _empty(TT, H, K, device=dev, dtype=k.dtype)
        u = _empty(TT, H, V, device=dev, dtype=k.dtype)
    h = _empty(NC, H, K, V, device=dev, dtype=k.dtype)
    U = _empty(TT, H, V, device=dev, dtype=k.dtype)
    if not direct and shapes_only(k):
        return w, h, U
    meta, cfgs = p.meta, p.configs
    if recompute:
        _launch("wu", p.mod.delta_wu,
                lambda cfg: (NC * (1 if cfg.get("PER_CHUNK") else p.NK + triton.cdiv(V, cfg["BV"])), H),
                (k, v, gcum, beta, tm, w, u, nonfinite, chunk_tok, chunk_len, H), dict(meta, BKS=p.BKS), V, cfgs,
                direct)
    _launch("state_fwd", p.mod.delta_state_fwd, lambda cfg: (N, H, triton.cdiv(V, cfg["BV"])),
            (k, w, u, gcum, h0 if h0 is not None else h, chunk_tok, chunk_len, seq_chunk0, h, U, h, H),
            dict(meta, HAS_H0=h0 is not None, STORE_FINAL=False), V, cfgs, direct)
    return w, h, U


def _chunk_forward(p: Plan, q, k, v, a, hp, s, h0, chunk_tok, chunk_len, seq_chunk0, eps, scale, direct,
                   keep_wu=False):
    """[o, final state, Tm, gcum, beta, nonfinite] (and with `keep_wu` w, u): the body of `delta_chunk_fwd`. prep (gcum,
    beta, Tm, w, u, the outputs' in-chunk matrices Q K^T * Dec and each chunk's first non-finite row), then
    delta_state_output (the sequential pass over chunks, storing the outputs and the final state)."""
    TT, H, K = k.shape
    V = v.shape[-1]
    NC, N, dev, C = chunk_tok.numel(), seq_chunk0.numel() - 1, k.device, p.C
    w = _empty(TT, H, K, device=dev, dtype=k.dtype)
    u = _empty(TT, H, V, device=dev, dtype=k.dtype)
    tm = _empty(NC, H, C, C, device=dev, dtype=torch.float32)
    gcum = _empty(TT, H, device=dev, dtype=torch.float32)
    beta = _empty(TT, H, device=dev, dtype=torch.float32)
    o = _empty(TT, H, V, device=dev, dtype=torch.float32)
    ht = _empty(N, H, K, V, device=dev, dtype=torch.float32)
    mq = _empty(NC, H, C, C, device=dev, dtype=k.dtype)     # Q K^T * Dec per chunk, from prep to state_output
    nonfinite = _empty(NC, H, device=dev, dtype=torch.int32)  # per chunk its first non-finite token's row, or C
    if direct or not shapes_only(k):
        meta, cfgs = p.meta, p.configs
        _launch("prep", p.mod.delta_prep, lambda cfg: (NC, H),
                (q, k, v, a, *_hp(p, hp), s, *_eps(p, eps), chunk_tok, chunk_len, w, u, tm, gcum, beta, mq, nonfinite,
                 H),
                dict(meta, BKS=p.BKS, BV=min(PREP_VALUE_BLOCK, max(16, triton.next_power_of_2(V)))), V, cfgs, direct)
        _launch("state_output", p.mod.delta_state_output, lambda cfg: (N, H, triton.cdiv(V, cfg["BV"])),
                (q, k, w, u, gcum, h0 if h0 is not None else ht, chunk_tok, chunk_len, seq_chunk0, ht, o, mq, nonfinite,
                 scale, H),
                dict(meta, HAS_H0=h0 is not None, STORE_FINAL=True), V, cfgs, direct)
    return [o, ht, tm, gcum, beta, nonfinite, w, u] if keep_wu else [o, ht, tm, gcum, beta, nonfinite]


def _chunk_backward(p: Plan, q, k, v, a, hp, s, h0, chunk_tok, chunk_len, seq_chunk0, tm, gcum, beta, nonfinite, w_fwd,
                    u_fwd, do, dht, eps, scale, direct):
    """[dq, dk, dv, da, ds, dh0, dhp]: the body of `delta_chunk_bwd` (w_fwd, u_fwd: the forward's w, u, or None)."""
    TT, H, K = k.shape
    V = v.shape[-1]
    NC, N, dev = chunk_tok.numel(), seq_chunk0.numel() - 1, k.device
    w, h, U = _states(p, k, v, hp, h0, chunk_tok, chunk_len, seq_chunk0, tm, gcum, beta, nonfinite, direct=direct,
                      w=w_fwd, u=u_fwd)
    dh = _empty(NC, H, K, V, device=dev, dtype=k.dtype)
    dU = _empty(TT, H, V, device=dev, dtype=k.dtype if p.host.get("LOWP_DU") else torch.float32)
    local_du = p.configs["state_bwd"]["LOCAL_DU"]     # else delta_dU_local stores the local part (fp32) first
    dul = dU if local_du or dU.dtype == torch.float32 else _empty(TT, H, V, device=dev, dtype=torch.float32)
    # and dO rounded to the input dtype (every use rounds it so): state_bwd and bwd_dqk read half the bytes
    store_do = not local_du and k.dtype != do.dtype
    doq = _empty(TT, H, V, device=dev, dtype=k.dtype) if store_do else do
    dh0 = _empty(N, H, K, V, device=dev, dtype=torch.float32) if h0 is not None else k.new_empty(0, dtype=torch.float32)
    dq = _empty(TT, H, K, device=dev, dtype=q.dtype)
    dk = _empty(TT, H, K, device=dev, dtype=k.dtype)
    dv = _empty(TT, H, V, device=dev, dtype=v.dtype)
    da = _empty(TT, H, device=dev, dtype=torch.float32)
    ds = _empty(TT, H, device=dev, dtype=torch.float32)
    NKQ = triton.cdiv(K, p.configs["bwd_dqk"]["BKS"])      # delta_bwd_dqk's key blocks, each storing shares
    wy = p.configs["bwd_dqk"]["WY"]                         # or one block doing delta_bwd_wy's work too
    if not wy:
        dk_part = _empty(TT, H, K, device=dev, dtype=k.dtype if p.host.get("LOWP_DK") else torch.float32)
        dTm_part = _empty(NC, H, NKQ, p.C, p.C, device=dev,
                          dtype=k.dtype if p.host.get("LOWP_DTM") else torch.float32)
        dG_part = _empty(NKQ, TT, H, device=dev, dtype=torch.float32)
        dbeta_part = _empty(NKQ, TT, H, device=dev, dtype=torch.float32)
    dhp_tok = _empty(hp.shape[0], TT, H, device=dev, dtype=torch.float32) if p.hooks.params else None
    if not direct and shapes_only(k):
        return [dq, dk, dv, da, ds, dh0, hp.new_empty(hp.shape)]
    meta, cfgs, mod = p.meta, p.configs, p.mod
    if not local_du:
        _launch("dU_local", mod.delta_dU_local, lambda cfg: (NC * triton.cdiv(V, cfg["BV"]), H),
                (q, k, gcum, do, dul, doq, chunk_tok, chunk_len, scale, H), dict(meta, STORE_DO=store_do), V, cfgs,
                direct)
    _launch("state_bwd", mod.delta_state_bwd, lambda cfg: (N, H, triton.cdiv(V, cfg["BV"])),
            (q, k, w, gcum, doq, dul, dht if dht is not None else dh, chunk_tok, chunk_len, seq_chunk0, dh, dU,
             dh0 if h0 is not None else dh, scale, H),
            dict(meta, HAS_DHT=dht is not None, STORE_DH0=h0 is not None), V, cfgs, direct)
    # with WY the shares' pointers are placeholders, never touched; without it, dv, da, dhp, ds are
    _launch("bwd_dqk", mod.delta_bwd_dqk, lambda cfg: (NC * NKQ, H),
            (q, k, v, a, *_hp(p, hp), s, *_eps(p, eps), gcum, beta, tm, nonfinite, h, dh, U, dU, doq, dq,
             dk if wy else dk_part, dv, *((dU, dU, dU) if wy else (dTm_part, dG_part, dbeta_part)), da,
             *_hp(p, dhp_tok), ds, chunk_tok, chunk_len, scale, TT * H, H), meta, V, cfgs, direct)
    if not wy:
        _launch("bwd_wy", mod.delta_bwd_wy, lambda cfg: (NC, H),
                (k, v, a, *_hp(p, hp), s, *_eps(p, eps), gcum, beta, tm, nonfinite, dU, dTm_part, dk_part, dG_part,
                 dbeta_part, dk, dv, da, *_hp(p, dhp_tok), ds, chunk_tok, chunk_len, TT * H, H),
                dict(meta, BKS=p.BKS, NKQ=NKQ), V, cfgs, direct)
    return [dq, dk, dv, da, ds, dh0, dhp_tok.sum(1) if p.hooks.params else hp.new_zeros(hp.shape)]


@triton_op("scanlang::delta_chunk_fwd", mutates_args=())
def delta_chunk_fwd(key: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, hp: torch.Tensor,
                    s: torch.Tensor, h0: Optional[torch.Tensor], chunk_tok: torch.Tensor, chunk_len: torch.Tensor,
                    seq_chunk0: torch.Tensor, eps: float, scale: float) -> list[torch.Tensor]:
    """Packed [TT, H, *] inputs (hp: the decay hook's per-head parameters [P, H] fp32) ->
    [o [TT, H, V] fp32, final state [N, H, K, V] fp32, and for the backward Tm, gcum, beta, nonfinite, w, u]."""
    p = plan(key, k.shape[-1], v.shape[-1], k.dtype, k.device)
    return _chunk_forward(p, q, k, v, a, hp, s, h0, chunk_tok, chunk_len, seq_chunk0, eps, scale, direct=False,
                          keep_wu=True)


@triton_op("scanlang::delta_chunk_bwd", mutates_args=())
def delta_chunk_bwd(key: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, hp: torch.Tensor,
                    s: torch.Tensor, h0: Optional[torch.Tensor], chunk_tok: torch.Tensor, chunk_len: torch.Tensor,
                    seq_chunk0: torch.Tensor, tm: torch.Tensor, gcum: torch.Tensor, beta: torch.Tensor,
                    nonfinite: torch.Tensor, w: Optional[torch.Tensor], u: Optional[torch.Tensor], do: torch.Tensor,
                    dht: Optional[torch.Tensor], eps: float, scale: float) -> list[torch.Tensor]:
    """Recompute w, u from the forward's Tm (unless given) and the chunk states, then [dq, dk, dv (input dtypes),
    da, ds (fp32), dh0 (fp32; empty without h0), dhp [P, H] fp32]."""
    p = plan(key, k.shape[-1], v.shape[-1], k.dtype, k.device)
    return _chunk_backward(p, q, k, v, a, hp, s, h0, chunk_tok, chunk_len, seq_chunk0, tm, gcum, beta, nonfinite, w, u,
                           do, dht, eps, scale, direct=False)


def _setup_context(ctx, inputs, output):
    key, q, k, v, a, hp, s, h0, chunk_tok, chunk_len, seq_chunk0, eps, scale = inputs
    _, _, tm, gcum, beta, nonfinite, w, u = output
    ctx.mark_non_differentiable(tm, gcum, beta, nonfinite, w, u)
    ctx.set_materialize_grads(False)      # no zero-filled gradients for Tm, gcum, beta, w, u (nor an unused o or S)
    if not tuning.current().delta_save_wu:
        w = u = None                      # the backward recomputes them (delta_wu)
    ctx.save_for_backward(q, k, v, a, hp, s, h0, chunk_tok, chunk_len, seq_chunk0, tm, gcum, beta, nonfinite, w, u)
    ctx.key, ctx.eps, ctx.scale = key, eps, scale


def _input_grads(ctx, do, dht, backward):
    """Gradients of delta_chunk_fwd's inputs from those of (o, final state); `backward` is the op or the eager body.
    Under create_graph=True they are refused a second differentiation (the kernels' gradients have no history)."""
    if torch.is_grad_enabled():
        with torch.no_grad():
            grads = _input_grads(ctx, do, dht, backward)
        return refuse_second_order("delta_rule / kaczmarz_delta_rule (backend='triton')", grads,
                                   [*ctx.saved_tensors, do, dht])
    q, k, v, a, hp, s, h0, chunk_tok, chunk_len, seq_chunk0, tm, gcum, beta, nonfinite, w, u = ctx.saved_tensors
    do = torch.zeros(*q.shape[:2], v.shape[-1], device=q.device) if do is None else do.contiguous().float()
    dht = None if dht is None else dht.contiguous().float()
    dq, dk, dv, da, ds, dh0, dhp = backward(ctx.key, q, k, v, a, hp, s, h0, chunk_tok, chunk_len, seq_chunk0,
                                            tm, gcum, beta, nonfinite, w, u, do, dht, ctx.eps, ctx.scale)
    return (None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), da.to(a.dtype), dhp.to(hp.dtype), ds.to(s.dtype),
            dh0.to(h0.dtype) if h0 is not None else None, None, None, None, None, None)


def _backward(ctx, grads):
    return _input_grads(ctx, grads[0], grads[1], delta_chunk_bwd)


delta_chunk_fwd.register_autograd(_backward, setup_context=_setup_context)


def _eager_chunk_backward(key, q, k, v, *rest):
    return _chunk_backward(plan(key, k.shape[-1], v.shape[-1], k.dtype, k.device), q, k, v, *rest, direct=True)


class _EagerChunk(torch.autograd.Function):
    """`delta_chunk_fwd` with its registered autograd, minus the dispatcher: same bodies, kernels launched directly.
    (`forward` takes ctx itself: with a separate setup_context, Function.apply binds arguments through
    inspect.signature on every call.)"""

    @staticmethod
    def forward(ctx, key, q, k, v, a, hp, s, h0, chunk_tok, chunk_len, seq_chunk0, eps, scale):
        p = plan(key, k.shape[-1], v.shape[-1], k.dtype, k.device)
        out = _chunk_forward(p, q, k, v, a, hp, s, h0, chunk_tok, chunk_len, seq_chunk0, eps, scale, direct=True,
                             keep_wu=True)
        _setup_context(ctx, (key, q, k, v, a, hp, s, h0, chunk_tok, chunk_len, seq_chunk0, eps, scale), out)
        return tuple(out)

    @staticmethod
    def backward(ctx, do, dht, *_):
        return _input_grads(ctx, do, dht, _eager_chunk_backward)


def _eager(*tensors) -> bool:
    """Whether the dispatcher can be skipped (runtime.eager), unless tuning turns the fast path off."""
    return tuning.current().delta_eager_fast_path and eager(tensors)


def recurrent_forward(p: Plan, q, k, v, a, hp, s, h0, eps, scale, table: ChunkTable):
    """Token loop with the state in registers: (o fp32 shaped like v, final state fp32). No autograd.

    Tensors are contiguous, packed [TT, H, *] or the batch itself [B, T, H, *] (the same memory)."""
    H, K, V = k.shape[-2], p.meta["K"], p.meta["V"]
    o = _empty(*v.shape, device=k.device, dtype=torch.float32)
    ht = _empty(table.n_seq, H, K, V, device=k.device, dtype=torch.float32)
    _launch("recurrent", p.mod.delta_recurrent, lambda cfg: (table.n_seq, H, triton.cdiv(V, cfg["BV"])),
            (q, k, v, a, *_hp(p, hp), s, *_eps(p, eps), h0 if h0 is not None else ht, o, ht, table.seq_tok, scale, H),
            dict(K=K, V=V, BK=p.meta["BK"], HAS_H0=h0 is not None, STORE_FINAL=True), V, p.configs, direct=True)
    return o, ht


def kernel_source(rule: DeltaRule, chunk_size: int) -> str:
    """The generated module of `rule` at `chunk_size` (backends/delta/codegen.py), as `scanlang show` prints it."""
    return codegen.kernel_source(rule, chunk_size)


def route_kernels(rule: DeltaRule, chunk_size: int, K: int, V: int, rows: int, grad: bool,
                  dtype: torch.dtype = torch.float32) -> tuple[list[str], list[str]]:
    """(forward kernels, backward kernels) that `delta_rule` launches for `rule` at this chunk, K, V and input dtype
    when its longest sequence has `rows` rows, with or without gradients (what `scanlang show --shape` prints):
    the token loop without gradients up to RECURRENT_MAX_LEN rows, else the chunk kernels, with the backward's
    choices the plan's configs and tuning.current() make (delta_save_wu, LOCAL_DU, WY) as `_chunk_backward` makes
    them. The plan is built for the shape (no tensor, no device touched)."""
    if not grad and rows <= RECURRENT_MAX_LEN:
        return ["delta_recurrent"], []
    forward = ["delta_prep", "delta_state_output"]
    if not grad:
        return forward, []
    p = plan(program_key(rule, chunk_size), K, V, dtype, torch.device("cuda"))
    backward = ([] if tuning.current().delta_save_wu else ["delta_wu"]) + ["delta_state_fwd"]
    backward += ([] if p.configs["state_bwd"]["LOCAL_DU"] else ["delta_dU_local"]) + ["delta_state_bwd",
                                                                                        "delta_bwd_dqk"]
    return forward, backward + ([] if p.configs["bwd_dqk"]["WY"] else ["delta_bwd_wy"])


def program_key(rule: DeltaRule, chunk_size: int) -> str:
    """Load (once) the generated module for `rule` at `chunk_size` and return its key in PROGRAMS.

    Under torch.compile the build runs at trace time, outside the graph (`_built`)."""
    return _built(rule.name, rule.key, chunk_size)


@torch.compiler.assume_constant_result
def _built(name: str, rule_key: str, chunk_size: int) -> str:
    """program_key's work on constants (strings and an int, as Dynamo needs them); the rule is found
    in `scanlang.delta.DECLARED`."""
    key = f"{name}_{rule_key}_c{chunk_size}"
    if key not in PROGRAMS:
        rule = DECLARED[(name, rule_key)]
        PROGRAMS[key] = (codegen.load(rule, chunk_size), chunk_size, codegen.hooks(rule))
    return key


def chunk_table(B: int, T: int, cu_seqlens, C: int, device) -> ChunkTable:
    """The ChunkTable of this batch, cached per shape (or per offsets: a tensor, or a sequence of ints, which
    spares a device read); a fresh one while compiling."""
    if torch.compiler.is_compiling():
        return ChunkTable(B, T, cu_seqlens, C, device)
    if cu_seqlens is None:
        return cached(TABLES, (B, T, C, device), lambda: ChunkTable(B, T, None, C, device))
    cu = tuple(int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens))
    return cached(TABLES, (cu, C, device), lambda: ChunkTable(B, T, cu, C, device))


def delta_rule(q, k, v, g, s, rule, scale: float, initial_state=None, output_final_state=False,
               cu_seqlens=None, chunk_size: int = 64, eps: float = 0.0, decay_params=()):
    """Gated delta rule with the step beta = rule.step(s, ||k||^2, eps) and the decay g = rule.decay(g, *params).

    `rule` is a `scanlang.delta.DeltaRule` or "beta" (beta = s as given) / "kaczmarz"
    (beta = s / (||k||^2 + eps)); `decay_params` are the rule's per-head parameters, each [H], in the order
    of `rule.head_params` (differentiable). Returns (o [B,T,H,V] fp32, final state [N,H,K,V] fp32 or None).
    """
    rule = _RULES[rule] if isinstance(rule, str) else rule
    if not isinstance(rule, DeltaRule):
        raise TypeError(f"rule must be a DeltaRule or one of {sorted(_RULES)}, got {rule!r}")
    B, T, H, K = k.shape
    V = v.shape[-1]
    decay_params = tuple(decay_params)
    if len(decay_params) != len(rule.head_params) or any(
            not isinstance(p, torch.Tensor) or tuple(p.shape) != (H,) for p in decay_params):
        raise ValueError(f"decay_params must be {len(rule.head_params)} tensors of shape [H] = [{H}] "
                         f"({rule.head_params} of rule '{rule.name}')")
    dt = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    table = chunk_table(B, T, cu_seqlens, chunk_size, k.device)
    if T == 0:
        o = torch.zeros(B, 0, H, V, device=k.device, dtype=torch.float32)
        S = initial_state.float() if initial_state is not None else torch.zeros(table.n_seq, H, K, V, device=k.device)
        return o, (S if output_final_state else None)
    if decay_params:
        hp = torch.stack([p.float() for p in decay_params])
    elif torch.compiler.is_compiling():
        hp = torch.zeros(0, H, device=k.device, dtype=torch.float32)
    else:
        hp = cached(_NO_PARAMS, (H, k.device), lambda: torch.zeros(0, H, device=k.device, dtype=torch.float32))
    h0 = initial_state.contiguous() if initial_state is not None else None
    key = program_key(rule, chunk_size)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, s, initial_state, *decay_params))
    # (not while compiling: the token-loop kernel launches directly, the chunk ops are the traceable ones)
    if not needs_grad and table.max_len <= RECURRENT_MAX_LEN and not torch.compiler.is_compiling():
        # decode: contiguous [B, T, H, *] inputs are already the packed stream; no reshapes
        dense = lambda t: (t if t.dtype == dt else t.to(dt)).contiguous()  # noqa: E731
        o, S = recurrent_forward(plan(key, K, V, dt, k.device), dense(q), dense(k), dense(v), g.contiguous(), hp,
                                 s.contiguous(), h0, eps, scale, table)
        return o, (S if output_final_state else None)
    pack = lambda t: (t if t.dtype == dt else t.to(dt)).reshape(B * T, H, t.shape[-1]).contiguous()  # noqa: E731
    qp, kp, vp = pack(q), pack(k), pack(v)
    a, sp = g.reshape(B * T, H).contiguous(), s.reshape(B * T, H).contiguous()
    args = (qp, kp, vp, a, hp, sp, h0, *table.chunks, float(eps), float(scale))
    if not _eager(qp, kp, vp, a, sp):
        o, S, *_ = delta_chunk_fwd(key, *args)
    elif needs_grad:
        o, S, *_ = _EagerChunk.apply(key, *args)
    else:
        o, S, *_ = _chunk_forward(plan(key, K, V, dt, k.device), *args, direct=True)
    o = o.reshape(B, T, H, V)
    return o, (S if output_final_state else None)


backend.register("delta", sys.modules[__name__])
