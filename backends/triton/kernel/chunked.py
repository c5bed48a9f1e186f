"""The chunk-parallel schedule: for few lanes and a long time axis (prefill at batch 1).

The tile schedule gives every lane block one program that walks all of T, so a scan over 16 lanes
keeps 16 programs busy. Here time is cut into chunks of BLOCK_T steps and each (chunk, lane block)
is its own program; three kernels per pass, each a `tl.associative_scan` over one [BLOCK_T, BLOCK_L]
tile (time down the rows):

forward, y_t = y_{t-1} (+) x_t with y_{-1} = initial or the identity e:
    chunk_reduce   A_c = x_{cB} (+) ... (+) x_{cB+B-1}                 reads the inputs; writes A_c
    chunk_carry    P_0 = y_{-1}, P_{c+1} = P_c (+) A_c                  one program per lane block;
                   P_c (the carry into chunk c) is stored as the backward's checkpoint c, and
                   P_{n} as the final prefix
    chunk_rescan   y_t = P_c (+) x_{cB} (+) ... (+) x_t, out_t = readout(y_t, u_t)   reads inputs,
                   writes outputs once
backward, the same three phases on the adjoint's reverse affine scan gbar_t = v_t + M_{t+1} gbar_{t+1}
(v_t = the direct gradient of y_t, M_t = J1(y_{t-1}, x_t)^T; scanlang/autodiff.py). Every row reads only
its own step: M_t comes from the row's own element x_t and the previous prefix y_{t-1}, and y_{t-1} from
one scan over (aggregate, aggregate-but-last) pairs (common.prefix_pair_combine), so no input is loaded
shifted by a step (a shifted tile is unaligned: scalar loads, which made the L1 the H100's bottleneck).
The carry between chunks runs in z_t = M_t gbar_t, what row t hands to row t - 1:
    chunk_bwd_reduce  replays y over the chunk from checkpoint c, forms (M_t, M_t v_t) and reduces them
                      by the reverse affine scan z_t = M_t v_t + M_t z_{t+1} to (M_c, V_c) with
                      Z_c = V_c + M_c Z_{c+1} (Z_c = z at the chunk's first step)
    chunk_bwd_carry   Z_c = V_c + M_c Z_{c+1}, Z_n = 0, in reverse over the chunks (all n + 1 stored)
    chunk_bwd_rescan  replays y and y_{t-1}, scans the rows as (F, c, L) segments
                      (common.adjoint_exclusive_combine) so gbar_t = c_t + F_t Z_{c+1}, then
                      dx = J2(y_{t-1}, x_t)^T gbar_t, the input gradients (stored, atomically added where
                      an input is broadcast over lanes, summed over the chunk where it is constant in
                      time) and, in chunk 0, dL/dinitial = c_0 + M_0 gbar_0.
An upstream gradient constant in time (an output the loss does not use, or a plain sum) is loaded once
per lane (constexpr GSTATIC<j>).
kernel/chunked_lookback.py is the same schedule in one kernel per pass (a decoupled look-back, each
input read once), selected by the tuning knob `chunk_single_pass`.

Time runs backwards in memory when REVERSE is set (index T-1-t). The arguments are those of the tile
kernels (codegen.forward_args / backward_args) plus the aggregate buffers, so checkpoints mean the
same in every schedule: the carry into each piece of CHUNK steps, the backward's chunk. A forward
chunk of BLOCK_T steps spans BLOCK_T // CHUNK of them (one by default in three kernels; four in one
pass, whose look-back waits less on longer chunks) and stores the checkpoints inside it
(`inner_checkpoints`).

Projective monoids: every lifted leaf x_t is scaled by leaf_scale, an exact power of two bringing its
largest field into [1, 2), before any product, as in the other schedules (builders.renormalise_leaf);
the outputs do not change, and the backward multiplies each step's dx by the same factor
(builders.scale_leaf_gradient).

Supported: plain scans (`supports`; the kernels take any lift and a readout that neither uses the
previous prefix nor sums over state lanes), one sequence (no cu_seqlens), T >= 1; other programs
run on the other schedules.
"""
from __future__ import annotations


from scanlang import expr as E
from scanlang.autodiff import Adjoint, matmul, matvec
from scanlang.ir import ScanIR

from ..codegen import backward_args, forward_args
from . import builders as B
from . import common
from .builders import GradMode, grad_mode_is
from . import ir as K
from .printer import render as print_module

