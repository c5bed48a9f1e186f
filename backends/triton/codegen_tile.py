"""The tile schedule: `scan_forward` / `scan_backward` of a generated module (see codegen.py's
docstring for what they compute), built as kernel IR (kernel/ir.py) from the shared builders of
kernel/builders.py and printed by the one printer with the rest of the module (codegen_module.py).
Tiles of at least RUN_TILE steps take the run-based bodies of kernel/runs.py (a constexpr branch
inside these kernels, `_runs_or_tiles`).
"""
from __future__ import annotations

import sympy

from scanlang import expr as E
from scanlang.autodiff import Adjoint
from scanlang.ir import ScanIR

from .codegen import _symbols_named, backward_args, forward_args
from .kernel import builders as B
from .kernel import common
from .kernel.common import assign, assign_inverted
from .kernel import ir as K
from .kernel import runs as R
from .kernel.builders import GradMode, grad_mode_is, when

GROUPS = (K.assign("group", "pid.to(tl.int64) * (BLOCK_L // STATE) + tl.arange(0, BLOCK_L // STATE)"),
          K.assign("group_ok", "group < L // STATE"))


def _runs_or_tiles(ir: ScanIR, carried: str, var: str, runs_loop: tuple, epilogue: bool, tile_loop) -> tuple:
    """Tiles of at least RUN_TILE steps run kernel/runs.py's bodies (its prologue, the tile loop
    `runs_loop`, and for the forward its epilogue); smaller tiles run `tile_loop`. Both walk the
    n_tiles tiles as `var`."""
    RUN_TILE = R.runs_shape()[2]
    over = lambda body: K.For(var, K.expr(0), K.expr("n_tiles"), tuple(body), num_stages=K.expr("STAGES"))  # noqa: E731
    runs = R.prologue(ir, carried) + (over(runs_loop),) + (R.epilogue(ir, carried) if epilogue else ())
    return (K.If(K.expr(f"BLOCK_T >= {RUN_TILE}"), runs, (over(tile_loop),)),)   # runs of RUN steps per thread


