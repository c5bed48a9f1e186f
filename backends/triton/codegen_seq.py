"""The lane-sequential schedule (README, "Two schedules"): lanes in registers, time stepped one at a time.

Lane layout. A program owns BLOCK_L lanes held as [R, BLOCK_L // R] tensors: column g is a thread
slot holding the R consecutive lanes slot..slot + R - 1 (slot = pid * BLOCK_L + g * R) in registers
(Triton's default layout puts the whole first axis in one thread when BLOCK_L // R >= the threads).
R (constexpr, runtime.lanes_per_thread) divides STATE, so a group's STATE lanes are STATE // R
adjacent slots: its sum over the state is R - 1 adds in registers and log2(STATE // R) shuffles, and
an input constant over the state (v, prec of the Kalman program: constexpr SLOT<i>) is loaded once
per slot. Addresses: per slot a base pointer computed once, per lane a register offset r * stride
(an immediate when the stride is 1), per block of steps one scalar `index * time stride` with the
block's steps at constant (immediate) offsets from it (`_time`).

Memory. Every load, store and atomic goes through the lane (or slot) tensor reshaped to 1-D
(`_load`, `_store`): a 1-D access has one order, so Triton's coalescing keeps the layout the [R, G]
arithmetic has (R in registers) whatever the strides. Accessed as [R, G], Triton 3.6 ordered the
accesses dim 0 first when both dims' contiguities tied, spread R over 4 threads, and the state sums
then needed shuffles and 32 layout conversions through shared memory per forward loop (offline
SASS, Kalman forward inner loop: 44 -> 23 instructions per lane-step under 3.6).

- `scan_forward_lanes`: walks its sequence one step at a time: lift, prefix = combine(prefix,
  element), readout (optionally summed over the STATE lanes), store. Every CHUNK steps it stores the
  carry into the chunk: the same checkpoints as the tile schedule (slot j = the carry into chunk j),
  so either backward can run after either forward. No shared memory: work-optimal, one combine per
  step and lane. Steps run in blocks of UNROLL (a constexpr <= tuning.max_unroll): the block's loads are
  issued first (they do not depend on the carry, and a store between them would keep the compiler
  from hoisting them), then the dependent chain. Full blocks run without step masks or keeps; the
  chunk's partial last block (if any) runs a masked copy whose steps past the end leave the carries.
  Lane masks vanish when every program is full (constexpr EVEN_L).
- `scan_backward_lanes`: walks the chunks in reverse. Per chunk it replays the prefixes from the
  checkpoint: with CHUNK == UNROLL into registers (the chunk is one block; its loaded inputs and
  elements are reused on the way back), otherwise into per-lane scratch rows (global memory:
  the checkpoint and CHUNK prefixes of the carried fields, each program's block contiguous at
  compile-time strides, `_scratch`; a barrier separates writing and reading them). Then it steps the adjoint
  backwards one step at a time (scanlang/autodiff.py):

      gbar_t = direct(p_t, dy_t + c_{t+1} [+ dL/dfinal at the last step]) + B_{t+1} gbar_{t+1}
      dx_t   = J2(y_{t-1}, x_t)^T gbar_t,  du_t = (d lift/du)^T dx_t + (d readout/du)^T g_t

  Step t hands its successor-side terms down to step t - 1 as two carried vectors: `cd` = c_t
  (the readout at t differentiated in its previous prefix) and `bd` = B_t gbar_t (B_t the adjoint
  transition J1(y_{t-1}, x_t)^T in its sparse form). At t = 0 they sum to dL/d(initial). The
  prefix y_t of a step is its successor's previous prefix (carried as `nq`), so each step reads
  one scratch row. A readout that does not use the previous prefix (c = 0) carries `bd` alone.
  When the step composes with the lift (`_composed_step`), so does the adjoint
  (`_composed_adjoint`): B's entries and du = (dF/du)^T gbar + (d readout/du)^T g over the inputs
  and prefixes, simplified with the lift in view, and no dx.
- Both: an input constant in time (a broadcast static parameter, time stride 0: constexpr
  TSTATIC<i>) is loaded once per program; the fields of a specialised carry (`ir.constants`,
  scanlang/ir.py `specialize_carry`) are literals, never stored, loaded or carried. The combine is
  rendered in place, and every step inverts each distinct denominator once (`_assign_rcp`): with
  constexpr RCP_APPROX (float32 on a GPU) by the hardware reciprocal, else by a division. The
  forward stores checkpoints only when a backward will read them (constexpr CKPT).
"""
from __future__ import annotations

import dataclasses
import functools

import sympy

from scanlang import expr as E
from scanlang import tuning
from scanlang.autodiff import Adjoint
from scanlang.ir import ScanIR

from .codegen import (_assign, _assign_inverted, _indent, _initial_carry, _num, _symbols_named, backward_args, forward_args,
                      memory_index, renormalise_leaf, scale_leaf_gradient, sequence_bounds, static_flags)

SHAPE = "[R, BLOCK_L // R]"   # a lane tensor: R lanes per thread slot, BLOCK_L // R slots
SLOTS = "[1, BLOCK_L // R]"   # a slot tensor: one value per thread slot


def _flat(x: str, per_slot: bool = False) -> str:
    """`x` (a lane tensor, or a slot tensor when `per_slot`) as the 1-D tensor memory is accessed through."""
    return f"tl.reshape({x}, {'(BLOCK_L // R,)' if per_slot else '(BLOCK_L,)'})"