FORWARD_KERNELS = ("chunk_reduce", "chunk_carry", "chunk_rescan")
BACKWARD_KERNELS = ("chunk_bwd_reduce", "chunk_bwd_carry", "chunk_bwd_rescan")
KERNELS = FORWARD_KERNELS + BACKWARD_KERNELS


def supports(ir: ScanIR) -> bool:
    """Whether `ir` runs on this schedule: a plain scan (`sl.scan`). The kernels are written for any
    lift and readout that do not use the previous prefix or sum over state lanes, but only plain
    scans are tested on them so far, so mixers keep the other schedules."""
    return ir.is_plain and not (ir.sequential_only or ir.reduce_state or ir.uses_previous)


def _fields(ir, fmt: str) -> str:
    return ", ".join(fmt.format(f) for f in ir.fields)


def _lanes(axis: int) -> tuple:
    """Lane block `pid` of program axis `axis`: lane indices and lane_ok."""
    return (K.assign("pid", f"tl.program_id({axis})"),
            K.assign("lane", "pid.to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L)"),
            K.assign("lane_ok", "lane < L"))


def _offsets(name: str, lanes: str = "lane") -> str:
    return f"lane_offsets({lanes}, D1, D2, D3, {name}_s0, {name}_s1, {name}_s2, {name}_s3)"


def _prologue(tensors) -> tuple:
    """Program (chunk, lane block): rows of the tile, t (scan step), ok, tt (memory index), and
    the lane offsets of `tensors`."""
    body = [K.assign("chunk", "tl.program_id(0)"), *_lanes(1), K.assign("n_chunks", "tl.cdiv(T, BLOCK_T)"),
            K.assign("rows", "tl.arange(0, BLOCK_T)[:, None]"), K.assign("t", "chunk.to(tl.int64) * BLOCK_T + rows"),
            K.assign("ok", "(t < T) & lane_ok[None, :]"),
            K.If(K.expr("REVERSE"), (K.assign("tt", "T - 1 - t"),), (K.assign("tt", "t"),))]
    body += [K.assign(f"{n}_off", f"{_offsets(n)}[None, :]") for n in tensors]
    return tuple(body)


def _scan_from(ir: ScanIR, elems: str, out: str, carry: str, reverse_note: str = "") -> tuple:
    """{out}_<field> = carry (+) the inclusive scan of {elems}_<field> down the rows."""
    scanned = tuple(f"s{out}_{f}" for f in ir.fields)
    args = _fields(ir, elems + "_{}")
    value = (f"tl.associative_scan(({args}), 0, combine)" if len(ir.fields) > 1
             else f"tl.associative_scan({args}, 0, combine)")
    return (K.Comment(f"the prefixes of the tile from {carry}: the combine, in scan order{reverse_note}"),
            K.Assign(scanned, K.expr(value)),
            K.Assign(tuple(f"{out}_{f}" for f in ir.fields),
                     K.expr(f"combine({_fields(ir, carry + '_{}[None, :]')}, {', '.join(scanned)})")))


def _row(src: str, row: str, rows: str = "rows") -> str:
    """One row of a tile as a lane vector (a masked sum: exact, whatever the other rows hold)."""
    return f"tl.sum(tl.where({rows} == {row}, {src}, 0.0), 0)"


def _carry_from(ir: ScanIR, ptr: str, slot: str, mask: str = "lane_ok") -> tuple:
    """c_<field>: the checkpoint (carry into a chunk) at `slot`."""
    return tuple(K.Load(f"c_{f}", K.expr(f"{ptr} + ({k} * n_slots + {slot}) * L + lane"), K.expr(mask),
                        K.expr(common.number(i))) for k, (f, i) in enumerate(zip(ir.fields, ir.identity)))


def carry_slot(chunk: str) -> str:
    """The checkpoint slot of the carry into chunk `chunk`: checkpoints are every CHUNK steps (the
    backward's chunk), BLOCK_T // CHUNK of them per forward chunk; the carry out of the last chunk
    (the final prefix) is the last slot (plan.checkpoint_shape: n_chunks * BLOCK_T // CHUNK + 1 slots).
    No clamp: a clamped slot in the one-pass forward's publish and look-back cost it 8% on an H100."""
    return f"{chunk} * (BLOCK_T // CHUNK)"


def inclusive_slot(chunk: str) -> str:
    """The slot of the carry out of chunk `chunk` (into the next)."""
    return carry_slot(f"({chunk} + 1)")


