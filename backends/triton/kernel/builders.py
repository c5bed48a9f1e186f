"""Statement builders the kernel-IR schedules share (kernel/ir.py): the program prologue, sequence
bounds and memory index, lifting a leaf (and renormalising a projective one), loading and lifting a
tile, replaying prefixes from a carry, the initial carry, checkpoint stores and loads, the kernel
parameters, the combine and scan calls, and the module's small functions (leaf_scale, reciprocal,
combine_rcp). Every builder returns IR statements (or a `Kernel`); expressions inside them are
source text (`ir.Expr`), the monoid's own printed by the one expression printer (codegen._assign /
_assign_inverted, over `scanlang.expr.render`) and made assignments by `common.assign` /
`common.assign_inverted`. No schedule writes statements as text lines.
"""
from __future__ import annotations

import enum

from scanlang.ir import ScanIR

from ..codegen import _num, combine_operands, has_combine_rcp
from . import common
from . import ir as K

# the tile kernels' layout constexprs (plan.py): RCP_APPROX (float32 compiled for a GPU: reciprocals by
# the hardware instruction), EVEN_T (every time tile full: not VARLEN and BLOCK_T divides T), EVEN_L
# (every lane block full); under EVEN_T and EVEN_L the loads, stores and identity pads drop their masks
TILE_FLAGS = ("RCP_APPROX", "EVEN_T", "EVEN_L")


class GradMode(enum.IntEnum):
    """How a kernel writes an input's gradient: the constexpr DU<i>, which plan.py picks per input
    (`plan._du_mode`, `plan._lanes_mode`) and the kernels branch on. STORE one value per element;
    ATOMIC added atomically (the input broadcast over lanes); TIME_SUM summed over time in registers,
    added once per lane at the end (constant in time); STATE_STORE / STATE_ATOMIC summed over the
    STATE lanes, then stored / added atomically; GROUP_ATOMIC (lane-sequential only) summed over a
    program's state groups, then added; WARP_ATOMIC (lane-sequential only) summed over the groups of
    each warp, then added."""

    STORE = 0
    ATOMIC = 1
    TIME_SUM = 2
    STATE_STORE = 3
    STATE_ATOMIC = 4
    GROUP_ATOMIC = 5
    WARP_ATOMIC = 6


# the modes that add into their gradient buffer (which therefore starts zeroed)
ADDING_MODES = (GradMode.ATOMIC, GradMode.TIME_SUM, GradMode.STATE_ATOMIC, GradMode.GROUP_ATOMIC, GradMode.WARP_ATOMIC)


def grad_mode_is(i: int, mode: GradMode) -> K.Expr:
    """The constexpr test `DU<i> == mode` a kernel branches on for input i's gradient."""
    return K.expr(f"DU{i} == {int(mode)}")


def when(cond: str, body, orelse=()) -> K.If:
    """`if cond: body else: orelse` (constexpr conditions fold away when Triton compiles)."""
    return K.If(K.expr(cond), tuple(body), tuple(orelse))


# --- kernel parameters ----------------------------------------------------------------------------------------

def params(args, consts) -> tuple[K.Param, ...]:
    """Runtime arguments `args` then the constexprs `consts`."""
    return tuple(K.Param(p) for p in args) + tuple(K.Param(c, constexpr=True) for c in consts)


def lane_off(prefix: str, lanes: str = "lane", d3: str = "D3") -> str:
    """The memory offset of lanes `lanes` in tensor `prefix` (its lane strides)."""
    return f"lane_offsets({lanes}, D1, D2, {d3}, {prefix}_s0, {prefix}_s1, {prefix}_s2, {prefix}_s3)"


# --- program, sequence, time --------------------------------------------------------------------------------

def sequence_bounds() -> tuple:
    """t0, seq_len: where sequence `seq` starts in memory and its length."""
    return (when("VARLEN", [K.assign("t0", "tl.load(cu_ptr + seq).to(tl.int64)"),
                            K.assign("seq_len", "tl.load(cu_ptr + seq + 1).to(tl.int64) - t0")],
                 [K.assign("t0", "0"), K.assign("seq_len", "T")]),)


def prologue() -> tuple:
    """Program = (lane block, sequence). Packed sequences (VARLEN) start at cu[seq] in memory; the
    checkpoint slots of sequence `seq` start at t0 // CHUNK + seq (disjoint ranges, no host sync).
    Every lane block full (EVEN_L): the masks by lane_ok fold away."""
    return (K.assign("pid", "tl.program_id(0)"), K.assign("seq", "tl.program_id(1)"), K.assign("rows", "tl.arange(0, BLOCK_T)[:, None]"),
            K.assign("lane", "pid.to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L)"),
            when("EVEN_L", [K.assign("lane_ok", "tl.full([BLOCK_L], 1, tl.int1)")], [K.assign("lane_ok", "lane < L")]),
            *sequence_bounds(), K.assign("n_tiles", "tl.cdiv(seq_len, BLOCK_T)"), K.assign("slot0", "t0 // CHUNK + seq"))