def _load(ptr: str, mask: str, other: str, per_slot: bool = False) -> str:
    """A lane (or slot) tensor loaded through flat 1-D pointers (see the module docstring, "Memory")."""
    shape = SLOTS if per_slot else SHAPE
    return f"tl.reshape(tl.load({_flat(ptr, per_slot)}, mask={_flat(mask, per_slot)}, other={other}), {shape})"


def _store(ptr: str, value: str, mask: str, per_slot: bool = False, atomic: bool = False) -> str:
    """A lane (or slot) tensor stored (or atomically added, relaxed) through flat 1-D pointers."""
    value = _flat(f"tl.broadcast_to({value}, {SLOTS if per_slot else SHAPE})", per_slot)
    if atomic:
        return f"tl.atomic_add({_flat(ptr, per_slot)}, {value}, mask={_flat(mask, per_slot)}, sem='relaxed')"
    return f"tl.store({_flat(ptr, per_slot)}, {value}, mask={_flat(mask, per_slot)})"


def _prologue() -> list[str]:
    """Program = (lane block, sequence), as in the tile schedule."""
    return [
        "pid = tl.program_id(0)",
        "seq = tl.program_id(1)",
        "r_idx = tl.arange(0, R)[:, None]",
        "slot = pid.to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L // R)[None, :] * R",
        "lane = slot + r_idx",
        "if EVEN_L:   # constant masks: the loads and stores below lose them",
        "    slot_ok = tl.full([1, BLOCK_L // R], 1, tl.int1)",
        f"    lane_ok = tl.full({SHAPE}, 1, tl.int1)",
        "else:",
        "    slot_ok = slot < L",
        "    lane_ok = lane < L",
        *sequence_bounds(),
        "n_chunks = tl.cdiv(seq_len, CHUNK)",
        "slot0 = t0 // CHUNK + seq",
        "first = (slot % STATE) == 0",   # the slot that stores its group's sum
        "first_group = slot - pid.to(tl.int64) * BLOCK_L < STATE",   # the program's group that adds the groups' sum
        "first_in_warp = (slot - pid.to(tl.int64) * BLOCK_L) % (32 * R) < STATE",   # each warp's first group
        "slot_in_block = tl.arange(0, BLOCK_L // R)[None, :]",   # a warp's slots: 32 consecutive (_warp_sum_scatter)
    ]


def _guarded(j: int, lines: list[str]) -> list[str]:
    """Block step j exists when j < UNROLL (a constexpr: the other copies are not compiled)."""
    return lines if j == 0 else [f"if {j} < UNROLL:", *_indent(lines, 4)]


def _block_index(first: str) -> list[str]:
    """tt: the memory index of scan step t = k * CHUNK + `first` (backwards in memory when REVERSE);
    step j of the block is at tt + j * step (forward walk) or tt - j * step (backward walk)."""
    return [f"t = k * CHUNK + {first}", *memory_index()]


def _offsets(prefix: str, per_group: bool = False) -> list[str]:
    """p<prefix>: the slots' base pointers [1, G]; <prefix>_r: the lanes' offsets from them [R, 1]
    (lane dims D0..D3, last fastest; R divides D3). `per_group`: the group's address (lane // STATE
    over dims D0..D2), for values summed over the state."""
    if per_group:
        return [f"p{prefix}g = {prefix}_ptr + lane_offsets(slot // STATE, D1, D2, 1, {prefix}_s0, {prefix}_s1, "
                f"{prefix}_s2, {prefix}_s3)"]
    return [f"p{prefix} = {prefix}_ptr + lane_offsets(slot, D1, D2, D3, {prefix}_s0, {prefix}_s1, {prefix}_s2, "
            f"{prefix}_s3)", f"{prefix}_r = r_idx * {prefix}_s3"]


def _time(buffer: str, shift: int) -> str:
    """` + <offset of memory index tt + shift * step>` in `buffer`'s elements: tt's offset plus a constant
    one, so every step of a block shares one address and the constant becomes the access's immediate
    (offset arithmetic on (tt + shift) is not folded)."""
    if shift == 0:
        return f" + tt * TS_{buffer}"
    return f" + tt * TS_{buffer} + ({'+' if shift > 0 else '-'}{abs(shift)} * step * TS_{buffer})"


def _at(prefix: str, shift: int, per_slot: bool = False) -> str:
    """Pointers of `prefix` at memory index tt + shift * step: per lane [R, G], or per slot [1, G]."""
    base = f"p{prefix}{_time(prefix, shift)}"
    return base if per_slot else f"{base} + {prefix}_r"


def _masks(j: int, first: str, masked: bool) -> tuple[list[str], str, str, str]:
    """(lines, lane mask, slot mask, live flag) of block step j. Full blocks: the lane masks only
    (constant true under EVEN_L); a masked block: also the step's existence (first + j < n_steps)."""
    if not masked:
        return [], "lane_ok", "slot_ok", ""
    return ([f"live{j} = {first} + {j} < n_steps", f"ok{j} = lane_ok & (lane * 0 + {j} < n_steps - {first})",
             f"oks{j} = slot_ok & (slot * 0 + {j} < n_steps - {first})"],
            f"ok{j}", f"oks{j}", f"live{j}")