def inner_checkpoints(ir: ScanIR, prefix: str = "p") -> tuple:
    """When the checkpoint interval CHUNK is shorter than the forward's chunk (a forward serving a
    backward): the prefix ending each CHUNK-step piece of the tile, {prefix}_<field> at its last row, is
    the checkpoint of the next piece (the next chunk's is the inclusive prefix, stored by the caller).
    A store of every row, masked to those rows: on an H100 it cost the one-pass forward 8% (0.111 ->
    0.120 ms), taking the rows out by masked sums (per piece, or of a [pieces, CHUNK, BLOCK_L] view)
    16-17%."""
    sub = "ok & ((rows + 1) % CHUNK == 0) & (rows + 1 < BLOCK_T) & (t + 1 < T)"
    stores = tuple(K.Store(K.expr(f"ckpt_ptr + ({k} * n_slots + {carry_slot('chunk')} + (rows + 1) // CHUNK) * L + lane[None, :]"),
                           K.expr(f"{prefix}_{f}"), K.expr(sub)) for k, f in enumerate(ir.fields))
    return (K.If(K.expr("CHUNK < BLOCK_T"), (K.Comment("checkpoints inside the chunk, every CHUNK steps"), *stores)),)


def _initial(ir: ScanIR) -> tuple:
    """c_<field>: the initial element of each lane, else the identity."""
    loads = tuple(K.Load(f"c_{f}", K.expr(f"init{k}_ptr + {_offsets(f'init{k}')}"), K.expr("lane_ok"),
                         K.expr(common.number(i))) for k, (f, i) in enumerate(zip(ir.fields, ir.identity)))
    idents = tuple(K.assign(f"c_{f}", f"to_acc(tl.full([BLOCK_L], {common.number(i)}, tl.float64), FP64)")
                   for f, i in zip(ir.fields, ir.identity))
    return (K.If(K.expr("HAS_INIT"), loads, idents),)


def _params(args, consts) -> tuple:
    return tuple(K.Param(a) for a in args) + tuple(K.Param(c, constexpr=True) for c in consts)


FWD_CONSTS = ("BLOCK_T", "BLOCK_L", "BLOCK_C", "CHUNK", "REVERSE", "HAS_INIT", "FP64")


def _forward_kernels(ir: ScanIR, origin) -> list[K.Kernel]:
    params = _params(forward_args(ir) + ["agg_ptr"], FWD_CONSTS)
    ins = [f"u{i}" for i in range(len(ir.inputs))]
    name = E.docstring_text(ir.name)
    reduce = _prologue(ins) + B.load_lift(ir) + (
        K.Comment("the chunk's aggregate: the inclusive scan's last valid row"),
        K.Assign(tuple(f"s_{f}" for f in ir.fields),
                 K.expr(f"tl.associative_scan(({_fields(ir, 'e_{}')}), 0, combine)" if len(ir.fields) > 1
                        else f"tl.associative_scan(e_{ir.fields[0]}, 0, combine)")),
        K.assign("last", "tl.minimum(T - 1 - chunk * BLOCK_T, BLOCK_T - 1)"),
    ) + tuple(K.Store(K.expr(f"agg_ptr + ({k} * n_chunks + chunk) * L + lane"), K.expr(_row(f"s_{f}", "last")),
                      K.expr("lane_ok")) for k, f in enumerate(ir.fields))
    carry_loop = (K.assign("j", "k * BLOCK_C + crow"), K.assign("okc", "(j < n_chunks) & lane_ok[None, :]"))
    carry_loop += tuple(K.Load(f"a_{f}", K.expr(f"agg_ptr + ({k} * n_chunks + j) * L + lane[None, :]"), K.expr("okc"),
                               K.expr(common.number(i))) for k, (f, i) in enumerate(zip(ir.fields, ir.identity)))
    carry_loop += _scan_from(ir, "a", "p", "c")
    carry_loop += tuple(K.Store(K.expr(f"ckpt_ptr + ({k} * n_slots + {inclusive_slot('j')}) * L + lane[None, :]"), K.expr(f"p_{f}"),
                                K.expr("okc")) for k, f in enumerate(ir.fields))
    carry_loop += (K.assign("last", "tl.minimum(n_chunks - 1 - k * BLOCK_C, BLOCK_C - 1)"),)
    carry_loop += tuple(K.assign(f"c_{f}", _row(f"p_{f}", "last", "crow")) for f in ir.fields)
    carry = (*_lanes(0), K.assign("n_chunks", "tl.cdiv(T, BLOCK_T)"),
             K.assign("crow", "tl.arange(0, BLOCK_C)[:, None]"),
             *_initial(ir),
             K.Comment("checkpoint c = the carry into chunk c (slot 0: the initial element itself)"),
             *(K.Store(K.expr(f"ckpt_ptr + {k} * n_slots * L + lane"), K.expr(f"c_{f}"), K.expr("lane_ok"))
               for k, f in enumerate(ir.fields)),
             K.For("k", K.expr("0"), K.expr("tl.cdiv(n_chunks, BLOCK_C)"), carry_loop),
             *(K.Store(K.expr(f"final_ptr + {k} * n_seq * L + lane"), K.expr(f"c_{f}"), K.expr("lane_ok"))
               for k, f in enumerate(ir.fields)))
    outs = [f"o{j}" for j in range(len(ir.outputs))]
    names = {s: f"p_{f}" for s, f in zip(ir.prefix_symbols, ir.fields)} | {
        s: f"u_{n}" for s, n in zip(ir.input_symbols, ir.inputs)}
    rescan = (_prologue(ins + outs) + _carry_from(ir, "ckpt_ptr", carry_slot("chunk")) + B.load_lift(ir)
              + _scan_from(ir, "e", "p", "c") + inner_checkpoints(ir)
              + common.assign([f"r{j}" for j in range(len(outs))], ir.readout, names, "_r", shape_like=f"p_{ir.fields[0]}")
              + tuple(K.Store(K.expr(f"o{j}_ptr + o{j}_off + tt * o{j}_st"),
                              K.expr(f"r{j}.to(o{j}_ptr.dtype.element_ty)"), K.expr("ok")) for j in range(len(outs))))
    return [K.Kernel("chunk_reduce", params, reduce, origin=origin,
                     doc=f"Forward of {name}, phase 1 of 3: each chunk of BLOCK_T steps reduced to its aggregate."),
            K.Kernel("chunk_carry", params, carry, origin=origin,
                     doc=f"Forward of {name}, phase 2 of 3: the carry into every chunk (a scan of the aggregates)."),
            K.Kernel("chunk_rescan", params, rescan, origin=origin,
                     doc=f"Forward of {name}, phase 3 of 3: each chunk scanned from its carry, read out, stored.")]


