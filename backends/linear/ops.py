"""Launch the generated matrix-state kernels: the plain-write chunk kernels (backends/linear/kernels.py)
and the per-key delta chunk kernels (backends/linear/kernels_delta.py) under autograd, and the recurrent
decode kernel of every structure (backends/linear/decode.py), as torch.library ops (torch.compile traces
them, fullgraph) that plain eager calls bypass (runtime.eager: same bodies, same bits).

Routing (`run`): when no input requires a gradient and no sequence is longer than
`scanlang.tuning.current().decode_max_tokens` tokens (of q; default 64, 0 turns it off), the forward is
the token loop of decode.py, for every decay and correction. Otherwise plain writes take the chunk
kernels of kernels.py, per-key decay with the one-step delta correction (KDA's structure) those of
kernels_delta.py, and the other delta / Householder structures raise a ValueError asking for
backend='reference' (recipes/linear/family.py sends the delta and Householder corrections with decay none
or per head to the delta-rule kernels instead: what reaches this module with them is per-key decay, or a
direct call).

`member_op(declaration)` returns the member's `backend="triton"` op, called by
`recipes.linear.family.MemberOp` with the member's positional inputs after q, k, v (fla's order) and
fla's keywords. Tokens are packed into one stream [TT, H, ...] (an equal-length batch [B, T] is the
packed stream with offsets 0, T, 2T, ...) and a chunk table lists every chunk's first token, length
and sequence, so equal-length and `cu_seqlens` inputs run the same kernels; an empty sequence has no
chunk (its final state is its initial state).

The plain-write forward is one pass over each sequence's chunks in order (per sequence, head and value
block) writing the outputs, or (`tuning.linear_forward`; "auto": per-key decay) two kernels: that pass
storing the state entering every chunk, in the input dtype, then the output kernel over every chunk at
once (per chunk and head), so the intra-chunk matrix is formed off the serial path and once per chunk
rather than once per value block.

Recomputation policy (the backward): the forward keeps nothing but its inputs and the chunk-local
cumulative log-decay G (one fp32 value per token, or per token and key); the backward recomputes
the state entering every chunk with the forward kernel (STORE_H, no outputs), then runs the reverse
state-gradient pass and the per-chunk gradient kernel. The per-key delta forward also keeps its prep
kernel's beta, Tm, Aqk and w (C + C + K + 1 fp32 values per token and head) for its backward. Everything
the kernels fill is allocated by `_empty`, so a test can NaN-fill them.
"""
from __future__ import annotations

import contextlib
import contextvars
import sys
from typing import Optional

import torch
import triton
from torch.library import triton_op, wrap_triton

from scanlang import backend, tuning
from scanlang.linear import MatrixState
from scanlang.second_order import refuse_second_order

from ..triton.runtime import cached, eager, kernel_defaults, load, shapes_only
from . import decode, kernels, kernels_delta

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MODULES: dict[str, object] = {}        # declaration key -> the loaded generated module
CONFIG = dict(BV=32, num_warps=4)      # value columns per program (clamped to the padded V)
# the per-key delta prep kernel's warps: with forward substitution it spilled 1,504 B a thread at 4, 48 B at 8; with
# the blocked inverse 504 B at 8 (bf16, K = V = 128, C = 64; offline sm_90, Triton 3.6)
PREP_WARPS = 8
DECODE_CONFIG = dict(BV=32, num_warps=4)   # the decode kernel's value columns per program (clamped likewise)
DECODE_MODULES: dict[str, object] = {}     # declaration key -> the loaded decode module


_RECORDING: contextvars.ContextVar = contextvars.ContextVar("linear_launches", default=None)


@contextlib.contextmanager
def recording(run: bool = False):
    """Within the block, launches are recorded as (name, kernel, grid, args, constexprs and options) instead
    of run (scanlang.tools.offline_compile compiles them for a GPU without one); `run=True` records them and
    runs them too (bench_linear --breakdown times each one again)."""
    launches = []
    token = _RECORDING.set((launches, run))
    try:
        yield launches
    finally:
        _RECORDING.reset(token)


def _for_cuda(device) -> bool:
    """Whether launches on `device` take CUDA's settings: a CUDA device, or any while launches are recorded and not
    run (offline_compile compiles them for a GPU, so it sees the launch settings a GPU would get)."""
    recorder = _RECORDING.get()
    return device.type == "cuda" or (recorder is not None and not recorder[1])


def _launch(kernel, grid, args, meta, direct: bool = True):
    """`kernel[grid](*args, **meta)`; `direct=False` through wrap_triton (which torch.compile traces; its mutation
    analysis needs every parameter, defaulted ones too), and not at all in a shape-only (fake tensor) pass."""
    recorder = _RECORDING.get()
    if recorder is not None:
        recorder[0].append((kernel.fn.__name__, kernel, grid, tuple(args), dict(meta)))
        if not recorder[1]:
            return
    if direct:
        kernel[grid](*args, **meta)
    elif not shapes_only(next(a for a in args if isinstance(a, torch.Tensor))):
        wrap_triton(kernel)[grid](*args, **{**kernel_defaults(kernel), **meta})


def _empty(*shape, device, dtype=torch.float32):
    """Every buffer the kernels fill (tests may replace it with a NaN-filled one)."""
    return torch.empty(*shape, device=device, dtype=dtype)


def module(decl: MatrixState):
    """The generated module of `decl`, rendered and loaded once (content-addressed, runtime.load)."""
    mod = MODULES.get(decl.key)
    if mod is None:
        mod = MODULES[decl.key] = load((kernels_delta if kernels_delta.supports(decl) else kernels).render(decl))
    return mod


