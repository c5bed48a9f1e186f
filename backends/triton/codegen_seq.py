"""The lane-sequential schedule (DESIGN.md "Schedules" (a)): one lane per thread slot, time stepped in registers.

- `scan_forward_lanes`: a program owns BLOCK_L lanes (coalesced across lanes when lanes are
  contiguous in memory, the channels-contiguous [B, T, D] layout; strided otherwise) and walks its
  sequence one step at a time: lift, prefix = combine(prefix, element), readout (optionally summed
  over the STATE lanes), store. Every CHUNK steps it stores the carry into the chunk: the same
  checkpoints as the tile schedule (slot j = the carry into chunk j), so either backward can run
  after either forward. No shared memory, no cross-thread traffic: work-optimal, one combine per
  step and lane. Steps run in blocks of UNROLL (a constexpr <= MAX_UNROLL): the block's loads are
  issued first (they do not depend on the carry, and a store between them would keep the compiler
  from hoisting them), then the dependent chain; steps past the chunk's end are masked and leave
  the carries unchanged.
- `scan_backward_lanes`: walks the chunks in reverse. Per chunk it replays the prefixes from the
  checkpoint: with CHUNK == UNROLL into registers (the chunk is one block; its loaded inputs and
  elements are reused on the way back), otherwise into a per-lane scratch row (global memory,
  CHUNK x fields per lane; a barrier separates writing and reading it). Then it steps the adjoint
  backwards one step at a time (scanlang/autodiff.py):

      gbar_t = direct(p_t, dy_t + c_{t+1} [+ dL/dfinal at the last step]) + B_{t+1} gbar_{t+1}
      dx_t   = J2(y_{t-1}, x_t)^T gbar_t,  du_t = (d lift/du)^T dx_t + (d readout/du)^T g_t

  Step t hands its successor-side terms down to step t - 1 as two carried vectors: `cd` = c_t
  (the readout at t differentiated in its previous prefix) and `bd` = B_t gbar_t (B_t the adjoint
  transition J1(y_{t-1}, x_t)^T in its sparse form). At t = 0 they sum to dL/d(initial). The
  prefix y_t of a step is its successor's previous prefix (carried as `nq`), so each step reads
  one scratch row.
- Both: an input constant in time (a broadcast static parameter, time stride 0: constexpr
  TSTATIC<i>) is loaded once per program; the fields of a specialised carry (`ir.constants`,
  scanlang/ir.py `specialize_carry`) are literals, never stored, loaded or carried.
"""
from __future__ import annotations

import sympy

from scanlang import expr as E
from scanlang.autodiff import Adjoint
from scanlang.ir import ScanIR

from .codegen import (_assign, _indent, _initial_carry, _lane_off, _load_lift, _num, _static_loads, _symbols_named,
                      backward_args, forward_args, lanes_and_sequence, memory_index, static_flags)


def _prologue() -> list[str]:
    """Program = (lane block, sequence), as in the tile schedule; 1-d lane vectors, no time tile."""
    return [
        "pid = tl.program_id(0)",
        "seq = tl.program_id(1)",
        *lanes_and_sequence(),
        "n_chunks = tl.cdiv(seq_len, CHUNK)",
        "slot0 = t0 // CHUNK + seq",
        "first = (lane % STATE) == 0",   # the lane that stores its STATE-lane group's sum
        "first_group = tl.arange(0, BLOCK_L) < STATE",   # the program's group that adds the groups' sum
    ]


MAX_UNROLL = 16   # steps per loop iteration (constexpr UNROLL <= this): loads issued together, ahead of the chain


def _guarded(j: int, lines: list[str]) -> list[str]:
    """Block step j exists when j < UNROLL (a constexpr: the other copies are not compiled)."""
    return lines if j == 0 else [f"if {j} < UNROLL:", *_indent(lines, 4)]


def _block_index(first: str) -> list[str]:
    """tt: the memory index of scan step t = k * CHUNK + `first` (backwards in memory when REVERSE);
    step j of the block is at tt + j * step (forward walk) or tt - j * step (backward walk)."""
    return [f"t = k * CHUNK + {first}", *memory_index()]


def _keep(names, live: str) -> list[str]:
    """Carried values advance only on live steps (a block's tail past the chunk end keeps them)."""
    return [f"{n} = tl.where({live}, {n}_new, {n})" for n in names]


def _free(ir: ScanIR) -> list[str]:
    """The carried fields: all but the constants of a specialised carry (ir.specialize_carry)."""
    const = dict(ir.constants)
    return [f for f in ir.fields if f not in const]