def memory_index() -> tuple:
    """tt: the memory index of scan step t (backwards in memory when REVERSE), and its step."""
    return (when("REVERSE", [K.assign("tt", "(t0 + seq_len - 1 - t).to(tl.int64)"), K.assign("step", "-1")],
                 [K.assign("tt", "(t0 + t).to(tl.int64)"), K.assign("step", "1")]),)


def time_index() -> tuple:
    """t, ok (in the sequence; constant under EVEN_T: the masks fold away), and the memory index."""
    return (K.assign("t", "k * BLOCK_T + rows"),
            when("EVEN_T", [K.assign("ok", "tl.full([BLOCK_T, BLOCK_L], 1, tl.int1) & lane_ok[None, :]")],
                 [K.assign("ok", "(t < seq_len) & lane_ok[None, :]")]),
            *memory_index())


# --- projective leaves ---------------------------------------------------------------------------------------

def _max_tree(items: list[str]) -> str:
    """tl.maximum over `items`, as a balanced tree (independent maxima issue together)."""
    if len(items) == 1:
        return items[0]
    half = len(items) // 2
    return f"tl.maximum({_max_tree(items[:half])}, {_max_tree(items[half:])})"


def renormalise_leaf(ir: ScanIR, tag: str) -> tuple:
    """Projective monoids: the lifted leaf l{tag}_<field> scaled by inv_leaf{tag} = leaf_scale(its largest
    |field|), before any product, as the reference backend renormalises every leaf (there by its scale;
    any non-zero factor is the same projective element, and every combine result is divided by its scale,
    so the outputs are those of the raw leaves: leaves near 1e20 no longer overflow float32 in a product).
    The outputs do not change when a leaf is scaled, so d out / d leaf = inv_leaf * d out / d(scaled
    leaf): the backward multiplies each dx by its step's inv_leaf. Nothing for other monoids."""
    if not ir.is_projective:
        return ()
    largest = _max_tree([f"tl.abs(l{tag}_{f})" for f in ir.fields])
    return (K.assign(f"inv_leaf{tag}", f"leaf_scale({largest})"),
            *(K.assign(f"l{tag}_{f}", f"l{tag}_{f} * inv_leaf{tag}") for f in ir.fields))


def scale_leaf_gradient(ir: ScanIR, dx: str, tag: str) -> tuple:
    """dx<field> (format `dx`) times the step's inv_leaf{tag} (see `renormalise_leaf`); nothing unless projective."""
    if not ir.is_projective:
        return ()
    return tuple(K.assign(dx.format(f), f"{dx.format(f)} * inv_leaf{tag}") for f in ir.fields)


# --- combine calls, tiles -----------------------------------------------------------------------------------

def combine_call(ir: ScanIR, outs, args: str, unpack: bool = False, fn: str = "combine") -> tuple:
    """`outs = fn(args)` (fn the combine, or another function of the module such as runs.py's
    `combine_raw`), by `combine_rcp` under RCP_APPROX where fn is the combine and the module has one."""
    call = lambda f: K.Assign(tuple(outs), K.expr(f"{f}({args})"), unpack)  # noqa: E731
    if fn != "combine" or not has_combine_rcp(ir):
        return (call(fn),)
    return (when("RCP_APPROX", [call("combine_rcp")], [call("combine")]),)


def scan_call(ir: ScanIR, outs, args: str) -> tuple:
    """`outs = tl.associative_scan((args,), 0, combine)`, by `combine_rcp` under RCP_APPROX where the
    module has one."""
    call = lambda fn: K.Assign(tuple(outs), K.expr(f"tl.associative_scan(({args},), 0, {fn})"), True)  # noqa: E731
    if not has_combine_rcp(ir):
        return (call("combine"),)
    return (when("RCP_APPROX", [call("combine_rcp")], [call("combine")]),)