TABLES: dict = {}   # (B, T, offsets or None, C, device) -> ChunkTable


def chunk_table(B: int, T: int, offsets, C: int, device) -> "ChunkTable":
    """The ChunkTable of this batch, built once per (shape or offsets, chunk size, device): each build is
    four host-to-device copies from pageable memory, which the GPU timeline showed on every call (and
    which make the host wait); a fresh one while torch.compile traces."""
    if torch.compiler.is_compiling():
        return ChunkTable(B, T, offsets, C, device)
    key = (B, T, None if offsets is None else tuple(offsets), C, device)
    return cached(TABLES, key, lambda: ChunkTable(B, T, offsets, C, device))


class ChunkTable:
    """chunk_tok, chunk_len, chunk_seq [NC] and seq_chunk0 [N + 1] (int32) of a packed stream (read only:
    `chunk_table` shares one between calls)."""

    def __init__(self, B: int, T: int, offsets, C: int, device):
        bounds = [(b * T, (b + 1) * T) for b in range(B)] if offsets is None else list(zip(offsets, offsets[1:]))
        toks, lens, seqs, first = [], [], [], [0]
        for n, (s, e) in enumerate(bounds):
            for t in range(s, e, C):
                toks.append(t)
                lens.append(min(C, e - t))
                seqs.append(n)
            first.append(len(toks))
        as_int = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
        self.n_seq, self.n_chunks = len(bounds), len(toks)
        self.chunk_tok, self.chunk_len, self.chunk_seq = as_int(toks), as_int(lens), as_int(seqs)
        self.seq_chunk0 = as_int(first)


def _meta(K: int, V: int, C: int, dtype: torch.dtype, device, d: Optional[MatrixState] = None) -> dict:
    """The shape constexprs. PREC, the precision of dots whose operands are fp32: "ieee" for fp32 inputs,
    except the per-key delta kernels' on CUDA (`d`), which take "tf32", as they do for 16-bit inputs (then
    fp32 inputs lose nothing to bf16 rounding, and the dots run on tensor cores): with "ieee" (FMA) on sm_90
    their fp32 module spilled tens of KB a thread and took over 25 minutes to compile (Triton 3.6;
    BENCHMARKS_HISTORY.md "Session 15"); with "tf32" it compiles as fast as bf16's (Session 18). The GPU
    tolerance rows for fp32 (scanlang.testing) are those of tf32 dots."""
    fp32 = dtype == torch.float32
    ieee = fp32 and not (d is not None and kernels_delta.supports(d) and _for_cuda(device))
    return dict(K=K, V=V, BK=max(16, triton.next_power_of_2(K)),
                BV=min(CONFIG["BV"], max(16, triton.next_power_of_2(V))), C=C,
                BS=min(tuning.current().linear_pairwise_block, C),
                PREC="ieee" if ieee else "tf32", UPCAST=device.type == "cpu" and dtype == torch.bfloat16)


def _cuda_16bit(q: torch.Tensor) -> bool:
    """16-bit inputs on CUDA: where Triton 3.6 on sm_90 miscompiled tiles narrower than the chunk."""
    return _for_cuda(q.device) and q.dtype != torch.float32


def _narrow_16bit(meta: dict, q: torch.Tensor) -> bool:
    """Whether a per-key delta backward kernel runs with BV = 16 (CUDA, 16-bit inputs, BV < C): Triton 3.6 on
    sm_90 miscompiled BV = 32 < C = 64 (the plain backward in session 10; KDA's `{name}_bwd_dh` made an illegal
    memory access at V = 32 on an H100 in session 14, and was right at BV = 16 and at BV = 64)."""
    return _cuda_16bit(q) and meta["BV"] < meta["C"]


def _wide(meta: dict, q: torch.Tensor) -> dict:
    """`meta` for the output-writing forward and the per-chunk backward on CUDA with 16-bit inputs:
    BV >= C (masked past V), and one pipeline stage in the backward. Triton 3.6 on sm_90 miscompiles
    both kernels when BV < C (BENCHMARKS_HISTORY.md, "Session 10"): the forward's o wrong from the first
    chunk at C=64, BV=32 (an illegal memory access with 8 warps); the backward's dq wrong, or an illegal
    memory access, at C=64, BV=V=32. Every variant with BV >= C (one stage) or BV=16 was right; the
    states were right throughout. One stage: at BV=64 the pipelined backward needs 245-279 KB of shared
    memory, over the H200's 227 KB."""
    if _narrow_16bit(meta, q):
        return dict(meta, BV=meta["C"])
    return meta


# ---- the chunk path: two torch.library ops with registered autograd ------------------------------
#
# `scanlang::linear_chunk_fwd` / `linear_chunk_bwd` take the declaration by its key (DECLS) and the chunk
# table as tensors, so torch.compile traces a member call whole (fullgraph) and its kernels launch through
# wrap_triton. Outside a trace `_EagerChunk`, a torch.autograd.Function, runs the same two bodies with the
# kernels launched directly (no dispatcher): both paths give identical bits.

DECLS: dict[str, MatrixState] = {}   # declaration key -> declaration, for the ops (which take strings)


class _Table:
    """A ChunkTable rebuilt from its four tensors inside an op (counts from their shapes, no device read)."""

    def __init__(self, chunk_tok, chunk_len, chunk_seq, seq_chunk0):
        self.chunk_tok, self.chunk_len, self.chunk_seq, self.seq_chunk0 = chunk_tok, chunk_len, chunk_seq, seq_chunk0
        self.n_chunks, self.n_seq = chunk_tok.shape[0], seq_chunk0.shape[0] - 1