def _load_lift(ir: ScanIR, tag: str, shift: int, lane_mask: str, slot_mask: str, masked: bool,
               lift: bool = True) -> list[str]:
    """Load the inputs at memory index tt + shift * step (once per slot for SLOT<i>, once per program for
    TSTATIC<i>), lift them (when `lift`): u{tag}_<input>, e{tag}_<field>; masked lanes get the identity."""
    lines = []
    for i, n in enumerate(ir.inputs):
        lines += [f"if TSTATIC{i}:", f"    u{tag}_{n} = us{i}",
                  f"elif SLOT{i}:",
                  f"    u{tag}_{n} = to_acc({_load(_at(f'u{i}', shift, True), slot_mask, '1.0', True)}, FP64)",
                  "else:",
                  f"    u{tag}_{n} = to_acc({_load(_at(f'u{i}', shift), lane_mask, '1.0')}, FP64)"]
    if not lift:
        return lines
    names = {s: f"u{tag}_{s.name[2:]}" for s in ir.input_symbols}
    lines += _assign([f"l{tag}_{f}" for f in ir.fields], ir.lift, names, f"_l{tag}", shape_like=f"u{tag}_{ir.inputs[0]}")
    lines += renormalise_leaf(ir, tag)
    for f, ident in zip(ir.fields, ir.identity):
        lines.append(f"e{tag}_{f} = tl.where({lane_mask}, l{tag}_{f}, {_num(ident)})" if masked else f"e{tag}_{f} = l{tag}_{f}")
    return lines


def _static_loads(ir: ScanIR) -> list[str]:
    """us<i>: input i loaded once per program when it is constant in time (constexpr TSTATIC<i>)."""
    lines = []
    for i in range(len(ir.inputs)):
        lines += [f"if TSTATIC{i}:",
                  f"    if SLOT{i}:",
                  f"        us{i} = to_acc({_load(f'pu{i}', 'slot_ok', '1.0', True)}, FP64)",
                  "    else:",
                  f"        us{i} = to_acc({_load(f'pu{i} + u{i}_r', 'lane_ok', '1.0')}, FP64)"]
    return lines


def lanes_flags(ir: ScanIR, backward: bool) -> list[str]:
    """The per-buffer constexpr parameters: TS_<buffer>, its time stride (so a block's steps are
    immediate offsets from one pointer; the runtime stride arguments go unused); per input
    TSTATIC<i> (constant in time) and SLOT<i> (constant over the R lanes of a slot: lane stride 0
    along the last lane dim), default False."""
    per_step = ([f"u{i}" for i in range(len(ir.inputs))]
                + ([f"g{o}" for o in range(len(ir.outputs))] + [f"du{i}" for i in range(len(ir.inputs))] if backward
                   else [f"o{o}" for o in range(len(ir.outputs))]))
    return ([f"TS_{b}: tl.constexpr" for b in per_step]
            + static_flags(ir)
            + [f"SLOT{i}: tl.constexpr = False" for i in range(len(ir.inputs))])


def _keep(names, live: str) -> list[str]:
    """Carried values advance (only on live steps in a masked block: its tail keeps them)."""
    if not live:
        return [f"{n} = {n}_new" for n in names]
    return [f"{n} = tl.where({live}, {n}_new, {n})" for n in names]


def _free(ir: ScanIR) -> list[str]:
    """The carried fields: all but the constants of a specialised carry (ir.specialize_carry)."""
    const = dict(ir.constants)
    return [f for f in ir.fields if f not in const]


def _rcp(name: str, value: str) -> list[str]:
    """name = 1 / value by the generated `reciprocal` (the hardware one under RCP_APPROX)."""
    return [f"{name} = reciprocal({value}, RCP_APPROX)"]


def _assign_rcp(names_out, exprs, names, prefix, recips: dict, shape_like=None) -> list[str]:
    """codegen._assign_inverted under RCP_APPROX, one `recips` dict per step: each step divides once per
    distinct denominator."""
    return _assign_inverted(names_out, exprs, names, prefix, shape_like, hw="RCP_APPROX", recips=recips)


def _combine_inline(ir: ScanIR, out: str, left: str, right: str, recips: dict) -> list[str]:
    """`out` = combine(`left`, `right`) (formats for one name per field; left the earlier operand)
    rendered in place, renormalised by the scale for projective monoids (the generated `combine`)."""
    names = ({s: left.format(f) for s, f in zip(ir.earlier, ir.fields)}
             | {s: right.format(f) for s, f in zip(ir.later, ir.fields)})
    outs = [out.format(f) for f in ir.fields]
    if not ir.is_projective:
        return _assign_rcp(outs, ir.combine, names, "_c", recips, shape_like=left.format(ir.fields[0]))
    raw = [f"_m_{f}" for f in ir.fields]
    lines = _assign_rcp(raw, ir.combine, names, "_c", recips, shape_like=left.format(ir.fields[0]))
    lines += _assign(["_scale"], [ir.scale], dict(zip(ir.scale_symbols, raw)), "_s")
    lines += _rcp("_inv_scale", "_scale")
    return lines + [f"{o} = {m} * _inv_scale" for o, m in zip(outs, raw)]


def _cost(exprs) -> int:
    """Operations after common subexpressions are shared (how the renderer prints them)."""
    reps, reduced = sympy.cse(list(exprs), optimizations=None, order="canonical")
    return sum(sympy.count_ops(v) for _, v in reps) + sum(sympy.count_ops(e) for e in reduced)


def _cheapest(exprs) -> list:
    """The same expressions as printed with the fewest operations: as given, over common
    denominators (sympy.together) or factored (sympy.factor); expressions over 300 operations stay."""
    return list(_cheapest_of(tuple(sympy.sympify(e) for e in exprs)))


