"""The tile schedule: `scan_forward` / `scan_backward` of a generated module (see codegen.py's
docstring for what they compute). Tiles of at least RUN_TILE steps take the run-based bodies of
codegen_runs.py (a constexpr branch inside these kernels).
"""
from __future__ import annotations

import sympy

from scanlang import expr as E
from scanlang.autodiff import Adjoint
from scanlang.ir import ScanIR

from .codegen import (TILE_FLAGS, scale_leaf_gradient, _assign, _assign_inverted, _common_prologue, _indent, _initial_carry, _lane_off,
                      _load_lift, _num, _previous, _replay, _symbols_named, _time_index, backward_args, combine_call,
                      forward_args, tile_start_checkpoints)
from .codegen_runs import backward_loop, forward_loop, runs_epilogue, runs_prologue, runs_shape


def render_forward(ir: ScanIR) -> list[str]:
    RUN, _, RUN_TILE = runs_shape()
    args = forward_args(ir)
    consts = ["BLOCK_T", "BLOCK_L", "CHUNK", "REVERSE", "HAS_INIT", "VARLEN", "STATE", "FP64", "STAGES", "CKPT"] + TILE_FLAGS
    body = _common_prologue()
    for i in range(len(ir.inputs)):
        body.append(f"u{i}_off = {_lane_off(f'u{i}')}[None, :]")
    if ir.reduce_state:
        body += ["group = pid.to(tl.int64) * (BLOCK_L // STATE) + tl.arange(0, BLOCK_L // STATE)",
                 "group_ok = group < L // STATE"]
        for j in range(len(ir.outputs)):
            body.append(f"o{j}_off = {_lane_off(f'o{j}', 'group', '1')}[None, :]")
    else:
        for j in range(len(ir.outputs)):
            body.append(f"o{j}_off = {_lane_off(f'o{j}')}[None, :]")
    body += _initial_carry(ir)
    # checkpoints every CHUNK steps (the backward's tile), only for a backward (CKPT; without one
    # CHUNK is BLOCK_T and nothing is stored): slot j holds the carry into chunk j. With CHUNK ==
    # BLOCK_T that is the carry at each tile start; with a shorter CHUNK the prefixes at chunk ends
    # are stored from inside the tile (a masked store, one row in CHUNK active); a longer CHUNK (a
    # multiple of BLOCK_T) stores the carry at the start of every CHUNK // BLOCK_T-th tile.
    loop = _time_index() + tile_start_checkpoints(ir, "c", "lane", "lane_ok")
    loop += _load_lift(ir) + _replay(ir)
    loop += ["if CHUNK < BLOCK_T:",
             "    chunk = t // CHUNK + 1",
             "    chunk_end = ((t % CHUNK) == CHUNK - 1) & (chunk < tl.cdiv(seq_len, CHUNK)) & lane_ok[None, :]"]
    for f, name in enumerate(ir.fields):
        loop.append(f"    tl.store(ckpt_ptr + ({f} * n_slots + slot0 + chunk) * L + lane[None, :], p_{name}, mask=chunk_end)")
    body.append("if CHUNK < BLOCK_T:")
    for f, name in enumerate(ir.fields):
        body.append(f"    tl.store(ckpt_ptr + ({f} * n_slots + slot0) * L + lane, c_{name}, mask=lane_ok)")
    if ir.uses_previous:
        loop += _previous(ir)
    names = {s: s.name for s in ir.prefix_symbols + ir.previous_symbols + ir.input_symbols}
    loop += _assign_inverted([f"r{j}" for j in range(len(ir.outputs))], ir.readout, names, "_r", shape_like=f"p_{ir.fields[0]}")
    for j in range(len(ir.outputs)):
        if ir.reduce_state:
            loop.append(f"r{j} = tl.sum(tl.reshape(r{j}, (BLOCK_T, BLOCK_L // STATE, STATE)), 2)")
            loop.append(f"tl.store(o{j}_ptr + o{j}_off + tt * o{j}_st, r{j}.to(o{j}_ptr.dtype.element_ty), "
                        f"mask=(t < seq_len) & group_ok[None, :])")
        else:
            loop.append(f"tl.store(o{j}_ptr + o{j}_off + tt * o{j}_st, r{j}.to(o{j}_ptr.dtype.element_ty), mask=ok)")
    # the carry is the prefix at the tile's last valid row (padding may not even be finite)
    loop += ["if EVEN_T:", "    last = BLOCK_T - 1", "else:", "    last = tl.minimum(seq_len - 1 - k * BLOCK_T, BLOCK_T - 1)"]
    for name in ir.fields:
        loop.append(f"c_{name} = tl.sum(tl.where(rows == last, p_{name}, 0.0), 0)")
    body.append(f"if BLOCK_T >= {RUN_TILE}:   # runs of {RUN} steps per thread (codegen_runs.py)")
    body += _indent(runs_prologue(ir, "c"), 4)
    body.append("    for k in tl.range(0, n_tiles, num_stages=STAGES):")
    body += _indent(forward_loop(ir), 8)
    body += _indent(runs_epilogue(ir, "c"), 4)
    body.append("else:")
    body.append("    for k in tl.range(0, n_tiles, num_stages=STAGES):")
    body += _indent(loop, 8)
    for f, name in enumerate(ir.fields):
        body.append(f"tl.store(final_ptr + ({f} * n_seq + seq) * L + lane, c_{name}, mask=lane_ok)")
    sig = ", ".join(args + [f"{c}: tl.constexpr" for c in consts])
    return ["@triton.jit", f"def scan_forward({sig}):",
            f'    """Forward fused scan of {E.docstring_text(ir.name)}: lift, tile scan with carried prefix, readout."""',
            *_indent(body, 4)]