def _forward(d: MatrixState, q, k, v, h0, xs, table, constants, scale: float, C: int, direct: bool) -> list:
    """[o [TT,H,V], final state [N,H,K,V], then what the backward keeps: G (with decay), and for the per-key
    delta correction beta, Tm, Aqk, w, P, u] (fp32)."""
    mod, meta = module(d), _meta(q.shape[-1], v.shape[-1], C, q.dtype, q.device, d)
    TT, H, _ = q.shape
    V, dev = v.shape[-1], q.device
    o = _empty(TT, H, V, device=dev)
    ht = _empty(table.n_seq, H, meta["K"], V, device=dev)
    if kernels_delta.supports(d):
        G, wy = _empty(TT, H, meta["K"], device=dev), _wy(table, TT, H, q.shape[-1], V, C, dev)
        by_name = dict(zip(kernels_delta.hook_inputs(d), xs))   # the cumsum kernel takes the log-decay's, in its order
        g_inputs = [by_name[n] for n in d.used(d.log_decay) if n in d.inputs]
        _launch(getattr(mod, f"{d.name}_decay_cumsum"), (table.n_chunks, H),
                (*g_inputs, G, table.chunk_tok, table.chunk_len, *constants, H),
                dict(K=meta["K"], BK=meta["BK"], C=C), direct)
        _launch(getattr(mod, f"{d.name}_prep"), (table.n_chunks, H),
                (q, k, v, *(by_name[n] for n in kernels_delta.beta_inputs(d)), G, *wy, table.chunk_tok, table.chunk_len, *constants, H),
                dict(K=meta["K"], V=meta["V"], BK=min(meta["BK"], tuning.current().linear_delta_key_block), BV=meta["BV"],
                     C=C, BS=meta["BS"], PREC=meta["PREC"], UPCAST=meta["UPCAST"], num_warps=PREP_WARPS),
                direct)
        # the states entering the chunks in the input dtype: the output's product rounds them to it anyway (`mm`)
        hs = _empty(table.n_chunks + table.n_seq, H, meta["K"], V, device=dev, dtype=q.dtype)
        U = _empty(TT, H, V, device=dev)
        _delta_states(mod, d, meta, q, k, G, wy, h0, U, ht, hs, table, True, True, direct)
        out = _per_chunk_launch(meta, q, CONFIG["num_warps"])
        _launch(getattr(mod, f"{d.name}_fwd_o"), (table.n_chunks, H, triton.cdiv(V, out["BV"])),
                (q, k, v, G, wy[0], wy[2], U, hs, o, table.chunk_tok, table.chunk_len, table.chunk_seq, scale, H), out,
                direct)
        return [o, ht, G, *wy]
    G = None
    if d.decay != "none":
        G = _empty(TT, H, *((meta["K"],) if d.decay == "per_key" else ()), device=dev)
        _launch(getattr(mod, f"{d.name}_decay_cumsum"), (table.n_chunks, H),
                (*xs, G, table.chunk_tok, table.chunk_len, *constants, H),
                dict(K=meta["K"], BK=meta["BK"], C=C), direct)
    if not _split_forward(d):
        _fwd(mod, d, meta, q, k, v, G, h0, o, ht, ht, table, scale, True, True, False, direct)
        return [o, ht] + ([G] if G is not None else [])
    # the states entering the chunks in the input dtype: the output's product rounds them to it anyway (`mm`)
    hs = _empty(table.n_chunks + table.n_seq, H, meta["K"], V, device=dev, dtype=q.dtype)
    _fwd(mod, d, meta, q, k, v, G, h0, o, ht, hs, table, scale, False, True, True, direct)
    g = (G,) if G is not None else ()
    out, blocks = _per_chunk_meta(d, meta, q)
    if blocks > 1:
        o.zero_()   # the key blocks' shares add up in it
    _launch(getattr(mod, f"{d.name}_fwd_o"), (table.n_chunks, H, blocks),
            (q, k, v, *g, hs, o, table.chunk_tok, table.chunk_len, table.chunk_seq, scale, H), out, direct)
    return [o, ht] + ([G] if G is not None else [])


def _backward(d: MatrixState, q, k, v, h0, xs, saved, do, dht, table, constants, scale: float, C: int,
              direct: bool) -> list:
    """[dq, dk, dv (fp32, or the inputs' dtype on CUDA: `_grad_dtype`), d(initial state) (empty without one),
    d(hook inputs) (fp32)]."""
    meta = _meta(q.shape[-1], v.shape[-1], C, q.dtype, q.device, d)
    # plain writes keep the chunk states and their gradients in the input dtype (every product that reads
    # them rounds its operands to it; the decay gradient's rowsum(S0 * dS_end) reads them rounded too)
    states = torch.float32 if kernels_delta.supports(d) else q.dtype
    do, dht, hs, dh, dh0 = _backward_buffers(table, q, v, h0, do, dht, states)
    if kernels_delta.supports(d):
        dq, dk, dv, dxs = _delta_backward(d, meta, q, k, v, h0, saved[0], saved[1:], xs, do, dht, hs, dh, dh0,
                                          table, constants, scale, direct)
    else:
        dq, dk, dv, dxs = _plain_backward(d, meta, q, k, v, h0, saved[0] if saved else None, xs, do, dht, hs, dh,
                                          dh0, table, constants, scale, direct)
    return [dq, dk, dv, dh0 if h0 is not None else dh.new_empty(0), *dxs]


