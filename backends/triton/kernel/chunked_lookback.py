"""The chunk-parallel schedule in one pass: a variant of kernel/chunked.py (same arguments, chunks and
checkpoints), picked by the tuning knob `chunk_single_pass`.

kernel/chunked.py runs three kernels per pass (reduce, carry, rescan) and so reads the inputs twice.
Here each (chunk, lane block) is one program of ONE kernel per pass that reads its inputs once (a
single-pass scan with decoupled look-back):

forward, y_t = y_{t-1} (+) x_t with y_{-1} = initial or the identity e (kernel chunk_scan):
    1. the program takes a ticket: chunk c = the number of programs of its lane block that started
       before it, so a program only ever waits on programs already running (no deadlock, whatever
       order the hardware starts them in);
    2. it loads and lifts its tile and scans it: s_t = x_{cB} (+) ... (+) x_t, the aggregate A_c the
       last valid row;
    3. it publishes A_c (flag 1), then looks back: the carry P_c = P_j (+) A_{j+1} (+) ... (+) A_{c-1}
       for the nearest chunk j < c whose inclusive prefix P_{j+1} is published (flag 2), waiting on a
       chunk that has published nothing yet; chunk 0 starts from y_{-1};
    4. it publishes its inclusive prefix P_{c+1} = P_c (+) A_c (flag 2; stored as the checkpoint of
       chunk c + 1, and as the final prefix by the last chunk), then writes
       out_t = readout(P_c (+) s_t, u_t) from the tile still in registers, and the checkpoints
       inside the chunk. Inputs and outputs stream (evict-first loads, `.cs` stores): on an H100 the
       forward took 0.111 ms with them, 0.126 without (BENCHMARKS_HISTORY.md, "Session 17"); the
       likely reason, not measured, is that L2 then keeps the look-back's flags and values.
backward, the same on kernel/chunked.py's aligned adjoint (every row reads only its own step; the
carry between chunks in z_t = M_t gbar_t), chunks ticketed from the last (kernel chunk_bwd_scan): it
replays y and y_{t-1} over its chunk from checkpoint c, scans its rows as (F, c, L) segments, takes
its aggregate Z_c = aw + am Z_{c+1} from row 0, publishes that, looks forward to Z_{c+1} (from the
later chunks), publishes Z_c, and finishes the chunk: gbar_t = c_t + F_t Z_{c+1},
dx = J2(y_{t-1}, x_t)^T gbar_t, the input gradients (stored, atomically added where an input is
broadcast over lanes, summed over the chunk where it is constant in time) and, in chunk 0,
dL/dinitial = c_0 + M_0 gbar_0.

Publishing: a program stores its values, synchronises its threads (`tl.debug_barrier`) and sets its
flag with a release atomic; a reader polls the flags with acquire atomics, synchronises its threads
and loads the values past L1 (`.cg`: another program wrote them during this launch). Flags and tickets are one zeroed int32
buffer per pass. The carry a chunk receives depends on how far its look-back went (how the
aggregates were grouped), so in floating point the outputs can differ between runs in the last
bits, as with any single-pass parallel scan; the math is the same.

Time runs backwards in memory when REVERSE is set (index T-1-t). The arguments are those of the tile
kernels (codegen.forward_args / backward_args) plus the look-back buffers, so checkpoints mean the
same in every schedule: the carry into each piece of CHUNK steps, the backward's chunk. A forward
chunk of BLOCK_T steps spans BLOCK_T // CHUNK of them (one by default in three kernels; four in one
pass, whose look-back waits less on longer chunks) and stores the checkpoints inside it
(`inner_checkpoints`).

Projective monoids: every lifted leaf x_t is scaled by leaf_scale, an exact power of two bringing its
largest field into [1, 2), before any product, as in the other schedules (builders.renormalise_leaf);
the outputs do not change, and the backward multiplies each step's dx by the same factor
(builders.scale_leaf_gradient).

Supported: what kernel/chunked.py supports (`supports`).
"""
from __future__ import annotations

from scanlang import expr as E
from scanlang.autodiff import Adjoint
from scanlang.ir import ScanIR