def _grad_loads(ir: ScanIR) -> tuple:
    """g_<output>: the upstream gradient of each row; one value per lane, broadcast down the tile, where
    it is constant in time (constexpr GSTATIC<j>: an output without a gradient, or the gradient of a
    sum), instead of one load per row of the same address."""
    return tuple(K.If(K.expr(f"GSTATIC{j}"),
                      (K.Load(f"g1_{o}", K.expr(f"g{j}_ptr + g{j}_off"), K.expr("lane_ok[None, :]"), K.expr("0.0")),
                       K.assign(f"g_{o}", f"tl.where(ok, g1_{o}, 0.0)")),
                      (K.Load(f"g_{o}", K.expr(f"g{j}_ptr + g{j}_off + tt * g{j}_st"), K.expr("ok"), K.expr("0.0")),))
                 for j, o in enumerate(ir.outputs))


def bwd_consts(ir: ScanIR, *schedule) -> tuple:
    """The backward kernels' constexprs: the schedule's tile sizes, the plan's flags, each input's
    gradient mode DU<i> and each output's GSTATIC<j> (`_grad_loads`)."""
    return (*schedule, "REVERSE", "HAS_INIT", "HAS_DFINAL", "FP64", *(f"DU{i}" for i in range(len(ir.inputs))),
            *(f"GSTATIC{j}" for j in range(len(ir.outputs))))


def _dfinal(ir: ScanIR) -> tuple:
    loads = tuple(K.Load(f"dfin_{f}", K.expr(f"dfinal_ptr + {k} * n_seq * L + lane"), K.expr("lane_ok"),
                         K.expr("0.0")) for k, f in enumerate(ir.fields))
    zeros = tuple(K.assign(f"dfin_{f}", "to_acc(tl.zeros([BLOCK_L], tl.float32), FP64)") for f in ir.fields)
    return (K.If(K.expr("HAS_DFINAL"), loads, zeros),)




def _apply_carry(ir: ScanIR, adj: Adjoint, out: str, carry: str, ra: str = "ra{}", rv: str = "rv{}",
                 lanes: str = "[None, :]") -> tuple:
    """{out}_<field> = rv + R carry: the reverse scan's results continued from the gradient `carry`
    entering from the later steps (R the scanned transition, in the adjoint's sparse form; `ra`, `rv`
    name its entries and the scanned values, `lanes` indexes the carry's lane vector)."""
    n, nb = len(ir.fields), len(adj.b_entries)
    ra, rv = [ra.format(k) for k in range(nb)], [rv.format(i) for i in range(n)]
    gc = [E.symbol(f"{carry}_{f}") for f in ir.fields]
    exprs = [E.symbol(v) + m for v, m in zip(rv, matvec(adj.matrix([E.symbol(r) for r in ra]), gc))]
    names = {E.symbol(r): r for r in ra + rv} | {s: f"{s.name}{lanes}" for s in gc}
    return common.assign([f"{out}_{f}" for f in ir.fields], exprs, names, f"_{out}")