@triton_op("scanlang::linear_chunk_fwd", mutates_args=())
def linear_chunk_fwd(key: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h0: Optional[torch.Tensor],
                     xs: list[torch.Tensor], chunk_tok: torch.Tensor, chunk_len: torch.Tensor, chunk_seq: torch.Tensor,
                     seq_chunk0: torch.Tensor, constants: list[float], scale: float, C: int) -> list[torch.Tensor]:
    """Packed [TT, H, *] inputs of the declaration DECLS[key] -> `_forward`'s list."""
    return _forward(DECLS[key], q, k, v, h0, xs, _Table(chunk_tok, chunk_len, chunk_seq, seq_chunk0), constants,
                    scale, C, direct=False)


@triton_op("scanlang::linear_chunk_bwd", mutates_args=())
def linear_chunk_bwd(key: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h0: Optional[torch.Tensor],
                     xs: list[torch.Tensor], saved: list[torch.Tensor], do: Optional[torch.Tensor],
                     dht: Optional[torch.Tensor], chunk_tok: torch.Tensor, chunk_len: torch.Tensor,
                     chunk_seq: torch.Tensor, seq_chunk0: torch.Tensor, constants: list[float], scale: float,
                     C: int) -> list[torch.Tensor]:
    """The gradients of linear_chunk_fwd's tensor inputs (`_backward`'s list) from those of (o, final state)."""
    return _backward(DECLS[key], q, k, v, h0, xs, saved, do, dht, _Table(chunk_tok, chunk_len, chunk_seq, seq_chunk0),
                     constants, scale, C, direct=False)


def _setup_context(ctx, inputs, output):
    key, q, k, v, h0, xs, chunk_tok, chunk_len, chunk_seq, seq_chunk0, constants, scale, C = inputs
    saved = output[2:]
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)   # no zero-filled gradient for an unused o or final state
    ctx.save_for_backward(q, k, v, h0, chunk_tok, chunk_len, chunk_seq, seq_chunk0, *xs, *saved)
    ctx.key, ctx.constants, ctx.scale, ctx.C, ctx.n_xs = key, constants, scale, C, len(xs)


def _input_grads(ctx, do, dht, backward) -> tuple:
    """(dq, dk, dv, d(initial state) or None, *d(hook inputs)) from the gradients of (o, final state); `backward`
    is the op or the eager body. Under create_graph=True they are refused a second differentiation (the
    kernels' gradients have no history)."""
    q, k, v, h0, chunk_tok, chunk_len, chunk_seq, seq_chunk0, *rest = ctx.saved_tensors
    xs, saved = rest[:ctx.n_xs], rest[ctx.n_xs:]
    if torch.is_grad_enabled():
        with torch.no_grad():
            grads = _input_grads(ctx, do, dht, backward)
        return refuse_second_order(f"{DECLS[ctx.key].name} (backend='triton')", grads, [q, k, v, do, dht])
    dq, dk, dv, dh0, *dxs = backward(ctx.key, q, k, v, h0, list(xs), list(saved), do, dht, chunk_tok, chunk_len,
                                     chunk_seq, seq_chunk0, ctx.constants, ctx.scale, ctx.C)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dh0 if h0 is not None else None,
            *(dx.to(x.dtype) for dx, x in zip(dxs, xs)))


def _op_backward(ctx, grads):
    dq, dk, dv, dh0, *dxs = _input_grads(ctx, grads[0], grads[1], linear_chunk_bwd)
    # the float list of constants: None, or [] when empty (torch's pytree takes an empty list for a list of tensors)
    return (None, dq, dk, dv, dh0, list(dxs), None, None, None, None, None if ctx.constants else [], None, None)


linear_chunk_fwd.register_autograd(_op_backward, setup_context=_setup_context)


def _eager_backward(key, q, k, v, h0, xs, saved, do, dht, chunk_tok, chunk_len, chunk_seq, seq_chunk0, constants,
                    scale, C):
    return _backward(DECLS[key], q, k, v, h0, xs, saved, do, dht, _Table(chunk_tok, chunk_len, chunk_seq, seq_chunk0),
                     constants, scale, C, direct=True)


class _EagerChunk(torch.autograd.Function):
    """linear_chunk_fwd with its registered autograd, minus the dispatcher: same bodies, kernels launched directly.
    The hook inputs come last, unpacked (an autograd.Function's gradients are per argument)."""

    @staticmethod
    def forward(ctx, key, q, k, v, h0, chunk_tok, chunk_len, chunk_seq, seq_chunk0, constants, scale, C, *xs):
        table = _Table(chunk_tok, chunk_len, chunk_seq, seq_chunk0)
        out = _forward(DECLS[key], q, k, v, h0, list(xs), table, constants, scale, C, direct=True)
        _setup_context(ctx, (key, q, k, v, h0, list(xs), chunk_tok, chunk_len, chunk_seq, seq_chunk0, constants,
                             scale, C), out)
        return tuple(out)

    @staticmethod
    def backward(ctx, do, dht, *_):
        dq, dk, dv, dh0, *dxs = _input_grads(ctx, do, dht, _eager_backward)
        return (None, dq, dk, dv, dh0) + (None,) * 7 + tuple(dxs)


def _warps(d: MatrixState) -> int:
    """Warps of the per-chunk kernels: per-key decay holds many [C, BK] fp32 tiles (8 warps halve each
    thread's share of them); the per-key delta backward's `{name}_bwd` 16: on an H100 (bf16 B8 T4096 H16,
    K = V = 128, key blocks of 32) it took 10.4 ms at 16 against 14.2 at 8 and 17.0 at 4 (BENCHMARKS_HISTORY.md
    "Session 19")."""
    if kernels_delta.supports(d):
        return 16
    return 8 if d.decay == "per_key" else CONFIG["num_warps"]