from ..codegen import backward_args, forward_args
from . import builders as B
from . import common
from . import ir as K
from .chunked import (assemble, bwd_consts, carry_slot, exclusive_adjoint, inclusive_slot, inner_checkpoints, replay_pairs,
                      transitions, z_aggregate, _apply_carry, _carry_from, _dfinal, _fields, _initial, _input_gradients,
                      _offsets, _params, _row)
from .printer import render as print_module

FORWARD_KERNELS, BACKWARD_KERNELS = ("chunk_scan",), ("chunk_bwd_scan",)
KERNELS = FORWARD_KERNELS + BACKWARD_KERNELS


def _prologue(tensors, backward: bool) -> tuple:
    """Program (lane block pid, ticket) of the 1-D grid: its chunk (in scan order from the first chunk, or from the last
    in the backward), rows of the tile, t (scan step), ok, tt (memory index), the lane offsets
    of `tensors`, and `sync`: the lane block's ticket counter, followed by one flag per chunk."""
    chunk = "n_chunks - 1 - ticket" if backward else "ticket"
    body = [K.Comment("lane blocks vary fastest over the grid, so the programs running at once spread over them"),
            K.assign("pid", "tl.program_id(0) % tl.cdiv(L, BLOCK_L)"),
            K.assign("lane", "pid.to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L)"),
            K.assign("lane_ok", "lane < L"), K.assign("n_chunks", "tl.cdiv(T, BLOCK_T)"),
            K.assign("sync", "sync_ptr + pid * (n_chunks + 1)"),
            K.Comment("a ticket in start order: a program waits only on programs that started before it"),
            K.assign("ticket", "tl.atomic_add(sync, 1)"), K.assign("chunk", chunk),
            K.assign("rows", "tl.arange(0, BLOCK_T)[:, None]"), K.assign("t", "chunk.to(tl.int64) * BLOCK_T + rows"),
            K.assign("ok", "(t < T) & lane_ok[None, :]"),
            K.If(K.expr("REVERSE"), (K.assign("tt", "T - 1 - t"),), (K.assign("tt", "t"),))]
    body += [K.assign(f"{n}_off", f"{_offsets(n)}[None, :]") for n in tensors]
    return tuple(body)


def _tile_scan(ir: ScanIR, elems: str, out: str) -> tuple:
    """s{out}_<field>: the inclusive scan of {elems}_<field> down the rows (the combine, in scan order)."""
    args = _fields(ir, elems + "_{}")
    value = (f"tl.associative_scan(({args}), 0, combine)" if len(ir.fields) > 1
             else f"tl.associative_scan({args}, 0, combine)")
    return (K.Assign(tuple(f"s{out}_{f}" for f in ir.fields), K.expr(value)),)


def _from_carry(ir: ScanIR, out: str, carry: str) -> tuple:
    """{out}_<field> = carry (+) s{out}_<field>, row by row."""
    return (K.Assign(tuple(f"{out}_{f}" for f in ir.fields),
                     K.expr(f"combine({_fields(ir, carry + '_{}[None, :]')}, {_fields(ir, 's' + out + '_{}')})")),)


def _scan_from(ir: ScanIR, elems: str, out: str, carry: str) -> tuple:
    """{out}_<field> = carry (+) the inclusive scan of {elems}_<field> down the rows."""
    return (K.Comment(f"the prefixes of the tile from {carry}: the combine, in scan order"),
            *_tile_scan(ir, elems, out), *_from_carry(ir, out, carry))


def _slot(ptr: str, k: int, n: str, slot: str, lane: str = "lane") -> str:
    """Address of lane vector `slot` of entry `k` in a [entries, n, L] buffer (`slot` and `lane` may be a
    column and a row: a [window, BLOCK_L] tile of addresses)."""
    return f"{ptr} + ({k} * {n} + {slot}) * L + {lane}"


def _publish(stores, flag: int) -> tuple:
    """`stores`, then this chunk's flag set to `flag` once every thread's stores are done (release)."""
    return (*stores, K.Eval(K.expr("tl.debug_barrier()")),
            K.Eval(K.expr(f"tl.atomic_xchg(sync + 1 + chunk, {flag}, sem='release')")))