@functools.lru_cache(maxsize=1024)
def _cheapest_of(exprs: tuple) -> tuple:
    if not exprs or any(sympy.count_ops(e) > 300 for e in exprs):
        return exprs
    candidates = [exprs, tuple(sympy.together(e) for e in exprs), tuple(sympy.factor(e) for e in exprs)]
    return min(candidates, key=_cost)   # the first of equal costs: as given


def _split_at_zero_carry(expr: sympy.Expr, carry: set) -> sympy.Expr:
    """N / D (D depending on the carry) as q + r / D with q = N / D at carry 0: the part of the step
    that does not depend on the carry moves off the dependent chain and the numerator shrinks
    (Kalman: lam' = (a^2 phi + lam (1 + p phi)) / (a^2 + p lam) = phi + lam / (a^2 + p lam)). The
    same function; `expr` itself when that is not cheaper."""
    if sympy.count_ops(expr) > 200:
        return expr
    num, den = sympy.fraction(sympy.cancel(expr))
    zero = {c: 0 for c in carry}
    d0 = den.xreplace(zero)
    if not (den.free_symbols & carry) or d0 == 0:
        return expr
    q = sympy.cancel(num.xreplace(zero) / d0)
    split = q + sympy.cancel(sympy.expand(num - q * den)) / den
    return split if _cost([split]) < _cost([expr]) else expr


def _composed_step(ir: ScanIR):
    """The carried fields' update combine(carry, lift(u)) as one expression per free field over the
    carry (earlier symbols) and the inputs, each split at zero carry; None for a projective monoid
    (its renormalisation stays with the combine)."""
    if ir.is_projective:
        return None
    const = dict(ir.constants)
    lift = dict(zip(ir.later, ir.lift))
    carry = {x for x, f in zip(ir.earlier, ir.fields) if f not in const}
    return [_split_at_zero_carry(sympy.sympify(ir.combine[ir.fields.index(f)]).xreplace(lift), carry)
            for f in _free(ir)]


def _advance(ir: ScanIR, inputs: str, elements: str, recips: dict) -> list[str]:
    """c_<field>_new for the free fields: the composed step (inputs named by the format `inputs`),
    else the combine of the carry with the lifted elements (format `elements`)."""
    step = _composed_step(ir)
    if step is None:
        return _combine_inline(ir, "c_{}_new", "c_{}", elements, recips)
    names = ({x: f"c_{f}" for x, f in zip(ir.earlier, ir.fields)}
             | {s: inputs.format(s.name[2:]) for s in ir.input_symbols})
    return _assign_rcp([f"c_{f}_new" for f in _free(ir)], step, names, "_c", recips, shape_like=f"c_{ir.fields[0]}")


def _state_sum(value: str) -> str:
    """Each group's sum over its STATE lanes of a lane tensor [R, G], on every slot of the group
    ([1, G]): in registers, then across the group's STATE // R adjacent slots. No layout change."""
    per_slot = f"tl.sum(tl.broadcast_to({value}, {SHAPE}), 0, keep_dims=True)"
    split = "(1, BLOCK_L // STATE, STATE // R)"
    return (f"tl.reshape(tl.broadcast_to(tl.sum(tl.reshape({per_slot}, {split}), 2, keep_dims=True), {split}), "
            "(1, BLOCK_L // R))")


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


# Software-pipelining depth of the loops over full blocks, per pass: tuning.loop_stages_forward /
# loop_stages_backward (render-time: in the program key). With N > 1 the loop is
# `tl.range(..., num_stages=N)`: Triton issues the loads of the next N - 1 blocks (cp.async into shared
# memory) while the current block's chain runs, for more instructions and registers.
# (Offline counts and timings: BENCHMARKS_HISTORY.md, "Notes moved from code comments".)


def _split_blocks(full: list[str], masked: list[str], start: str, stages: int = 1) -> list[str]:
    """The chunk's full blocks of UNROLL steps (loop variable `start`, software-pipelined `stages`
    deep), then its partial last block."""
    loop = (f"range(0, n_steps - (UNROLL - 1), UNROLL)" if stages == 1
            else f"tl.range(0, n_steps - (UNROLL - 1), UNROLL, num_stages={stages})")
    return [f"for {start} in {loop}:", *_indent(full, 4),
            f"{start} = n_steps - n_steps % UNROLL",
            f"if {start} < n_steps:", *_indent(masked, 4)]


def _forward_block(ir: ScanIR, masked: bool) -> list[str]:
    MAX_UNROLL = tuning.current().max_unroll
    block = _block_index("s0")
    for j in range(MAX_UNROLL):   # loads first: nothing below depends on the carry
        lines, lmask, smask, _ = _masks(j, "s0", masked)
        block += _guarded(j, lines + _load_lift(ir, str(j), j, lmask, smask, masked,
                                                lift=_composed_step(ir) is None))
    names = ({s: f"c_{s.name[2:]}" for s in ir.prefix_symbols} | {s: s.name for s in ir.previous_symbols}
             | _symbols_named(ir.input_symbols, "u_{}"))
    for j in range(MAX_UNROLL):
        _, lmask, smask, live = _masks(j, "s0", masked)
        part = [f"u_{n} = u{j}_{n}" for n in ir.inputs]
        if ir.uses_previous:
            part += [f"q_{f} = c_{f}" for f in ir.fields]
        part += _advance(ir, "u_{}", f"e{j}_" + "{}", {})
        part += _keep([f"c_{f}" for f in _free(ir)], live)
        part += _assign_rcp([f"r{o}" for o in range(len(ir.outputs))], ir.readout, names, "_r", {},
                            shape_like=f"c_{ir.fields[0]}")
        for o in range(len(ir.outputs)):
            cast = f".to(o{o}_ptr.dtype.element_ty)"
            if ir.reduce_state:
                part.append(_store(_at(f'o{o}', j, True), f"{_state_sum(f'r{o}')}{cast}",
                                   f"{smask} & first", per_slot=True))
            else:
                part.append(_store(_at(f'o{o}', j), f"r{o}{cast}", lmask))
        block += _guarded(j, part)
    return block