def lift(ir: ScanIR, tag: str, mask: str | None, prefix: str | None = None, unpadded=()) -> tuple:
    """l{tag}_<field>: the inputs u{tag}_<input> lifted (projective: renormalised, `renormalise_leaf`);
    e{tag}_<field>: the lifted leaf, the identity where `mask` is false (as lifted for the fields in
    `unpadded`, and for every field when `mask` is None). The lift's temporaries are `prefix`<k>
    (default _l{tag}). Every schedule lifts by this."""
    names = {s: f"u{tag}_{s.name[2:]}" for s in ir.input_symbols}
    prefix = f"_l{tag}" if prefix is None else prefix
    out = list(common.assign([f"l{tag}_{f}" for f in ir.fields], ir.lift, names, prefix, shape_like=f"u{tag}_{ir.inputs[0]}"))
    out += renormalise_leaf(ir, tag)
    for f, ident in zip(ir.fields, ir.identity):
        padded = mask is not None and f not in unpadded
        out.append(K.assign(f"e{tag}_{f}", f"tl.where({mask}, l{tag}_{f}, {_num(ident)})" if padded else f"l{tag}_{f}"))
    return tuple(out)


def load_lift(ir: ScanIR, tag: str = "", shift: int = 0, mask: str = "ok", stream: bool = False) -> tuple:
    """Load the inputs `shift` steps later in scan order (memory index tt + shift * step), lift them,
    and pad with the identity where `mask` is false: u{tag}_<input>, e{tag}_<field> (the tile and
    chunk-parallel schedules). `stream`: the inputs are read once, so they leave L2 first."""
    at = "tt" if shift == 0 else f"(tt + {shift} * step)"
    loads = tuple(K.Load(f"u{tag}_{n}", K.expr(f"u{i}_ptr + u{i}_off + {at} * u{i}_st"), K.expr(mask), K.expr("1.0"),
                         evict="evict_first" if stream else None)
                  for i, n in enumerate(ir.inputs))
    return loads + lift(ir, tag, mask)


def replay(ir: ScanIR, tag: str = "", out: str = "p") -> tuple:
    """Inclusive prefixes of the tile's elements e{tag}_* from the carry c_*, named {out}_*."""
    e = ", ".join(f"e{tag}_{f}" for f in ir.fields)
    c = ", ".join(f"c_{f}[None, :]" for f in ir.fields)
    s = [f"s{tag}_{f}" for f in ir.fields]
    return scan_call(ir, s, e) + combine_call(ir, [f"{out}_{f}" for f in ir.fields], f"{c}, {', '.join(s)}")


def previous(ir: ScanIR) -> tuple:
    """q_<field>: the previous prefix of each row (the carry at row 0)."""
    return (K.assign("prev_rows", "tl.maximum(rows - 1, 0) + tl.zeros([BLOCK_T, BLOCK_L], tl.int32)"),
            *(K.assign(f"q_{f}", f"tl.where(rows == 0, c_{f}[None, :], tl.gather(p_{f}, prev_rows, 0))") for f in ir.fields))


def initial_carry(ir: ScanIR, shape: str = "[BLOCK_L]") -> tuple:
    """c_<field> (a `shape` lane tensor): the initial element of each lane (of sequence `seq`), else
    the identity; fields of a specialised carry (`ir.constants`) are their constant."""
    const = dict(ir.constants)
    out = [K.assign(f"c_{f}", f"to_acc(tl.full({shape}, {_num(v)}, tl.float64), FP64)") for f, v in ir.constants]
    free = [(f, name, ident) for f, (name, ident) in enumerate(zip(ir.fields, ir.identity)) if name not in const]
    if not free:
        return tuple(out)
    load = [K.Load(f"c_{name}", K.expr(f"init{f}_ptr + seq * init{f}_sn + lane_offsets(lane, D1, D2, D3, init{f}_s0, "
                                       f"init{f}_s1, init{f}_s2, init{f}_s3)"), K.expr("lane_ok"), K.expr(_num(ident)))
            for f, name, ident in free]
    identity = [K.assign(f"c_{name}", f"to_acc(tl.full({shape}, {_num(ident)}, tl.float64), FP64)") for f, name, ident in free]
    return (*out, when("HAS_INIT", load, identity))


def tile_start_checkpoints(ir: ScanIR, carry: str, lanes: str, mask: str) -> tuple:
    """Store the carry {carry}_<field> into tile k as a checkpoint: into slot k when CHUNK == BLOCK_T,
    into slot k // (CHUNK // BLOCK_T) at every CHUNK // BLOCK_T-th tile when CHUNK is a longer multiple of
    BLOCK_T (a shorter CHUNK stores from inside the tile instead)."""
    every = checkpoint_store(ir, "slot0 + k // (CHUNK // BLOCK_T)", lanes, carry, mask)
    return (when("CKPT and CHUNK == BLOCK_T", checkpoint_store(ir, "slot0 + k", lanes, carry, mask)),
            when("CKPT and CHUNK > BLOCK_T", [when("k % (CHUNK // BLOCK_T) == 0", every)]))