def _look_back(forward: bool, fold) -> tuple:
    """The look-back, LOOKBACK chunks at a time: poll the window's flags (acquire); once no chunk
    between this one and the nearest inclusive value (flag 2, row `term`) in the window is
    unpublished (flag 0), the statements `fold` fold the window's published values up to that one,
    and the loop ends if it found one; else the window moves on. The forward looks at earlier chunks,
    the backward at later ones; a window's rows are in time order either way."""
    if forward:
        window = (K.assign("js", "j0 - (LOOKBACK - 1) + w"), K.assign("valid", "js >= 0"))
        find = (K.Comment("term: the newest row with an inclusive value (-1: none)"),
                K.assign("term", "tl.max(tl.where(fl == 2, w, -1), 0)"),
                K.assign("pending", "tl.sum(tl.where((fl == 0) & (w > term), 1, 0), 0)"))
        found, move = "(term >= 0).to(tl.int32)", "j0 - LOOKBACK"
    else:
        window = (K.assign("js", "j0 + w"), K.assign("valid", "js < n_chunks"))
        find = (K.Comment("term: the nearest row with an inclusive value (LOOKBACK: none)"),
                K.assign("term", "tl.min(tl.where(fl == 2, w, LOOKBACK), 0)"),
                K.assign("pending", "tl.sum(tl.where((fl == 0) & (w < term), 1, 0), 0)"))
        found, move = "(term < LOOKBACK).to(tl.int32)", "j0 + LOOKBACK"
    poll = (*window, K.assign("fl", "tl.atomic_add(sync + 1 + js, 0, mask=valid, sem='acquire')"),
            K.Comment("the threads that load a published value need not be those that acquired its flag"),
            K.Eval(K.expr("tl.debug_barrier()")),
            K.assign("fl", "tl.where(valid, fl, 1)"), *find)
    return (K.Comment("look back: fold published aggregates (flag 1) up to an inclusive value (flag 2)"),
            K.assign("j0", f"chunk {'-' if forward else '+'} 1"), K.assign("w", "tl.arange(0, LOOKBACK)"),
            K.assign("wrows", "w[:, None]"), K.assign("done", "tl.full([], 0, tl.int32)"),
            K.While(K.expr("done == 0"), poll + (
                K.If(K.expr("pending == 0"), (*fold, K.assign("done", found), K.assign("j0", move))),)))


FWD_CONSTS = ("BLOCK_T", "BLOCK_L", "CHUNK", "LOOKBACK", "REVERSE", "HAS_INIT", "FP64")


