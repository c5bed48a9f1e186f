"""`scan_backward_lanes`, the lane-sequential schedule's backward (kernel/lanes.py's docstring has the
layout, the memory rules and the walk): per chunk, in reverse, replay the prefixes from its
checkpoint (in registers when CHUNK == UNROLL, else into per-lane scratch rows), then step the
adjoint back one step at a time (scanlang/autodiff.py), storing the input gradients by their DU<i>
mode. Built on the kernel IR and printed by the one printer, as kernel/lanes.py.
"""
from __future__ import annotations

import dataclasses

import sympy

from scanlang import expr as E
from scanlang import tuning
from scanlang.autodiff import Adjoint
from scanlang.ir import ScanIR

from ..codegen import _num, _symbols_named, backward_args
from . import builders as B
from .builders import when
from . import common
from .common import assign_inverted
from . import ir as K
from .lanes import (SHAPE, advance, at, block_index, chain, cheapest, composed_step, cost, free, guarded, keep,
                    lane_load, lane_store, lanes_flags, load_lift, masks, offsets, prologue, split_blocks, state_sum,
                    static_loads, time)


def _warp_groups_sum(value: str) -> str:
    """The sum over the groups of each 32 consecutive thread slots (one warp's) per state index of a
    lane tensor [R, G] (G a multiple of 32), on every lane: shuffles within the warp only."""
    split = "(R, BLOCK_L // R // 32, 32 * R // STATE, STATE // R)"
    return (f"tl.reshape(tl.broadcast_to(tl.sum(tl.reshape(tl.broadcast_to({value}, {SHAPE}), {split}), 2, "
            f"keep_dims=True), {split}), {SHAPE})")


def _groups_sum(value: str) -> str:
    """The sum over the program's groups per state index of a lane tensor [R, G], on every lane."""
    split = "(R, BLOCK_L // STATE, STATE // R)"
    return (f"tl.reshape(tl.broadcast_to(tl.sum(tl.reshape(tl.broadcast_to({value}, {SHAPE}), {split}), 1, "
            f"keep_dims=True), {split}), {SHAPE})")


def _du_store_lanes(i: int, name: str, shift: int, lane_mask: str, slot_mask: str, masked: bool) -> list:
    """Write du_<name> (memory index tt + shift * step) by DU{i} (the tile schedule's modes): 0 store, 1 atomic
    add, 2 summed over time, 3 summed over the STATE lanes then stored, 4 summed over the STATE
    lanes then atomically added (by the group's first slot), 5 summed over the program's groups lane
    by lane (inputs shared by the groups of a program) then atomically added by the first group, 6
    the same over the groups of each warp (plan._lanes_mode): when STATE <= 32 reduce-scattered
    (`_warp_sum_scatter`), each sum added by one atomic of one slot (R x fewer atomic instructions
    than one per lane, each predicated atomic being a branch in SASS), else added by the first
    group's R registers. Atomics are relaxed: gradients only accumulate."""
    ptr, gptr = at(f"du{i}", shift), f"pdu{i}g{time(f'du{i}', shift)}"
    value = f"tl.where({lane_mask}, du_{name}, 0.0)" if masked else f"du_{name}"
    cast = f".to(du{i}_ptr.dtype.element_ty)"
    scattered = _warp_sum_scatter(value) + [   # a warp's groups summed and scattered over its slots
        K.assign("ws_ok", f"{slot_mask} & ws_own"),
        when("not EVEN_L", [K.assign("ws_ok", "ws_ok & (slot + ws_reg < L)")]),
        K.AtomicAdd(K.expr(f"tl.reshape(pdu{i}{time(f'du{i}', shift)} + ws_reg * du{i}_s3, (ws_sum.numel,))"),
                    K.expr(f"tl.reshape(ws_sum{cast}, (ws_sum.numel,))"),
                    K.expr("tl.reshape(tl.broadcast_to(ws_ok, ws_sum.shape), (ws_sum.numel,))"))]
    return [chain([
        (f"DU{i} == 0", [lane_store(ptr, f"du_{name}{cast}", lane_mask)]),
        (f"DU{i} == 1", [lane_store(ptr, f"du_{name}{cast}", lane_mask, atomic=True)]),
        (f"DU{i} == 2", [K.AugAssign(f"acc{i}", K.expr(value))]),
        (f"DU{i} == 3", [lane_store(gptr, f"{state_sum(value)}{cast}", f"{slot_mask} & first", per_slot=True)]),
        (f"DU{i} == 4", [lane_store(gptr, f"{state_sum(value)}{cast}", f"{slot_mask} & first", per_slot=True,
                                    atomic=True)]),
        (f"DU{i} == 5", [lane_store(ptr, f"{_groups_sum(value)}{cast}", f"{lane_mask} & first_group", atomic=True)]),
        ("STATE <= 32", scattered)],
        [lane_store(ptr, f"{_warp_groups_sum(value)}{cast}", f"{lane_mask} & first_in_warp", atomic=True)])]


