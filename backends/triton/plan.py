"""Launch plans: everything a scan launch derives from shapes, strides, dtypes and flags.

A plan holds the broadcast shape, the lane layout (or the note that inputs are copied to contiguous
first), the chosen configs and their `fit_launch` keys, and the kernels' scalar arguments with a
hole wherever a tensor goes. `ops._forward` / `ops._backward_pass` build one per call under tracing
(shapes may be symbolic there) and take one from `PLANS` in eager mode, so a repeated eager call
only allocates and launches.

The cache key is everything a plan reads: program key, pass flags, every tensor's (shape, stride,
dtype), the device, the number of sequences, and the launch-time knobs of `scanlang.tuning` (a
forced config or a gradient mode changes the plan; `launch_key`). The config that survives `fit_launch` (runtime.FITTED) is looked up at each launch, never cached here.
"""
from __future__ import annotations

import dataclasses

import torch

from scanlang import settings, tuning

from . import runtime
from .kernel import chunked
from .kernel.builders import ADDING_MODES, GradMode
from .runtime import Config, broadcast_strides, lane_layout


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def contiguous_strides(shape) -> list[int]:
    """Strides of a contiguous tensor of `shape` (as torch lays it out: size-0 dims count as 1)."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return out[::-1]


def _buffer_strides(buffer_shape, shape) -> list[int]:
    """Broadcast strides of a contiguous buffer of `buffer_shape` seen in `shape`."""
    return [0 if (n == 1 and m != 1) else s for n, m, s in zip(buffer_shape, shape, contiguous_strides(buffer_shape))]


def _time_contiguous(sizes, strides, dim) -> bool:
    """Whether the first input that moves along `dim` has unit time stride."""
    for size, st in zip(sizes, strides):
        if size[dim] > 1 and st[dim] != 0:
            return st[dim] == 1
    return False


ATOMIC_MODES = ADDING_MODES   # gradient buffers these modes add into start zeroed (kernel/builders.GradMode)
# Mode 5 (see `_du_mode`, tuning.sum_groups_before_atomics, off by default): a program sums the
# gradients of an input its state groups share before adding atomically (the Kalman keys: fewer
# atomics, for a cross-warp sum with barriers); per-lane relaxed atomics measured faster
# (BENCHMARKS_HISTORY.md, "Notes moved from code comments"). Mode 6 (`_lanes_mode`, tuning.sum_warp_groups_before_atomics, on): the
# lane-sequential kernels sum such gradients over the groups of each warp (shuffles, no barrier)
# before the atomic add.


def _du_mode(du_strides, lane_sizes, reduce_state: bool, T: int) -> GradMode:
    """The `GradMode` (kernel/builders.py) of an input's gradient: 0 store, 1 atomic add, 2 summed over
    time, 3 summed over the state lanes, 4 that plus atomic, 5 (lane-sequential only, see `_lanes_mode`)
    summed over a program's state groups, then atomic: an input broadcast only over the lane dim just
    above the state (e.g. keys shared by channels)."""
    if T > 1 and du_strides[0] == 0:
        return GradMode.TIME_SUM
    broadcast = [s == 0 and n > 1 for s, n in zip(du_strides[1:], lane_sizes)]
    if not any(broadcast):
        return GradMode.STORE
    if reduce_state and broadcast[-1]:
        return GradMode.STATE_STORE if not any(broadcast[:-1]) else GradMode.STATE_ATOMIC
    if reduce_state and broadcast == [False] * (len(broadcast) - 2) + [True, False]:
        return GradMode.GROUP_ATOMIC
    return GradMode.ATOMIC


def _lanes_mode(mode: GradMode, sizes, cfg: Config, state: int = 1, knobs: tuning.Tuning | None = None) -> GradMode:
    """Mode 5 needs the lane-sequential kernel and programs whose lanes share every outer lane index
    (BLOCK_L divides the two innermost lane sizes' product), and knobs.sum_groups_before_atomics. Else
    mode 6 (lane-sequential, knobs.sum_warp_groups_before_atomics): the sum over the groups of each 32
    consecutive thread slots (one warp's: shuffles only, no shared memory), then one atomic per state
    index and warp, when those slots share every outer lane index (32 R lanes divide that product, R = runtime.lanes_per_thread);
    otherwise one atomic per lane (1)."""
    if mode != GradMode.GROUP_ATOMIC:
        return GradMode(mode)
    knobs = knobs or tuning.current()
    if cfg.schedule != "lanes":
        return GradMode.ATOMIC
    inner = sizes[-2] * sizes[-1]
    if knobs.sum_groups_before_atomics and inner % cfg.block_l == 0:
        return GradMode.GROUP_ATOMIC
    r = runtime.lanes_per_thread(cfg, state)
    slots = cfg.block_l // r
    if knobs.sum_warp_groups_before_atomics and slots % 32 == 0 and 32 % (state // r) == 0 and inner % (32 * r) == 0:
        return GradMode.WARP_ATOMIC
    return GradMode.ATOMIC


def _init_strides(t: torch.Tensor, shape, dim: int, n_seq: int, varlen: bool) -> tuple[int, list[int]]:
    """(per-sequence stride, strides in `shape` with 0 at `dim`) of an initial element."""
    lane_shape = shape[:dim] + shape[dim + 1:]
    st = broadcast_strides(t, ([n_seq] if varlen else []) + lane_shape)
    sn, st = (st[0], st[1:]) if varlen else (0, st)
    return sn, st[:dim] + [0] + st[dim:]


def chunk_of(cfg: Config, checkpoint: bool = True) -> int:
    """The forward's checkpoint interval under `cfg` (the backward recomputes it the same way).

    Tile schedule: without a backward to serve (`checkpoint=False`) the interval is the whole tile,
    the cheapest forward; with one, the config's `chunk`, the backward's tile: shorter than the
    forward's (checkpoints from inside its tiles) or a multiple of it (every chunk // block_t tiles).
    Lanes schedule: `chunk` (or block_t) either way.
    """
    if cfg.schedule == "lanes":
        return cfg.chunk or cfg.block_t
    if cfg.schedule == "chunked":   # checkpoints every `chunk` steps of a block_t chunk (kernel/chunked.py)
        inner = checkpoint and 0 < cfg.chunk < cfg.block_t and cfg.block_t % cfg.chunk == 0
        return cfg.chunk if inner else cfg.block_t
    if not checkpoint:
        return cfg.block_t
    chunk = cfg.chunk or cfg.block_t
    return chunk if chunk <= cfg.block_t or chunk % cfg.block_t == 0 else cfg.block_t


class _Plan:
    """Shared part of both passes: shape, layout (copying inputs when the lanes do not merge), configs."""

    checkpoint = True   # a backward is served (a ForwardPlan sets its own: False for inference)

    def _lay_out(self, prog, inputs, shape, extra, dim, fp64, extra_copied):
        """Set layout, copy_shape and the forward's config for `inputs` broadcast to `shape`; `extra`
        are the other tensors' strides, `extra_copied(shape)` theirs when the inputs are copied."""
        ir = prog.ir
        self.knobs = tuning.current()   # the launch-time knobs this plan is built and keyed under
        self.shape = shape
        sizes = [list(t.shape) for t in inputs]
        in_st = [broadcast_strides(t, shape) for t in inputs]
        self.copy_shape = None
        layout = lane_layout(shape, dim, in_st + extra, keep_last=ir.reduce_state)
        if layout is None:   # too many lane dims: full-size contiguous copies
            self.copy_shape = shape
            sizes, in_st = [shape] * len(inputs), [contiguous_strides(shape)] * len(inputs)
            layout = lane_layout(shape, dim, in_st + extra_copied(shape), keep_last=ir.reduce_state)
        self.layout = layout
        self.state = layout.sizes[-1] if ir.reduce_state else 1
        self.time_contiguous = _time_contiguous(sizes, in_st, dim)
        # lane-sequential kernels load an input constant in time once per program (time stride 0)
        self.static = {f"TSTATIC{i}": layout.strides[i][0] == 0 for i in range(len(inputs))}
        self.fwd_chosen, self.fwd_fit_key = self._choose(prog, fp64, backward=False)

    def _choose(self, prog, fp64: bool, backward: bool) -> tuple[Config, tuple]:
        """(chosen config, fit key): the key names program, pass and shape bucket for runtime.fit_launch."""
        layout, contiguous = self.layout, self.time_contiguous
        chosen = runtime.choose_config(layout.T, layout.L, contiguous, self.state, backward,
                                       sequential=prog.ir.sequential_only,
                                       checkpoint=self.checkpoint,
                                       chunkable=not self.varlen and chunked.supports(prog.ir),
                                       fields=len(prog.ir.fields))
        key = (prog.key, backward, contiguous, max(layout.T - 1, 0).bit_length(), self.state, fp64, chosen)
        return chosen, key

    def lanes_meta(self, cfg: Config) -> dict:
        """The lane-sequential kernels' layout constexprs: R lanes per thread slot
        (runtime.lanes_per_thread), EVEN_L (every program full), TSTATIC<i> (input i constant in time:
        loaded once), SLOT<i> (constant over the last lane dim, which R divides: loaded once per slot),
        RCP_APPROX (float32 compiled for a GPU: reciprocals by the hardware instruction), TS_<buffer>
        (time strides: a block's steps become immediate offsets; one compiled kernel per stride set)."""
        lanes = self.layout.L
        slot = {f"SLOT{i}": st[4] == 0 for i, st in enumerate(self.layout.strides[:len(self.static)])}
        rcp = not self.common["FP64"] and not settings.triton_interpret()
        return dict(R=runtime.lanes_per_thread(cfg, self.state), EVEN_L=lanes % cfg.block_l == 0, RCP_APPROX=rcp,
                    **self.static, **slot, **self.time_strides())

    def tile_meta(self, cfg: Config) -> dict:
        """The tile kernels' layout constexprs (kernel/builders.TILE_FLAGS): RCP_APPROX (float32 compiled for a
        GPU: reciprocals by the hardware instruction), EVEN_T (every time tile full: one sequence whose
        length block_t divides), EVEN_L (every lane block full)."""
        return dict(RCP_APPROX=not self.common["FP64"] and not settings.triton_interpret(),
                    EVEN_T=not self.varlen and self.layout.T % cfg.block_t == 0, EVEN_L=self.layout.L % cfg.block_l == 0)

    def time_strides(self) -> dict:
        """TS_<buffer>: the time stride of every buffer a lane-sequential step addresses (constexprs)."""
        ir = self.prog.ir
        n_in, n_out = len(ir.inputs), len(ir.outputs)
        names = [f"u{i}" for i in range(n_in)] + (
            [f"g{o}" for o in range(n_out)] + [f"du{i}" for i in range(n_in)] if isinstance(self, BackwardPlan)
            else [f"o{o}" for o in range(n_out)])
        return {f"TS_{n}": st[0] for n, st in zip(names, self.layout.strides)}

    def smaller(self, cfg: Config, keep_block_t: bool = False) -> Config | None:
        return runtime.smaller_config(cfg, self.state, keep_block_t=keep_block_t)

    def _holes(self, tensors_strides) -> tuple[list, tuple[int, ...]]:
        """Kernel arguments [tensor, *strides] per tensor with None for the tensor; and where those are."""
        head, slots = [], []
        for st in tensors_strides:
            slots.append(len(head))
            head += [None, *st]
        return head, tuple(slots)

    def fill(self, tensors) -> list:
        """This plan's leading kernel arguments with `tensors` in their holes (order as planned)."""
        args = self.head.copy()
        for pos, t in zip(self.slots, tensors):
            args[pos] = t
        return args


class ForwardPlan(_Plan):
    """scan_fwd: outputs, checkpoints and final prefix; launch arguments per config."""

    def __init__(self, prog, inputs, initial, n_seq: int, varlen: bool, dim: int, reverse: bool, fp64: bool,
                 checkpoint: bool):
        ir = prog.ir
        self.prog, self.checkpoint, self.n_seq, self.varlen = prog, checkpoint, n_seq, varlen
        self.acc = torch.float64 if fp64 else torch.float32
        self.n_out, n = len(ir.outputs), len(ir.fields)
        shape = list(torch.broadcast_shapes(*(t.shape for t in inputs)))
        self.out_shape = shape[:-1] if ir.reduce_state else shape
        out_st = contiguous_strides(self.out_shape) + ([0] if ir.reduce_state else [])
        init_st = [_init_strides(i, shape, dim, n_seq, varlen) for i in initial]
        extra = [out_st] * self.n_out + [s for _, s in init_st]
        self._lay_out(prog, inputs, shape, extra, dim, fp64, lambda s: extra)
        layout = self.layout
        self.final_shape = (n, n_seq, layout.L)
        self.launches = layout.L > 0 and n_seq > 0
        st = layout.strides
        n_in = len(inputs)
        per_tensor = list(st[:n_in + self.n_out])
        for f in range(n):
            per_tensor.append([init_st[f][0], *st[n_in + self.n_out + f][1:]] if initial else [0] * len(st[0]))
        self.head, self.slots = self._holes(per_tensor)
        self.tail = (layout.T, layout.L, *layout.sizes[1:], n_seq)
        self.common = {"REVERSE": reverse, "HAS_INIT": bool(initial), "VARLEN": varlen, "STATE": self.state,
                       "FP64": fp64}
        self._launch: dict = {}
        self.backward_plans = PlanCache(limit=64)   # backward plans of these inputs by gradient signature (eager)

    def checkpoint_shape(self, cfg: Config) -> tuple[int, int, int]:
        """[fields, slots, lanes]: a slot per checkpoint interval and one more per sequence; on the
        chunked schedule every chunk of block_t steps has block_t // chunk slots, the last one partial
        or not (its carry out, the final prefix, is the last slot: kernel/chunked.carry_slot)."""
        chunk = chunk_of(cfg, self.checkpoint)
        steps = _cdiv(self.layout.T, cfg.block_t) * cfg.block_t if cfg.schedule == "chunked" else self.layout.T
        return (len(self.prog.ir.fields), _cdiv(steps, chunk) + self.n_seq, self.layout.L)

    def launch(self, cfg: Config):
        """(kernel, grid, constexpr/meta kwargs, checkpoint shape) under `cfg` (memoised)."""
        got = self._launch.get(cfg)
        if got is None:
            meta = dict(self.common, BLOCK_L=cfg.block_l, CHUNK=chunk_of(cfg, self.checkpoint), num_warps=cfg.num_warps)
            if cfg.schedule == "lanes":
                kernel = self.prog.module.scan_forward_lanes   # CKPT: checkpoints only for a backward
                meta = dict(meta, UNROLL=cfg.unroll, CKPT=self.checkpoint, **self.lanes_meta(cfg))
            else:
                kernel = self.prog.module.scan_forward
                meta = dict(meta, BLOCK_T=cfg.block_t, STAGES=cfg.stages, CKPT=self.checkpoint, **self.tile_meta(cfg))
            got = self._launch[cfg] = (kernel, (_cdiv(self.layout.L, cfg.block_l), self.n_seq), meta,
                                       self.checkpoint_shape(cfg))
        return got


class BackwardPlan(_Plan):
    """scan_bwd: gradient buffers (stored, atomically added or reduced in the kernel) and launch arguments."""

    def __init__(self, prog, inputs, initial, grads, has_dfinal: bool, n_seq: int, varlen: bool, dim: int,
                 reverse: bool, fp64: bool):
        ir = prog.ir
        self.prog, self.n_seq, self.varlen = prog, n_seq, varlen
        self.acc = acc = torch.float64 if fp64 else torch.float32
        n_in, n_out = len(inputs), len(grads)
        shape = list(torch.broadcast_shapes(*(t.shape for t in inputs)))
        g_st = [list(g.stride()) + ([0] if ir.reduce_state else []) for g in grads]
        self.du_shapes = [list(t.shape) for t in inputs]
        extra = g_st + [_buffer_strides(s, shape) for s in self.du_shapes]
        self._lay_out(prog, inputs, shape, extra, dim, fp64, lambda s: g_st + [contiguous_strides(s)] * n_in)
        if self.copy_shape is not None:   # full-size gradients, summed to the inputs' shapes after
            self.du_shapes = [self.shape] * n_in
        layout = self.layout
        st = layout.strides
        modes = [_du_mode(s, layout.sizes, ir.reduce_state, layout.T) for s in st[n_in + n_out:]]
        self.du_zeroed = [m in ATOMIC_MODES for m in modes]
        self.launches = layout.L > 0 and n_seq > 0
        self.head, self.slots = self._holes(st)
        self.tail = (layout.T, layout.L, *layout.sizes[1:], n_seq)
        self.common = dict(REVERSE=reverse, HAS_INIT=bool(initial), HAS_DFINAL=has_dfinal, VARLEN=varlen,
                           STATE=self.state, FP64=fp64, **{f"DU{i}": int(m) for i, m in enumerate(modes)})
        # input gradients: (sum to the input's shape or None, dtype to cast to or None)
        self.finish = [(tuple(t.shape) if list(t.shape) != s else None, t.dtype if t.dtype != acc else None)
                       for t, s in zip(inputs, self.du_shapes)]
        self.init_shape = ([n_seq] if varlen else []) + self.shape[:dim] + self.shape[dim + 1:]
        self.bwd_chosen, bwd_fit_key = self._choose(prog, fp64, backward=True)
        self._bwd_key = bwd_fit_key[:-1]
        self._configs: dict = {}
        self._launch: dict = {}

    def config(self, chunk: int) -> tuple[Config, tuple]:
        """(config, fit key) for the forward's checkpoint interval `chunk` (memoised).

        The backward's time tile is that interval (block_t = chunk, kept when fit_launch shrinks);
        the fit key names it, so a config fitted for one interval is never reused with another."""
        got = self._configs.get(chunk)
        if got is None:
            cfg = dataclasses.replace(self.bwd_chosen, block_t=chunk)
            got = self._configs[chunk] = (cfg, self._bwd_key + (cfg,))
        return got

    def launch(self, cfg: Config):
        """(kernel, grid, constexpr/meta kwargs, lanes scratch shape or None) under `cfg` (memoised)."""
        got = self._launch.get(cfg)
        if got is None:
            chunk = cfg.block_t
            meta = dict(self.common, BLOCK_L=cfg.block_l, CHUNK=chunk, num_warps=cfg.num_warps)
            meta.update({k: int(_lanes_mode(v, self.layout.sizes, cfg, self.state, self.knobs)) for k, v in meta.items()
                         if k.startswith("DU")})
            grid = (_cdiv(self.layout.L, cfg.block_l), self.n_seq)
            if cfg.schedule == "lanes":   # per-lane scratch for one chunk's replayed prefixes (none in registers):
                in_registers = chunk == cfg.unroll   # per program CHUNK + 1 rows of its free fields (kernel/lanes_adjoint._scratch)
                free = len(self.prog.ir.fields) - len(self.prog.ir.constants)
                scratch = (1,) if in_registers else (self.n_seq, grid[0], chunk + 1, free, cfg.block_l)
                got = (self.prog.module.scan_backward_lanes, grid, dict(meta, UNROLL=cfg.unroll, **self.lanes_meta(cfg)),
                       scratch)
            else:
                got = (self.prog.module.scan_backward, grid,   # FLIP_REV: see codegen_tile.render_backward
                       dict(meta, BLOCK_T=cfg.block_t, STAGES=cfg.stages, FLIP_REV=not self.time_contiguous,
                            **self.tile_meta(cfg)), None)
            self._launch[cfg] = got
        return got


class PlanCache:
    """Eager plans by key. `built` counts plans built (a call whose plan was cached adds nothing)."""

    def __init__(self, limit: int = 4096):
        self.plans: dict = {}
        self.built = 0
        self.limit = limit

    def get(self, key, build):
        plan = self.plans.get(key)
        if plan is None:
            if len(self.plans) >= self.limit:   # shapes that keep changing: start over, stay bounded
                self.plans.clear()
            plan = self.plans[key] = self.build(build)
        return plan

    def build(self, build):
        """A plan built by `build()` and counted (also those kept elsewhere: a forward's backward plans)."""
        self.built += 1
        return build()

    def clear(self):
        self.plans.clear()


PLANS = PlanCache()


def overrides() -> tuple:
    """The launch-time knobs in effect (`scanlang.tuning`, forced configs included) and whether torch's
    deterministic algorithms are on (they pick the chunk-parallel variant) as part of a plan key."""
    return tuning.current().launch_key, torch.are_deterministic_algorithms_enabled()