def forward_kernel(ir: ScanIR) -> K.Kernel:
    """Per tile: lift, `tl.associative_scan` along time, combine with the carried prefix, readout
    (summed over the STATE lanes when `ir.reduce_state`), store; the carry at tile starts (and chunk
    ends) as the backward's checkpoints, the last prefix per lane at the end."""
    consts = ["BLOCK_T", "BLOCK_L", "CHUNK", "REVERSE", "HAS_INIT", "VARLEN", "STATE", "FP64", "STAGES", "CKPT",
              *B.TILE_FLAGS]
    outs = range(len(ir.outputs))
    body = list(B.prologue()) + [K.assign(f"u{i}_off", f"{B.lane_off(f'u{i}')}[None, :]") for i in range(len(ir.inputs))]
    if ir.reduce_state:
        body += [*GROUPS, *(K.assign(f"o{j}_off", f"{B.lane_off(f'o{j}', 'group', '1')}[None, :]") for j in outs)]
    else:
        body += [K.assign(f"o{j}_off", f"{B.lane_off(f'o{j}')}[None, :]") for j in outs]
    body += B.initial_carry(ir)
    # checkpoints every CHUNK steps (the backward's tile), only for a backward (CKPT; without one
    # CHUNK is BLOCK_T and nothing is stored): slot j holds the carry into chunk j. With CHUNK ==
    # BLOCK_T that is the carry at each tile start; with a shorter CHUNK the prefixes at chunk ends
    # are stored from inside the tile (a masked store, one row in CHUNK active); a longer CHUNK (a
    # multiple of BLOCK_T) stores the carry at the start of every CHUNK // BLOCK_T-th tile.
    loop = list(B.time_index() + B.tile_start_checkpoints(ir, "c", "lane", "lane_ok") + B.load_lift(ir) + B.replay(ir))
    loop.append(when("CHUNK < BLOCK_T", [
        K.assign("chunk", "t // CHUNK + 1"),
        K.assign("chunk_end", "((t % CHUNK) == CHUNK - 1) & (chunk < tl.cdiv(seq_len, CHUNK)) & lane_ok[None, :]"),
        *B.checkpoint_store(ir, "slot0 + chunk", "lane[None, :]", "p", "chunk_end")]))
    body.append(when("CHUNK < BLOCK_T", B.checkpoint_store(ir, "slot0", "lane", "c", "lane_ok")))
    if ir.uses_previous:
        loop += B.previous(ir)
    names = {s: s.name for s in ir.prefix_symbols + ir.previous_symbols + ir.input_symbols}
    loop += assign_inverted([f"r{j}" for j in outs], ir.readout, names, "_r", shape_like=f"p_{ir.fields[0]}")
    for j in outs:
        value = K.expr(f"r{j}.to(o{j}_ptr.dtype.element_ty)")
        ptr = K.expr(f"o{j}_ptr + o{j}_off + tt * o{j}_st")
        if ir.reduce_state:
            loop += [K.assign(f"r{j}", f"tl.sum(tl.reshape(r{j}, (BLOCK_T, BLOCK_L // STATE, STATE)), 2)"),
                     K.Store(ptr, value, K.expr("(t < seq_len) & group_ok[None, :]"))]
        else:
            loop.append(K.Store(ptr, value, K.expr("ok")))
    # the carry is the prefix at the tile's last valid row (padding may not even be finite)
    loop += [when("EVEN_T", [K.assign("last", "BLOCK_T - 1")], [K.assign("last", "tl.minimum(seq_len - 1 - k * BLOCK_T, BLOCK_T - 1)")]),
             *(K.assign(f"c_{name}", f"tl.sum(tl.where(rows == last, p_{name}, 0.0), 0)") for name in ir.fields)]
    body += _runs_or_tiles(ir, "c", "k", R.forward_loop(ir), True, loop)
    body += [K.Store(K.expr(f"final_ptr + ({f} * n_seq + seq) * L + lane"), K.expr(f"c_{name}"), K.expr("lane_ok"))
             for f, name in enumerate(ir.fields)]
    return K.Kernel("scan_forward", B.params(forward_args(ir), consts), tuple(body), origin=common.origins(ir),
                    doc=f"Forward fused scan of {E.docstring_text(ir.name)}: lift, tile scan with carried prefix, readout.")


def _du_store(i: int, name: str) -> K.If:
    """Write du_<name> by the constexpr DU{i} (a `GradMode`)."""
    ptr, cast = K.expr(f"du{i}_ptr + du{i}_off + tt * du{i}_st"), K.expr(f"du_{name}.to(du{i}_ptr.dtype.element_ty)")
    red, grp = K.expr(f"red{i}.to(du{i}_ptr.dtype.element_ty)"), K.expr("(t < seq_len) & group_ok[None, :]")
    mode = lambda m: grad_mode_is(i, m).text  # noqa: E731
    by_state = [K.assign(f"red{i}", f"tl.sum(tl.reshape(tl.where(ok, du_{name}, 0.0), (BLOCK_T, BLOCK_L // STATE, STATE)), 2)"),
                K.assign(f"gptr{i}", f"du{i}_ptr + du{i}_goff + tt * du{i}_st"),
                when(mode(GradMode.STATE_STORE), [K.Store(K.expr(f"gptr{i}"), red, grp)],
                     [K.AtomicAdd(K.expr(f"gptr{i}"), red, grp)])]
    return when(mode(GradMode.STORE), [K.Store(ptr, cast, K.expr("ok"))],
                [when(mode(GradMode.ATOMIC), [K.AtomicAdd(ptr, cast, K.expr("ok"))],
                      [when(mode(GradMode.TIME_SUM), [K.AugAssign(f"acc{i}", K.expr(f"tl.sum(tl.where(ok, du_{name}, 0.0), 0)"))],
                            by_state)])])