def _split_forward(d: MatrixState) -> bool:
    """Whether the forward is the state pass plus the per-chunk output kernel (tuning.linear_forward; "auto":
    per-key decay, whose intra-chunk matrix is the costly part) rather than the one fused pass."""
    choice = tuning.current().linear_forward
    return d.decay == "per_key" if choice == "auto" else choice == "split"


def _per_chunk_launch(meta: dict, q: torch.Tensor, warps: int) -> dict:
    """`meta` for a per-chunk kernel on `warps` warps: `_wide`'s BV >= C, with one pipeline stage, for 16-bit CUDA
    inputs."""
    wide = _wide(meta, q)
    return dict(wide, num_warps=warps, **({"num_stages": 1} if wide is not meta else {}))


def _per_chunk_meta(d: MatrixState, meta: dict, q: torch.Tensor) -> tuple[dict, int]:
    """(launch meta, key blocks) of the plain-write per-chunk kernels (`{name}_fwd_o`, `{name}_bwd`): `_wide`'s
    BV >= C with one stage for 16-bit CUDA inputs, `_warps`, and for per-key decay key blocks of
    tuning.linear_key_block columns (linear_delta_key_block for the per-key delta backward), each its own
    program (kernels.py `_key_block`; SPLIT_K when there are several). At BK = 128 the backward's pairwise
    gradients spilled 3.3 KB a thread at 8 warps (offline sm_90, Triton 3.6); the split backward ran 40% faster
    on an H100 (BENCHMARKS_HISTORY.md, "Session 14"). The blocks' shares of o, dv and the per-token hook inputs'
    gradients meet in atomic adds: with two blocks the result has the same bits in either order, with more it
    can differ in the last bits between runs, so under torch.use_deterministic_algorithms(True) there are at
    most two (one where beta's share is added first: kernels_delta.beta_adds_first)."""
    out = _per_chunk_launch(meta, q, _warps(d))
    if d.decay != "per_key":
        return out, 1
    knobs = tuning.current()
    BK = min(out["BK"], knobs.linear_delta_key_block if kernels_delta.supports(d) else knobs.linear_key_block)
    if torch.are_deterministic_algorithms_enabled():   # two shares add to the same bits in either order, more need not
        # (one, where a per-token input's gradient already holds beta's share: kernels_delta.summed)
        shares = 1 if kernels_delta.supports(d) and kernels_delta.beta_adds_first(d) else 2
        BK = max(BK, min(out["BK"], triton.next_power_of_2(triton.cdiv(q.shape[-1], shares))))
    blocks = triton.cdiv(q.shape[-1], BK)
    return dict(out, BK=BK, SPLIT_K=blocks > 1), blocks


def _fwd(mod, d, meta, q, k, v, G, h0, o, ht, hs, table, scale, store_o, store_final, store_h, direct):
    """The state pass (kernels.py `{name}_fwd`): the outputs into o (store_o: the fused forward), the state
    entering every chunk into hs (store_h), the final states into ht (store_final)."""
    H, V = q.shape[1], v.shape[-1]
    g = (G,) if G is not None else ()
    meta = _wide(meta, q) if store_o else meta
    grid = (table.n_seq, H, triton.cdiv(V, meta["BV"]))
    _launch(getattr(mod, f"{d.name}_fwd"), grid,
            (q, k, v, *g, h0 if h0 is not None else ht, o, ht, hs, table.chunk_tok, table.chunk_len, table.seq_chunk0,
             scale, H), dict(meta, HAS_H0=h0 is not None, STORE_O=store_o, STORE_FINAL=store_final, STORE_H=store_h,
                             num_warps=CONFIG["num_warps"]), direct)


def _grad_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype the per-chunk backward kernels store dq, dk (and, with no key blocks adding up, dv) in: the
    inputs' own on CUDA (the store rounds to nearest, as the cast after it did: three fp32 -> bf16 casts took
    0.40 ms of linear attention's 2.66 ms forward+backward on an H100, BENCHMARKS_HISTORY.md "Session 18"),
    fp32 in Triton's interpreter, whose fp32 -> bf16 conversion truncates."""
    return q.dtype if _for_cuda(q.device) else torch.float32


def _backward_buffers(table, q, v, h0, do, dht, states=torch.float32):
    """(do fp32 (zeros when None), dht fp32 or None, hs: the state entering every chunk (slot c + n; filled by
    the caller's recomputation), dh: dS_end per chunk (both of dtype `states`), dh0: d(initial state) (fp32),
    or dh when there is none)."""
    TT, H, K = q.shape
    V, dev = v.shape[-1], q.device
    do = torch.zeros(TT, H, V, device=dev) if do is None else do.contiguous().float()
    dht = None if dht is None else dht.contiguous().float()
    hs = _empty(table.n_chunks + table.n_seq, H, K, V, device=dev, dtype=states)
    dh = _empty(max(table.n_chunks, 1), H, K, V, device=dev, dtype=states)
    dh0 = _empty(table.n_seq, H, K, V, device=dev) if h0 is not None else dh
    return do, dht, hs, dh, dh0