def _du_store(i: int, name: str) -> K.If:
    """du_<name> by the constexpr mode DU<i> (a builders.GradMode, plan._du_mode): STORE, ATOMIC (broadcast
    over lanes), else TIME_SUM: summed over the chunk then added once per lane (constant in time)."""
    ptr = K.expr(f"du{i}_ptr + du{i}_off + tt * du{i}_st")
    value = K.expr(f"du_{name}.to(du{i}_ptr.dtype.element_ty)")
    summed = K.expr(f"tl.sum(tl.where(ok, du_{name}, 0.0), 0).to(du{i}_ptr.dtype.element_ty)")
    return K.If(grad_mode_is(i, GradMode.STORE), (K.Store(ptr, value, K.expr("ok")),),
                (K.If(grad_mode_is(i, GradMode.ATOMIC), (K.AtomicAdd(ptr, value, K.expr("ok")),),
                      (K.AtomicAdd(K.expr(f"du{i}_ptr + {_offsets(f'du{i}')}"), summed, K.expr("lane_ok")),)),))


def _input_gradients(ir: ScanIR, adj: Adjoint) -> tuple:
    """From gbar_* (the adjoint of every row), p_*, q_*, the tile's elements and the transitions m<k>
    (`transitions`): dx = J2(q, x)^T gbar, the input gradients stored by their modes, and in chunk 0
    dL/d(initial)."""
    nb = len(adj.b_entries)
    shape = f"p_{ir.fields[0]}"
    out = []
    names_x = ({s: f"q_{f}" for s, f in zip(ir.previous_symbols, ir.fields)} | {s: s.name for s in adj.gbar}
               | {s: f"e_{f}" for s, f in zip(ir.later, ir.fields)})
    out += common.assign([f"dx_{f}" for f in ir.fields], adj.dx, names_x, "_x", shape_like=shape)
    out += B.scale_leaf_gradient(ir, "dx_{}", "")   # d/d(raw leaf) = inv_leaf d/d(scaled leaf)
    names_u = ({s: f"p_{f}" for s, f in zip(ir.prefix_symbols, ir.fields)}
               | {s: f"q_{f}" for s, f in zip(ir.previous_symbols, ir.fields)}
               | {s: f"u_{m}" for s, m in zip(ir.input_symbols, ir.inputs)} | {g: g.name for g in adj.g}
               | {s: s.name for s in adj.dx_symbols})
    out += common.assign([f"du_{m}" for m in ir.inputs], adj.du, names_u, "_u", shape_like=shape)
    out += [_du_store(i, m) for i, m in enumerate(ir.inputs)]
    gb = [E.symbol(f"gbar_{f}") for f in ir.fields]
    w_exprs = [E.symbol(f"cq_{f}") + m for f, m in zip(ir.fields, matvec(adj.matrix([E.symbol(f"m{k}") for k in range(nb)]), gb))]
    names_w = ({E.symbol(f"cq_{f}"): f"cq_{f}" for f in ir.fields} | {s: s.name for s in gb}
               | {E.symbol(f"m{k}"): f"m{k}" for k in range(nb)})
    init = (K.Comment("dL/d(initial) = c_0 + M_0 gbar_0 (M_0 = J1(y_{-1}, x_0)^T), from row 0 of chunk 0"),
            *common.assign([f"cq_{f}" for f in ir.fields], adj.c, names_u, "_i", shape_like=shape),
            *common.assign([f"w_{f}" for f in ir.fields], w_exprs, names_w, "_w", shape_like=shape),
            *(K.Store(K.expr(f"dinit{k}_ptr + lane"), K.expr(_row(f"w_{f}", "0")), K.expr("lane_ok"))
              for k, f in enumerate(ir.fields)))
    out.append(K.If(K.expr("HAS_INIT"), (K.If(K.expr("chunk == 0"), init),)))
    return tuple(out)


