"""The lane-sequential schedule (README, "Two schedules"): lanes in registers, time stepped one at a time.

Built on the kernel IR (kernel/ir.py) and printed by the one printer (kernel/printer.py): statements
are IR nodes, expressions source text inside `Expr`. This file: the layout, memory, step and block
helpers and `scan_forward_lanes`; kernel/lanes_adjoint.py: `scan_backward_lanes`.

Lane layout. A program owns BLOCK_L lanes held as [R, BLOCK_L // R] tensors: column g is a thread
slot holding the R consecutive lanes slot..slot + R - 1 (slot = pid * BLOCK_L + g * R) in registers
(Triton's default layout puts the whole first axis in one thread when BLOCK_L // R >= the threads).
R (constexpr, runtime.lanes_per_thread) divides STATE, so a group's STATE lanes are STATE // R
adjacent slots: its sum over the state is R - 1 adds in registers and log2(STATE // R) shuffles, and
an input constant over the state (v, prec of the Kalman program: constexpr SLOT<i>) is loaded once
per slot. Addresses: per slot a base pointer computed once, per lane a register offset r * stride
(an immediate when the stride is 1), per block of steps one scalar `index * time stride` with the
block's steps at constant (immediate) offsets from it (`time`).

Memory. Every load, store and atomic goes through the lane (or slot) tensor reshaped to 1-D
(`lane_load`, `lane_store`): a 1-D access has one order, so Triton's coalescing keeps the layout the [R, G]
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
  compile-time strides, `lanes_adjoint._scratch`; a barrier separates writing and reading them). Then it steps the
  adjoint
  backwards one step at a time (scanlang/autodiff.py):

      gbar_t = direct(p_t, dy_t + c_{t+1} [+ dL/dfinal at the last step]) + B_{t+1} gbar_{t+1}
      dx_t   = J2(y_{t-1}, x_t)^T gbar_t,  du_t = (d lift/du)^T dx_t + (d readout/du)^T g_t

  Step t hands its successor-side terms down to step t - 1 as two carried vectors: `cd` = c_t
  (the readout at t differentiated in its previous prefix) and `bd` = B_t gbar_t (B_t the adjoint
  transition J1(y_{t-1}, x_t)^T in its sparse form). At t = 0 they sum to dL/d(initial). The
  prefix y_t of a step is its successor's previous prefix (carried as `nq`), so each step reads
  one scratch row. A readout that does not use the previous prefix (c = 0) carries `bd` alone.
  When the step composes with the lift (`composed_step`), so does the adjoint
  (`lanes_adjoint.composed_adjoint`): B's entries and du = (dF/du)^T gbar + (d readout/du)^T g over the inputs
  and prefixes, simplified with the lift in view, and no dx.
- Both: an input constant in time (a broadcast static parameter, time stride 0: constexpr
  TSTATIC<i>) is loaded once per program; the fields of a specialised carry (`ir.constants`,
  scanlang/ir.py `specialize_carry`) are literals, never stored, loaded or carried. The combine is
  rendered in place, and every step inverts each distinct denominator once (`common.assign_inverted`): with
  constexpr RCP_APPROX (float32 on a GPU) by the hardware reciprocal, else by a division. The
  forward stores checkpoints only when a backward will read them (constexpr CKPT).
"""
from __future__ import annotations

import functools

import sympy

from scanlang import expr as E
from scanlang import tuning
from scanlang.ir import ScanIR

from ..codegen import _symbols_named, forward_args
from . import builders as B
from .builders import when
from . import common
from .common import assign_inverted
from . import ir as K

SHAPE = "[R, BLOCK_L // R]"   # a lane tensor: R lanes per thread slot, BLOCK_L // R slots
SLOTS = "[1, BLOCK_L // R]"   # a slot tensor: one value per thread slot


# --- small statement helpers ---

def chain(branches, orelse=()) -> K.If:
    """`if c0: b0 elif c1: b1 ... else: orelse` from (condition, body) pairs."""
    (cond, body), *rest = branches
    return when(cond, body, (chain(rest, orelse),) if rest else orelse)


def _flat(x: str, per_slot: bool = False) -> str:
    """`x` (a lane tensor, or a slot tensor when `per_slot`) as the 1-D tensor memory is accessed through."""
    return f"tl.reshape({x}, {'(BLOCK_L // R,)' if per_slot else '(BLOCK_L,)'})"