def _forward_kernel(ir: ScanIR, origin) -> K.Kernel:
    params = _params(forward_args(ir) + ["agg_ptr", "sync_ptr"], FWD_CONSTS)
    ins = [f"u{i}" for i in range(len(ir.inputs))]
    outs = [f"o{j}" for j in range(len(ir.outputs))]
    fields = list(ir.fields)

    window = "lane_ok[None, :] & ((w >= term) & valid)[:, None]"   # the inclusive value and newer
    fold = tuple(K.Load(f"v_{f}", K.expr(f"tl.where((fl == 2)[:, None], {_slot('ckpt_ptr', k, 'n_slots', inclusive_slot('js[:, None]'), 'lane[None, :]')}, "
                                         f"{_slot('agg_ptr', k, 'n_chunks', 'js[:, None]', 'lane[None, :]')})"),
                        K.expr(window), K.expr(common.number(i)), cache=".cg")
                 for k, (f, i) in enumerate(zip(fields, ir.identity)))
    fold += (*_tile_scan(ir, "v", "v"), *(K.assign(f"t_{f}", _row(f"sv_{f}", "LOOKBACK - 1", "wrows")) for f in fields),
             K.Comment("the window is earlier than the chunks folded so far"),
             K.Assign(tuple(f"c_{f}" for f in fields), K.expr(f"combine({_fields(ir, 't_{}')}, {_fields(ir, 'c_{}')})")))
    look = (_publish([K.Store(K.expr(_slot("agg_ptr", k, "n_chunks", "chunk")), K.expr(f"a_{f}"), K.expr("lane_ok"))
                      for k, f in enumerate(fields)], 1)
            + tuple(K.assign(f"c_{f}", f"to_acc(tl.full([BLOCK_L], {common.number(i)}, tl.float64), FP64)")
                    for f, i in zip(fields, ir.identity))
            + _look_back(True, fold))
    names = {s: f"p_{f}" for s, f in zip(ir.prefix_symbols, ir.fields)} | {
        s: f"u_{n}" for s, n in zip(ir.input_symbols, ir.inputs)}
    body = (_prologue(ins + outs, backward=False) + B.load_lift(ir, stream=True)
            + (K.Comment("the chunk's own scan; its aggregate A_c is the last valid row"),)
            + _tile_scan(ir, "e", "p")
            + (K.assign("last", "tl.minimum(T - 1 - chunk * BLOCK_T, BLOCK_T - 1)"),)
            + tuple(K.assign(f"a_{f}", _row(f"sp_{f}", "last")) for f in fields)
            + (K.Comment("c_*: the carry into this chunk (chunk 0: the initial element, checkpoint 0)"),
               K.If(K.expr("chunk == 0"),
                    _initial(ir) + tuple(K.Store(K.expr(_slot("ckpt_ptr", k, "n_slots", "0")), K.expr(f"c_{f}"),
                                                 K.expr("lane_ok")) for k, f in enumerate(fields)),
                    look),
               K.Comment("publish the inclusive prefix P_(c+1) = P_c (+) A_c: checkpoint c + 1"),
               K.Assign(tuple(f"n_{f}" for f in fields), K.expr(f"combine({_fields(ir, 'c_{}')}, {_fields(ir, 'a_{}')})")))
            + _publish([K.Store(K.expr(_slot("ckpt_ptr", k, "n_slots", inclusive_slot("chunk"))), K.expr(f"n_{f}"), K.expr("lane_ok"))
                        for k, f in enumerate(fields)], 2)
            + (K.If(K.expr("chunk == n_chunks - 1"),
                    tuple(K.Store(K.expr(f"final_ptr + {k} * n_seq * L + lane"), K.expr(f"n_{f}"), K.expr("lane_ok"))
                          for k, f in enumerate(fields))),)
            + _from_carry(ir, "p", "c") + inner_checkpoints(ir)
            + common.assign([f"r{j}" for j in range(len(outs))], ir.readout, names, "_r", shape_like=f"p_{ir.fields[0]}")
            + (K.Comment("inputs and outputs stream (read and written once, evicted first from L2): a faster forward on an H100"),)
            + tuple(K.Store(K.expr(f"o{j}_ptr + o{j}_off + tt * o{j}_st"), K.expr(f"r{j}.to(o{j}_ptr.dtype.element_ty)"),
                            K.expr("ok"), cache=".cs") for j in range(len(outs))))
    return K.Kernel("chunk_scan", params, body, origin=origin,
                    doc=f"Forward of {E.docstring_text(ir.name)}: each chunk scanned from the carry its look-back finds.")