def render_forward_lanes(ir: ScanIR) -> list[str]:
    consts = ["BLOCK_L", "R", "EVEN_L", "CHUNK", "UNROLL", "REVERSE", "HAS_INIT", "VARLEN", "STATE", "FP64",
              "RCP_APPROX", "CKPT"]
    body = _prologue()
    for i in range(len(ir.inputs)):
        body += _offsets(f"u{i}")
    for o in range(len(ir.outputs)):
        body += _offsets(f"o{o}", per_group=ir.reduce_state)
    if ir.reduce_state:
        body += [f"po{o} = po{o}g" for o in range(len(ir.outputs))]
    body += _static_loads(ir)
    body += _initial_carry(ir, SHAPE)
    ckpt = "ckpt_ptr + ({} * n_slots + slot0 + k) * L + lane"
    chunk = ["if CKPT:"] + ["    " + _store(ckpt.format(f), f"c_{name}", "lane_ok")
                            for f, name in enumerate(ir.fields) if name in _free(ir)]
    chunk.append("n_steps = tl.minimum(CHUNK, seq_len - k * CHUNK)")
    chunk += _split_blocks(_forward_block(ir, masked=False), _forward_block(ir, masked=True), "s0",
                           tuning.current().loop_stages_forward)
    body.append("for k in range(0, n_chunks):")
    body += _indent(chunk, 4)
    for f, name in enumerate(ir.fields):
        body.append(_store(f"final_ptr + ({f} * n_seq + seq) * L + lane", f"c_{name}", "lane_ok"))
    sig = ", ".join(forward_args(ir) + [f"{c}: tl.constexpr" for c in consts] + lanes_flags(ir, False))
    return ["@triton.jit", f"def scan_forward_lanes({sig}):",
            f'    """Forward fused scan of {E.docstring_text(ir.name)}, lane-sequential: one combine per step and lane, in registers."""',
            *_indent(body, 4)]


def _du_store_lanes(i: int, name: str, shift: int, lane_mask: str, slot_mask: str, masked: bool) -> list[str]:
    """Write du_<name> (memory index tt + shift * step) by DU{i} (the tile schedule's modes): 0 store, 1 atomic
    add, 2 summed over time, 3 summed over the STATE lanes then stored, 4 summed over the STATE
    lanes then atomically added (by the group's first slot), 5 summed over the program's groups lane
    by lane (inputs shared by the groups of a program) then atomically added by the first group, 6
    the same over the groups of each warp (plan._lanes_mode): when STATE <= 32 reduce-scattered
    (`_warp_sum_scatter`), each sum added by one atomic of one slot (R x fewer atomic instructions
    than one per lane, each predicated atomic being a branch in SASS), else added by the first
    group's R registers. Atomics are relaxed: gradients only accumulate."""
    ptr, gptr = _at(f"du{i}", shift), f"pdu{i}g{_time(f'du{i}', shift)}"
    value = f"tl.where({lane_mask}, du_{name}, 0.0)" if masked else f"du_{name}"
    cast = f".to(du{i}_ptr.dtype.element_ty)"
    return [
        f"if DU{i} == 0:",
        "    " + _store(ptr, f"du_{name}{cast}", lane_mask),
        f"elif DU{i} == 1:",
        "    " + _store(ptr, f"du_{name}{cast}", lane_mask, atomic=True),
        f"elif DU{i} == 2:",
        f"    acc{i} += {value}",
        f"elif DU{i} == 3:",
        "    " + _store(gptr, f"{_state_sum(value)}{cast}", f"{slot_mask} & first", per_slot=True),
        f"elif DU{i} == 4:",
        "    " + _store(gptr, f"{_state_sum(value)}{cast}", f"{slot_mask} & first", per_slot=True, atomic=True),
        f"elif DU{i} == 5:",
        "    " + _store(ptr, f"{_groups_sum(value)}{cast}", f"{lane_mask} & first_group", atomic=True),
        "elif STATE <= 32:",   # a warp's groups summed and scattered over its slots
        *_indent(_warp_sum_scatter(value), 4),
        f"    ws_ok = {slot_mask} & ws_own",
        "    if not EVEN_L:",
        "        ws_ok = ws_ok & (slot + ws_reg < L)",
        f"    tl.atomic_add(tl.reshape(pdu{i}{_time(f'du{i}', shift)} + ws_reg * du{i}_s3, (ws_sum.numel,)), "
        f"tl.reshape(ws_sum{cast}, (ws_sum.numel,)), mask=tl.reshape(tl.broadcast_to(ws_ok, ws_sum.shape), "
        "(ws_sum.numel,)), sem='relaxed')",
        "else:",
        "    " + _store(ptr, f"{_warp_groups_sum(value)}{cast}", f"{lane_mask} & first_in_warp", atomic=True),
    ]