def _reduce_lanes(value: str, axis: int = 1) -> str:
    """Sums over the [BLOCK_L // STATE, STATE] view of a lane vector back on every lane, in the
    lanes' own layout (so a store of it needs no layout conversion: no shared memory, no barrier
    per step): axis 1 sums each group's STATE lanes, axis 0 each state index over the groups."""
    return (f"tl.reshape(tl.broadcast_to(tl.sum(tl.reshape({value}, (BLOCK_L // STATE, STATE)), {axis}, "
            f"keep_dims=True), (BLOCK_L // STATE, STATE)), (BLOCK_L,))")


def _combine_call(ir: ScanIR, out: str, left: str, right: str) -> str:
    """`out` = combine(`left`, `right`), each a format for one name per field."""
    fs = ir.fields
    lhs = ", ".join(out.format(f) for f in fs)   # one field: combine returns a scalar, not a tuple
    return f"{lhs} = combine({', '.join(left.format(f) for f in fs)}, {', '.join(right.format(f) for f in fs)})"


def render_forward_lanes(ir: ScanIR) -> list[str]:
    consts = ["BLOCK_L", "CHUNK", "UNROLL", "REVERSE", "HAS_INIT", "VARLEN", "STATE", "FP64"]
    body = _prologue()
    for i in range(len(ir.inputs)):
        body.append(f"u{i}_off = {_lane_off(f'u{i}')}")
    for j in range(len(ir.outputs)):
        body.append(f"o{j}_off = " + (_lane_off(f"o{j}", "lane // STATE", "1") if ir.reduce_state else _lane_off(f"o{j}")))
    body += _static_loads(ir)
    body += _initial_carry(ir)
    block = _block_index("s0")
    for j in range(MAX_UNROLL):   # loads first: nothing below depends on the carry
        part = []
        part += [f"live{j} = s0 + {j} < n_steps", f"ok{j} = lane_ok & (lane * 0 + {j} < n_steps - s0)"]
        part += _load_lift(ir, tag=str(j), shift=j, mask=f"ok{j}", hoisted=True)
        block += _guarded(j, part)
    names = ({s: f"c_{s.name[2:]}" for s in ir.prefix_symbols} | {s: s.name for s in ir.previous_symbols}
             | _symbols_named(ir.input_symbols, "u_{}"))
    for j in range(MAX_UNROLL):
        part = []
        part += [f"u_{n} = u{j}_{n}" for n in ir.inputs] + [f"e_{f} = e{j}_{f}" for f in ir.fields]
        if ir.uses_previous:
            part += [f"q_{f} = c_{f}" for f in ir.fields]
        part.append(_combine_call(ir, "c_{}_new", "c_{}", "e_{}"))
        part += _keep([f"c_{f}" for f in _free(ir)], f"live{j}")
        part += _assign([f"r{o}" for o in range(len(ir.outputs))], ir.readout, names, "_r", shape_like=f"c_{ir.fields[0]}")
        for o in range(len(ir.outputs)):
            ptr = f"o{o}_ptr + o{o}_off + (tt + {j} * step) * o{o}_st"
            if ir.reduce_state:
                part.append(f"tl.store({ptr}, {_reduce_lanes(f'r{o}')}.to(o{o}_ptr.dtype.element_ty), "
                            f"mask=ok{j} & first)")
            else:
                part.append(f"tl.store({ptr}, r{o}.to(o{o}_ptr.dtype.element_ty), mask=ok{j})")
        block += _guarded(j, part)
    chunk = [f"tl.store(ckpt_ptr + ({f} * n_slots + slot0 + k) * L + lane, c_{name}, mask=lane_ok)"
             for f, name in enumerate(ir.fields) if name in _free(ir)]
    chunk += ["n_steps = tl.minimum(CHUNK, seq_len - k * CHUNK)", "for s0 in range(0, n_steps, UNROLL):"]
    chunk += _indent(block, 4)
    body.append("for k in range(0, n_chunks):")
    body += _indent(chunk, 4)
    for f, name in enumerate(ir.fields):
        body.append(f"tl.store(final_ptr + ({f} * n_seq + seq) * L + lane, c_{name}, mask=lane_ok)")
    sig = ", ".join(forward_args(ir) + [f"{c}: tl.constexpr" for c in consts] + static_flags(ir))
    return ["@triton.jit", f"def scan_forward_lanes({sig}):",
            f'    """Forward fused scan of {ir.name}, lane-sequential: one combine per step and lane, in registers."""',
            *_indent(body, 4)]