def _gradient_from_later_chunks(ir: ScanIR, adj: Adjoint) -> tuple:
    """gin_*: Z_{c+1}, the z entering this chunk from the later ones (0 for the last chunk), by
    publishing (am, aw) and looking forward. A published Z_j is taken as the element (0, Z_j) and
    the rows after it as (0, 0), so the folded pair (B, e) ends with B = 0 and e = Z_{c+1}."""
    n, nb = len(ir.fields), len(adj.b_entries)
    entries = [f"am{k}" for k in range(nb)] + [f"aw{i}" for i in range(n)]
    window = "lane_ok[None, :] & ((w <= term) & valid)[:, None]"   # up to the inclusive value
    fold = tuple(K.Load(f"xb{k}", K.expr(_slot("agg_ptr", k, "n_chunks", "js[:, None]", "lane[None, :]")),
                        K.expr(window), K.expr("0.0"), cache=".cg") for k in range(nb))
    fold += tuple(K.assign(f"xb{k}", f"tl.where((fl == 2)[:, None], 0.0, xb{k})") for k in range(nb))
    fold += tuple(K.Load(f"xe{i}", K.expr(f"tl.where((fl == 2)[:, None], {_slot('gc_ptr', i, 'n_chunks', 'js[:, None]', 'lane[None, :]')}, "
                                          f"{_slot('agg_ptr', nb + i, 'n_chunks', 'js[:, None]', 'lane[None, :]')})"),
                         K.expr(window), K.expr("0.0"), cache=".cg") for i in range(n))
    xs = [f"xb{k}" for k in range(nb)] + [f"xe{i}" for i in range(n)]
    rs = [f"rb{k}" for k in range(nb)] + [f"re{i}" for i in range(n)]
    ts = [f"tb{k}" for k in range(nb)] + [f"te{i}" for i in range(n)]
    ys = [f"yb{k}" for k in range(nb)] + [f"ye{i}" for i in range(n)]
    cs = [f"cb{k}" for k in range(nb)] + [f"ce{i}" for i in range(n)]
    fold += (K.Assign(tuple(rs), K.expr(f"tl.associative_scan(({', '.join(xs)}), 0, adjoint_combine, reverse=True)")),
             *(K.assign(t, _row(r, "0", "wrows")) for t, r in zip(ts, rs)),
             K.Comment("the window is later than the chunks folded so far: applied first"),
             K.Assign(tuple(cs), K.expr(f"adjoint_combine({', '.join(ts + ys)})")),
             *(K.assign(y, f"tl.where(started == 1, {c}, {t})") for y, c, t in zip(ys, cs, ts)),
             K.assign("started", "tl.full([], 1, tl.int32)"))
    publish = _publish([K.Store(K.expr(_slot("agg_ptr", k, "n_chunks", "chunk")), K.expr(e), K.expr("lane_ok"))
                        for k, e in enumerate(entries)], 1)
    zeros = "to_acc(tl.zeros([BLOCK_L], tl.float32), FP64)"
    start = (K.assign("started", "tl.full([], 0, tl.int32)"), *(K.assign(y, zeros) for y in ys))
    last = tuple(K.assign(f"gin_{f}", zeros) for f in ir.fields)
    found = tuple(K.assign(f"gin_{f}", f"ye{i}") for i, f in enumerate(ir.fields))
    return (z_aggregate(ir, adj)
            + (K.If(K.expr("chunk == n_chunks - 1"), last, publish + start + _look_back(False, fold) + found),
               K.Comment("publish Z_c = aw + am Z_(c+1), the z entering chunk c"))
            + _apply_carry(ir, adj, "G", "gin", ra="am{}", rv="aw{}", lanes="")
            + _publish([K.Store(K.expr(_slot("gc_ptr", i, "n_chunks", "chunk")), K.expr(f"G_{f}"), K.expr("lane_ok"))
                        for i, f in enumerate(ir.fields)], 2))


def _backward_kernel(ir: ScanIR, adj: Adjoint, origin) -> K.Kernel:
    consts = bwd_consts(ir, "BLOCK_T", "BLOCK_L", "LOOKBACK")
    params = _params(backward_args(ir) + ["agg_ptr", "gc_ptr", "sync_ptr"], consts)
    ins = [f"u{i}" for i in range(len(ir.inputs))]
    grads = [f"g{j}" for j in range(len(ir.outputs))]
    body = list(_prologue(ins + grads + [f"du{i}" for i in range(len(ir.inputs))], backward=True) + _dfinal(ir))
    body += _carry_from(ir, "ckpt_ptr", "chunk") + B.load_lift(ir) + replay_pairs(ir) + transitions(ir, adj)
    body += exclusive_adjoint(ir, adj)
    body += _gradient_from_later_chunks(ir, adj)
    body += _apply_carry(ir, adj, "gbar", "gin", ra="rf{}", rv="rc{}")
    body += _input_gradients(ir, adj)
    return K.Kernel("chunk_bwd_scan", params, tuple(body), origin=origin,
                    doc=f"Backward of {E.docstring_text(ir.name)}: each chunk's adjoint from the gradient its "
                        "look-back finds; input gradients.")


def module(ir: ScanIR, adj: Adjoint) -> K.Module:
    """The single-pass chunk-parallel kernels of `ir` (forward and backward) as one IR module."""
    return assemble(ir, adj, lambda ir, adj, origin: [_forward_kernel(ir, origin), _backward_kernel(ir, adj, origin)],
                    "the chunk-parallel schedule in one pass (backends/triton/kernel/chunked_lookback.py)")


def render(ir: ScanIR, adj: Adjoint) -> str:
    """The single-pass chunk-parallel module's source (deterministic)."""
    return print_module(module(ir, adj))
