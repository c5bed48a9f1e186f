"""Run-based tile bodies of `scan_forward` / `scan_backward` (tiles of at least RUN_TILE steps), on
the kernel IR (kernel/ir.py): every function returns a tuple of statements (`raw_kernels` and
`sum_fields_kernel` whole `Kernel`s), placed in the tile kernels by codegen_tile.py.

`tl.associative_scan` over a [BLOCK_T, BLOCK_L] tile costs several combines per element (its
in-thread part covers only the 4 steps of one vector load; the warp shuffles and the cross-warp
pass combine again, and the carried prefix once more). Here a tile is RUN interleaved
[BLOCK_T // RUN, BLOCK_L] tensors: tensor j holds step run * RUN + j of every run, so a thread owns
whole runs of RUN consecutive steps and

    l_j  = e_0 (+) ... (+) e_j            in registers, RUN - 1 combines per run
    s    = scan over the runs of l_{RUN-1} (tl.associative_scan on 1/RUN of the elements)
    P    = c (+) s_{run-1}                 the prefix before each run (c before the first)
    p_j  = P (+) l_j                       RUN combines per run

about 2 combines per element instead of ~6. The previous prefix of step j is p_{j-1} (P for j = 0),
and the next step's element is e_{j+1}, both in the same thread: the backward needs no second
replay scan and no shifted loads except one per run; its reverse adjoint scan is split the same
way. Where time is contiguous (Triton specialises a unit stride), a run's
steps are loaded and stored VEC at a time (16-byte vectors split into the step tensors in
registers); otherwise one strided access per step. Values crossing threads (the runs' exclusive
prefixes, the carry into the next tile) go through one packed 1-D gather each.

Expressions stay source text (`K.Expr`); the monoid's own expressions are printed by the one
sympy -> Triton printer (codegen._assign / _assign_inverted, wrapped by `common.assign` and
`common.assign_inverted`); the statements the tile schedules share (combine and scan calls, checkpoints) are
builders.py's.
"""
from __future__ import annotations

import functools

import sympy

from scanlang import expr as E
from scanlang import tuning
from scanlang.autodiff import Adjoint
from scanlang.ir import ScanIR

from ..codegen import _num, combine_operands
from . import builders as B
from . import common
from .common import assign_inverted
from . import ir as K

X = K.expr
A = K.assign


def runs_shape() -> tuple[int, int, int]:
    """(RUN, VEC, RUN_TILE) of the program being rendered, render-time knobs of `scanlang.tuning`
    (in the program key): steps per run (one thread's consecutive steps), steps per vector
    load/store where time is contiguous, and the smallest tile that takes the run-based bodies."""
    t = tuning.current()
    return t.run, t.vec, t.run_tile


def prologue(ir: ScanIR, carried: str) -> tuple[K.Stmt, ...]:
    """run: the run index along the tile's rows; vec: the steps of one vector load; {carried}r_<field>:
    the carry {carried}_<field> [lanes] held on every run ([runs, lanes], so a tile hands it on with
    one gather instead of a reduction over the runs)."""
    RUN, VEC, _ = runs_shape()
    return (A("run", f"tl.arange(0, BLOCK_T // {RUN})[:, None]"), A("vec", f"tl.arange(0, {VEC})[None, None, :]"),
            *(A(f"{carried}r_{f}",
                f"{carried}_{f}[None, :] + tl.zeros([BLOCK_T // {RUN}, BLOCK_L], {carried}_{f}.dtype)")
              for f in ir.fields))


def epilogue(ir: ScanIR, carried: str) -> tuple[K.Stmt, ...]:
    """{carried}_<field> [lanes] again from the per-run copies (all runs hold the same value)."""
    return tuple(A(f"{carried}_{f}", f"tl.sum(tl.where(run == 0, {carried}r_{f}, 0.0), 0)") for f in ir.fields)