def _du_store_lanes(i: int, name: str, j: int, at: str) -> list[str]:
    """Write du_<name> [BLOCK_L] of block step j (memory index `at`, where ok<j>) by DU{i} (the tile
    schedule's modes): 0 store, 1 atomic add, 2 summed over time, 3 summed over the STATE lanes then
    stored, 4 summed over the STATE lanes then atomically added (by the group's first lane), 5 summed
    over the program's groups lane by lane (inputs shared by the groups of a program) then
    atomically added by the first group. Atomics are relaxed: gradients only accumulate."""
    ptr = f"du{i}_ptr + du{i}_off + {at} * du{i}_st"
    gptr = f"du{i}_ptr + du{i}_goff + {at} * du{i}_st"
    red = _reduce_lanes(f"tl.where(ok{j}, du_{name}, 0.0)")
    across = _reduce_lanes(f"tl.where(ok{j}, du_{name}, 0.0)", axis=0)
    group_live = f"ok{j} & first"
    return [
        f"if DU{i} == 0:",
        f"    tl.store({ptr}, du_{name}.to(du{i}_ptr.dtype.element_ty), mask=ok{j})",
        f"elif DU{i} == 1:",
        f"    tl.atomic_add({ptr}, du_{name}.to(du{i}_ptr.dtype.element_ty), mask=ok{j}, sem='relaxed')",
        f"elif DU{i} == 2:",
        f"    acc{i} += tl.where(ok{j}, du_{name}, 0.0)",
        f"elif DU{i} == 3:",
        f"    tl.store({gptr}, {red}.to(du{i}_ptr.dtype.element_ty), mask={group_live})",
        f"elif DU{i} == 4:",
        f"    tl.atomic_add({gptr}, {red}.to(du{i}_ptr.dtype.element_ty), mask={group_live}, sem='relaxed')",
        "else:",
        f"    tl.atomic_add({ptr}, {across}.to(du{i}_ptr.dtype.element_ty), mask=ok{j} & first_group, sem='relaxed')",
    ]


def _scratch(f: int, row: str) -> str:
    return f"scratch_ptr + (({f} * n_seq + seq) * CHUNK + {row}) * L + lane"


def _adjoint_step(ir: ScanIR, adj: Adjoint, j: int, at: str, carried: list[str]) -> list[str]:
    """One step of the adjoint walked backwards, block step j: from u_*, e_*, g_*, q_* (the previous
    prefix) and p_* (the prefix) set by the caller, and the carried cd_*, bd_*; stores the input
    gradients at memory index `at` and hands c_t and B_t gbar_t down to step t - 1."""
    n, nb = len(ir.fields), len(adj.b_entries)
    shape = f"p_{ir.fields[0]}"
    here = ({s: s.name for s in ir.prefix_symbols + ir.previous_symbols + adj.g}
            | _symbols_named(ir.input_symbols, "u_{}"))
    b_names = {s: s.name for s in ir.previous_symbols} | {s: f"e_{f}" for s, f in zip(ir.later, ir.fields)}
    bmat = adj.matrix([E.symbol(f"b{k}") for k in range(nb)])
    gb = [E.symbol(f"gbar_{f}") for f in ir.fields]
    bd = [sum((bmat[i][k] * gb[k] for k in range(n)), sympy.Integer(0)) for i in range(n)]
    part = _assign([f"dy_{f}" for f in ir.fields], adj.dy, here, "_d", shape_like=shape)
    part += [f"d_{f} = dy_{f} + cd_{f}" for f in ir.fields]
    part += _assign([f"v_{f}" for f in ir.fields], adj.direct, {s: s.name for s in ir.prefix_symbols + adj.d},
                    "_v", shape_like=shape)
    part += [f"gbar_{f} = v_{f} + bd_{f}" for f in ir.fields]
    names_x = {s: s.name for s in ir.previous_symbols + adj.gbar} | {s: f"e_{f}" for s, f in zip(ir.later, ir.fields)}
    part += _assign([f"dx_{f}" for f in ir.fields], adj.dx, names_x, "_x", shape_like=shape)
    part += _assign([f"du_{u}" for u in ir.inputs], adj.du, here | {s: s.name for s in adj.dx_symbols}, "_u",
                    shape_like=shape)
    for i, name in enumerate(ir.inputs):
        part += _du_store_lanes(i, name, j, at)
    # hand down to step t - 1: c_t, B_t gbar_t (B_t = J1(y_{t-1}, x_t)^T) and its prefix y_{t-1}
    part += _assign([f"cd_{f}_new" for f in ir.fields], adj.c, here, "_i", shape_like=shape)
    part += _assign([f"b{k}" for k in range(nb)], adj.b_entries, b_names, "_b", shape_like=shape)
    part += _assign([f"bd_{f}_new" for f in ir.fields], bd,
                    {s: s.name for s in gb} | {E.symbol(f"b{k}"): f"b{k}" for k in range(nb)}, "_w", shape_like=shape)
    part += [f"nq_{f}_new = q_{f}" for f in ir.fields]
    part += _keep(carried, f"live{j}")
    return part