def lane_load(ptr: str, mask: str, other: str, per_slot: bool = False) -> str:
    """A lane (or slot) tensor loaded through flat 1-D pointers (see the module docstring, "Memory")."""
    shape = SLOTS if per_slot else SHAPE
    return f"tl.reshape(tl.load({_flat(ptr, per_slot)}, mask={_flat(mask, per_slot)}, other={other}), {shape})"


def lane_store(ptr: str, value: str, mask: str, per_slot: bool = False, atomic: bool = False):
    """A lane (or slot) tensor stored (or atomically added, relaxed) through flat 1-D pointers."""
    value = _flat(f"tl.broadcast_to({value}, {SLOTS if per_slot else SHAPE})", per_slot)
    node = K.AtomicAdd if atomic else K.Store
    return node(K.expr(_flat(ptr, per_slot)), K.expr(value), K.expr(_flat(mask, per_slot)))


def prologue() -> list:
    """Program = (lane block, sequence), as in the tile schedule."""
    return [
        K.assign("pid", "tl.program_id(0)"),
        K.assign("seq", "tl.program_id(1)"),
        K.assign("r_idx", "tl.arange(0, R)[:, None]"),
        K.assign("slot", "pid.to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L // R)[None, :] * R"),
        K.assign("lane", "slot + r_idx"),
        # constant masks under EVEN_L: the loads and stores below lose them
        when("EVEN_L", [K.assign("slot_ok", "tl.full([1, BLOCK_L // R], 1, tl.int1)"),
                       K.assign("lane_ok", f"tl.full({SHAPE}, 1, tl.int1)")],
            [K.assign("slot_ok", "slot < L"), K.assign("lane_ok", "lane < L")]),
        *B.sequence_bounds(),
        K.assign("n_chunks", "tl.cdiv(seq_len, CHUNK)"),
        K.assign("slot0", "t0 // CHUNK + seq"),
        K.assign("first", "(slot % STATE) == 0"),   # the slot that stores its group's sum
        K.assign("first_group", "slot - pid.to(tl.int64) * BLOCK_L < STATE"),   # the group that adds the groups' sum
        K.assign("first_in_warp", "(slot - pid.to(tl.int64) * BLOCK_L) % (32 * R) < STATE"),   # each warp's first group
        K.assign("slot_in_block", "tl.arange(0, BLOCK_L // R)[None, :]"),   # a warp's slots: 32 consecutive
    ]


def guarded(j: int, stmts) -> list:
    """Block step j exists when j < UNROLL (a constexpr: the other copies are not compiled)."""
    return list(stmts) if j == 0 else [when(f"{j} < UNROLL", stmts)]


def block_index(first: str) -> list:
    """tt: the memory index of scan step t = k * CHUNK + `first` (backwards in memory when REVERSE);
    step j of the block is at tt + j * step (forward walk) or tt - j * step (backward walk)."""
    return [K.assign("t", f"k * CHUNK + {first}"), *B.memory_index()]


def offsets(prefix: str, per_group: bool = False) -> list:
    """p<prefix>: the slots' base pointers [1, G]; <prefix>_r: the lanes' offsets from them [R, 1]
    (lane dims D0..D3, last fastest; R divides D3). `per_group`: the group's address (lane // STATE
    over dims D0..D2), for values summed over the state."""
    if per_group:
        return [K.assign(f"p{prefix}g", f"{prefix}_ptr + lane_offsets(slot // STATE, D1, D2, 1, {prefix}_s0, {prefix}_s1, "
                                  f"{prefix}_s2, {prefix}_s3)")]
    return [K.assign(f"p{prefix}", f"{prefix}_ptr + lane_offsets(slot, D1, D2, D3, {prefix}_s0, {prefix}_s1, {prefix}_s2, "
                             f"{prefix}_s3)"), K.assign(f"{prefix}_r", f"r_idx * {prefix}_s3")]


def time(buffer: str, shift: int) -> str:
    """` + <offset of memory index tt + shift * step>` in `buffer`'s elements: tt's offset plus a constant
    one, so every step of a block shares one address and the constant becomes the access's immediate
    (offset arithmetic on (tt + shift) is not folded)."""
    if shift == 0:
        return f" + tt * TS_{buffer}"
    return f" + tt * TS_{buffer} + ({'+' if shift > 0 else '-'}{abs(shift)} * step * TS_{buffer})"