def _warp_sum_scatter(value: str) -> list:
    """ws_sum [K, G], ws_reg [K, G], ws_own [1, G]: per state index, the sum of lane tensor `value`
    [R, G] over the groups of each warp (slots g and g ^ m for the lane bits m >= STATE // R),
    reduce-scattered. At each group bit, while two or more registers remain, a slot keeps the half
    its bit selects and adds its partner's copy of that half (one shuffle per kept register), then
    adds its partner's sums. ws_reg: the sums' state registers (index r of the R lanes); ws_own: the
    one slot of each set holding equal sums; K = max(1, R >> group bits)."""
    halves = [K.Assign(("ws_lo", "ws_hi"), K.expr("tl.split(tl.permute(tl.reshape(ws_sum, [2, ws_sum.shape[0] // 2, "
                                                  "ws_sum.shape[1]]), (1, 2, 0)))")),
              K.AugAssign("ws_base", K.expr("tl.where(ws_up, ws_sum.shape[0] // 2, 0)")),
              K.assign("ws_send", "tl.where(ws_up, ws_lo, ws_hi)"),
              K.assign("ws_sum", f"tl.where(ws_up, ws_hi, ws_lo) + {_partner('ws_send', '1 << ws_bit')}")]
    single = [K.assign("ws_sum", f"ws_sum + {_partner('ws_sum', '1 << ws_bit')}"), K.assign("ws_own", "ws_own & ~ws_up")]
    bit = when("(1 << ws_bit) >= STATE // R", [K.assign("ws_up", "(slot_in_block & (1 << ws_bit)) != 0"),
                                              when("ws_sum.shape[0] > 1", halves, single)])
    return [K.assign("ws_sum", value), K.assign("ws_base", "slot_in_block * 0"), K.assign("ws_own", "slot_in_block == slot_in_block"),
            K.For("ws_bit", None, K.expr(5), (bit,), static=True),
            K.assign("ws_reg", "ws_base + tl.arange(0, ws_sum.shape[0])[:, None]")]


def _partner(x: str, m: str) -> str:
    """Lane tensor `x` [K, G] at slot g ^ m (m < 32): a gather along a [K, G // 32, 32] view, so it
    stays warp-local (shuffles) in the [K, G] layout (slot g on lane g % 32 of warp g // 32); over
    [K, G] Triton re-lays the gather out through shared memory."""
    view = f"[{x}.shape[0], {x}.shape[1] // 32, 32]"
    return (f"tl.reshape(tl.gather(tl.reshape({x}, {view}), (tl.arange(0, 32)[None, None, :] ^ ({m})) + "
            f"tl.zeros({view}, tl.int32), 2), {x}.shape)")


def _scratch(ir: ScanIR, name: str, row: str) -> str:
    """Pointers of free field `name` in scratch row `row` (0..CHUNK): the program's block of
    (CHUNK + 1) x free fields x BLOCK_L values, rows at compile-time strides (plan.py allocates
    [n_seq, programs, CHUNK + 1, free fields, BLOCK_L]). Row 0 is the chunk's checkpoint, row s + 1
    the prefix after step s, so step s reads its previous prefix from row s (no select at s = 0).
    Within a row the lanes lie in the order the 1-D accesses flatten [R, G] (register r of slot g at
    r * G + g): each register's access by a warp is 128 contiguous bytes (in lane order, 32 bytes
    of every 128 a thread's stride of R lanes apart, 4x the sectors per access)."""
    fields = free(ir)
    return f"scratch_lane + (({row}) * {len(fields)} + {fields.index(name)}) * BLOCK_L"