def _plain_backward(d, meta, q, k, v, h0, G, xs, do, dht, hs, dh, dh0, table, constants, scale, direct):
    """Plain writes: recompute the chunk states, the reverse state-gradient pass, the per-chunk gradients."""
    mod = module(d)
    TT, H, K = q.shape
    V, dev = v.shape[-1], q.device
    _fwd(mod, d, meta, q, k, v, G, h0, hs, hs, hs, table, scale, False, False, True, direct)
    g = (G,) if G is not None else ()
    grid = (table.n_seq, H, triton.cdiv(V, meta["BV"]))
    _launch(getattr(mod, f"{d.name}_bwd_dh"), grid,
            (q, *g, do, dht if dht is not None else dh, dh, dh0, table.chunk_tok, table.chunk_len, table.seq_chunk0,
             scale, H), dict(meta, HAS_DHT=dht is not None, STORE_DH0=h0 is not None, num_warps=CONFIG["num_warps"]),
            direct)
    bwd, blocks = _per_chunk_meta(d, meta, q)
    gdt = _grad_dtype(q)
    dq, dk = _empty(TT, H, K, device=dev, dtype=gdt), _empty(TT, H, K, device=dev, dtype=gdt)
    dv = _empty(TT, H, V, device=dev, dtype=gdt if blocks == 1 else torch.float32)   # key blocks add up in fp32
    kinds = [d.inputs[n] for n in d.used(d.log_decay) if n in d.inputs] if d.decay != "none" else []
    summed = ("head", "token") if d.decay == "per_key" else ("head",)   # atomics add into them
    dxs = [torch.zeros(x.shape, device=dev) if kind in summed else _empty(*x.shape, device=dev)
           for x, kind in zip(xs, kinds)]
    hook = [*xs, *dxs, *constants] if d.decay != "none" else []
    if table.n_chunks:
        if blocks > 1:
            dv.zero_()   # the key blocks' shares add up in it
        _launch(getattr(mod, f"{d.name}_bwd"), (table.n_chunks, H, blocks),
                (q, k, v, *g, hs, dh, do, dq, dk, dv, table.chunk_tok, table.chunk_len, table.chunk_seq, *hook,
                 scale, H), bwd, direct)
    return dq, dk, dv, dxs


def _wy(table, TT: int, H: int, K: int, V: int, C: int, dev) -> tuple:
    """beta [TT, H], Tm and Aqk [NC, H, C, C], w [TT, H, K], P [NC, H, C, C], u [TT, H, V]: what the prep kernel
    stores."""
    cc = lambda: _empty(table.n_chunks, H, C, C, device=dev)  # noqa: E731
    return (_empty(TT, H, device=dev), cc(), cc(), _empty(TT, H, K, device=dev), cc(), _empty(TT, H, V, device=dev))


def _delta_states(mod, d, meta, q, k, G, wy, h0, U, ht, hs, table, store_u, store_final, direct):
    """The per-key delta state pass (`{name}_fwd`): U of every chunk into U (store_u), the state entering every
    chunk into hs, the final states into ht (store_final). One pipeline stage: compiled offline for sm_90 (K = V =
    128, C = 64, bf16) the pipelined output-writing pass this replaced needed 242 KB of shared memory, over the
    227 KB an SM gives a block; one stage, 98 KB."""
    H, V = q.shape[1], hs.shape[-1]
    grid = (table.n_seq, H, triton.cdiv(V, meta["BV"]))
    _launch(getattr(mod, f"{d.name}_fwd"), grid,
            (q, k, G, wy[3], wy[5], h0 if h0 is not None else ht, U, ht, hs, table.chunk_tok, table.chunk_len,
             table.seq_chunk0, H),
            dict(meta, HAS_H0=h0 is not None, STORE_U=store_u, STORE_FINAL=store_final, STORE_H=True,
                 num_warps=CONFIG["num_warps"], num_stages=1), direct)


def _delta_backward(d, meta, q, k, v, h0, G, wy, xs, do, dht, hs, dh, dh0, table, constants, scale, direct):
    """Per-key decay with the delta correction (kernels_delta.py): the forward kept G and the prep kernel's beta,
    Tm, Aqk, w and P; recompute the state entering every chunk (STORE_H), the reverse state-gradient pass, then
    the two per-chunk gradient kernels (every key, then key blocks)."""
    mod = module(d)
    TT, H, K = q.shape
    V, dev = v.shape[-1], q.device
    NC = table.n_chunks
    _delta_states(mod, d, meta, q, k, G, wy, h0, hs, hs, hs, table, False, False, direct)
    beta, tm, aqk, w, _, _ = wy
    narrow = _narrow_16bit(meta, q)
    # BV = C where BV < C is what Triton 3.6 miscompiles (`_narrow_16bit`): on an H100 (bf16 B8 T4096 H16, K = V =
    # 128) this pass took 2.07 ms at BV = 64 against 5.16 at BV = 16, which repeats the key side for every value block
    dh_meta = _wide(meta, q)
    grid = (table.n_seq, H, triton.cdiv(V, dh_meta["BV"]))
    _launch(getattr(mod, f"{d.name}_bwd_dh"), grid,
            (q, k, G, beta, aqk, w, do, dht if dht is not None else dh, dh, dh0, table.chunk_tok, table.chunk_len,
             table.seq_chunk0, scale, H),
            dict(dh_meta, HAS_DHT=dht is not None, STORE_DH0=h0 is not None, num_warps=CONFIG["num_warps"],
                 num_stages=1), direct)   # 222 KB of shared memory pipelined at K = V = 128, C = 64 (_delta_states)
    gdt = _grad_dtype(q)
    dq, dk = _empty(TT, H, K, device=dev, dtype=gdt), _empty(TT, H, K, device=dev, dtype=gdt)
    dv, u = _empty(TT, H, V, device=dev), _empty(TT, H, V, device=dev)   # dv fp32: `{name}_bwd` reads it back
    daqk, dp, dn2 = _empty(NC, H, meta["C"], meta["C"], device=dev), _empty(NC, H, meta["C"], meta["C"], device=dev), \
        _empty(TT, H, device=dev)
    names = kernels_delta.hook_inputs(d)
    dxs = [torch.zeros(x.shape, device=dev) if kernels_delta.summed(d, n) else _empty(*x.shape, device=dev)
           for x, n in zip(xs, names)]
    hook = (*xs, *dxs, *constants)
    # one stage: pipelined, its value loop asked for 248 KB of shared memory at K = V = 128, C = 64 (offline sm_90)
    bwd_v = dict(meta, num_warps=CONFIG["num_warps"], num_stages=1)
    if narrow:
        # BV = 16, one stage: BV = 32 < C is the width Triton 3.6 miscompiled in the plain backward; BV = 16 was
        # right there (BENCHMARKS_HISTORY.md, "Session 10")
        bwd_v["BV"] = 16
    if _cuda_16bit(q):
        # key tiles at least C wide (masked past K): at K = 32 (BK = 32 < C = 64) with bf16 inputs the single backward
        # kernel made an illegal memory access on an H100 under Triton 3.6; BK = C was right ("Session 14")
        bwd_v["BK"] = max(bwd_v["BK"], meta["C"])
    _launch(getattr(mod, f"{d.name}_bwd_v"), (NC, H),
            (q, k, v, G, *wy, hs, dh, do, dv, u, daqk, dp, dn2, table.chunk_tok, table.chunk_len, table.chunk_seq,
             *hook, scale, H), bwd_v, direct)
    bwd, blocks = _per_chunk_meta(d, meta, q)
    bwd.pop("SPLIT_K")
    _launch(getattr(mod, f"{d.name}_bwd"), (NC, H, blocks),
            (q, k, G, hs, dh, do, u, dv, daqk, dp, dn2, dq, dk, table.chunk_tok, table.chunk_len, table.chunk_seq,
             *hook, scale, H), bwd, direct)
    return dq, dk, dv, dxs