def replay_pairs(ir: ScanIR) -> tuple:
    """p_* (y_t) and q_* (y_{t-1}) of every row from the checkpoint c_* and the tile's own elements e_*:
    one scan over (A, B) pairs (prefix_pair_combine), so no input is loaded shifted by a step. Row 0's
    q is the carry itself (a raw initial element is not renormalised)."""
    e = [f"e_{f}" for f in ir.fields]
    ident = [K.assign(f"id_{f}", f"tl.zeros_like(e_{f})" + ("" if i == 0 else f" + {common.number(i)}"))
             for f, i in zip(ir.fields, ir.identity)]
    sa, sb = [f"sa_{f}" for f in ir.fields], [f"sb_{f}" for f in ir.fields]
    carry = _fields(ir, "c_{}[None, :]")
    return (*ident,
            K.Comment("each row's prefix and the one before it, from the tile's own elements and the carry"),
            K.Assign(tuple(sa + sb), K.expr(f"tl.associative_scan(({', '.join(e + [f'id_{f}' for f in ir.fields])}), "
                                            "0, prefix_pair_combine)")),
            K.Assign(tuple(f"p_{f}" for f in ir.fields), K.expr(f"combine({carry}, {', '.join(sa)})")),
            K.Assign(tuple(f"qs_{f}" for f in ir.fields), K.expr(f"combine({carry}, {', '.join(sb)})")),
            *(K.assign(f"q_{f}", f"tl.where(rows == 0, c_{f}[None, :], qs_{f})") for f in ir.fields))


def transitions(ir: ScanIR, adj: Adjoint) -> tuple:
    """Per row, from p_*, q_* and the row's own elements e_*: the upstream gradients, v_* (the direct
    gradient of y_t, dL/dy_final added on the last step) and m<k>, the entries of M_t = B_t =
    J1(y_{t-1}, x_t)^T, the transition into row t - 1 (0 past the end: nothing flows in from padding)."""
    nb = len(adj.b_entries)
    shape = f"p_{ir.fields[0]}"
    body = list(_grad_loads(ir))
    here = ({s: f"p_{f}" for s, f in zip(ir.prefix_symbols, ir.fields)}
            | {s: f"u_{n}" for s, n in zip(ir.input_symbols, ir.inputs)} | {g: g.name for g in adj.g})
    body += common.assign([f"dy_{f}" for f in ir.fields], adj.dy, here, "_d", shape_like=shape)
    body.append(K.assign("is_last", "t == T - 1"))
    body += [K.assign(f"d_{f}", f"dy_{f} + tl.where(is_last, dfin_{f}[None, :], 0.0)") for f in ir.fields]
    v_names = {s: f"p_{f}" for s, f in zip(ir.prefix_symbols, ir.fields)} | {s: s.name for s in adj.d}
    body += common.assign([f"v_{f}" for f in ir.fields], adj.direct, v_names, "_v", shape_like=shape)
    body += [K.assign(f"v_{f}", f"tl.where(ok, v_{f}, 0.0)") for f in ir.fields]
    m_names = ({s: f"q_{f}" for s, f in zip(ir.previous_symbols, ir.fields)}
               | {s: f"e_{f}" for s, f in zip(ir.later, ir.fields)})
    body.append(K.Comment("M_t = J1(y_{t-1}, x_t)^T from the row's own step"))
    body += common.assign([f"m{k}" for k in range(nb)], adj.b_entries, m_names, "_m", shape_like=shape)
    body += [K.assign(f"m{k}", f"tl.where(ok, m{k}, 0.0)") for k in range(nb)]
    return tuple(body)


def exclusive_adjoint(ir: ScanIR, adj: Adjoint) -> tuple:
    """rf<k>, rc<i>, rl<k>: per row t, the rows from t to the chunk's end as (F, c, L), so that
    gbar_t = c + F Z with Z the z entering after the chunk (common.adjoint_exclusive_combine)."""
    n, nb = len(ir.fields), len(adj.b_entries)
    ident = [1.0 if adj.scalar or i == j else 0.0 for i, j in ([(0, 0)] if adj.scalar else adj.pattern)]
    scanned = ", ".join([f"f{k}" for k in range(nb)] + [f"v_{f}" for f in ir.fields] + [f"m{k}" for k in range(nb)])
    return (*(K.assign(f"f{k}", f"tl.zeros_like(m{k})" + (" + 1.0" if one else "")) for k, one in enumerate(ident)),
            K.Comment("gbar_t = c_t + F_t Z_(c+1): the rows from t to the chunk's end as a map of the z entering after it"),
            K.Assign(tuple([f"rf{k}" for k in range(nb)] + [f"rc{i}" for i in range(n)] + [f"rl{k}" for k in range(nb)]),
                     K.expr(f"tl.associative_scan(({scanned}), 0, adjoint_exclusive_combine, reverse=True)")))