def backward_kernel(ir: ScanIR, adj: Adjoint) -> K.Kernel:
    """Tiles in reverse order. Per tile: replay p (prefixes) and q (previous prefixes, the scan of
    the elements shifted by one) from the checkpoint; load the next step's inputs; run the reverse
    affine scan gbar_s = E_s + A_s gbar_{s+1} with A_s = J1(p_s, x_{s+1})^T, E_s = dy_s + c_{s+1};
    then dx = J2(q, x)^T gbar and the input gradients. No shifts of register tiles are needed.
    Tiles of at least RUN_TILE steps run `kernel.runs.backward_loop` instead."""
    n, nb = len(ir.fields), len(adj.b_entries)
    consts = ["BLOCK_T", "BLOCK_L", "CHUNK", "REVERSE", "HAS_INIT", "HAS_DFINAL", "VARLEN", "STATE", "FP64", "STAGES",
              *B.TILE_FLAGS, "FLIP_REV", *(f"DU{i}" for i in range(len(ir.inputs)))]
    zeros = "to_acc(tl.zeros([BLOCK_L], tl.float32), FP64)"
    body = list(B.prologue() + GROUPS)
    for i in range(len(ir.inputs)):
        body += [K.assign(f"u{i}_off", f"{B.lane_off(f'u{i}')}[None, :]"), K.assign(f"du{i}_lane_off", B.lane_off(f"du{i}")),
                 K.assign(f"du{i}_off", f"du{i}_lane_off[None, :]"), K.assign(f"du{i}_goff", f"{B.lane_off(f'du{i}', 'group', '1')}[None, :]"),
                 K.assign(f"acc{i}", zeros)]
    body += [K.assign(f"g{j}_off", f"{B.lane_off(f'g{j}')}[None, :]") for j in range(len(ir.outputs))]
    body.append(when("HAS_DFINAL", [K.Load(f"dfin_{name}", K.expr(f"dfinal_ptr + ({f} * n_seq + seq) * L + lane"),
                                           K.expr("lane_ok"), K.expr("0.0")) for f, name in enumerate(ir.fields)],
                     [K.assign(f"dfin_{name}", zeros) for name in ir.fields]))
    # gbar carried from the later tile; w0 = dL/d(initial) (= dfinal if T = 0)
    for name in ir.fields:
        body += [K.assign(f"gc_{name}", zeros), K.assign(f"w0_{name}", f"dfin_{name}")]
    shape = f"p_{ir.fields[0]}"
    loop = [K.assign("k", "n_tiles - 1 - kk"), *B.time_index()]
    loop += B.checkpoint_load(ir)
    loop += B.load_lift(ir) + B.replay(ir)
    loop.append(K.assign("ok_prev", "ok & (rows > 0)"))
    loop += B.load_lift(ir, tag="v", shift=-1, mask="ok_prev") + B.replay(ir, tag="v", out="qs")
    # row 0: the carry itself (a raw initial element is not renormalised)
    loop += [K.assign(f"q_{f}", f"tl.where(rows == 0, c_{f}[None, :], qs_{f})") for f in ir.fields]
    loop.append(K.assign("ok_next", "(t + 1 < seq_len) & lane_ok[None, :]"))
    loop += B.load_lift(ir, tag="n", shift=1, mask="ok_next")
    loop += [K.Load(f"g_{o}", K.expr(f"g{j}_ptr + g{j}_off + tt * g{j}_st"), K.expr("ok"), K.expr("0.0"))
             for j, o in enumerate(ir.outputs)]
    here = ({s: s.name for s in ir.prefix_symbols + ir.previous_symbols + adj.g}
            | _symbols_named(ir.input_symbols, "u_{}"))
    recips = {}   # divisions by reciprocals, each inverted once (another set after the adjoint scan)
    loop += assign_inverted([f"dy_{f}" for f in ir.fields], adj.dy, here, "_d", shape_like=shape, recips=recips)
    if ir.uses_previous:   # c_{s+1}: the next step's readout differentiated in its previous prefix (= p_s)
        loop += [K.Load(f"gn_{o}", K.expr(f"g{j}_ptr + g{j}_off + (tt + step) * g{j}_st"), K.expr("ok_next"),
                        K.expr("0.0")) for j, o in enumerate(ir.outputs)]
        loop += B.combine_call(ir, [f"pn_{f}" for f in ir.fields], f"{', '.join(f'p_{f}' for f in ir.fields)}, "
                               f"{', '.join(f'en_{f}' for f in ir.fields)}", unpack=True)
        nxt = ({s: f"pn_{s.name[2:]}" for s in ir.prefix_symbols} | {s: f"p_{s.name[2:]}" for s in ir.previous_symbols}
               | {g: f"gn_{g.name[2:]}" for g in adj.g} | _symbols_named(ir.input_symbols, "un_{}"))
        loop += assign_inverted([f"cn_{f}" for f in ir.fields], adj.c, nxt, "_n", shape_like=shape, recips=recips)
    else:
        loop += [K.assign(f"cn_{f}", "0.0") for f in ir.fields]
    a_names = ({s: f"p_{s.name[2:]}" for s in ir.previous_symbols}
               | {s: f"en_{f}" for s, f in zip(ir.later, ir.fields)})
    loop += assign_inverted([f"a{k}" for k in range(nb)], adj.b_entries, a_names, "_a", shape_like=shape, recips=recips)
    # the last step has no successor: A = 0 (its padding may not be finite)
    loop += [K.assign(f"a{k}", f"tl.where(ok_next, a{k}, 0.0)") for k in range(nb)]
    loop.append(K.assign("is_last", "t == seq_len - 1"))
    # the direct gradient of y_t: its readout, the next readout, a returned final prefix
    loop += [K.assign(f"d_{f}", f"dy_{f} + tl.where(ok_next, cn_{f}, 0.0) + tl.where(is_last, dfin_{f}[None, :], 0.0)")
             for f in ir.fields]
    names_v = {s: s.name for s in ir.prefix_symbols + adj.d}
    loop += assign_inverted([f"v_{f}" for f in ir.fields], adj.direct, names_v, "_v", shape_like=shape, recips=recips)
    loop += [K.assign(f"v_{f}", f"tl.where(ok, v_{f}, 0.0)") for f in ir.fields]
    ra, rv = [f"ra{k}" for k in range(nb)], [f"rv{i}" for i in range(n)]
    scanned = [f"a{k}" for k in range(nb)] + [f"v_{f}" for f in ir.fields]
    # FLIP_REV (channels-contiguous tiles): the reverse scan as flip, forward scan, flip. Triton 3.6 lowers a
    # reverse scan along a tile's time axis to shuffles even where time is in-thread (offline, sm_90a, default
    # 32 x 32 tiles: affine backward 1244 -> 764 SHFL, 89.1 -> 74.0 SASS per element; Möbius 515.8 -> 454.5;
    # same registers and shared memory). Where time spans the threads (time-contiguous tiles under 128 steps)
    # the flips cost more than they save (affine, 64-step tiles: 110.5 -> 140.0).
    flipped = ", ".join(f"tl.flip({x}, 0)" for x in scanned)
    loop.append(when("FLIP_REV", [
        K.Assign(tuple(ra + rv), K.expr(f"tl.associative_scan(({flipped},), 0, adjoint_combine)"), True),
        *(K.assign(x, f"tl.flip({x}, 0)") for x in ra + rv)],
        [K.Assign(tuple(ra + rv), K.expr(f"tl.associative_scan(({', '.join(scanned)},), 0, adjoint_combine, reverse=True)"),
                  True)]))
    rmat = adj.matrix([E.symbol(r) for r in ra])
    gc = [E.symbol(f"gc_{f}") for f in ir.fields]
    g_exprs = [E.symbol(rv[i]) + sum((rmat[i][j] * gc[j] for j in range(n)), sympy.Integer(0)) for i in range(n)]
    names_g = {E.symbol(r): r for r in ra + rv} | {s: f"{s.name}[None, :]" for s in gc}
    loop += assign([f"gbar_{f}" for f in ir.fields], g_exprs, names_g, "_g")
    names_x = ({s: s.name for s in ir.previous_symbols + adj.gbar}
               | {s: f"e_{f}" for s, f in zip(ir.later, ir.fields)})
    recips = {}
    loop += assign_inverted([f"dx_{f}" for f in ir.fields], adj.dx, names_x, "_x", shape_like=shape, recips=recips)
    loop += B.scale_leaf_gradient(ir, "dx_{}", "")
    names_u = here | {s: s.name for s in adj.dx_symbols}
    loop += assign_inverted([f"du_{m}" for m in ir.inputs], adj.du, names_u, "_u", shape_like=shape, recips=recips)
    loop += [_du_store(i, name) for i, name in enumerate(ir.inputs)]
    loop += [K.assign(f"gc_{f}", f"tl.sum(tl.where(rows == 0, gbar_{f}, 0.0), 0)") for f in ir.fields]
    # dL/d(initial) = J1(q_0, x_0)^T gbar_0 + c_0, taken from the first tile (the loop's last)
    loop.append(when("HAS_INIT", _initial_gradient(ir, adj, here, shape)))
    body += _runs_or_tiles(ir, "gc", "kk", R.backward_loop(ir, adj), False, loop)
    body += [when(grad_mode_is(i, GradMode.TIME_SUM).text, [
        K.AtomicAdd(K.expr(f"du{i}_ptr + du{i}_lane_off"), K.expr(f"acc{i}.to(du{i}_ptr.dtype.element_ty)"),
                    K.expr("lane_ok"))]) for i in range(len(ir.inputs))]
    body.append(when("HAS_INIT", [K.Store(K.expr(f"dinit{f}_ptr + seq * L + lane"), K.expr(f"w0_{name}"), K.expr("lane_ok"))
                                  for f, name in enumerate(ir.fields)]))
    return K.Kernel("scan_backward", B.params(backward_args(ir), consts), tuple(body), origin=common.origins(ir),
                    doc=f"Backward of {E.docstring_text(ir.name)}: replay each tile from its checkpoint, "
                        "reverse affine scan of the adjoint.")