def _du_store(i: int, name: str) -> list[str]:
    """Write du_<name> by the constexpr mode DU{i}: 0 store, 1 atomic add, 2 summed over time,
    3 summed over the STATE lanes then stored, 4 summed over the STATE lanes then atomically added."""
    ptr = f"du{i}_ptr + du{i}_off + tt * du{i}_st"
    return [
        f"if DU{i} == 0:",
        f"    tl.store({ptr}, du_{name}.to(du{i}_ptr.dtype.element_ty), mask=ok)",
        f"elif DU{i} == 1:",
        f"    tl.atomic_add({ptr}, du_{name}.to(du{i}_ptr.dtype.element_ty), mask=ok, sem='relaxed')",
        f"elif DU{i} == 2:",
        f"    acc{i} += tl.sum(tl.where(ok, du_{name}, 0.0), 0)",
        "else:",
        f"    red{i} = tl.sum(tl.reshape(tl.where(ok, du_{name}, 0.0), (BLOCK_T, BLOCK_L // STATE, STATE)), 2)",
        f"    gptr{i} = du{i}_ptr + du{i}_goff + tt * du{i}_st",
        f"    if DU{i} == 3:",
        f"        tl.store(gptr{i}, red{i}.to(du{i}_ptr.dtype.element_ty), mask=(t < seq_len) & group_ok[None, :])",
        "    else:",
        f"        tl.atomic_add(gptr{i}, red{i}.to(du{i}_ptr.dtype.element_ty), mask=(t < seq_len) & group_ok[None, :], "
        "sem='relaxed')",
    ]