def checkpoint_store(ir: ScanIR, slot: str, lanes: str, value: str, mask: str) -> tuple:
    """{value}_<field> stored as checkpoint `slot` of lanes `lanes` (masked by `mask`): field f of slot s
    at ckpt_ptr + (f * n_slots + s) * L + lane (the tile schedules' layout, read by `checkpoint_load`)."""
    return tuple(K.Store(K.expr(f"ckpt_ptr + ({f} * n_slots + {slot}) * L + {lanes}"), K.expr(f"{value}_{name}"),
                         K.expr(mask)) for f, name in enumerate(ir.fields))


def checkpoint_load(ir: ScanIR) -> tuple:
    """c_<field> [BLOCK_L]: the carry into tile k, from checkpoint slot0 + k (the identity on lanes past L)."""
    return tuple(K.Load(f"c_{name}", K.expr(f"ckpt_ptr + ({f} * n_slots + slot0 + k) * L + lane"), K.expr("lane_ok"),
                        K.expr(_num(ident))) for f, (name, ident) in enumerate(zip(ir.fields, ir.identity)))


# --- the module's small functions ------------------------------------------------------------------------

LEAF_SCALE_DOC = """2^-e where 2^e <= m < 2^(e + 1), m >= 0 the largest |field| of a projective leaf: the leaf times it
    has its largest field in [1, 2), exactly (a power of two). From the exponent bits, clamped to a finite
    normal factor (m = 0 or subnormal: 2^127 in float32; m = inf or NaN: 2^-126, the leaf stays as it is)."""

# leaf_scale's bit arithmetic, per accumulation dtype: (integer type, exponent mask, the exponent
# bits of 2^(bias - 1) and the largest exponent used, so that the factor stays a finite normal number).
LEAF_SCALE_BITS = {"tl.float64": ("tl.int64", "0x7FF0000000000000", "0x7FE0000000000000", "0x7FD0000000000000"),
                   "tl.float32": ("tl.int32", "0x7F800000", "0x7F000000", "0x7E800000")}


def _leaf_scale_body(dtype: str) -> tuple:
    """leaf_scale's statements for accumulation dtype `dtype`: e = the exponent bits of m; return the factor."""
    itype, mask, top, clamp = LEAF_SCALE_BITS[dtype]
    return (K.assign("e", f"m.to({itype}, bitcast=True) & {mask}"),
            K.Return((K.expr(f"({top} - tl.minimum(e, {clamp})).to({dtype}, bitcast=True)"),)))


def leaf_scale_kernel(doc: str = LEAF_SCALE_DOC) -> K.Kernel:
    """`leaf_scale(m)`: the exact power of two bringing a projective leaf's largest field into [1, 2)
    (the tile modules' and the chunk-parallel one's: chunked.py gives `doc` on one line)."""
    return K.Kernel("leaf_scale", (K.Param("m"),),
                    (when("m.dtype == tl.float64", _leaf_scale_body("tl.float64"), _leaf_scale_body("tl.float32")),),
                    doc=doc)


RECIPROCAL_DOC = """1 / x. HW (RCP_APPROX: float32 compiled for a GPU): the hardware reciprocal rcp.approx.ftz.f32,
    within 1 ulp, |x| > 2^126 flushed to 0 (one MUFU.RCP; the division is that plus range fixes);
    otherwise a division (float32: Triton's div.full.f32, 2 ulp; float64: IEEE)."""


def reciprocal_kernel() -> K.Kernel:
    """`reciprocal(x, HW)`: 1 / x, by the hardware instruction (inline PTX) when HW."""
    rcp = 'tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)'
    return K.Kernel("reciprocal", (K.Param("x"), K.Param("HW", constexpr=True)),
                    (when("HW", [K.assign("r", rcp)], [K.assign("r", "1.0 / x")]), K.Return((K.expr("r"),))), doc=RECIPROCAL_DOC)


def combine_rcp_kernel(ir: ScanIR, origin=()) -> K.Kernel | None:
    """`combine_rcp`: the combine with every reciprocal (its divisions, the projective rescale) by the
    hardware instruction; None when the combine inverts nothing."""
    if not has_combine_rcp(ir):
        return None
    xs, ys, names, out = combine_operands(ir)
    body = list(common.assign_inverted(out, ir.combine, names, "_c", shape_like=xs[0], hw="True"))
    if ir.is_projective:
        body += common.assign(["scale"], [ir.scale], dict(zip(ir.scale_symbols, out)), "_s")
        body += [K.assign("inv_scale", "reciprocal(scale, True)"), K.Return(tuple(K.expr(f"{o} * inv_scale") for o in out))]
    else:
        body.append(K.Return(tuple(K.expr(o) for o in out)))
    return K.Kernel("combine_rcp", tuple(K.Param(p) for p in xs + ys), tuple(body),
                    doc="combine(x, y) by the hardware reciprocal (float32 on a GPU: RCP_APPROX).", origin=origin)