def at(prefix: str, shift: int, per_slot: bool = False) -> str:
    """Pointers of `prefix` at memory index tt + shift * step: per lane [R, G], or per slot [1, G]."""
    base = f"p{prefix}{time(prefix, shift)}"
    return base if per_slot else f"{base} + {prefix}_r"


def masks(j: int, first: str, masked: bool) -> tuple[list, str, str, str]:
    """(statements, lane mask, slot mask, live flag) of block step j. Full blocks: the lane masks only
    (constant true under EVEN_L); a masked block: also the step's existence (first + j < n_steps)."""
    if not masked:
        return [], "lane_ok", "slot_ok", ""
    return ([K.assign(f"live{j}", f"{first} + {j} < n_steps"),
             K.assign(f"ok{j}", f"lane_ok & (lane * 0 + {j} < n_steps - {first})"),
             K.assign(f"oks{j}", f"slot_ok & (slot * 0 + {j} < n_steps - {first})")],
            f"ok{j}", f"oks{j}", f"live{j}")


def load_lift(ir: ScanIR, tag: str, shift: int, lane_mask: str, slot_mask: str, masked: bool,
              lift: bool = True) -> list:
    """Load the inputs at memory index tt + shift * step (once per slot for SLOT<i>, once per program for
    TSTATIC<i>), lift them (when `lift`): u{tag}_<input>, e{tag}_<field>; masked lanes get the identity."""
    body = []
    for i, n in enumerate(ir.inputs):
        u = f"u{tag}_{n}"
        per_slot = lane_load(at(f"u{i}", shift, True), slot_mask, "1.0", True)
        per_lane = lane_load(at(f"u{i}", shift), lane_mask, "1.0")
        body.append(chain([(f"TSTATIC{i}", [K.assign(u, f"us{i}")]), (f"SLOT{i}", [K.assign(u, f"to_acc({per_slot}, FP64)")])],
                          [K.assign(u, f"to_acc({per_lane}, FP64)")]))
    if not lift:
        return body
    return body + list(B.lift(ir, tag, lane_mask if masked else None))


def static_loads(ir: ScanIR) -> list:
    """us<i>: input i loaded once per program when it is constant in time (constexpr TSTATIC<i>)."""
    out = []
    for i in range(len(ir.inputs)):
        per_slot = lane_load(f"pu{i}", "slot_ok", "1.0", True)
        per_lane = lane_load(f"pu{i} + u{i}_r", "lane_ok", "1.0")
        out.append(when(f"TSTATIC{i}", [when(f"SLOT{i}", [K.assign(f"us{i}", f"to_acc({per_slot}, FP64)")],
                                             [K.assign(f"us{i}", f"to_acc({per_lane}, FP64)")])]))
    return out


def lanes_flags(ir: ScanIR, backward: bool) -> tuple[K.Param, ...]:
    """The per-buffer constexpr parameters: TS_<buffer>, its time stride (so a block's steps are
    immediate offsets from one pointer; the runtime stride arguments go unused); per input
    TSTATIC<i> (constant in time) and SLOT<i> (constant over the R lanes of a slot: lane stride 0
    along the last lane dim), default False."""
    per_step = ([f"u{i}" for i in range(len(ir.inputs))]
                + ([f"g{o}" for o in range(len(ir.outputs))] + [f"du{i}" for i in range(len(ir.inputs))] if backward
                   else [f"o{o}" for o in range(len(ir.outputs))]))
    flags = [f"{flag}{i}" for flag in ("TSTATIC", "SLOT") for i in range(len(ir.inputs))]
    return B.params((), [f"TS_{b}" for b in per_step]) + tuple(K.Param(f, True, K.expr(False)) for f in flags)


def keep(names, live: str) -> list:
    """Carried values advance (only on live steps in a masked block: its tail keeps them)."""
    if not live:
        return [K.assign(n, f"{n}_new") for n in names]
    return [K.assign(n, f"tl.where({live}, {n}_new, {n})") for n in names]


def free(ir: ScanIR) -> list[str]:
    """The carried fields: all but the constants of a specialised carry (ir.specialize_carry)."""
    const = dict(ir.constants)
    return [f for f in ir.fields if f not in const]