def render_backward(ir: ScanIR, adj: Adjoint) -> list[str]:
    """Tiles in reverse order. Per tile: replay p (prefixes) and q (previous prefixes, the scan of
    the elements shifted by one) from the checkpoint; load the next step's inputs; run the reverse
    affine scan gbar_s = E_s + A_s gbar_{s+1} with A_s = J1(p_s, x_{s+1})^T, E_s = dy_s + c_{s+1};
    then dx = J2(q, x)^T gbar and the input gradients. No shifts of register tiles are needed.
    Tiles of at least RUN_TILE steps run `codegen_runs.backward_loop` instead."""
    RUN, _, RUN_TILE = runs_shape()
    n = len(ir.fields)
    nb = len(adj.b_entries)
    args = backward_args(ir)
    consts = (["BLOCK_T", "BLOCK_L", "CHUNK", "REVERSE", "HAS_INIT", "HAS_DFINAL", "VARLEN", "STATE", "FP64", "STAGES"]
              + TILE_FLAGS + ["FLIP_REV"] + [f"DU{i}" for i in range(len(ir.inputs))])
    body = _common_prologue()
    body += ["group = pid.to(tl.int64) * (BLOCK_L // STATE) + tl.arange(0, BLOCK_L // STATE)",
             "group_ok = group < L // STATE"]
    for i in range(len(ir.inputs)):
        body.append(f"u{i}_off = {_lane_off(f'u{i}')}[None, :]")
        body.append(f"du{i}_lane_off = {_lane_off(f'du{i}')}")
        body.append(f"du{i}_off = du{i}_lane_off[None, :]")
        body.append(f"du{i}_goff = {_lane_off(f'du{i}', 'group', '1')}[None, :]")
        body.append(f"acc{i} = to_acc(tl.zeros([BLOCK_L], tl.float32), FP64)")
    for j in range(len(ir.outputs)):
        body.append(f"g{j}_off = {_lane_off(f'g{j}')}[None, :]")
    body.append("if HAS_DFINAL:")
    for f, name in enumerate(ir.fields):
        body.append(f"    dfin_{name} = to_acc(tl.load(dfinal_ptr + ({f} * n_seq + seq) * L + lane, mask=lane_ok, "
                    "other=0.0), FP64)")
    body.append("else:")
    for name in ir.fields:
        body.append(f"    dfin_{name} = to_acc(tl.zeros([BLOCK_L], tl.float32), FP64)")
    for name in ir.fields:   # gbar carried from the later tile; w0 = dL/d(initial) (= dfinal if T = 0)
        body.append(f"gc_{name} = to_acc(tl.zeros([BLOCK_L], tl.float32), FP64)")
        body.append(f"w0_{name} = dfin_{name}")
    shape = f"p_{ir.fields[0]}"
    loop = ["k = n_tiles - 1 - kk", *_time_index()]
    for f, (name, ident) in enumerate(zip(ir.fields, ir.identity)):
        loop.append(f"c_{name} = to_acc(tl.load(ckpt_ptr + ({f} * n_slots + slot0 + k) * L + lane, mask=lane_ok, "
                    f"other={_num(ident)}), FP64)")
    loop += _load_lift(ir) + _replay(ir)
    loop.append("ok_prev = ok & (rows > 0)")
    loop += _load_lift(ir, tag="v", shift=-1, mask="ok_prev") + _replay(ir, tag="v", out="qs")
    for f in ir.fields:   # row 0: the carry itself (a raw initial element is not renormalised)
        loop.append(f"q_{f} = tl.where(rows == 0, c_{f}[None, :], qs_{f})")
    loop.append("ok_next = (t + 1 < seq_len) & lane_ok[None, :]")
    loop += _load_lift(ir, tag="n", shift=1, mask="ok_next")
    for j, o in enumerate(ir.outputs):
        loop.append(f"g_{o} = to_acc(tl.load(g{j}_ptr + g{j}_off + tt * g{j}_st, mask=ok, other=0.0), FP64)")
    here = ({s: s.name for s in ir.prefix_symbols + ir.previous_symbols + adj.g}
            | _symbols_named(ir.input_symbols, "u_{}"))
    recips = {}   # divisions by reciprocals, each inverted once (another set after the adjoint scan)
    loop += _assign_inverted([f"dy_{f}" for f in ir.fields], adj.dy, here, "_d", shape_like=shape, recips=recips)
    if ir.uses_previous:   # c_{s+1}: the next step's readout differentiated in its previous prefix (= p_s)
        for j, o in enumerate(ir.outputs):
            loop.append(f"gn_{o} = to_acc(tl.load(g{j}_ptr + g{j}_off + (tt + step) * g{j}_st, mask=ok_next, "
                        "other=0.0), FP64)")
        pn = ", ".join(f"pn_{f}" for f in ir.fields)
        loop += combine_call(ir, f"{pn}{',' if n == 1 else ''}", f"{', '.join(f'p_{f}' for f in ir.fields)}, "
                             f"{', '.join(f'en_{f}' for f in ir.fields)}")
        nxt = ({s: f"pn_{s.name[2:]}" for s in ir.prefix_symbols} | {s: f"p_{s.name[2:]}" for s in ir.previous_symbols}
               | {g: f"gn_{g.name[2:]}" for g in adj.g} | _symbols_named(ir.input_symbols, "un_{}"))
        loop += _assign_inverted([f"cn_{f}" for f in ir.fields], adj.c, nxt, "_n", shape_like=shape, recips=recips)
    else:
        loop += [f"cn_{f} = 0.0" for f in ir.fields]
    a_names = ({s: f"p_{s.name[2:]}" for s in ir.previous_symbols}
               | {s: f"en_{f}" for s, f in zip(ir.later, ir.fields)})
    loop += _assign_inverted([f"a{k}" for k in range(nb)], adj.b_entries, a_names, "_a", shape_like=shape, recips=recips)
    for k in range(nb):   # the last step has no successor: A = 0 (its padding may not be finite)
        loop.append(f"a{k} = tl.where(ok_next, a{k}, 0.0)")
    loop.append("is_last = t == seq_len - 1")
    for f in ir.fields:   # the direct gradient of y_t: its readout, the next readout, a returned final prefix
        loop.append(f"d_{f} = dy_{f} + tl.where(ok_next, cn_{f}, 0.0) + tl.where(is_last, dfin_{f}[None, :], 0.0)")
    names_v = {s: s.name for s in ir.prefix_symbols + adj.d}
    loop += _assign_inverted([f"v_{f}" for f in ir.fields], adj.direct, names_v, "_v", shape_like=shape, recips=recips)
    for f in ir.fields:
        loop.append(f"v_{f} = tl.where(ok, v_{f}, 0.0)")
    ra = [f"ra{k}" for k in range(nb)]
    rv = [f"rv{i}" for i in range(n)]
    scanned = [f"a{k}" for k in range(nb)] + [f"v_{f}" for f in ir.fields]
    # FLIP_REV (channels-contiguous tiles): the reverse scan as flip, forward scan, flip. Triton 3.6 lowers a
    # reverse scan along a tile's time axis to shuffles even where time is in-thread (offline, sm_90a, default
    # 32 x 32 tiles: affine backward 1244 -> 764 SHFL, 89.1 -> 74.0 SASS per element; Möbius 515.8 -> 454.5;
    # same registers and shared memory). Where time spans the threads (time-contiguous tiles under 128 steps)
    # the flips cost more than they save (affine, 64-step tiles: 110.5 -> 140.0).
    loop.append("if FLIP_REV:")
    loop.append(f"    {', '.join(ra + rv)} = tl.associative_scan(({', '.join(f'tl.flip({x}, 0)' for x in scanned)},), "
                "0, adjoint_combine)")
    loop += [f"    {x} = tl.flip({x}, 0)" for x in ra + rv]
    loop.append("else:")
    loop.append(f"    {', '.join(ra + rv)} = tl.associative_scan(({', '.join(scanned)},), 0, adjoint_combine, reverse=True)")
    rmat = adj.matrix([E.symbol(r) for r in ra])
    gc = [E.symbol(f"gc_{f}") for f in ir.fields]
    g_exprs = [E.symbol(rv[i]) + sum((rmat[i][j] * gc[j] for j in range(n)), sympy.Integer(0)) for i in range(n)]
    names_g = {E.symbol(r): r for r in ra + rv} | {s: f"{s.name}[None, :]" for s in gc}
    loop += _assign([f"gbar_{f}" for f in ir.fields], g_exprs, names_g, "_g")
    names_x = ({s: s.name for s in ir.previous_symbols + adj.gbar}
               | {s: f"e_{f}" for s, f in zip(ir.later, ir.fields)})
    recips = {}
    loop += _assign_inverted([f"dx_{f}" for f in ir.fields], adj.dx, names_x, "_x", shape_like=shape, recips=recips)
    loop += scale_leaf_gradient(ir, "dx_{}", "")
    names_u = here | {s: s.name for s in adj.dx_symbols}
    loop += _assign_inverted([f"du_{n_}" for n_ in ir.inputs], adj.du, names_u, "_u", shape_like=shape, recips=recips)
    for i, name in enumerate(ir.inputs):
        loop += _du_store(i, name)
    for f in ir.fields:
        loop.append(f"gc_{f} = tl.sum(tl.where(rows == 0, gbar_{f}, 0.0), 0)")
    # dL/d(initial) = J1(q_0, x_0)^T gbar_0 + c_0, taken from the first tile (the loop's last)
    loop.append("if HAS_INIT:")
    recips = {}
    init_block = _assign_inverted([f"cq_{f}" for f in ir.fields], adj.c, here, "_i", shape_like=shape, recips=recips)
    b_names = ({s: s.name for s in ir.previous_symbols} | {s: f"e_{f}" for s, f in zip(ir.later, ir.fields)})
    init_block += _assign_inverted([f"b{k}" for k in range(nb)], adj.b_entries, b_names, "_b", shape_like=shape,
                                   recips=recips)
    bmat = adj.matrix([E.symbol(f"b{k}") for k in range(nb)])
    gb = [E.symbol(f"gbar_{f}") for f in ir.fields]
    w_exprs = [E.symbol(f"cq_{ir.fields[i]}") + sum((bmat[i][j] * gb[j] for j in range(n)), sympy.Integer(0))
               for i in range(n)]
    names_w = {E.symbol(f"cq_{f}"): f"cq_{f}" for f in ir.fields} | {s: s.name for s in gb} | {
        E.symbol(f"b{k}"): f"b{k}" for k in range(nb)}
    init_block += _assign([f"w_{f}" for f in ir.fields], w_exprs, names_w, "_w", shape_like=shape)
    for f in ir.fields:
        init_block.append(f"w0_{f} = tl.sum(tl.where(rows == 0, w_{f}, 0.0), 0)")
    loop += _indent(init_block, 4)
    body.append(f"if BLOCK_T >= {RUN_TILE}:   # runs of {RUN} steps per thread (codegen_runs.py)")
    body += _indent(runs_prologue(ir, "gc"), 4)
    body.append("    for kk in tl.range(0, n_tiles, num_stages=STAGES):")
    body += _indent(backward_loop(ir, adj), 8)
    body.append("else:")
    body.append("    for kk in tl.range(0, n_tiles, num_stages=STAGES):")
    body += _indent(loop, 8)
    for i in range(len(ir.inputs)):
        body += [f"if DU{i} == 2:",
                 f"    tl.atomic_add(du{i}_ptr + du{i}_lane_off, acc{i}.to(du{i}_ptr.dtype.element_ty), mask=lane_ok, "
                 "sem='relaxed')"]
    body.append("if HAS_INIT:")
    for f, name in enumerate(ir.fields):
        body.append(f"    tl.store(dinit{f}_ptr + seq * L + lane, w0_{name}, mask=lane_ok)")
    sig = ", ".join(args + [f"{c}: tl.constexpr" for c in consts])
    return ["@triton.jit", f"def scan_backward({sig}):",
            f'    """Backward of {E.docstring_text(ir.name)}: replay each tile from its checkpoint, reverse affine scan of the adjoint."""',
            *_indent(body, 4)]