def member_op(decl: MatrixState):
    """The `backend="triton"` op of a declaration (module docstring). Every structure runs on the recurrent
    decode kernel without gradients for short sequences (`run`); with gradients or longer sequences plain
    writes and per-key decay with the delta correction have chunk kernels, and the rest raise a ValueError
    there. Inputs of every kind reach the hooks:
    per token [B,T,H] (or [B,T*n,H] rows of beta's inputs), per token and key [B,T,H,K], per head [H]."""
    if not isinstance(decl, MatrixState):
        raise TypeError(f"declaration: expected a MatrixState, got {type(decl).__name__}")
    DECLS[decl.key] = decl   # the torch.library ops find it by key, also inside a torch.compile trace
    return lambda *args, **kwargs: run(decl, *args, **kwargs)


def sources(decl: MatrixState) -> dict[str, str]:
    """The generated source of each module `run` may launch for `decl` (what `scanlang show` prints):
    "chunk" (backends/linear/kernels.py for plain writes, kernels_delta.py for per-key decay with the delta
    correction; no entry for the other structures) and "decode" (backends/linear/decode.py)."""
    if not isinstance(decl, MatrixState):
        raise TypeError(f"declaration: expected a MatrixState, got {type(decl).__name__}")
    found = ({"chunk": kernels.render(decl)} if decl.correction == "plain" else
             {"chunk": kernels_delta.render(decl)} if kernels_delta.supports(decl) else {})
    found["decode"] = decode.render(decl)
    return found


def decode_module(decl: MatrixState):
    """The generated decode module of `decl` (backends/linear/decode.py), rendered and loaded once."""
    mod = DECODE_MODULES.get(decl.key)
    if mod is None:
        mod = DECODE_MODULES[decl.key] = load(decode.render(decl))
    return mod


def _decode(decl: MatrixState, q, k, v, xs, scale, initial_state, output_final_state, offsets, constants):
    """The forward by the token loop (decode.py): one program per (sequence, head, value block)."""
    B, T, H, K = q.shape
    V, dev = v.shape[-1], q.device
    bounds = [b * T for b in range(B + 1)] if offsets is None else list(offsets)
    N = len(bounds) - 1
    h0 = None if initial_state is None else initial_state.float().contiguous()
    if B * T == 0 or N == 0:   # no token: every final state is its initial state
        S = h0.clone() if h0 is not None else torch.zeros(N, H, K, V, device=dev)   # not the caller's tensor
        return torch.zeros(B, T, H, V, device=dev), (S if output_final_state else None)
    dt = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    pack = lambda t: t.to(dt).reshape(-1, H, *t.shape[3:]).contiguous()  # noqa: E731
    used = set(decode.hook_inputs(decl))
    hooked = [(x if decl.inputs[m] == "head" else x.reshape(-1, H, *x.shape[3:])).float().contiguous()
              for m, x in zip(decl.inputs, xs) if m in used]
    cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
    consts = [float(constants[c]) for c in decl.constants]
    args = (pack(q), pack(k), pack(v), hooked, h0, cu, consts, float(scale), bool(output_final_state))
    if eager([t for t in (*args[:3], h0, *hooked) if t is not None]):
        o, ht = _decode_launch(decl, *args, direct=True)
    else:
        o, ht = linear_decode(decl.key, *args)
    return o.reshape(B, T, H, V), (ht if output_final_state else None)