def _warp_sum_scatter(value: str) -> list[str]:
    """ws_sum [K, G], ws_reg [K, G], ws_own [1, G]: per state index, the sum of lane tensor `value`
    [R, G] over the groups of each warp (slots g and g ^ m for the lane bits m >= STATE // R),
    reduce-scattered. At each group bit, while two or more registers remain, a slot keeps the half
    its bit selects and adds its partner's copy of that half (one shuffle per kept register), then
    adds its partner's sums. ws_reg: the sums' state registers (index r of the R lanes); ws_own: the
    one slot of each set holding equal sums; K = max(1, R >> group bits)."""
    return ["ws_sum = " + value,
            "ws_base = slot_in_block * 0",
            "ws_own = slot_in_block == slot_in_block",
            "for ws_bit in tl.static_range(5):",
            "    if (1 << ws_bit) >= STATE // R:",
            "        ws_up = (slot_in_block & (1 << ws_bit)) != 0",
            "        if ws_sum.shape[0] > 1:",
            "            ws_lo, ws_hi = tl.split(tl.permute(tl.reshape(ws_sum, [2, ws_sum.shape[0] // 2, "
            "ws_sum.shape[1]]), (1, 2, 0)))",
            "            ws_base += tl.where(ws_up, ws_sum.shape[0] // 2, 0)",
            "            ws_send = tl.where(ws_up, ws_lo, ws_hi)",
            f"            ws_sum = tl.where(ws_up, ws_hi, ws_lo) + {_partner('ws_send', '1 << ws_bit')}",
            "        else:",
            f"            ws_sum = ws_sum + {_partner('ws_sum', '1 << ws_bit')}",
            "            ws_own = ws_own & ~ws_up",
            "ws_reg = ws_base + tl.arange(0, ws_sum.shape[0])[:, None]"]


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
    free = _free(ir)
    return f"scratch_lane + (({row}) * {len(free)} + {free.index(name)}) * BLOCK_L"


def _adjoint_step(ir: ScanIR, adj: Adjoint, j: int, shift: int, carried: list[str], masked: bool) -> list[str]:
    """One step of the adjoint walked backwards, block step j: from u_*, e_*, g_*, q_* (the previous
    prefix) and p_* (the prefix) set by the caller, and the carried cd_*, bd_*; stores the input
    gradients at memory index tt + shift * step and hands c_t and B_t gbar_t down to step t - 1."""
    _, lmask, smask, live = _masks(j, "", masked)
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
    part = _assign_rcp([f"dy_{f}" for f in ir.fields], _cheapest(adj.dy), here, "_d", recips, shape_like=shape)
    part += [f"d_{f} = dy_{f} + cd_{f}" if _hands_down_c(adj) else f"d_{f} = dy_{f}" for f in ir.fields]
    part += _assign_rcp([f"v_{f}" for f in ir.fields], _cheapest(adj.direct),
                        {s: s.name for s in ir.prefix_symbols + adj.d}, "_v", recips, shape_like=shape)
    part += [f"gbar_{f} = v_{f} + bd_{f}" for f in ir.fields]
    names_x = {s: s.name for s in ir.previous_symbols + adj.gbar} | {s: f"e_{f}" for s, f in zip(ir.later, ir.fields)}
    if adj.dx:   # (a composed adjoint has none: its du is over gbar directly)
        part += _assign_rcp([f"dx_{f}" for f in ir.fields], _cheapest(adj.dx), names_x, "_x", recips, shape_like=shape)
        part += scale_leaf_gradient(ir, "dx_{}", "")
    part += _assign_rcp([f"du_{u}" for u in ir.inputs], _cheapest(adj.du),
                        here | {s: s.name for s in adj.dx_symbols + adj.gbar}, "_u", recips, shape_like=shape)
    for i, name in enumerate(ir.inputs):
        part += _du_store_lanes(i, name, shift, lmask, smask, masked)
    # hand down to step t - 1: c_t, B_t gbar_t (B_t = J1(y_{t-1}, x_t)^T) and its prefix y_{t-1}
    if _hands_down_c(adj):
        part += _assign_rcp([f"cd_{f}_new" for f in ir.fields], _cheapest(adj.c), here, "_i", recips, shape_like=shape)
    part += _assign_rcp([f"b{k}" for k in range(nb)], _cheapest(adj.b_entries), b_names, "_b", recips,
                        shape_like=shape)
    part += _assign_rcp([f"bd_{f}_new" for f in ir.fields], bd,
                        {s: s.name for s in gb} | {E.symbol(f"b{k}"): f"b{k}" for k in range(nb)}, "_w", recips,
                        shape_like=shape)
    part += [f"nq_{f}_new = q_{f}" for f in ir.fields]
    part += _keep(carried, live)
    return part


def _composed_adjoint(ir: ScanIR, adj: Adjoint) -> Adjoint:
    """`adj` with the lift composed in, for programs whose step composes (`_composed_step`; else `adj`):
    B's entries over the previous prefix and the inputs, and du = (dF/du)^T gbar + (d readout/du)^T g
    with F(q, u) = combine(q, lift(u)) differentiated directly (no dx), each expression simplified with
    the lift in view. The same gradients with fewer operations (Kalman: B's entries reduce to
    a^2 / den^2, -a p eta / den^2 and a / den; du_k to 2 prec k gbar_lam + prec v gbar_eta)."""
    if _composed_step(ir) is None:
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
    """Each expression in its cheapest of: as given, sympy.cancel, sympy.factor (`_cost`)."""
    out = []
    for e in exprs:
        if sympy.count_ops(e) > 300:
            out.append(e)
            continue
        out.append(min([e, sympy.cancel(e), sympy.factor(e)], key=lambda x: _cost([x])))
    return tuple(out)