def _adjoint_step(ir: ScanIR, adj: Adjoint, j: int, shift: int, carried: list[str], masked: bool) -> list:
    """One step of the adjoint walked backwards, block step j: from u_*, e_*, g_*, q_* (the previous
    prefix) and p_* (the prefix) set by the caller, and the carried cd_*, bd_*; stores the input
    gradients at memory index tt + shift * step and hands c_t and B_t gbar_t down to step t - 1."""
    _, lmask, smask, live = masks(j, "", masked)
    n, nb = len(ir.fields), len(adj.b_entries)
    shape = f"p_{ir.fields[0]}"
    here = ({s: s.name for s in ir.prefix_symbols + ir.previous_symbols + adj.g}
            | _symbols_named(ir.input_symbols, "u_{}"))
    b_names = {s: s.name for s in ir.previous_symbols} | {s: f"e_{f}" for s, f in zip(ir.later, ir.fields)} | here
    # entries of B that are identically zero (e.g. the rows of a specialised carry's constants) drop out
    bmat = adj.matrix([E.symbol(f"b{k}") if adj.b_entries[k] != 0 else sympy.Integer(0) for k in range(nb)])
    gb = [E.symbol(f"gbar_{f}") for f in ir.fields]
    bd = [sum((bmat[i][k] * gb[k] for k in range(n)), sympy.Integer(0)) for i in range(n)]
    recips: dict = {}   # one reciprocal per distinct denominator of the step
    part = list(assign_inverted([f"dy_{f}" for f in ir.fields], cheapest(adj.dy), here, "_d", recips=recips,
                                shape_like=shape))
    part += [K.assign(f"d_{f}", f"dy_{f} + cd_{f}" if _hands_down_c(adj) else f"dy_{f}") for f in ir.fields]
    part += assign_inverted([f"v_{f}" for f in ir.fields], cheapest(adj.direct),
                            {s: s.name for s in ir.prefix_symbols + adj.d}, "_v", recips=recips, shape_like=shape)
    part += [K.assign(f"gbar_{f}", f"v_{f} + bd_{f}") for f in ir.fields]
    names_x = {s: s.name for s in ir.previous_symbols + adj.gbar} | {s: f"e_{f}" for s, f in zip(ir.later, ir.fields)}
    if adj.dx:   # (a composed adjoint has none: its du is over gbar directly)
        part += assign_inverted([f"dx_{f}" for f in ir.fields], cheapest(adj.dx), names_x, "_x", recips=recips,
                                shape_like=shape)
        part += B.scale_leaf_gradient(ir, "dx_{}", "")
    part += assign_inverted([f"du_{u}" for u in ir.inputs], cheapest(adj.du),
                            here | {s: s.name for s in adj.dx_symbols + adj.gbar}, "_u", recips=recips,
                            shape_like=shape)
    for i, name in enumerate(ir.inputs):
        part += _du_store_lanes(i, name, shift, lmask, smask, masked)
    # hand down to step t - 1: c_t, B_t gbar_t (B_t = J1(y_{t-1}, x_t)^T) and its prefix y_{t-1}
    if _hands_down_c(adj):
        part += assign_inverted([f"cd_{f}_new" for f in ir.fields], cheapest(adj.c), here, "_i", recips=recips,
                                shape_like=shape)
    part += assign_inverted([f"b{k}" for k in range(nb)], cheapest(adj.b_entries), b_names, "_b", recips=recips,
                            shape_like=shape)
    part += assign_inverted([f"bd_{f}_new" for f in ir.fields], bd,
                            {s: s.name for s in gb} | {E.symbol(f"b{k}"): f"b{k}" for k in range(nb)}, "_w",
                            recips=recips, shape_like=shape)
    part += [K.assign(f"nq_{f}_new", f"q_{f}") for f in ir.fields]
    return part + keep(carried, live)