def _decode_launch(d: MatrixState, q, k, v, hooked, h0, cu, constants, scale: float, store_final: bool,
                   direct: bool) -> list:
    """[o [TT,H,V], final states [N,H,K,V]] (fp32) of packed inputs; cu: the sequences' bounds [N + 1]."""
    TT, H, K = q.shape
    V, N = v.shape[-1], cu.shape[0] - 1
    o, ht = _empty(TT, H, V, device=q.device), _empty(N, H, K, V, device=q.device)
    BV = min(DECODE_CONFIG["BV"], triton.next_power_of_2(V))
    _launch(getattr(decode_module(d), f"{d.name}_decode"), (N, H, triton.cdiv(V, BV)),
            (q, k, v, *hooked, h0 if h0 is not None else ht, o, ht, cu, *constants, scale, H),
            dict(K=K, V=V, BK=triton.next_power_of_2(K), BV=BV, HAS_H0=h0 is not None, STORE_FINAL=store_final,
                 num_warps=DECODE_CONFIG["num_warps"]), direct)
    return [o, ht]


@triton_op("scanlang::linear_decode", mutates_args=())
def linear_decode(key: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hooked: list[torch.Tensor],
                  h0: Optional[torch.Tensor], cu: torch.Tensor, constants: list[float], scale: float,
                  store_final: bool) -> list[torch.Tensor]:
    """The decode kernel of DECLS[key] (no autograd: taken only when no input needs a gradient)."""
    return _decode_launch(DECLS[key], q, k, v, hooked, h0, cu, constants, scale, store_final, direct=False)


def _needs_grad(tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def decodes(q, tensors, offsets) -> bool:
    """Whether `run` takes the decode kernel: no tensor (q and `tensors`, None allowed) requires a
    gradient and no sequence (`offsets`: cu_seqlens as ints, or None) has more tokens of q than
    tuning.current().decode_max_tokens (on CUDA and in the interpreter; H200 runs: BENCHMARKS.md)."""
    B, T = q.shape[:2]
    return not _needs_grad((q, *tensors)) and _longest(B, T, offsets) <= tuning.current().decode_max_tokens


def _longest(B: int, T: int, offsets) -> int:
    """The longest sequence's tokens (of q)."""
    if offsets is None:
        return T if B else 0
    return max((e - s for s, e in zip(offsets, offsets[1:])), default=0)


def run(decl: MatrixState, q, k, v, *xs, scale: float, initial_state, output_final_state: bool, offsets,
        chunk_size: int, constants: dict, cu_seqlens=None):
    """Validated inputs (recipes.linear.family) -> (o [B,T,H,V] fp32, final state [N,H,K,V] fp32 or None).

    `offsets`: cu_seqlens as ints, or None (then read from `cu_seqlens` here: while torch.compile traces,
    the caller cannot read them: a packed batch under torch.compile breaks the graph there). torch.compile
    traces the rest, the kernels included (the torch.library ops above)."""
    if offsets is None and cu_seqlens is not None:
        offsets = tuple(int(x) for x in cu_seqlens.tolist())
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16 for backend='triton' (tl.dot tiles), "
                         f"got {chunk_size}")
    for name, t in (("q", q), ("k", k), ("v", v), *zip(decl.inputs, xs)):
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}: backend='triton' takes float16, bfloat16 or float32, got {t.dtype} "
                             "(use backend='reference' for float64)")
    B, T, H, K = q.shape
    compiling = torch.compiler.is_compiling()
    if decodes(q, (k, v, initial_state, *xs), offsets):
        return _decode(decl, q, k, v, xs, scale, initial_state, output_final_state, offsets, constants)
    wy = kernels_delta.supports(decl)
    if decl.correction != "plain" and not wy:
        limit = tuning.current().decode_max_tokens
        needs_grad = _needs_grad((q, k, v, initial_state, *xs))
        why = "gradients are needed" if needs_grad else f"a sequence is longer than decode_max_tokens = {limit}"
        raise ValueError(f"backend='triton': matrix state {decl.name!r} has correction {decl.correction!r} and "
                         f"{why}; generated chunk kernels cover plain writes and the one-step delta correction with "
                         f"per-key decay so far (the recurrent decode kernel "
                         f"runs every structure, forward only, for sequences of at most decode_max_tokens "
                         f"tokens); use backend='reference'")
    V, dev = v.shape[-1], q.device
    dt = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    table = chunk_table(B, T, offsets, chunk_size, dev)
    if table.n_chunks == 0:   # every sequence empty
        S = initial_state.float() if initial_state is not None else torch.zeros(table.n_seq, H, K, V, device=dev)
        return v.new_zeros(B, T, H, V, dtype=torch.float32), (S if output_final_state else None)
    pack = lambda t: t.to(dt).reshape(B * T, H, *t.shape[3:]).contiguous()  # noqa: E731
    used = set(kernels_delta.hook_inputs(decl)) if wy else set(decl.used(decl.log_decay))
    hooked = [(x if decl.inputs[n] == "head" else x.reshape(B * T, H, *x.shape[3:])).float().contiguous()
              for n, x in zip(decl.inputs, xs) if n in used]
    h0 = None if initial_state is None else initial_state.float().contiguous()
    consts = [float(constants[c]) for c in decl.constants]
    if not compiling:   # (a trace cannot add it: member_op did, outside the trace)
        DECLS.setdefault(decl.key, decl)
    qp, kp, vp = pack(q), pack(k), pack(v)
    tables = (table.chunk_tok, table.chunk_len, table.chunk_seq, table.seq_chunk0)
    if eager([t for t in (qp, kp, vp, h0, *hooked) if t is not None]):
        o, S, *_ = _EagerChunk.apply(decl.key, qp, kp, vp, h0, *tables, consts, float(scale), chunk_size, *hooked)
    else:
        o, S, *_ = linear_chunk_fwd(decl.key, qp, kp, vp, h0, hooked, *tables, consts, float(scale), chunk_size)
    return o.reshape(B, T, H, V), (S if output_final_state else None)


backend.register("linear", sys.modules[__name__])