def z_aggregate(ir: ScanIR, adj: Adjoint) -> tuple:
    """am<k>, aw<i> (lane vectors): the chunk as z_(cB) = aw + am Z_(c+1), from row 0 of
    `exclusive_adjoint`: z_(cB) = L (c + F Z), so am = L F and aw = L c."""
    n, nb = len(ir.fields), len(adj.b_entries)
    rows = [K.assign(f"{r}0_{k}", _row(f"r{r}{k}", "0")) for r, count in (("f", nb), ("c", n), ("l", nb)) for k in range(count)]
    lm = adj.matrix([E.symbol(f"l0_{k}") for k in range(nb)])
    am = adj.entries(matmul(lm, adj.matrix([E.symbol(f"f0_{k}") for k in range(nb)])))
    aw = matvec(lm, [E.symbol(f"c0_{k}") for k in range(n)])
    names = {E.symbol(f"{r}0_{k}"): f"{r}0_{k}" for r, count in (("f", nb), ("c", n), ("l", nb)) for k in range(count)}
    return (K.Comment("the chunk's aggregate in z: z at its first step = aw + am Z_(c+1)"), *rows,
            *common.assign([f"am{k}" for k in range(nb)] + [f"aw{i}" for i in range(n)], am + aw, names, "_z"))


def _backward_kernels(ir: ScanIR, adj: Adjoint, origin) -> list[K.Kernel]:
    n, nb = len(ir.fields), len(adj.b_entries)
    consts = bwd_consts(ir, "BLOCK_T", "BLOCK_L", "BLOCK_C")
    params = _params(backward_args(ir) + ["agg_ptr", "gc_ptr"], consts)
    ins = [f"u{i}" for i in range(len(ir.inputs))]
    grads = [f"g{j}" for j in range(len(ir.outputs))]
    name = E.docstring_text(ir.name)
    replay = _carry_from(ir, "ckpt_ptr", "chunk") + B.load_lift(ir) + replay_pairs(ir) + transitions(ir, adj)
    mv = matvec(adj.matrix([E.symbol(f"m{k}") for k in range(nb)]), [E.symbol(f"v_{f}") for f in ir.fields])
    mv_names = {E.symbol(f"m{k}"): f"m{k}" for k in range(nb)} | {E.symbol(f"v_{f}"): f"v_{f}" for f in ir.fields}
    scanned = ", ".join([f"m{k}" for k in range(nb)] + [f"mv{i}" for i in range(n)])
    reduce = (_prologue(ins + grads) + _dfinal(ir) + replay
              + (K.Comment("z_t = M_t gbar_t = M_t v_t + M_t z_(t+1): the reverse affine scan over (M_t, M_t v_t)"),)
              + common.assign([f"mv{i}" for i in range(n)], mv, mv_names, "_mv", shape_like="v_" + ir.fields[0])
              + (K.Assign(tuple([f"ra{k}" for k in range(nb)] + [f"rv{i}" for i in range(n)]),
                          K.expr(f"tl.associative_scan(({scanned}), 0, adjoint_combine, reverse=True)")),
                 K.Comment("(M_c, V_c): z at the chunk's first step = V_c + M_c z at the next chunk's, row 0 of the scan"))
              + tuple(K.Store(K.expr(f"agg_ptr + ({k} * n_chunks + chunk) * L + lane"), K.expr(_row(r, "0")),
                              K.expr("lane_ok"))
                      for k, r in enumerate([f"ra{k}" for k in range(nb)] + [f"rv{i}" for i in range(n)])))
    loop = (K.assign("k", "n_ctiles - 1 - kk"), K.assign("j", "k * BLOCK_C + crow"),
            K.assign("okc", "(j < n_chunks) & lane_ok[None, :]"))
    loop += tuple(K.Load(f"a{k}", K.expr(f"agg_ptr + ({k} * n_chunks + j) * L + lane[None, :]"), K.expr("okc"),
                         K.expr("0.0")) for k in range(nb))
    loop += tuple(K.Load(f"v_{f}", K.expr(f"agg_ptr + ({nb + i} * n_chunks + j) * L + lane[None, :]"), K.expr("okc"),
                         K.expr("0.0")) for i, f in enumerate(ir.fields))
    scanned = ", ".join([f"a{k}" for k in range(nb)] + [f"v_{f}" for f in ir.fields])
    targets = tuple([f"ra{k}" for k in range(nb)] + [f"rv{i}" for i in range(n)])
    loop += (K.Assign(targets, K.expr(f"tl.associative_scan(({scanned}), 0, adjoint_combine, reverse=True)")),)
    loop += _apply_carry(ir, adj, "G", "gc")
    loop += tuple(K.Store(K.expr(f"gc_ptr + ({i} * (n_chunks + 1) + j) * L + lane[None, :]"), K.expr(f"G_{f}"), K.expr("okc"))
                  for i, f in enumerate(ir.fields))
    loop += tuple(K.assign(f"gc_{f}", _row(f"G_{f}", "0", "crow")) for f in ir.fields)
    carry = (*_lanes(0), K.assign("n_chunks", "tl.cdiv(T, BLOCK_T)"),
             K.assign("crow", "tl.arange(0, BLOCK_C)[:, None]"),
             K.assign("n_ctiles", "tl.cdiv(n_chunks, BLOCK_C)"),
             *(K.assign(f"gc_{f}", "to_acc(tl.zeros([BLOCK_L], tl.float32), FP64)") for f in ir.fields),
             K.Comment("Z_c = z at the first step of chunk c, from the last chunk back; Z_n = 0"),
             *(K.Store(K.expr(f"gc_ptr + ({i} * (n_chunks + 1) + n_chunks) * L + lane"), K.expr(f"gc_{f}"),
                       K.expr("lane_ok")) for i, f in enumerate(ir.fields)),
             K.For("kk", K.expr("0"), K.expr("n_ctiles"), loop))
    rescan = list(_prologue(ins + grads + [f"du{i}" for i in range(len(ir.inputs))]) + _dfinal(ir) + replay)
    rescan += exclusive_adjoint(ir, adj)
    rescan += [K.Load(f"gin_{f}", K.expr(f"gc_ptr + ({i} * (n_chunks + 1) + chunk + 1) * L + lane"),
                      K.expr("lane_ok"), K.expr("0.0")) for i, f in enumerate(ir.fields)]
    rescan += _apply_carry(ir, adj, "gbar", "gin", ra="rf{}", rv="rc{}")
    rescan += _input_gradients(ir, adj)
    return [K.Kernel("chunk_bwd_reduce", params, reduce, origin=origin,
                     doc=f"Backward of {name}, phase 1 of 3: each chunk's adjoint reduced to (M_c, V_c)."),
            K.Kernel("chunk_bwd_carry", params, carry, origin=origin,
                     doc=f"Backward of {name}, phase 2 of 3: Z_c = V_c + M_c Z_(c+1), the adjoint entering each chunk."),
            K.Kernel("chunk_bwd_rescan", params, tuple(rescan), origin=origin,
                     doc=f"Backward of {name}, phase 3 of 3: the adjoint rescanned from Z_(c+1); input gradients.")]