def _initial_gradient(ir: ScanIR, adj: Adjoint, here: dict, shape: str) -> list:
    """w0_<field> = dL/d(initial): J1(q_0, x_0)^T gbar_0 + c_0 at row 0 of the first tile."""
    n, nb = len(ir.fields), len(adj.b_entries)
    recips = {}
    out = list(assign_inverted([f"cq_{f}" for f in ir.fields], adj.c, here, "_i", shape_like=shape, recips=recips))
    b_names = ({s: s.name for s in ir.previous_symbols} | {s: f"e_{f}" for s, f in zip(ir.later, ir.fields)})
    out += assign_inverted([f"b{k}" for k in range(nb)], adj.b_entries, b_names, "_b", shape_like=shape, recips=recips)
    bmat = adj.matrix([E.symbol(f"b{k}") for k in range(nb)])
    gb = [E.symbol(f"gbar_{f}") for f in ir.fields]
    w_exprs = [E.symbol(f"cq_{ir.fields[i]}") + sum((bmat[i][j] * gb[j] for j in range(n)), sympy.Integer(0))
               for i in range(n)]
    names_w = {E.symbol(f"cq_{f}"): f"cq_{f}" for f in ir.fields} | {s: s.name for s in gb} | {
        E.symbol(f"b{k}"): f"b{k}" for k in range(nb)}
    out += assign([f"w_{f}" for f in ir.fields], w_exprs, names_w, "_w", shape_like=shape)
    return out + [K.assign(f"w0_{f}", f"tl.sum(tl.where(rows == 0, w_{f}, 0.0), 0)") for f in ir.fields]