def composed_adjoint(ir: ScanIR, adj: Adjoint) -> Adjoint:
    """`adj` with the lift composed in, for programs whose step composes (`lanes.composed_step`; else `adj`):
    B's entries over the previous prefix and the inputs, and du = (dF/du)^T gbar + (d readout/du)^T g
    with F(q, u) = combine(q, lift(u)) differentiated directly (no dx), each expression simplified with
    the lift in view. The same gradients with fewer operations (Kalman: B's entries reduce to
    a^2 / den^2, -a p eta / den^2 and a / den; du_k to 2 prec k gbar_lam + prec v gbar_eta)."""
    if composed_step(ir) is None:
        return adj
    lift = dict(zip(ir.later, ir.lift))
    const = dict(ir.constants)
    step = [sympy.sympify(e).xreplace(dict(zip(ir.earlier, ir.previous_symbols))).xreplace(lift)
            for f, e in zip(ir.fields, ir.combine) if f not in const]
    gbar = [g for g, f in zip(adj.gbar, ir.fields) if f not in const]
    du = tuple(sum((gb * sympy.diff(e, u) for gb, e in zip(gbar, step)), sympy.Integer(0))
               + sum((g * sympy.diff(r, u) for g, r in zip(adj.g, ir.readout)), sympy.Integer(0))
               for u in ir.input_symbols)
    b_entries = tuple(sympy.sympify(b).xreplace(lift) for b in adj.b_entries)
    return dataclasses.replace(adj, b_entries=_simplest(b_entries), dx=(), du=_simplest(du))


def _simplest(exprs) -> tuple:
    """Each expression in its cheapest of: as given, sympy.cancel, sympy.factor (`lanes.cost`)."""
    out = []
    for e in exprs:
        if sympy.count_ops(e) > 300:
            out.append(e)
            continue
        out.append(min([e, sympy.cancel(e), sympy.factor(e)], key=lambda x: cost([x])))
    return tuple(out)


def _hands_down_c(adj: Adjoint) -> bool:
    """Whether a step's readout uses its previous prefix (c_t not identically zero): only then is
    `cd` carried; otherwise gbar_t = dy_t + B_{t+1} gbar_{t+1}, and dL/dfinal starts `bd` instead."""
    return any(c != 0 for c in adj.c)


def _carried_adjoint(adj: Adjoint) -> tuple[str, ...]:
    """The adjoint vectors carried from step to step: ("cd", "bd"), or ("bd",) without c_t."""
    return ("cd", "bd") if _hands_down_c(adj) else ("bd",)


def _grad_loads(ir: ScanIR, j: int, shift: int, lane_mask: str, slot_mask: str) -> list:
    """Upstream gradients of the outputs: per slot when summed over the state (stride 0 over it)."""
    per_slot = ir.reduce_state
    mask = slot_mask if per_slot else lane_mask
    return [K.assign(f"g{j}_{out}", f"to_acc({lane_load(at(f'g{o}', shift, per_slot), mask, '0.0', per_slot)}, FP64)")
            for o, out in enumerate(ir.outputs)]


def _step_inputs(ir: ScanIR, j: int) -> list:
    return ([K.assign(f"u_{u}", f"u{j}_{u}") for u in ir.inputs] + [K.assign(f"e_{f}", f"e{j}_{f}") for f in ir.fields]
            + ([K.assign("inv_leaf", f"inv_leaf{j}")] if ir.is_projective else [])
            + [K.assign(f"g_{o}", f"g{j}_{o}") for o in ir.outputs] + [K.assign(f"q_{f}", f"q{j}_{f}") for f in ir.fields])


def _replay_block(ir: ScanIR, masked: bool) -> list:
    """Replay UNROLL steps from s0 into the scratch rows s0 + 1 ..."""
    max_unroll = tuning.current().max_unroll
    block = block_index("s0")
    for j in range(max_unroll):
        stmts, lmask, smask, _ = masks(j, "s0", masked)
        block += guarded(j, stmts + load_lift(ir, str(j), j, lmask, smask, masked, lift=composed_step(ir) is None))
    for j in range(max_unroll):
        _, lmask, _, live = masks(j, "s0", masked)
        part = advance(ir, f"u{j}_" + "{}", f"e{j}_" + "{}", {})
        part += keep([f"c_{f}" for f in free(ir)], live)
        part += [lane_store(_scratch(ir, name, f's0 + {j + 1}'), f"c_{name}", lmask) for name in free(ir)]
        block += guarded(j, part)
    return block