def _hands_down_c(adj: Adjoint) -> bool:
    """Whether a step's readout uses its previous prefix (c_t not identically zero): only then is
    `cd` carried; otherwise gbar_t = dy_t + B_{t+1} gbar_{t+1}, and dL/dfinal starts `bd` instead."""
    return any(c != 0 for c in adj.c)


def _carried_adjoint(adj: Adjoint) -> tuple[str, ...]:
    """The adjoint vectors carried from step to step: ("cd", "bd"), or ("bd",) without c_t."""
    return ("cd", "bd") if _hands_down_c(adj) else ("bd",)


def _grad_loads(ir: ScanIR, j: int, shift: int, lane_mask: str, slot_mask: str) -> list[str]:
    """Upstream gradients of the outputs: per slot when summed over the state (stride 0 over it)."""
    per_slot = ir.reduce_state
    mask = slot_mask if per_slot else lane_mask
    return [f"g{j}_{out} = to_acc({_load(_at(f'g{o}', shift, per_slot), mask, '0.0', per_slot)}, FP64)"
            for o, out in enumerate(ir.outputs)]


def _step_inputs(ir: ScanIR, j: int) -> list[str]:
    return ([f"u_{u} = u{j}_{u}" for u in ir.inputs] + [f"e_{f} = e{j}_{f}" for f in ir.fields]
            + ([f"inv_leaf = inv_leaf{j}"] if ir.is_projective else [])
            + [f"g_{o} = g{j}_{o}" for o in ir.outputs] + [f"q_{f} = q{j}_{f}" for f in ir.fields])


def _replay_block(ir: ScanIR, masked: bool) -> list[str]:
    """Replay UNROLL steps from s0 into the scratch rows s0 + 1 ..."""
    MAX_UNROLL = tuning.current().max_unroll
    block = _block_index("s0")
    for j in range(MAX_UNROLL):
        lines, lmask, smask, _ = _masks(j, "s0", masked)
        block += _guarded(j, lines + _load_lift(ir, str(j), j, lmask, smask, masked,
                                                lift=_composed_step(ir) is None))
    for j in range(MAX_UNROLL):
        _, lmask, _, live = _masks(j, "s0", masked)
        part = _advance(ir, f"u{j}_" + "{}", f"e{j}_" + "{}", {})
        part += _keep([f"c_{f}" for f in _free(ir)], live)
        part += [_store(_scratch(ir, name, f's0 + {j + 1}'), f"c_{name}", lmask) for name in _free(ir)]
        block += _guarded(j, part)
    return block


def _walk_block(ir: ScanIR, adj: Adjoint, masked: bool) -> list[str]:
    """UNROLL adjoint steps back from step n_steps - 1 - ss0, reading the previous prefixes from scratch."""
    MAX_UNROLL = tuning.current().max_unroll
    const = dict(ir.constants)
    block = _block_index("(n_steps - 1 - ss0)")
    for j in range(MAX_UNROLL):   # loads first (inputs, upstream gradients, previous prefixes), then the chain
        lines, lmask, smask, _ = _masks(j, "ss0", masked)
        part = lines + [f"s{j} = n_steps - 1 - ss0 - {j}"]
        part += _load_lift(ir, str(j), -j, lmask, smask, masked)
        part += _grad_loads(ir, j, -j, lmask, smask)
        for name in ir.fields:   # the previous prefix (row 0: the checkpoint)
            part.append(f"q{j}_{name} = " + (f"k_{name}" if name in const else _load(_scratch(ir, name, f's{j}'), lmask, '0.0')))
        block += _guarded(j, part)
    carried = [f"{c}_{f}" for c in _carried_adjoint(adj) + ("nq",) for f in ir.fields]
    for j in range(MAX_UNROLL):
        part = _step_inputs(ir, j) + [f"p_{f} = nq_{f}" for f in ir.fields]
        part += _adjoint_step(ir, adj, j, -j, carried, masked)
        block += _guarded(j, part)
    return block


def _chunk_in_scratch(ir: ScanIR, adj: Adjoint) -> list[str]:
    """CHUNK > UNROLL: replay the chunk's prefixes into the per-lane scratch rows, then walk back in
    blocks of UNROLL steps reading each step's previous prefix from scratch."""
    chunk = [_store(_scratch(ir, name, "0"), f"k_{name}", "lane_ok") for name in _free(ir)]
    stages = tuning.current().loop_stages_backward
    chunk += _split_blocks(_replay_block(ir, False), _replay_block(ir, True), "s0", stages) + ["tl.debug_barrier()"]
    chunk += [f"nq_{f} = c_{f}" for f in ir.fields]   # the prefix at the chunk's last step
    chunk += _split_blocks(_walk_block(ir, adj, False), _walk_block(ir, adj, True), "ss0", stages)
    return chunk + ["tl.debug_barrier()"]