def _combine_inline(ir: ScanIR, out: str, left: str, right: str, recips: dict) -> list:
    """`out` = combine(`left`, `right`) (formats for one name per field; left the earlier operand)
    rendered in place, renormalised by the scale for projective monoids (the generated `combine`)."""
    names = ({s: left.format(f) for s, f in zip(ir.earlier, ir.fields)}
             | {s: right.format(f) for s, f in zip(ir.later, ir.fields)})
    outs = [out.format(f) for f in ir.fields]
    if not ir.is_projective:
        return list(assign_inverted(outs, ir.combine, names, "_c", recips=recips, shape_like=left.format(ir.fields[0])))
    raw = [f"_m_{f}" for f in ir.fields]
    body = list(assign_inverted(raw, ir.combine, names, "_c", recips=recips, shape_like=left.format(ir.fields[0])))
    body += common.assign(["_scale"], [ir.scale], dict(zip(ir.scale_symbols, raw)), "_s")
    body.append(K.assign("_inv_scale", "reciprocal(_scale, RCP_APPROX)"))
    return body + [K.assign(o, f"{m} * _inv_scale") for o, m in zip(outs, raw)]


def cost(exprs) -> int:
    """Operations after common subexpressions are shared (how the renderer prints them)."""
    reps, reduced = sympy.cse(list(exprs), optimizations=None, order="canonical")
    return sum(sympy.count_ops(v) for _, v in reps) + sum(sympy.count_ops(e) for e in reduced)


def cheapest(exprs) -> list:
    """The same expressions as printed with the fewest operations: as given, over common
    denominators (sympy.together) or factored (sympy.factor); expressions over 300 operations stay."""
    return list(_cheapest_of(tuple(sympy.sympify(e) for e in exprs)))


@functools.lru_cache(maxsize=1024)
def _cheapest_of(exprs: tuple) -> tuple:
    if not exprs or any(sympy.count_ops(e) > 300 for e in exprs):
        return exprs
    candidates = [exprs, tuple(sympy.together(e) for e in exprs), tuple(sympy.factor(e) for e in exprs)]
    return min(candidates, key=cost)   # the first of equal costs: as given


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
    return split if cost([split]) < cost([expr]) else expr


def composed_step(ir: ScanIR):
    """The carried fields' update combine(carry, lift(u)) as one expression per free field over the
    carry (earlier symbols) and the inputs, each split at zero carry; None for a projective monoid
    (its renormalisation stays with the combine)."""
    if ir.is_projective:
        return None
    const = dict(ir.constants)
    lift = dict(zip(ir.later, ir.lift))
    carry = {x for x, f in zip(ir.earlier, ir.fields) if f not in const}
    return [_split_at_zero_carry(sympy.sympify(ir.combine[ir.fields.index(f)]).xreplace(lift), carry)
            for f in free(ir)]


def advance(ir: ScanIR, inputs: str, elements: str, recips: dict) -> list:
    """c_<field>_new for the free fields: the composed step (inputs named by the format `inputs`),
    else the combine of the carry with the lifted elements (format `elements`)."""
    step = composed_step(ir)
    if step is None:
        return _combine_inline(ir, "c_{}_new", "c_{}", elements, recips)
    names = ({x: f"c_{f}" for x, f in zip(ir.earlier, ir.fields)}
             | {s: inputs.format(s.name[2:]) for s in ir.input_symbols})
    return list(assign_inverted([f"c_{f}_new" for f in free(ir)], step, names, "_c", recips=recips,
                                shape_like=f"c_{ir.fields[0]}"))


def state_sum(value: str) -> str:
    """Each group's sum over its STATE lanes of a lane tensor [R, G], on every slot of the group
    ([1, G]): in registers, then across the group's STATE // R adjacent slots. No layout change."""
    per_slot = f"tl.sum(tl.broadcast_to({value}, {SHAPE}), 0, keep_dims=True)"
    split = "(1, BLOCK_L // STATE, STATE // R)"
    return (f"tl.reshape(tl.broadcast_to(tl.sum(tl.reshape({per_slot}, {split}), 2, keep_dims=True), {split}), "
            "(1, BLOCK_L // R))")


# Software-pipelining depth of the loops over full blocks, per pass: tuning.loop_stages_forward /
# loop_stages_backward (render-time: in the program key). With N > 1 the loop is
# `tl.range(..., num_stages=N)`: Triton issues the loads of the next N - 1 blocks (cp.async into shared
# memory) while the current block's chain runs, for more instructions and registers.
# (Offline counts and timings: BENCHMARKS_HISTORY.md, "Notes moved from code comments".)


