"""`load` and `launch`: the content-addressed kernel cache, lane layouts, and the two kernel launches.

Layout. Every tensor of a program is a view broadcastable to one common `shape` (same ndim); the
scanned `dim` is time, every other index is a lane. Lanes are numbered row-major over the other
dims; adjacent lane dims are merged when every tensor's strides allow it, so each tensor is
addressed with one time stride and up to four lane strides (size-1 broadcast dims get stride 0).
Merging keeps the row-major numbering, so checkpoints written by the forward are found by the
backward whatever the gradients' strides are.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.machinery
import importlib.util
import inspect
import linecache
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from triton.runtime.errors import OutOfResources

import scanlang
from scanlang import cache, settings, tuning

from .codegen import LANE_DIMS


# ---- load: the content-addressed cache ---------------------------------------------------------

def _device_kind() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "interpreter"


def cache_key(source: str) -> str:
    text = "\n".join([source, scanlang.__version__, triton.__version__, torch.__version__, _device_kind()])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


_MODULES: dict[str, object] = {}


class _VerifiedSourceLoader(importlib.machinery.SourceFileLoader):
    """Executes the source text it was given, compiled here: never a `__pycache__` file (which
    could be stale or forged next to a correct `.py`), and writes none."""

    def __init__(self, fullname: str, path: str, source: str):
        super().__init__(fullname, path)
        self.verified_source = source

    def get_source(self, fullname):
        return self.verified_source

    def get_code(self, fullname):
        return compile(self.verified_source, self.path, "exec", dont_inherit=True)

    def set_data(self, path, data, *, _mode=0o666):   # no bytecode is written
        pass


def load(source: str):
    """Write `source` (once) to `<cache_dir>/triton/scanlang_<key>.py` and import it from that file.

    The file is what Triton reads kernel source from (inspect.getsource), so it is kept as a real file
    whose bytes equal `source`: a missing, different, truncated or undecodable file (or a link) is
    rewritten atomically. The module executes `source` itself, compiled in memory (no bytecode read
    or written), and linecache holds the same text, so what runs and what Triton compiles is the
    verified source even if the file changes afterwards.
    """
    key = cache_key(source)
    if key in _MODULES:
        return _MODULES[key]
    folder = cache.directory("triton")
    path = folder / f"scanlang_{key}.py"
    data = source.encode()
    if cache.read_bytes(path) != data:
        cache.write_atomic(path, data)
    name = f"scanlang_generated_{key}"
    loader = _VerifiedSourceLoader(name, str(path), source)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    linecache.cache[str(path)] = (len(source), None, source.splitlines(True), str(path))
    sys.modules[name] = module
    try:
        loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    _MODULES[key] = module
    return module


# ---- layouts ------------------------------------------------------------------------------------

def broadcast_strides(t: torch.Tensor, shape) -> list[int]:
    """Strides of `t` seen as broadcast to `shape` (same ndim): 0 along broadcast dims."""
    return [0 if (n == 1 and m != 1) else s for n, m, s in zip(t.shape, shape, t.stride())]


@dataclass(frozen=True)
class Layout:
    T: int
    L: int
    sizes: tuple[int, ...]           # LANE_DIMS lane sizes, outermost first
    strides: tuple[tuple[int, ...], ...]   # per tensor: (time stride, LANE_DIMS lane strides)


def lane_layout(shape, dim: int, strides: list[list[int]], keep_last: bool = False) -> Layout | None:
    """Merge lane dims of `shape` (all but `dim`) for tensors with the given broadcast `strides`.

    Returns None when more than LANE_DIMS lane dims remain (the caller copies to contiguous).
    `keep_last` keeps the last lane dim apart (the state axis of a reducing readout).
    """
    lanes = [d for d in range(len(shape)) if d != dim]
    dims = [[shape[d], [s[d] for s in strides]] for d in lanes]
    last = dims[-1] if keep_last and dims else None
    body = dims[:-1] if last is not None else dims
    body = [d for d in body if d[0] != 1]
    merged: list = []
    for size, st in body:
        if merged and all(ps == s * size for ps, s in zip(merged[-1][1], st)):
            merged[-1] = [merged[-1][0] * size, st]
        else:
            merged.append([size, st])
    if last is not None:
        merged.append(last)
    if len(merged) > LANE_DIMS:
        return None
    while len(merged) < LANE_DIMS:
        merged.insert(0, [1, [0] * len(strides)])
    L = 1
    for size, _ in merged:
        L *= size
    per_tensor = tuple((strides[i][dim],) + tuple(m[1][i] for m in merged) for i in range(len(strides)))
    return Layout(T=shape[dim], L=L, sizes=tuple(m[0] for m in merged), strides=per_tensor)


SCHEDULES = ("tile", "lanes", "chunked")


@dataclass(frozen=True)
class Config:
    """A launch config. `schedule`: "tile" (`tl.associative_scan` over [block_t, block_l] tiles with a
    carried prefix) or "lanes" (lane-sequential: block_l lanes per program, time stepped one at a
    time in blocks of `unroll`, checkpoints every `chunk or block_t` steps; block_t is otherwise unused)."""

    block_t: int
    block_l: int
    num_warps: int
    stages: int = 1
    chunk: int = 0       # forward: checkpoint interval = the backward's time tile (0: block_t)
                         # (chunked: divides block_t)
    schedule: str = "tile"
    unroll: int = 4      # lanes: steps per loop iteration (their loads issued together)

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {SCHEDULES}, got {self.schedule!r}")
        max_unroll = tuning.current().max_unroll   # the steps per iteration the kernels are generated for
        if not 1 <= self.unroll <= max_unroll:
            raise ValueError(f"unroll: expected 1..{max_unroll}, got {self.unroll}")
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:   # configs key several dicts on every launch: hash the fields once
        return self._hash

    def __reduce__(self):        # rebuilt from the fields: a string's hash differs between processes
        return type(self), dataclasses.astuple(self)


def lanes_overrides(block_l: int = 64, num_warps: int = 2, chunk: int = 64, unroll: int = 16) -> dict:
    """Forced configs (`tuning.override(forced=...)`) that run every layout, forward and backward, on the
    lane-sequential schedule."""
    cfg = Config(block_t=chunk, block_l=block_l, num_warps=num_warps, chunk=chunk, schedule="lanes", unroll=unroll)
    return {(time_contiguous, backward): cfg for time_contiguous in (False, True) for backward in (False, True)}


def lanes_per_thread(cfg: Config, state: int) -> int:
    """Lanes a thread slot of the lane-sequential kernels holds in registers: the program's lanes
    over its threads, at most `state` (the state lanes of a reducing program, 1 otherwise), so a
    group's state sum starts in registers and an input constant over the state loads once per slot."""
    return max(1, min(cfg.block_l // (32 * cfg.num_warps), state))


def forces_lanes() -> bool:
    """True while a forced config (tuning.current().forced) runs the lane-sequential schedule."""
    return any(c.schedule == "lanes" for _, c in tuning.current().forced)


def prefers_lanes(L: int) -> bool:
    """True when `choose_config` picks the lane-sequential schedule for L lanes (forced configs aside):
    from tuning.lanes_min lanes, where it wins (BENCHMARKS.md); with fewer it cannot hide each step's latency."""
    return L >= tuning.current().lanes_min


def prefers_chunked(T: int, L: int) -> bool:
    """True when `choose_config` picks the chunk-parallel schedule (kernel/chunked.py) for a program
    that has it. The tile schedule runs one program per lane block that walks all of T, so few lanes
    leave most of the GPU idle (16 lanes: 16 programs for the H200's 132 SMs) however long T is;
    cutting time into chunks gives lanes x T / chunk programs for one extra read of the inputs (none with
    the single-pass variant, tuning.chunk_single_pass)."""
    return L < 512 and T >= 8192


def chunk_single_pass(backward: bool, fields: int, time_contiguous: bool = True) -> bool:
    """Whether the chunk-parallel schedule runs its one-pass variant (kernel/chunked_lookback.py) for
    this pass of a monoid of `fields` fields in this layout: the tuning knob `chunk_single_pass`
    ("auto": the forward of a monoid of up to 2 fields with time contiguous, where it was timed
    faster), unless torch.use_deterministic_algorithms is on. A one-pass carry depends on how far each
    look-back reached, so its last bits can differ between runs; the three kernels per pass
    (kernel/chunked.py) give the same bits every run."""
    if torch.are_deterministic_algorithms_enabled():
        return False
    which = tuning.current().chunk_single_pass
    if which == "auto":
        return not backward and fields <= 2 and time_contiguous
    return which == "both" or (which == "forward" and not backward)


def chunked_config(T: int, L: int, time_contiguous: bool, backward: bool, interpret: bool, fields: int = 2) -> Config:
    """The chunk-parallel launch: one chunk of block_t steps per program, a single lane when time is
    contiguous (the tile's rows are consecutive addresses), 16 lanes otherwise (one row of a tile: 64
    contiguous bytes). The forward checkpoints every `chunk` steps (block_t when 0), the backward's
    chunk; the backward's block_t is replaced by the forward's interval.

    Time contiguous, the backward takes 1024-step chunks. Its three-kernel variant holds two scans of
    about 2 and 2-3x `fields` values a row (replayed pairs, adjoint segments), so it takes 16 rows a
    thread for a monoid of up to 2 fields (affine: 85 registers, 2 warps, the fastest forward+backward
    timed on an H100) and 4 rows a thread beyond (Möbius: 8 warps, 208 registers, no spills; at 16 rows
    it spilled 660 B a thread, offline sm_90); its one-pass variant takes 32 warps (~150 registers a
    thread at 8 warps, one program per SM; 56 at 32 warps). The one-pass forward takes 4096-step chunks
    on 4 warps, checkpointing every 1024 (its look-back waits less on longer chunks; the backward is
    slower on them), 8 warps beyond 2 fields (Möbius: 149 registers; on 4 warps 255 and 72 B spilled,
    offline sm_90); the three-kernel forward takes 1024 on 4 warps. Channels contiguous: 16 lanes by
    256 steps (64 beyond 2 fields)."""
    pow2 = 1 << max(0, (T - 1).bit_length())
    small = fields <= 2
    if interpret:
        return Config(block_t=min(8, pow2), block_l=min(4, 1 << max(0, (L - 1).bit_length())), num_warps=1,
                      schedule="chunked")
    if time_contiguous:
        single = chunk_single_pass(backward, fields, time_contiguous)
        chunk = min(1024, pow2)   # the backward's chunk: the forward's checkpoint interval
        if not backward:
            block_t = min(4096, pow2) if single else chunk
            warps = 4 if small or not single else 8
            return Config(block_t=block_t, block_l=1, num_warps=warps, chunk=chunk, schedule="chunked")
        warps = max(4, min(32, chunk // 128)) if single else max(1, min(32, chunk // (32 * (16 if small else 4))))
        return Config(block_t=chunk, block_l=1, num_warps=warps, schedule="chunked")
    return Config(block_t=min(256 if small else 64, pow2), block_l=16, num_warps=8 if backward else 4, schedule="chunked")


def choose_config(T: int, L: int, time_contiguous: bool, state: int, backward: bool = False,
                  sequential: bool = False, checkpoint: bool = False, chunkable: bool = False, fields: int = 2) -> Config:
    """Tile shape per layout: long time tiles when time is contiguous, wide lane tiles otherwise; the
    lane-sequential schedule for very many lanes or for a program that has only that one (`sequential`);
    the chunk-parallel one for few lanes and long T where the program has it (`chunkable`).
    `checkpoint`: the forward serves a backward (its checkpoint interval is the backward's tile);
    `fields`: the monoid's (the chunk-parallel backward's registers grow with it)."""
    def pow2(n):
        return 1 << max(0, (n - 1).bit_length())
    knobs = tuning.current()
    forced = knobs.forced_config(time_contiguous, backward)
    if forced is not None and forced.schedule == "chunked" and not (chunkable and T > 0):
        forced = None   # a program or call (cu_seqlens) the chunk-parallel kernels do not serve
    if forced is not None and (forced.schedule == "lanes" or not sequential):
        return dataclasses.replace(forced, block_t=min(forced.block_t, pow2(T)), block_l=max(state, forced.block_l))
    interpret = settings.triton_interpret() and not torch.cuda.is_available()
    if chunkable and not sequential and prefers_chunked(T, L):
        return chunked_config(T, L, time_contiguous, backward, interpret, fields)
    if sequential or prefers_lanes(L):
        if interpret:
            return Config(block_t=4, block_l=max(state, min(4, pow2(L))), num_warps=1, chunk=4, schedule="lanes",
                          unroll=2)
        if state > 1:
            # a reducing program (Kalman): 256 lanes x 2 warps = 4 state lanes per thread slot,
            # checkpoints every 16 steps; the forward steps in blocks of 8, the backward replays each
            # chunk through scratch in blocks of 2: few enough registers for 6 programs per SM (one
            # wave at the benchmark's shape), and the fastest pair measured; larger backward blocks
            # spill into a second wave (BENCHMARKS_HISTORY.md, "Notes moved from code comments").
            return Config(block_t=16, block_l=max(state, 256), num_warps=2, chunk=16, schedule="lanes",
                          unroll=2 if backward else 8)
        # other programs, both passes: one lane per thread, 64 lanes x 2 warps, 8-step chunks = the unroll
        return Config(block_t=8, block_l=64, num_warps=2, chunk=8, schedule="lanes", unroll=8)
    if interpret:
        return Config(block_t=min(8, pow2(T)), block_l=max(state, min(4, pow2(L))), num_warps=1, chunk=4)
    if time_contiguous:
        # Tiles of RUN_TILE steps or more scan runs of RUN steps per thread (kernel/runs.py), one run
        # per thread: 512-step tiles on 2 warps, checkpoints every tile (the backward's tile). The
        # forward runs at copy bandwidth with them (BENCHMARKS.md; the earlier tile measurements in
        # BENCHMARKS_HISTORY.md, "Notes moved from code comments").
        bt = min(512, pow2(T))
        chunk = bt
        tile = chunk if backward else bt
        warps = max(1, min(4, tile * max(state, 1) // (32 * knobs.run)))
        return Config(block_t=bt, block_l=max(state, 1), num_warps=warps, chunk=chunk)
    # one lane per thread, 32 lanes on 1 warp, 32-step tiles with 4 stages of loads in flight: the
    # fastest channels-contiguous forward of the tiles swept (BENCHMARKS_HISTORY.md, "Notes moved from
    # code comments")
    bl = max(state, min(32, pow2(L)))
    forward = Config(block_t=32, block_l=bl, num_warps=1, stages=4)
    if not (backward or checkpoint):
        return forward
    # training: the backward on run-based tiles (kernel/runs.py) of 256 steps over 16 lanes on 4 warps with
    # 2 stages, the forward on its own tile checkpointing every 256 steps: a 32 x 32 backward scans time across
    # threads (more instructions per element), and this pair measured fastest (BENCHMARKS_HISTORY.md, "Notes
    # moved from code comments")
    chunk = min(256, pow2(T))
    if backward:
        return Config(block_t=chunk, block_l=max(state, min(16, pow2(L))), num_warps=4, stages=2, chunk=chunk)
    return dataclasses.replace(forward, chunk=chunk)


# ---- fitting configs to the device ------------------------------------------------------------

# (program, pass, shape bucket, chosen config) -> the config that launched (shrunk where needed)
FITTED: dict = {}


def _symbolic(key) -> bool:
    """Whether `key` holds a symbolic size or flag (graph tracing): looking such a key up would compare
    it with the remembered keys' plain values, a guard on a shape environment that is not the caller's."""
    if isinstance(key, (tuple, list)):
        return any(_symbolic(k) for k in key)
    return isinstance(key, (torch.SymInt, torch.SymBool, torch.SymFloat))


def fitted(key, chosen: Config) -> Config:
    """The config remembered for `key` by `fit_launch`, else `chosen` (always `chosen` for a symbolic key)."""
    return chosen if _symbolic(key) else FITTED.get(key, chosen)


def shapes_only(t: torch.Tensor) -> bool:
    """Shape propagation only (FakeTensor or meta, not recording a graph): allocate, launch nothing.

    While a graph is being recorded (torch.compile, make_fx) the launch must run: it records the kernel.
    """
    return t.device.type == "meta" or (is_fake(t) and get_proxy_mode() is None)


CACHE_LIMIT = 256   # entries per shape-keyed cache of the backends before it is emptied


def cached(cache: dict, key, make):
    """cache[key], made by make() the first time; the cache is emptied when it reaches CACHE_LIMIT."""
    found = cache.get(key)
    if found is None:
        if len(cache) >= CACHE_LIMIT:
            cache.clear()
        found = cache[key] = make()
    return found


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def eager(tensors) -> bool:
    """Whether a call may skip the registered torch.library ops (every backend's eager fast path): plain
    tensors outside torch.compile, graph tracing (FakeTensor, proxy and other dispatch modes,
    torch.jit.trace) and functorch transforms."""
    if torch.compiler.is_compiling():
        return False
    if (torch._C._len_torch_dispatch_stack() or torch._C._functorch.peek_interpreter_stack() is not None
            or torch._C._get_tracing_state() is not None):
        return False
    return all(type(t) in _PLAIN and not t.is_meta for t in tensors)


@functools.lru_cache(maxsize=None)
def kernel_defaults(kernel) -> dict:
    """The kernel's parameters that have a default (variant flags), by name (none for a stand-in that is not a
    function): wrap_triton's mutation analysis needs every parameter passed."""
    fn = getattr(kernel, "fn", kernel)
    if not callable(fn):
        return {}
    params = inspect.signature(fn).parameters
    return {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}


def fit_launch(key, cfg, attempt, smaller, remembered: dict | None = None):
    """`attempt(cfg)`, shrinking `cfg` with `smaller(cfg)` while the launch raises Triton's
    OutOfResources (a compiled kernel needing more shared memory than the device has); the config
    that ran is remembered under `key` and tried first next time. Re-raises when nothing smaller is left."""
    remembered = FITTED if remembered is None else remembered
    cfg = remembered.get(key, cfg)
    while True:
        try:
            result = attempt(cfg)
            break
        except OutOfResources:
            nxt = smaller(cfg)
            if nxt is None:
                raise
            cfg = nxt
    remembered[key] = cfg
    return result


def smaller_config(cfg: Config, state: int = 1, keep_block_t: bool = False) -> Config | None:
    """The next smaller tile: half block_t (unless kept: the backward's tile is the forward's
    checkpoint interval), then half block_l (down to `state`), then half the warps, then fewer stages."""
    if cfg.block_t > 1 and not keep_block_t and cfg.schedule == "tile":
        return dataclasses.replace(cfg, block_t=cfg.block_t // 2)
    if cfg.block_l > state:
        return dataclasses.replace(cfg, block_l=cfg.block_l // 2)
    if cfg.num_warps > 1:
        return dataclasses.replace(cfg, num_warps=cfg.num_warps // 2)
    if cfg.stages > 1:
        return dataclasses.replace(cfg, stages=cfg.stages - 1)
    return None