def _registers_block(ir: ScanIR, adj: Adjoint, masked: bool) -> list[str]:
    """The whole chunk as one block at fixed positions j (memory index tt + j * step)."""
    MAX_UNROLL = tuning.current().max_unroll
    const = dict(ir.constants)
    chunk = []
    for j in range(MAX_UNROLL):
        lines, lmask, smask, _ = _masks(j, "0", masked)
        part = lines + _load_lift(ir, str(j), j, lmask, smask, masked)
        part += _grad_loads(ir, j, j, lmask, smask)
        chunk += _guarded(j, part)
    for j in range(MAX_UNROLL):
        _, _, _, live = _masks(j, "0", masked)
        part = _advance(ir, f"u{j}_" + "{}", f"e{j}_" + "{}", {})
        part += _keep([f"c_{f}" for f in _free(ir)], live)
        part += [f"r{j}_{f} = c_{f}" for f in _free(ir)]
        chunk += _guarded(j, part)
    carried = [f"{c}_{f}" for c in _carried_adjoint(adj) for f in ir.fields]
    for j in reversed(range(MAX_UNROLL)):
        prev = [f"q{j}_{f} = " + (f"k_{f}" if f in const or j == 0 else f"r{j - 1}_{f}") for f in ir.fields]
        part = prev + _step_inputs(ir, j) + [f"p_{f} = " + (f"k_{f}" if f in const else f"r{j}_{f}") for f in ir.fields]
        part += _adjoint_step(ir, adj, j, j, carried, masked)
        chunk += _guarded(j, part)
    return chunk


def _chunk_in_registers(ir: ScanIR, adj: Adjoint) -> list[str]:
    """CHUNK == UNROLL: the chunk is one block; its prefixes stay in registers (r<j>_<field>) and its
    inputs and elements are reused by the walk back, so nothing goes through scratch memory. A full
    chunk runs unmasked; a partial one masks the positions past its end."""
    return [*_block_index("0"), "if n_steps == CHUNK:", *_indent(_registers_block(ir, adj, False), 4),
            "else:", *_indent(_registers_block(ir, adj, True), 4)]


def render_backward_lanes(ir: ScanIR, adj: Adjoint) -> list[str]:
    adj = _composed_adjoint(ir, adj)
    consts = (["BLOCK_L", "R", "EVEN_L", "CHUNK", "UNROLL", "REVERSE", "HAS_INIT", "HAS_DFINAL", "VARLEN", "STATE",
               "FP64", "RCP_APPROX"] + [f"DU{i}" for i in range(len(ir.inputs))])
    body = _prologue()
    body.append("scratch_lane = scratch_ptr + (seq * tl.num_programs(0) + pid).to(tl.int64) * "
                f"((CHUNK + 1) * {len(_free(ir))} * BLOCK_L) + r_idx * (BLOCK_L // R) + tl.arange(0, BLOCK_L // R)[None, :]")
    for i in range(len(ir.inputs)):
        body += _offsets(f"u{i}") + _offsets(f"du{i}") + _offsets(f"du{i}", per_group=True)
        body.append(f"acc{i} = to_acc(tl.zeros({SHAPE}, tl.float32), FP64)")
    for o in range(len(ir.outputs)):
        body += _offsets(f"g{o}")
    body += _static_loads(ir)
    for f, name in enumerate(ir.fields):   # dL/dfinal handed to the last step (in cd, else in bd)
        body += [f"{c}_{name} = to_acc(tl.zeros({SHAPE}, tl.float32), FP64)" for c in _carried_adjoint(adj)]
        dfinal = _load(f"dfinal_ptr + ({f} * n_seq + seq) * L + lane", "lane_ok", "0.0")
        body += ["if HAS_DFINAL:", f"    {_carried_adjoint(adj)[0]}_{name} += to_acc({dfinal}, FP64)"]
    chunk = ["k = n_chunks - 1 - kk", "n_steps = tl.minimum(CHUNK, seq_len - k * CHUNK)"]
    const = dict(ir.constants)
    for f, (name, ident) in enumerate(zip(ir.fields, ir.identity)):
        if name in const:
            chunk.append(f"k_{name} = to_acc(tl.full({SHAPE}, {_num(const[name])}, tl.float64), FP64)")
        else:
            ckpt = _load(f"ckpt_ptr + ({f} * n_slots + slot0 + k) * L + lane", "lane_ok", _num(ident))
            chunk.append(f"k_{name} = to_acc({ckpt}, FP64)")
        chunk.append(f"c_{name} = k_{name}")
    chunk += ["if CHUNK == UNROLL:", *_indent(_chunk_in_registers(ir, adj), 4),
              "else:", *_indent(_chunk_in_scratch(ir, adj), 4)]
    body.append("for kk in range(0, n_chunks):")
    body += _indent(chunk, 4)
    for i in range(len(ir.inputs)):
        body += [f"if DU{i} == 2:",
                 "    " + _store(f"pdu{i} + du{i}_r", f"acc{i}.to(du{i}_ptr.dtype.element_ty)", "lane_ok", atomic=True)]
    body.append("if HAS_INIT:")   # dL/d(initial) = c_0 + B_0 gbar_0 (dL/dfinal when the sequence is empty)
    for f, name in enumerate(ir.fields):
        body.append("    " + _store(f"dinit{f}_ptr + seq * L + lane",
                                       " + ".join(f"{c}_{name}" for c in _carried_adjoint(adj)), "lane_ok"))
    sig = ", ".join(backward_args(ir) + ["scratch_ptr"] + [f"{c}: tl.constexpr" for c in consts]
                    + lanes_flags(ir, True))
    return ["@triton.jit", f"def scan_backward_lanes({sig}):",
            f'    """Backward of {E.docstring_text(ir.name)}, lane-sequential: replay each chunk (in registers when CHUNK == UNROLL, '
            'else into scratch), step the adjoint back."""',
            *_indent(body, 4)]