def assemble(ir: ScanIR, adj: Adjoint, schedule_kernels, what: str) -> K.Module:
    """One IR module: the helpers every chunk-parallel kernel calls, then `schedule_kernels(ir, adj,
    origin)`; `what` names the schedule in the module's docstring."""
    if not supports(ir):
        raise ValueError(f"ir: program {E.docstring_text(ir.name)} cannot run chunk-parallel (a readout of the "
                         "previous prefix, a sum over state lanes, or a specialised carry)")
    origin = common.origins(ir)
    leaf_scale = [B.leaf_scale_kernel(" ".join(B.LEAF_SCALE_DOC.split()))] if ir.is_projective else []
    kernels = [common.combine_kernel(ir, origin), common.adjoint_combine_kernel(ir, adj),
               common.prefix_pair_combine_kernel(ir), common.adjoint_exclusive_combine_kernel(ir, adj), common.to_acc_kernel(),
               common.lane_offsets_kernel(), *leaf_scale, *schedule_kernels(ir, adj, origin)]
    doc = f"Generated by scanlang from monoid {E.docstring_text(ir.name)} (program {ir.key}): {what}. Do not edit."
    return K.Module(doc, tuple(kernels))


def module(ir: ScanIR, adj: Adjoint) -> K.Module:
    """The chunk-parallel kernels of `ir` (forward and backward) as one IR module."""
    return assemble(ir, adj, lambda ir, adj, origin: [*_forward_kernels(ir, origin), *_backward_kernels(ir, adj, origin)],
                    "the chunk-parallel schedule (backends/triton/kernel/chunked.py)")


def render(ir: ScanIR, adj: Adjoint) -> str:
    """The chunk-parallel module's source (deterministic)."""
    return print_module(module(ir, adj))