def split_blocks(full, masked, start: str, stages: int = 1) -> list:
    """The chunk's full blocks of UNROLL steps (loop variable `start`, software-pipelined `stages`
    deep), then its partial last block."""
    loop = K.For(start, K.expr(0), K.expr("n_steps - (UNROLL - 1)"), tuple(full), step=K.expr("UNROLL"),
                 builtin=stages == 1, num_stages=None if stages == 1 else K.expr(stages))
    return [loop, K.assign(start, "n_steps - n_steps % UNROLL"), when(f"{start} < n_steps", masked)]


def _forward_block(ir: ScanIR, masked: bool) -> list:
    max_unroll = tuning.current().max_unroll
    block = block_index("s0")
    for j in range(max_unroll):   # loads first: nothing below depends on the carry
        stmts, lmask, smask, _ = masks(j, "s0", masked)
        block += guarded(j, stmts + load_lift(ir, str(j), j, lmask, smask, masked, lift=composed_step(ir) is None))
    names = ({s: f"c_{s.name[2:]}" for s in ir.prefix_symbols} | {s: s.name for s in ir.previous_symbols}
             | _symbols_named(ir.input_symbols, "u_{}"))
    for j in range(max_unroll):   # then the dependent chain: combine (or composed step), readout, store
        _, lmask, smask, live = masks(j, "s0", masked)
        part = [K.assign(f"u_{n}", f"u{j}_{n}") for n in ir.inputs]
        if ir.uses_previous:
            part += [K.assign(f"q_{f}", f"c_{f}") for f in ir.fields]
        part += advance(ir, "u_{}", f"e{j}_" + "{}", {})
        part += keep([f"c_{f}" for f in free(ir)], live)
        part += assign_inverted([f"r{o}" for o in range(len(ir.outputs))], ir.readout, names, "_r", recips={},
                                shape_like=f"c_{ir.fields[0]}")
        for o in range(len(ir.outputs)):
            cast = f".to(o{o}_ptr.dtype.element_ty)"
            if ir.reduce_state:
                part.append(lane_store(at(f'o{o}', j, True), f"{state_sum(f'r{o}')}{cast}", f"{smask} & first",
                                   per_slot=True))
            else:
                part.append(lane_store(at(f'o{o}', j), f"r{o}{cast}", lmask))
        block += guarded(j, part)
    return block


FORWARD_CONSTEXPRS = ("BLOCK_L", "R", "EVEN_L", "CHUNK", "UNROLL", "REVERSE", "HAS_INIT", "VARLEN", "STATE", "FP64",
                      "RCP_APPROX", "CKPT")


def render_forward_lanes(ir: ScanIR) -> K.Kernel:
    """`scan_forward_lanes`: each program walks its lanes through the sequence one step at a time."""
    body = prologue()
    for i in range(len(ir.inputs)):
        body += offsets(f"u{i}")
    for o in range(len(ir.outputs)):
        body += offsets(f"o{o}", per_group=ir.reduce_state)
    if ir.reduce_state:
        body += [K.assign(f"po{o}", f"po{o}g") for o in range(len(ir.outputs))]
    body += static_loads(ir)
    body += B.initial_carry(ir, SHAPE)
    ckpt = "ckpt_ptr + ({} * n_slots + slot0 + k) * L + lane"
    chunk = [when("CKPT", [lane_store(ckpt.format(f), f"c_{name}", "lane_ok")
                          for f, name in enumerate(ir.fields) if name in free(ir)])]
    chunk.append(K.assign("n_steps", "tl.minimum(CHUNK, seq_len - k * CHUNK)"))
    chunk += split_blocks(_forward_block(ir, masked=False), _forward_block(ir, masked=True), "s0",
                          tuning.current().loop_stages_forward)
    body.append(K.For("k", K.expr(0), K.expr("n_chunks"), tuple(chunk), builtin=True))
    for f, name in enumerate(ir.fields):
        body.append(lane_store(f"final_ptr + ({f} * n_seq + seq) * L + lane", f"c_{name}", "lane_ok"))
    sig = B.params(forward_args(ir), FORWARD_CONSTEXPRS) + lanes_flags(ir, False)
    return K.Kernel("scan_forward_lanes", sig, tuple(body), origin=common.origins(ir),
                    doc=f"Forward fused scan of {E.docstring_text(ir.name)}, lane-sequential: one combine per step and lane, "
                        "in registers.")