def _grad_loads(ir: ScanIR, j: int, at: str) -> list[str]:
    return [f"g{j}_{out} = to_acc(tl.load(g{o}_ptr + g{o}_off + {at} * g{o}_st, mask=ok{j}, other=0.0), FP64)"
            for o, out in enumerate(ir.outputs)]


def _step_inputs(ir: ScanIR, j: int) -> list[str]:
    return ([f"u_{u} = u{j}_{u}" for u in ir.inputs] + [f"e_{f} = e{j}_{f}" for f in ir.fields]
            + [f"g_{o} = g{j}_{o}" for o in ir.outputs] + [f"q_{f} = q{j}_{f}" for f in ir.fields])


def _chunk_in_scratch(ir: ScanIR, adj: Adjoint) -> list[str]:
    """CHUNK > UNROLL: replay the chunk's prefixes into the per-lane scratch rows, then walk back in
    blocks of UNROLL steps reading each step's previous prefix from scratch."""
    const = dict(ir.constants)
    replay = _block_index("s0")
    for j in range(MAX_UNROLL):
        part = []
        part += [f"live{j} = s0 + {j} < n_steps", f"ok{j} = lane_ok & (lane * 0 + {j} < n_steps - s0)"]
        part += _load_lift(ir, tag=str(j), shift=j, mask=f"ok{j}", hoisted=True)
        replay += _guarded(j, part)
    for j in range(MAX_UNROLL):
        part = []
        part.append(_combine_call(ir, "c_{}_new", "c_{}", f"e{j}_" + "{}"))
        part += _keep([f"c_{f}" for f in _free(ir)], f"live{j}")
        part += [f"tl.store({_scratch(f, f's0 + {j}')}, c_{name}, mask=ok{j})" for f, name in enumerate(ir.fields)
                 if name not in const]
        replay += _guarded(j, part)
    chunk = ["for s0 in range(0, n_steps, UNROLL):", *_indent(replay, 4), "tl.debug_barrier()"]
    chunk += [f"nq_{f} = c_{f}" for f in ir.fields]   # the prefix at the chunk's last step
    block = _block_index("(n_steps - 1 - ss0)")
    for j in range(MAX_UNROLL):   # loads first (inputs, upstream gradients, previous prefixes), then the chain
        part = []
        part += [f"live{j} = ss0 + {j} < n_steps", f"ok{j} = lane_ok & (lane * 0 + {j} < n_steps - ss0)",
                 f"s{j} = n_steps - 1 - ss0 - {j}"]
        part += _load_lift(ir, tag=str(j), shift=-j, mask=f"ok{j}", hoisted=True)
        part += _grad_loads(ir, j, f"(tt - {j} * step)")
        for f, name in enumerate(ir.fields):   # the previous prefix: the checkpoint at the chunk's first step
            if name in const:
                part.append(f"q{j}_{name} = k_{name}")
                continue
            part.append(f"q{j}_{name} = tl.where(s{j} > 0, tl.load({_scratch(f, f'tl.maximum(s{j} - 1, 0)')}, "
                        f"mask=ok{j}, other=0.0), k_{name})")
        block += _guarded(j, part)
    carried = [f"{c}_{f}" for c in ("cd", "bd", "nq") for f in ir.fields]
    for j in range(MAX_UNROLL):
        part = _step_inputs(ir, j) + [f"p_{f} = nq_{f}" for f in ir.fields]
        part += _adjoint_step(ir, adj, j, f"(tt - {j} * step)", carried)
        block += _guarded(j, part)
    chunk += ["for ss0 in range(0, n_steps, UNROLL):", *_indent(block, 4), "tl.debug_barrier()"]
    return chunk