def _walk_block(ir: ScanIR, adj: Adjoint, masked: bool) -> list:
    """UNROLL adjoint steps back from step n_steps - 1 - ss0, reading the previous prefixes from scratch."""
    max_unroll = tuning.current().max_unroll
    const = dict(ir.constants)
    block = block_index("(n_steps - 1 - ss0)")
    for j in range(max_unroll):   # loads first (inputs, upstream gradients, previous prefixes), then the chain
        stmts, lmask, smask, _ = masks(j, "ss0", masked)
        part = stmts + [K.assign(f"s{j}", f"n_steps - 1 - ss0 - {j}")]
        part += load_lift(ir, str(j), -j, lmask, smask, masked)
        part += _grad_loads(ir, j, -j, lmask, smask)
        for name in ir.fields:   # the previous prefix (row 0: the checkpoint)
            part.append(K.assign(f"q{j}_{name}", f"k_{name}" if name in const
                           else lane_load(_scratch(ir, name, f's{j}'), lmask, '0.0')))
        block += guarded(j, part)
    carried = [f"{c}_{f}" for c in _carried_adjoint(adj) + ("nq",) for f in ir.fields]
    for j in range(max_unroll):
        part = _step_inputs(ir, j) + [K.assign(f"p_{f}", f"nq_{f}") for f in ir.fields]
        part += _adjoint_step(ir, adj, j, -j, carried, masked)
        block += guarded(j, part)
    return block


def _chunk_in_scratch(ir: ScanIR, adj: Adjoint) -> list:
    """CHUNK > UNROLL: replay the chunk's prefixes into the per-lane scratch rows, then walk back in
    blocks of UNROLL steps reading each step's previous prefix from scratch."""
    barrier = K.Eval(K.expr("tl.debug_barrier()"))   # writing the scratch rows / reading them
    chunk = [lane_store(_scratch(ir, name, "0"), f"k_{name}", "lane_ok") for name in free(ir)]
    stages = tuning.current().loop_stages_backward
    chunk += split_blocks(_replay_block(ir, False), _replay_block(ir, True), "s0", stages) + [barrier]
    chunk += [K.assign(f"nq_{f}", f"c_{f}") for f in ir.fields]   # the prefix at the chunk's last step
    chunk += split_blocks(_walk_block(ir, adj, False), _walk_block(ir, adj, True), "ss0", stages)
    return chunk + [barrier]


def _registers_block(ir: ScanIR, adj: Adjoint, masked: bool) -> list:
    """The whole chunk as one block at fixed positions j (memory index tt + j * step)."""
    max_unroll = tuning.current().max_unroll
    const = dict(ir.constants)
    chunk = []
    for j in range(max_unroll):
        stmts, lmask, smask, _ = masks(j, "0", masked)
        part = stmts + load_lift(ir, str(j), j, lmask, smask, masked)
        part += _grad_loads(ir, j, j, lmask, smask)
        chunk += guarded(j, part)
    for j in range(max_unroll):
        _, _, _, live = masks(j, "0", masked)
        part = advance(ir, f"u{j}_" + "{}", f"e{j}_" + "{}", {})
        part += keep([f"c_{f}" for f in free(ir)], live)
        part += [K.assign(f"r{j}_{f}", f"c_{f}") for f in free(ir)]
        chunk += guarded(j, part)
    carried = [f"{c}_{f}" for c in _carried_adjoint(adj) for f in ir.fields]
    for j in reversed(range(max_unroll)):
        prev = [K.assign(f"q{j}_{f}", f"k_{f}" if f in const or j == 0 else f"r{j - 1}_{f}") for f in ir.fields]
        part = prev + _step_inputs(ir, j) + [K.assign(f"p_{f}", f"k_{f}" if f in const else f"r{j}_{f}") for f in ir.fields]
        part += _adjoint_step(ir, adj, j, j, carried, masked)
        chunk += guarded(j, part)
    return chunk


def _chunk_in_registers(ir: ScanIR, adj: Adjoint) -> list:
    """CHUNK == UNROLL: the chunk is one block; its prefixes stay in registers (r<j>_<field>) and its
    inputs and elements are reused by the walk back, so nothing goes through scratch memory. A full
    chunk runs unmasked; a partial one masks the positions past its end."""
    return [*block_index("0"),
            when("n_steps == CHUNK", _registers_block(ir, adj, False), _registers_block(ir, adj, True))]