def run_index() -> tuple[K.Stmt, ...]:
    """ts: the first scan step of each run of tile k; ms its memory index; step the memory direction;
    m{h} the memory indices of the run's h-th VEC steps in increasing memory order (the last VEC
    steps first when REVERSE), okq{h} whether they are in the sequence (all true under EVEN_T: every
    step of the tile is in the sequence)."""
    RUN, VEC, _ = runs_shape()
    quads = range(RUN // VEC)
    # mq written so that Triton sees it divisible by VEC (seq_len and ts are)
    out = [A("ts", f"k * BLOCK_T + run * {RUN}"),
           K.If(X("REVERSE"), (A("mq", f"(t0 + seq_len - ts - {VEC}).to(tl.int64)"), A("step", "-1"),
                               A("ms", f"mq + {VEC - 1}")),
                (A("ms", "(t0 + ts).to(tl.int64)"), A("step", "1"), A("mq", "ms")))]
    out += [A(f"m{h}", f"(mq + ({h * VEC} * step))[:, :, None] + vec") for h in quads]
    full = f"tl.full([BLOCK_T // {RUN}, BLOCK_L, {VEC}], 1, tl.int1) & lane_ok[None, :, None]"
    out.append(K.If(X("EVEN_T"), tuple(A(f"okq{h}", full) for h in quads),
                    tuple(A(f"okq{h}", f"(m{h} >= t0) & (m{h} < t0 + seq_len) & lane_ok[None, :, None]")
                          for h in quads)))
    return tuple(out)


def step_masks() -> tuple[K.Stmt, ...]:
    """ok{j}: step j of every run is in the sequence (constant under EVEN_T: the masks fold away)."""
    RUN = runs_shape()[0]
    full = f"tl.full([BLOCK_T // {RUN}, BLOCK_L], 1, tl.int1) & lane_ok[None, :]"
    return (K.If(X("EVEN_T"), tuple(A(f"ok{j}", full) for j in range(RUN)),
                 tuple(A(f"ok{j}", f"(ts + {j} < seq_len) & lane_ok[None, :]") for j in range(RUN))),)


def bases(names) -> tuple[K.Stmt, ...]:
    """Per-tile base pointers at the runs' first steps for tensors `names` (e.g. u0, g0)."""
    return tuple(A(f"{n}_at", f"{n}_ptr + {n}_off + ms * {n}_st") for n in names)


def _split_vec(h: int, src: str, outs: str) -> tuple[K.Stmt, ...]:
    """The VEC steps of vector `src` ([runs, lanes, VEC], memory order) as outs.format(j), j the step."""
    RUN, VEC, _ = runs_shape()
    parts = X(", ".join(f"{src}_{q}" for q in range(VEC)))
    fwd = tuple(outs.format(h * VEC + q) for q in range(VEC))
    rev = tuple(outs.format(h * VEC + VEC - 1 - q) for q in range(VEC))
    return (K.Assign((f"{src}_a", f"{src}_b"), X(f"tl.split(tl.reshape({src}, [BLOCK_T // {RUN}, BLOCK_L, 2, 2]))")),
            K.Assign((f"{src}_0", f"{src}_2"), X(f"tl.split({src}_a)")),
            K.Assign((f"{src}_1", f"{src}_3"), X(f"tl.split({src}_b)")),
            K.If(X("REVERSE"), (K.Assign(rev, parts),), (K.Assign(fwd, parts),)))


def _join_vec(h: int, vals: str, dst: str) -> tuple[K.Stmt, ...]:
    """vals.format(j) of the VEC steps of quad h joined into `dst` ([runs, lanes, VEC], memory order)."""
    RUN, VEC, _ = runs_shape()

    def joined(js):
        a, b, c, d = (vals.format(j) for j in js)
        quad = f"tl.join(tl.join({a}, {c}), tl.join({b}, {d}))"
        return (A(dst, f"tl.reshape({quad}, [BLOCK_T // {RUN}, BLOCK_L, {VEC}])"),)

    return (K.If(X("REVERSE"), joined([h * VEC + VEC - 1 - q for q in range(VEC)]),
                 joined([h * VEC + q for q in range(VEC)])),)


def load_steps(tensor: str, out: str, other: str) -> tuple[K.Stmt, ...]:
    """out.format(j): tensor `tensor` (u0, g0, ...) at step j of every run; vector loads of VEC steps
    when its time stride is 1 (Triton specialises a stride of 1 into a constant), else one per step."""
    RUN, VEC, _ = runs_shape()
    vector = []
    for h in range(RUN // VEC):
        vector.append(K.Load("w", X(f"{tensor}_ptr + {tensor}_off[:, :, None] + m{h}"), X(f"okq{h}"), X(other),
                             to_acc=False))
        vector += _split_vec(h, "w", out)
    scalar = tuple(K.Load(out.format(j), X(f"{tensor}_at + ({j} * step) * {tensor}_st"), X(f"ok{j}"), X(other),
                          to_acc=False) for j in range(RUN))
    return (K.If(X(f"{tensor}_st == 1"), tuple(vector), scalar),)


def store_steps(tensor: str, vals: str, cast: str, mask_j: str = "ok{}", mask_q: str = "okq{}") -> tuple[K.Stmt, ...]:
    """Store vals.format(j) at step j of every run of `tensor` (vector stores when its time stride is 1)."""
    RUN, VEC, _ = runs_shape()
    vector = []
    for h in range(RUN // VEC):
        vector += _join_vec(h, vals, "w")
        vector.append(K.Store(X(f"{tensor}_ptr + {tensor}_off[:, :, None] + m{h}"), X(f"w.to({cast})"),
                              X(mask_q.format(h))))
    scalar = tuple(K.Store(X(f"{tensor}_at + ({j} * step) * {tensor}_st"), X(f"{vals.format(j)}.to({cast})"),
                           X(mask_j.format(j))) for j in range(RUN))
    return (K.If(X(f"{tensor}_st == 1"), tuple(vector), scalar),)


def _direct_fields(ir: ScanIR) -> dict[int, tuple[str, float]]:
    """Inputs lifted unchanged into exactly one field (and into no other field's lift): input index ->
    (field, identity). Their loads pad with the identity, so no select is needed after the lift."""
    out = {}
    for i, u in enumerate(ir.input_symbols):
        users = [f for f, e in enumerate(ir.lift) if u in e.free_symbols]
        if len(users) == 1 and ir.lift[users[0]] == u:
            out[i] = (ir.fields[users[0]], ir.identity[users[0]])
    return out


def _lift_run(ir: ScanIR, tag: str, mask: str) -> tuple[K.Stmt, ...]:
    """e{tag}_<field>: the lifted inputs u{tag}_<input>, the identity where `mask` is false."""
    # a renormalised padding step is the identity only where every field is selected
    direct = set() if ir.is_projective else {f for f, _ in _direct_fields(ir).values()}
    return (tuple(A(f"u{tag}_{n}", f"to_acc(u{tag}_{n}, FP64)") for n in ir.inputs)
            + B.lift(ir, tag, mask, prefix=f"_l{tag}_", unpadded=direct))


def _pad(ir: ScanIR, i: int) -> str:
    """The value a masked load of input i gives: the identity of the field it is lifted into unchanged."""
    direct = _direct_fields(ir)
    return _num(direct[i][1]) if i in direct else "1.0"


def load_lift_runs(ir: ScanIR) -> tuple[K.Stmt, ...]:
    """Inputs u{j}_<input> and elements e{j}_<field> of every step j of every run."""
    RUN = runs_shape()[0]
    out = []
    for i, name in enumerate(ir.inputs):
        out += load_steps(f"u{i}", f"u{{}}_{name}", _pad(ir, i))
    for j in range(RUN):
        out += _lift_run(ir, str(j), f"ok{j}")
    return tuple(out)


def load_lift_after(ir: ScanIR) -> tuple[K.Stmt, ...]:
    """un_<input>, en_<field>: the step after each run (masked by okn)."""
    RUN = runs_shape()[0]
    loads = tuple(K.Load(f"un_{name}", X(f"u{i}_at + ({RUN} * step) * u{i}_st"), X("okn"), X(_pad(ir, i)), to_acc=False)
                  for i, name in enumerate(ir.inputs))
    return loads + _lift_run(ir, "n", "okn")


def combine(ir: ScanIR, out: str, x: str, y: str, fn: str = "combine") -> tuple[K.Stmt, ...]:
    """out_<field> = fn(x_<field>.., y_<field>..) (one field: combine returns the value itself)."""
    args = f"{', '.join(f'{x}_{f}' for f in ir.fields)}, {', '.join(f'{y}_{f}' for f in ir.fields)}"
    return B.combine_call(ir, [f"{out}_{f}" for f in ir.fields], args, fn=fn)


def replay_runs(ir: ScanIR, raw: bool = False, carry: str = "cr") -> tuple[K.Stmt, ...]:
    """Prefixes p{j}_* of every step of the tile from the elements e{j}_* and the carry {carry}_*
    ([runs, lanes]); P_* is the prefix before each run (the carry before the first). `raw`: p{j}_*
    not rescaled, nor the run's partial products r{j}_* of an odd number of elements (j even): each
    is one element times a rescaled r{j-1}, so no product grows past two elements' magnitude (what
    every rescaled combine already computes before it rescales)."""
    RUN = runs_shape()[0]
    out = [A(f"r0_{f}", f"e0_{f}") for f in ir.fields]
    for j in range(1, RUN):
        out += combine(ir, f"r{j}", f"r{j - 1}", f"e{j}", "combine_raw" if raw and j % 2 == 0 else "combine")
    out += B.scan_call(ir, [f"s_{f}" for f in ir.fields], ", ".join(f"r{RUN - 1}_{f}" for f in ir.fields))
    out.append(A("prev_run", f"tl.maximum(tl.arange(0, BLOCK_T // {RUN} * BLOCK_L) - BLOCK_L, 0)"))
    out += gather_runs([f"s_{f}" for f in ir.fields], "prev_run", [f"x_{f}" for f in ir.fields])
    out += [A(f"cb_{f}", f"{carry}_{f}") for f in ir.fields]
    out += combine(ir, "pc", "cb", "x")
    out += [A(f"P_{f}", f"tl.where(run == 0, cb_{f}, pc_{f})") for f in ir.fields]
    for j in range(RUN):
        out += combine(ir, f"p{j}", "P", f"r{j}", "combine_raw" if raw else "combine")
    return tuple(out)


@functools.lru_cache(maxsize=256)
def scale_invariant_readout(ir: ScanIR) -> bool:
    """True for a projective monoid whose readout does not change when the prefix and the previous
    prefix are each multiplied by any non-zero number (e.g. Möbius (a + b) / (c + d)): then the
    forward's readout may take unnormalised prefixes (P (+) r_j without the rescale)."""
    if not ir.is_projective:
        return False
    lam, mu = sympy.Symbol("_lambda", nonzero=True), sympy.Symbol("_mu", nonzero=True)
    scaled = dict(zip(ir.prefix_symbols, [lam * x for x in ir.prefix_symbols]))
    scaled |= dict(zip(ir.previous_symbols, [mu * x for x in ir.previous_symbols]))
    for r in ir.readout:
        if r.count_ops() > 60:
            return False
        if sympy.simplify(r.subs(scaled, simultaneous=True) - r) != 0:
            return False
    return True


def _return(values) -> K.Return:
    return K.Return(tuple(X(v) for v in values))


def raw_kernels(ir: ScanIR) -> tuple[K.Kernel, ...]:
    """`combine_raw` (the combine without the rescale) and `normalise` (the rescale alone) of a
    projective monoid whose readout is scale invariant; nothing otherwise."""
    if not scale_invariant_readout(ir):
        return ()
    xs, ys, names, out = combine_operands(ir)
    raw = common.assign(out, ir.combine, names, "_c", shape_like=xs[0]) + (_return(out),)
    norm = common.assign(["scale"], [ir.scale], dict(zip(ir.scale_symbols, out)), "_s")
    norm += (A("inv_scale", "reciprocal(scale, HW)"), _return(f"{o} * inv_scale" for o in out))
    return (K.Kernel("combine_raw", tuple(K.Param(p) for p in xs + ys), raw, doc="combine(x, y) without the rescale."),
            K.Kernel("normalise", tuple(K.Param(p) for p in out) + (K.Param("HW", constexpr=True),), norm,
                     doc="m rescaled as the combine rescales (HW: by the hardware reciprocal, as combine_rcp)."))


def _pack(items: list[str]) -> str:
    """One tensor [..., 2, .., 2] holding `items` (a power-of-2 count) in order along its new axes."""
    if len(items) == 1:
        return items[0]
    return f"tl.join({_pack(items[0::2])}, {_pack(items[1::2])})"


def _unpack(src: str, items: list[str], tmp: str) -> list[K.Stmt]:
    """Statements assigning the tensors packed by `_pack(items)` in `src` back to `items`."""
    if len(items) == 1:
        return [A(items[0], src)]
    return ([K.Assign((f"{tmp}0", f"{tmp}1"), X(f"tl.split({src})"))]
            + _unpack(f"{tmp}0", items[0::2], f"{tmp}0_") + _unpack(f"{tmp}1", items[1::2], f"{tmp}1_"))


def gather_runs(srcs: list[str], index: str, outs: list[str]) -> tuple[K.Stmt, ...]:
    """outs[i] = srcs[i] at run `index` ([runs * lanes], flattened run-major) of each run, all in one
    gather through shared memory: the tensors are packed along new in-register axes and flattened
    (Triton gives a 2-D gather a warp-local layout that replicates the tile over the warps; a 1-D
    one goes through shared memory, one exchange and barrier pair for all of them)."""
    RUN = runs_shape()[0]
    flat = f"BLOCK_T // {RUN} * BLOCK_L"
    k = 1 << max(0, (len(srcs) - 1).bit_length())
    pad = [f"tl.zeros_like({srcs[0]})"] * (k - len(srcs))
    items = [f"tl.reshape(to_acc({x}, FP64), [{flat}])" for x in srcs + pad]
    idx = [f"{index} * {k} + {i}" for i in range(k)]
    shape = ", ".join(["2"] * (k.bit_length() - 1))
    gathered = (f"tl.gather(tl.reshape({_pack(items)}, [{flat} * {k}]), "
                f"tl.reshape({_pack(idx)}, [{flat} * {k}]), 0)")
    out = [A("gathered", f"tl.reshape({gathered}, [{flat}{', ' + shape if shape else ''}])")]
    out += _unpack("gathered", [f"{o}_flat" for o in outs] + [f"_unused{i}" for i in range(len(pad))], "_gs")
    return tuple(out + [A(o, f"tl.reshape({o}_flat, [BLOCK_T // {RUN}, BLOCK_L])") for o in outs])


def _last_prefix(ir: ScanIR, raw: bool = False) -> tuple[K.Stmt, ...]:
    """cr_*: the prefix at the tile's last valid step (padding may not even be finite) on every run;
    rescaled here when the prefixes are `raw`."""
    RUN = runs_shape()[0]
    out = [K.If(X("EVEN_T"), (A("last", "BLOCK_T - 1"),),
                (A("last", "tl.minimum(seq_len - 1 - k * BLOCK_T, BLOCK_T - 1)"),)),
           A("last_run", f"last // {RUN}")]
    out += [A(f"z_{f}", f"p{RUN - 1}_{f}") for f in ir.fields]
    chain = ()   # if last % RUN == 0: z = p0 / elif == 1: z = p1 ...
    for j in range(RUN - 2, -1, -1):
        chain = (K.If(X(f"last % {RUN} == {j}"), tuple(A(f"z_{f}", f"p{j}_{f}") for f in ir.fields), chain),)
    out.append(K.If(X(f"last % {RUN} != {RUN - 1}"), chain))
    if raw:
        zs = tuple(f"z_{f}" for f in ir.fields)
        out.append(K.Assign(zs, X(f"normalise({', '.join(zs)}, RCP_APPROX)")))
    out.append(A("last_run_lane", f"last_run * BLOCK_L + tl.arange(0, BLOCK_T // {RUN} * BLOCK_L) % BLOCK_L"))
    return tuple(out) + gather_runs([f"z_{f}" for f in ir.fields], "last_run_lane", [f"cr_{f}" for f in ir.fields])


def sum_runs(ir: ScanIR, out: str, src: str) -> tuple[K.Stmt, ...]:
    """out_<field> = src_<field> summed over the runs, all fields in one reduction (one exchange
    through shared memory instead of one per field)."""
    if len(ir.fields) == 1:
        return (A(f"{out}_{ir.fields[0]}", f"tl.sum({src}_{ir.fields[0]}, 0)"),)
    return (K.Assign(tuple(f"{out}_{f}" for f in ir.fields),
                     X(f"tl.reduce(({', '.join(f'{src}_{f}' for f in ir.fields)}), 0, sum_fields)")),)


def sum_fields_kernel(ir: ScanIR) -> K.Kernel:
    """`sum_fields(x.., y..)`: fieldwise sum (the combine of `sum_runs`)."""
    xs = [f"x_{f}" for f in ir.fields]
    ys = [f"y_{f}" for f in ir.fields]
    return K.Kernel("sum_fields", tuple(K.Param(p) for p in xs + ys),
                    (_return(f"{x} + {y}" for x, y in zip(xs, ys)),), doc="Fieldwise x + y.")


def forward_loop(ir: ScanIR) -> tuple[K.Stmt, ...]:
    """The tile loop of `scan_forward` on runs (module docstring); same checkpoints and outputs."""
    RUN, VEC, _ = runs_shape()
    loop = list(run_index() + step_masks())
    loop += B.tile_start_checkpoints(ir, "cr", "lane[None, :] + run * 0", "(run == 0) & lane_ok[None, :]")
    loop += bases([f"u{i}" for i in range(len(ir.inputs))] + [f"o{j}" for j in range(len(ir.outputs))])
    raw = scale_invariant_readout(ir)
    loop += load_lift_runs(ir)
    loop += replay_runs(ir, raw)
    # checkpoints every CHUNK steps from inside the tile: the prefix at each chunk's last step
    for j in range(RUN):
        store = [A(f"chunk{j}", f"(ts + {j}) // CHUNK + 1"),
                 A(f"end{j}",
                   f"((ts + {j}) % CHUNK == CHUNK - 1) & (chunk{j} < tl.cdiv(seq_len, CHUNK)) & lane_ok[None, :]")]
        saved = f"p{j}"
        if raw:
            saved = f"n{j}"
            store.append(K.Assign(tuple(f"n{j}_{f}" for f in ir.fields),
                                  X(f"normalise({', '.join(f'p{j}_{f}' for f in ir.fields)}, RCP_APPROX)")))
        store += B.checkpoint_store(ir, f"slot0 + chunk{j}", "lane[None, :]", saved, f"end{j}")
        # a chunk that is a multiple of RUN ends only on a run's last step
        cond = "CHUNK < BLOCK_T" if j == RUN - 1 else f"CHUNK < BLOCK_T and CHUNK % {RUN} != 0"
        loop.append(K.If(X(cond), tuple(store)))
    for j in range(RUN):
        names = ({s: f"p{j}_{s.name[2:]}" for s in ir.prefix_symbols}
                 | {s: (f"P_{s.name[2:]}" if j == 0 else f"p{j - 1}_{s.name[2:]}") for s in ir.previous_symbols}
                 | {s: f"u{j}_{s.name[2:]}" for s in ir.input_symbols})
        outs = [f"y{j}_{o}" for o in range(len(ir.outputs))]
        loop += assign_inverted(outs, ir.readout, names, f"_r{j}_", shape_like=f"p{j}_{ir.fields[0]}")
        if ir.reduce_state:
            loop += [A(f"y{j}_{o}", f"tl.sum(tl.reshape(y{j}_{o}, (BLOCK_T // {RUN}, BLOCK_L // STATE, STATE)), 2)")
                     for o in range(len(ir.outputs))]
    if ir.reduce_state:
        loop += [A(f"okg{j}", f"(ts + {j} < seq_len) & group_ok[None, :]") for j in range(RUN)]
        loop += [A(f"okgq{h}", f"(m{h} >= t0) & (m{h} < t0 + seq_len) & group_ok[None, :, None]")
                 for h in range(RUN // VEC)]
    for o in range(len(ir.outputs)):
        masks = ("okg{}", "okgq{}") if ir.reduce_state else ("ok{}", "okq{}")
        loop += store_steps(f"o{o}", f"y{{}}_{o}", f"o{o}_ptr.dtype.element_ty", *masks)
    loop += _last_prefix(ir, raw)
    return tuple(loop)


def _du_store_runs(i: int, name: str) -> K.If:
    """Write du{j}_<name> (step j of every run) by the constexpr mode DU{i}: 0 store, 1 atomic add,
    2 summed over time, 3 summed over the STATE lanes then stored, 4 summed then atomically added."""
    RUN = runs_shape()[0]
    cast = f"du{i}_ptr.dtype.element_ty"
    adds = tuple(K.AtomicAdd(X(f"du{i}_at + ({j} * step) * du{i}_st"), X(f"du{j}_{name}.to({cast})"), X(f"ok{j}"))
                 for j in range(RUN))
    sums = tuple(K.AugAssign(f"acc{i}", X(f"tl.sum(tl.where(ok{j}, du{j}_{name}, 0.0), 0)")) for j in range(RUN))
    grouped = []
    for j in range(RUN):
        mask = X(f"(ts + {j} < seq_len) & group_ok[None, :]")
        grouped += [A("red", f"tl.sum(tl.reshape(tl.where(ok{j}, du{j}_{name}, 0.0), "
                             f"(BLOCK_T // {RUN}, BLOCK_L // STATE, STATE)), 2)"),
                    A("gptr", f"du{i}_ptr + du{i}_goff + (ms + {j} * step) * du{i}_st"),
                    K.If(X(f"DU{i} == 3"), (K.Store(X("gptr"), X(f"red.to({cast})"), mask),),
                         (K.AtomicAdd(X("gptr"), X(f"red.to({cast})"), mask),))]
    return K.If(X(f"DU{i} == 0"), store_steps(f"du{i}", f"du{{}}_{name}", cast),
                (K.If(X(f"DU{i} == 1"), adds, (K.If(X(f"DU{i} == 2"), sums, tuple(grouped)),)),))


def _matvec(adj: Adjoint, entries: list[str], vec: list[str], add: list[str] | None = None) -> list[sympy.Expr]:
    """add + B vec with B given by its stored `entries` (names), as expressions over symbols."""
    n = len(vec)
    mat = adj.matrix([E.symbol(b) for b in entries])
    return [(E.symbol(add[i]) if add else sympy.Integer(0))
            + sum((mat[i][k] * E.symbol(vec[k]) for k in range(n)), sympy.Integer(0)) for i in range(n)]


def backward_loop(ir: ScanIR, adj: Adjoint) -> tuple[K.Stmt, ...]:
    """The tile loop of `scan_backward` on runs: replay the runs' prefixes (the previous prefix and
    the next element are the neighbouring step in the same thread), form the adjoint elements, then
    the reverse affine scan gbar_t = v_t + A_t gbar_{t+1} the same way as the forward: per run the
    composed maps (RUN - 1 adjoint combines), a reverse scan over the runs, and per step one
    matrix-vector product from the gbar entering the run."""
    RUN = runs_shape()[0]
    n, nb = len(ir.fields), len(adj.b_entries)
    F = ir.fields
    loop = [A("k", "n_tiles - 1 - kk"), *run_index(), *step_masks()]
    loop.append(A("okn", f"(ts + {RUN} < seq_len) & lane_ok[None, :]"))
    loop += B.checkpoint_load(ir)
    loop += bases([f"u{i}" for i in range(len(ir.inputs))] + [f"g{j}" for j in range(len(ir.outputs))]
                  + [f"du{i}" for i in range(len(ir.inputs))])
    loop += [A(f"cr_{f}", f"c_{f}[None, :] + tl.zeros([BLOCK_T // {RUN}, BLOCK_L], c_{f}.dtype)") for f in F]
    loop += load_lift_runs(ir) + load_lift_after(ir)
    # the upstream gradients are loaded with the inputs, before the replay's exchanges through shared memory
    # (barriers), so both loads' latencies overlap
    for jo, o in enumerate(ir.outputs):
        loop += load_steps(f"g{jo}", f"g{{}}_{o}", "0.0")
        loop += [A(f"g{j}_{o}", f"to_acc(g{j}_{o}, FP64)") for j in range(RUN)]
    loop += replay_runs(ir)
    shape = f"p0_{F[0]}"

    def q(j, f):   # the previous prefix of step j
        return f"P_{f}" if j == 0 else f"p{j - 1}_{f}"

    def nxt(j, f):   # the element of step j + 1
        return f"en_{f}" if j == RUN - 1 else f"e{j + 1}_{f}"

    def ok_next(j):
        return "okn" if j == RUN - 1 else f"ok{j + 1}"

    if ir.uses_previous:   # the readout after the run's last step: its prefix and upstream gradient
        loop += combine(ir, "pn", f"p{RUN - 1}", "en")
        loop += [K.Load(f"gn_{o}", X(f"g{jo}_at + ({RUN} * step) * g{jo}_st"), X("okn"), X("0.0"))
                 for jo, o in enumerate(ir.outputs)]
    for j in range(RUN):   # divisions by reciprocals, each inverted once per step (`recips`)
        recips = {}
        here = ({s: f"p{j}_{s.name[2:]}" for s in ir.prefix_symbols}
                | {s: q(j, s.name[2:]) for s in ir.previous_symbols}
                | {g: f"g{j}_{g.name[2:]}" for g in adj.g} | {s: f"u{j}_{s.name[2:]}" for s in ir.input_symbols})
        loop += assign_inverted([f"dy{j}_{f}" for f in F], adj.dy, here, f"_d{j}_", shape_like=shape, recips=recips)
        if ir.uses_previous:   # c_{t+1}: the next readout differentiated in its previous prefix (= p_t)
            last = j == RUN - 1
            names = ({s: (f"pn_{s.name[2:]}" if last else f"p{j + 1}_{s.name[2:]}") for s in ir.prefix_symbols}
                     | {s: f"p{j}_{s.name[2:]}" for s in ir.previous_symbols}
                     | {g: (f"gn_{g.name[2:]}" if last else f"g{j + 1}_{g.name[2:]}") for g in adj.g}
                     | {s: (f"un_{s.name[2:]}" if last else f"u{j + 1}_{s.name[2:]}") for s in ir.input_symbols})
            loop += assign_inverted([f"cn{j}_{f}" for f in F], adj.c, names, f"_n{j}_", shape_like=shape, recips=recips)
            cn = [f" + tl.where({ok_next(j)}, cn{j}_{f}, 0.0)" for f in F]
        else:
            cn = [""] * n
        a_names = ({s: f"p{j}_{s.name[2:]}" for s in ir.previous_symbols}
                   | {s: nxt(j, f) for s, f in zip(ir.later, F)})
        loop += assign_inverted([f"a{j}_{b}" for b in range(nb)], adj.b_entries, a_names, f"_a{j}_", shape_like=shape,
                                recips=recips)
        # the last step has no successor: A = 0 (its padding may not be finite)
        loop += [A(f"a{j}_{b}", f"tl.where({ok_next(j)}, a{j}_{b}, 0.0)") for b in range(nb)]
        loop.append(A(f"last{j}", f"ts + {j} == seq_len - 1"))
        loop += [A(f"d{j}_{f}", f"dy{j}_{f}{cn[i]} + tl.where(last{j}, dfin_{f}[None, :], 0.0)")
                 for i, f in enumerate(F)]
        names_v = {s: f"p{j}_{s.name[2:]}" for s in ir.prefix_symbols} | {s: f"d{j}_{s.name[2:]}" for s in adj.d}
        loop += assign_inverted([f"v{j}_{f}" for f in F], adj.direct, names_v, f"_v{j}_", shape_like=shape,
                                recips=recips)
        loop += [A(f"v{j}_{f}", f"tl.where(ok{j}, v{j}_{f}, 0.0)") for f in F]
    # per run: the map gbar_{run end + 1} -> gbar_{run start}, composed from the last step backwards
    last = RUN - 1
    loop += [A(f"mb{last}_{b}", f"a{last}_{b}") for b in range(nb)] + [A(f"mv{last}_{f}", f"v{last}_{f}") for f in F]
    for j in range(RUN - 2, -1, -1):
        outs = [f"mb{j}_{b}" for b in range(nb)] + [f"mv{j}_{f}" for f in F]
        args = ([f"mb{j + 1}_{b}" for b in range(nb)] + [f"mv{j + 1}_{f}" for f in F]
                + [f"a{j}_{b}" for b in range(nb)] + [f"v{j}_{f}" for f in F])
        loop.append(K.Assign(tuple(outs), X(f"adjoint_combine({', '.join(args)})")))
    tb = [f"tb_{b}" for b in range(nb)]
    tv = [f"tv_{f}" for f in F]
    scanned = ", ".join([f"mb0_{b}" for b in range(nb)] + [f"mv0_{f}" for f in F])
    loop.append(K.Assign(tuple(tb + tv), X(f"tl.associative_scan(({scanned},), 0, adjoint_combine, reverse=True)")))
    # gbar entering each run from the later runs (the carried gc after the tile's last run)
    flat = f"BLOCK_T // {RUN} * BLOCK_L"
    loop.append(A("next_run", f"tl.minimum(tl.arange(0, {flat}) + BLOCK_L, {flat} - 1)"))
    loop += gather_runs(tb + tv, "next_run", [f"{x}n" for x in tb + tv])
    entering = _matvec(adj, [f"{x}n" for x in tb], [f"gcb_{f}" for f in F], [f"{x}n" for x in tv])
    loop += [A(f"gcb_{f}", f"gcr_{f}") for f in F]
    names = {E.symbol(f"{x}n"): f"{x}n" for x in tb + tv} | {E.symbol(f"gcb_{f}"): f"gcb_{f}" for f in F}
    loop += common.assign([f"ge_{f}" for f in F], entering, names, "_ge")
    loop += [A(f"gin_{f}", f"tl.where(run == BLOCK_T // {RUN} - 1, gcb_{f}, ge_{f})") for f in F]
    # gbar_t = v_t + A_t gbar_{t+1}, the run's steps backwards
    after = [f"gin_{f}" for f in F]
    for j in range(RUN - 1, -1, -1):
        exprs = _matvec(adj, [f"a{j}_{b}" for b in range(nb)], after, [f"v{j}_{f}" for f in F])
        names = ({E.symbol(f"a{j}_{b}"): f"a{j}_{b}" for b in range(nb)} | {E.symbol(x): x for x in after}
                 | {E.symbol(f"v{j}_{f}"): f"v{j}_{f}" for f in F})
        loop += common.assign([f"gbar{j}_{f}" for f in F], exprs, names, f"_g{j}_")
        after = [f"gbar{j}_{f}" for f in F]
    for j in range(RUN):   # after the adjoint scan: reciprocals again (none kept live across it)
        recips = {}
        names_x = ({s: q(j, s.name[2:]) for s in ir.previous_symbols} | {s: f"gbar{j}_{s.name[5:]}" for s in adj.gbar}
                   | {s: f"e{j}_{f}" for s, f in zip(ir.later, F)})
        loop += assign_inverted([f"dx{j}_{f}" for f in F], adj.dx, names_x, f"_x{j}_", shape_like=shape, recips=recips)
        loop += B.scale_leaf_gradient(ir, f"dx{j}_" + "{}", str(j))
        names_u = ({s: f"p{j}_{s.name[2:]}" for s in ir.prefix_symbols}
                   | {s: q(j, s.name[2:]) for s in ir.previous_symbols}
                   | {g: f"g{j}_{g.name[2:]}" for g in adj.g} | {s: f"u{j}_{s.name[2:]}" for s in ir.input_symbols}
                   | {s: f"dx{j}_{s.name[3:]}" for s in adj.dx_symbols})
        loop += assign_inverted([f"du{j}_{name}" for name in ir.inputs], adj.du, names_u, f"_u{j}_", shape_like=shape,
                                recips=recips)
    loop += [_du_store_runs(i, name) for i, name in enumerate(ir.inputs)]
    loop.append(A("first_run_lane", f"tl.arange(0, BLOCK_T // {RUN} * BLOCK_L) % BLOCK_L"))
    loop += gather_runs([f"gbar0_{f}" for f in F], "first_run_lane", [f"gcr_{f}" for f in F])
    # dL/d(initial) = J1(q_0, x_0)^T gbar_0 + c_0, from the tile's first step (the loop's last tile)
    here0 = ({s: f"p0_{s.name[2:]}" for s in ir.prefix_symbols} | {s: f"P_{s.name[2:]}" for s in ir.previous_symbols}
             | {g: f"g0_{g.name[2:]}" for g in adj.g} | {s: f"u0_{s.name[2:]}" for s in ir.input_symbols})
    recips = {}
    init = assign_inverted([f"cq_{f}" for f in F], adj.c, here0, "_i", shape_like=shape, recips=recips)
    b_names = {s: f"P_{s.name[2:]}" for s in ir.previous_symbols} | {s: f"e0_{f}" for s, f in zip(ir.later, F)}
    init += assign_inverted([f"b{k}" for k in range(nb)], adj.b_entries, b_names, "_b", shape_like=shape, recips=recips)
    w = _matvec(adj, [f"b{k}" for k in range(nb)], [f"gbar0_{f}" for f in F], [f"cq_{f}" for f in F])
    names_w = ({E.symbol(f"cq_{f}"): f"cq_{f}" for f in F} | {E.symbol(f"gbar0_{f}"): f"gbar0_{f}" for f in F}
               | {E.symbol(f"b{k}"): f"b{k}" for k in range(nb)})
    init += common.assign([f"w_{f}" for f in F], w, names_w, "_w", shape_like=shape)
    init += tuple(A(f"w_{f}", f"tl.where(run == 0, w_{f}, 0.0)") for f in F) + sum_runs(ir, "w0", "w")
    loop.append(K.If(X("HAS_INIT"), init))
    return tuple(loop)