def _chunk_in_registers(ir: ScanIR, adj: Adjoint) -> list[str]:
    """CHUNK == UNROLL: the chunk is one block; its prefixes stay in registers (r<j>_<field>) and its
    inputs and elements are reused by the walk back, so nothing goes through scratch memory. Steps
    are at fixed positions j (memory index tt + j * step); positions past the chunk's end are masked."""
    const = dict(ir.constants)
    chunk = _block_index("0")
    for j in range(MAX_UNROLL):
        part = [f"live{j} = {j} < n_steps", f"ok{j} = lane_ok & (lane * 0 + {j} < n_steps)"]
        part += _load_lift(ir, tag=str(j), shift=j, mask=f"ok{j}", hoisted=True)
        part += _grad_loads(ir, j, f"(tt + {j} * step)")
        chunk += _guarded(j, part)
    for j in range(MAX_UNROLL):
        part = [_combine_call(ir, "c_{}_new", "c_{}", f"e{j}_" + "{}")]
        part += _keep([f"c_{f}" for f in _free(ir)], f"live{j}")
        part += [f"r{j}_{f} = c_{f}" for f in _free(ir)]
        chunk += _guarded(j, part)
    carried = [f"{c}_{f}" for c in ("cd", "bd") for f in ir.fields]
    for j in reversed(range(MAX_UNROLL)):
        prev = [f"q{j}_{f} = " + (f"k_{f}" if f in const or j == 0 else f"r{j - 1}_{f}") for f in ir.fields]
        part = prev + _step_inputs(ir, j) + [f"p_{f} = " + (f"k_{f}" if f in const else f"r{j}_{f}") for f in ir.fields]
        part += _adjoint_step(ir, adj, j, f"(tt + {j} * step)", carried)
        chunk += _guarded(j, part)
    return chunk


def render_backward_lanes(ir: ScanIR, adj: Adjoint) -> list[str]:
    consts = (["BLOCK_L", "CHUNK", "UNROLL", "REVERSE", "HAS_INIT", "HAS_DFINAL", "VARLEN", "STATE", "FP64"]
              + [f"DU{i}" for i in range(len(ir.inputs))])
    body = _prologue()
    for i in range(len(ir.inputs)):
        body.append(f"u{i}_off = {_lane_off(f'u{i}')}")
        body.append(f"du{i}_off = {_lane_off(f'du{i}')}")
        body.append(f"du{i}_goff = {_lane_off(f'du{i}', 'lane // STATE', '1')}")
        body.append(f"acc{i} = to_acc(tl.zeros([BLOCK_L], tl.float32), FP64)")
    for j in range(len(ir.outputs)):
        body.append(f"g{j}_off = {_lane_off(f'g{j}')}")
    body += _static_loads(ir)
    for f, name in enumerate(ir.fields):   # cd: direct terms handed down (dL/dfinal to the last step)
        body += [f"cd_{name} = to_acc(tl.zeros([BLOCK_L], tl.float32), FP64)",
                 "if HAS_DFINAL:",
                 f"    cd_{name} += to_acc(tl.load(dfinal_ptr + ({f} * n_seq + seq) * L + lane, mask=lane_ok, other=0.0), FP64)",
                 f"bd_{name} = to_acc(tl.zeros([BLOCK_L], tl.float32), FP64)"]
    chunk = ["k = n_chunks - 1 - kk", "n_steps = tl.minimum(CHUNK, seq_len - k * CHUNK)"]
    const = dict(ir.constants)
    for f, (name, ident) in enumerate(zip(ir.fields, ir.identity)):
        if name in const:
            chunk.append(f"k_{name} = to_acc(tl.full([BLOCK_L], {_num(const[name])}, tl.float64), FP64)")
        else:
            chunk.append(f"k_{name} = to_acc(tl.load(ckpt_ptr + ({f} * n_slots + slot0 + k) * L + lane, mask=lane_ok, "
                         f"other={_num(ident)}), FP64)")
        chunk.append(f"c_{name} = k_{name}")
    chunk += ["if CHUNK == UNROLL:", *_indent(_chunk_in_registers(ir, adj), 4),
              "else:", *_indent(_chunk_in_scratch(ir, adj), 4)]
    body.append("for kk in range(0, n_chunks):")
    body += _indent(chunk, 4)
    for i in range(len(ir.inputs)):
        body += [f"if DU{i} == 2:",
                 f"    tl.atomic_add(du{i}_ptr + du{i}_off, acc{i}.to(du{i}_ptr.dtype.element_ty), mask=lane_ok, "
                 "sem='relaxed')"]
    body.append("if HAS_INIT:")   # dL/d(initial) = c_0 + B_0 gbar_0 (dL/dfinal when the sequence is empty)
    for f, name in enumerate(ir.fields):
        body.append(f"    tl.store(dinit{f}_ptr + seq * L + lane, cd_{name} + bd_{name}, mask=lane_ok)")
    sig = ", ".join(backward_args(ir) + ["scratch_ptr"] + [f"{c}: tl.constexpr" for c in consts] + static_flags(ir))
    return ["@triton.jit", f"def scan_backward_lanes({sig}):",
            f'    """Backward of {ir.name}, lane-sequential: replay each chunk (in registers when CHUNK == UNROLL, '
            'else into scratch), step the adjoint back."""',
            *_indent(body, 4)]