BACKWARD_CONSTEXPRS = ("BLOCK_L", "R", "EVEN_L", "CHUNK", "UNROLL", "REVERSE", "HAS_INIT", "HAS_DFINAL", "VARLEN",
                       "STATE", "FP64", "RCP_APPROX")


def render_backward_lanes(ir: ScanIR, adj: Adjoint) -> K.Kernel:
    """`scan_backward_lanes`: the chunks in reverse, each replayed from its checkpoint, the adjoint
    stepped back through it; dL/d(initial) at the end."""
    adj = composed_adjoint(ir, adj)
    carried = _carried_adjoint(adj)
    body = prologue()
    body.append(K.assign("scratch_lane", "scratch_ptr + (seq * tl.num_programs(0) + pid).to(tl.int64) * "
                    f"((CHUNK + 1) * {len(free(ir))} * BLOCK_L) + r_idx * (BLOCK_L // R) "
                    "+ tl.arange(0, BLOCK_L // R)[None, :]"))
    for i in range(len(ir.inputs)):
        body += offsets(f"u{i}") + offsets(f"du{i}") + offsets(f"du{i}", per_group=True)
        body.append(K.assign(f"acc{i}", f"to_acc(tl.zeros({SHAPE}, tl.float32), FP64)"))
    for o in range(len(ir.outputs)):
        body += offsets(f"g{o}")
    body += static_loads(ir)
    for f, name in enumerate(ir.fields):   # dL/dfinal handed to the last step (in cd, else in bd)
        body += [K.assign(f"{c}_{name}", f"to_acc(tl.zeros({SHAPE}, tl.float32), FP64)") for c in carried]
        dfinal = lane_load(f"dfinal_ptr + ({f} * n_seq + seq) * L + lane", "lane_ok", "0.0")
        body.append(when("HAS_DFINAL", [K.AugAssign(f"{carried[0]}_{name}", K.expr(f"to_acc({dfinal}, FP64)"))]))
    chunk = [K.assign("k", "n_chunks - 1 - kk"), K.assign("n_steps", "tl.minimum(CHUNK, seq_len - k * CHUNK)")]
    const = dict(ir.constants)
    for f, (name, ident) in enumerate(zip(ir.fields, ir.identity)):
        if name in const:
            chunk.append(K.assign(f"k_{name}", f"to_acc(tl.full({SHAPE}, {_num(const[name])}, tl.float64), FP64)"))
        else:
            ckpt = lane_load(f"ckpt_ptr + ({f} * n_slots + slot0 + k) * L + lane", "lane_ok", _num(ident))
            chunk.append(K.assign(f"k_{name}", f"to_acc({ckpt}, FP64)"))
        chunk.append(K.assign(f"c_{name}", f"k_{name}"))
    chunk.append(when("CHUNK == UNROLL", _chunk_in_registers(ir, adj), _chunk_in_scratch(ir, adj)))
    body.append(K.For("kk", K.expr(0), K.expr("n_chunks"), tuple(chunk), builtin=True))
    for i in range(len(ir.inputs)):
        total = f"acc{i}.to(du{i}_ptr.dtype.element_ty)"
        body.append(when(f"DU{i} == 2", [lane_store(f"pdu{i} + du{i}_r", total, "lane_ok", atomic=True)]))
    # dL/d(initial) = c_0 + B_0 gbar_0 (dL/dfinal when the sequence is empty)
    dinit = [lane_store(f"dinit{f}_ptr + seq * L + lane", " + ".join(f"{c}_{name}" for c in carried), "lane_ok")
             for f, name in enumerate(ir.fields)]
    body.append(when("HAS_INIT", dinit))
    consts = [*BACKWARD_CONSTEXPRS, *(f"DU{i}" for i in range(len(ir.inputs)))]
    sig = B.params(backward_args(ir) + ["scratch_ptr"], consts) + lanes_flags(ir, True)
    return K.Kernel("scan_backward_lanes", sig, tuple(body), origin=common.origins(ir),
                    doc=f"Backward of {E.docstring_text(ir.name)}, lane-sequential: replay each chunk (in registers when "
                        "CHUNK == UNROLL, else into scratch), step the adjoint back.")
