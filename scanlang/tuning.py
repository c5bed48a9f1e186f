"""Knobs as data: one frozen `Tuning` with every tuning knob of the kernels, and an override context.

    sl.tuning.current()                      the Tuning in effect (the defaults unless overridden)
    with sl.tuning.override(lanes_min=1):    tests and benchmarks change knobs here, never by
        ...                                  assigning module globals; restored on exit

Two kinds of knob, by when they act:
- render-time knobs change the generated source. They are part of the program key
  (`render_key`, `scanlang.pipeline.build`): flipping one renders (and caches) another program.
- launch-time knobs change how a program is launched (configs, gradient-accumulation modes, the
  delta kernels' buffers and paths). They are part of the launch plans' keys (`launch_key`).

A graph `torch.compile` traced keeps the kernels and launches of the knobs in effect when it was
traced (its guards do not see the knobs): after changing one, `torch._dynamo.reset()` retraces.

Overrides are process-wide (the autograd engine runs backward passes on its own threads, which
must see the knobs the forward saw) and thread-safe: each `override` is one entry in a list kept
under a lock, `current()` is the defaults with every active entry applied in the order they were
entered, and leaving a context removes its own entry, whichever order contexts end in.

>>> with override(loop_stages_forward=2):
...     current().loop_stages_forward, current().render_key != DEFAULT.render_key
(2, True)
>>> current().loop_stages_forward
1
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import threading
import types
from dataclasses import dataclass, field

RENDER_KNOBS = ("loop_stages_forward", "loop_stages_backward", "run", "vec", "run_tile", "max_unroll")


@dataclass(frozen=True)
class Tuning:
    """Every knob; the defaults are what the kernels run with.

    Render-time (in the program key):
      loop_stages_forward, loop_stages_backward: software-pipelining stages of the lane-sequential
        kernels' loops over full blocks (`tl.range(..., num_stages=N)`); 1: plain loops.
      run: steps per thread run of the run-based tile bodies (kernel/runs.py), a multiple of vec.
      vec: steps per vector load/store where time is contiguous (the split into step tensors is
        written for 4: 16 bytes of float32).
      run_tile: tiles of at least this many steps take the run-based bodies.
      max_unroll: steps per loop iteration the lane-sequential kernels are generated for (a
        config's `unroll` is at most this).
    Launch-time (in the plan keys):
      forced: configs forced per (time_contiguous, backward), as ((key, Config), ...); give a dict
        to `override(forced=...)`. A forced Config with schedule "lanes" selects the
        lane-sequential kernels.
      lanes_min: lanes from which `choose_config` picks the lane-sequential schedule.
      sum_groups_before_atomics: gradient mode 5 (a program's state groups summed before the
        atomic add, plan._lanes_mode) instead of per-lane atomics.
      sum_warp_groups_before_atomics: gradient mode 6 (the groups of each warp summed by shuffles
        before the atomic add).
      decode_max_tokens: the matrix-state family's backend='triton' runs the recurrent decode kernel
        (backends/linear/decode.py) when no input requires a gradient and no sequence has more
        tokens than this (0: never); longer inputs take the chunk kernels.
      linear_forward: the plain-write matrix-state forward (backends/linear): "fused" (one pass over each
        sequence's chunks writing the outputs), "split" (that pass storing the chunk states, then an
        output kernel over every chunk at once) or "auto" (split for per-key decay, else fused).
      linear_key_block: key columns per program of the per-key-decay output and backward kernels
        (backends/linear, `{name}_fwd_o`, `{name}_bwd`; a power of two >= 16): the pairwise gradients
        hold about ten [C, BK] fp32 tiles. More than two blocks add their shares of o and dv in any
        order (last bits may differ between runs); torch.use_deterministic_algorithms(True) caps them at two.
      linear_delta_key_block: the same for the per-key delta kernels' `{name}_bwd` (backends/linear/
        kernels_delta.py), whose key blocks share no output but a per-token log-decay input's gradient:
        32 spilled 604 B a thread there against 64's 2,384 (8 warps, bf16, K = V = 128; offline sm_90);
        and the key columns a loop step of their `{name}_prep` sums P and Aqk over.
      linear_pairwise_block: BS, the row blocks inside which the per-key-decay kernels form the pairwise
        products e^(G_i - G_j) exactly, BS steps over [C, BK] tiles (a power of two, capped at the chunk);
        the pairs of different blocks run as log2(C / BS) masked fp32 tensor-core products
        (backends/linear/kernels.py `pairwise_kernels`); 1 leaves no exact steps but the diagonal. KDA on an
        H100 (bf16 B8 T4096 H16 K = V = 128): 6.8 / 34.1 ms fwd / fwd+bwd at 1, 6.8 / 36.7 at 4, 9.6 / 42.5
        at 16 (Session 19).
      chunk_single_pass: which passes of the chunk-parallel schedule run one kernel with a decoupled
        look-back (kernel/chunked_lookback.py, each input read once) instead of three
        (kernel/chunked.py): "auto" (the default: the forward of a monoid of up to 2 fields), "forward",
        "both" or "none" (True and False mean "both" and "none"). On an H100 at fp32 [1, 16, 2^20] the
        one pass wins the affine forward, the three kernels win every backward and Möbius's forward
        (BENCHMARKS.md); torch.use_deterministic_algorithms(True) runs the three whatever the knob
        says (the same bits every run).
      chunk_lookback: chunks the one-pass variant's look-back reads at a time (one poll of their
        flags, one scan of their published values; a power of two).
      delta_save_wu: the delta forward stores w, u for the backward (else the backward recomputes them).
      delta_eager_fast_path: eager delta calls skip the torch.library dispatcher.
      delta_key_block: key columns per program / loop step of the delta backward kernels.
      delta_configs: launch configs of delta kernels by name, in place of DELTA_CONFIGS' entries
        (the defaults, below), as ((name, ((key, value), ...)), ...); give a dict {name: config
        dict} to `override(delta_configs=...)`. Unlike the other knobs, a nested override's entries
        add to the enclosing ones' (by kernel name). What runs: `delta_launch_configs()`.
    """

    loop_stages_forward: int = 1
    loop_stages_backward: int = 1
    run: int = 8
    vec: int = 4
    run_tile: int = 128
    max_unroll: int = 16
    forced: tuple = ()
    lanes_min: int = 1 << 17
    sum_groups_before_atomics: bool = False
    sum_warp_groups_before_atomics: bool = True
    decode_max_tokens: int = 64
    linear_forward: str = "auto"
    linear_key_block: int = 64
    linear_delta_key_block: int = 32
    linear_pairwise_block: int = 1
    chunk_single_pass: str = "auto"
    chunk_lookback: int = 32
    delta_save_wu: bool = True
    delta_eager_fast_path: bool = True
    delta_key_block: int = 64
    delta_configs: tuple = ()
    render_key: str = field(init=False, repr=False, compare=False)
    launch_key: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.forced, dict):
            object.__setattr__(self, "forced", tuple(sorted(self.forced.items(), key=lambda kv: kv[0])))
        if isinstance(self.delta_configs, dict):
            frozen = tuple(sorted((name, tuple(sorted(cfg.items()))) for name, cfg in self.delta_configs.items()))
            object.__setattr__(self, "delta_configs", frozen)
        for name in ("loop_stages_forward", "loop_stages_backward", "run", "vec", "run_tile", "max_unroll",
                     "lanes_min", "delta_key_block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if isinstance(self.decode_max_tokens, bool) or not isinstance(self.decode_max_tokens, int) \
                or self.decode_max_tokens < 0:
            raise ValueError(f"decode_max_tokens: expected an int >= 0, got {self.decode_max_tokens!r}")
        for name in ("sum_groups_before_atomics", "sum_warp_groups_before_atomics", "delta_save_wu",
                     "delta_eager_fast_path"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if isinstance(self.chunk_single_pass, bool):
            object.__setattr__(self, "chunk_single_pass", "both" if self.chunk_single_pass else "none")
        if self.chunk_single_pass not in ("auto", "forward", "both", "none"):
            raise ValueError("chunk_single_pass: expected 'auto', 'forward', 'both', 'none' or a bool, "
                             f"got {self.chunk_single_pass!r}")
        if self.linear_forward not in ("auto", "fused", "split"):
            raise ValueError(f"linear_forward: expected 'auto', 'fused' or 'split', got {self.linear_forward!r}")
        for name in ("linear_key_block", "linear_delta_key_block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"{name}: expected a power of two >= 16, got {value!r}")
        if isinstance(self.linear_pairwise_block, bool) or not isinstance(self.linear_pairwise_block, int) \
                or self.linear_pairwise_block < 1 or self.linear_pairwise_block & (self.linear_pairwise_block - 1):
            raise ValueError(f"linear_pairwise_block: expected a power of two >= 1, got {self.linear_pairwise_block!r}")
        if isinstance(self.chunk_lookback, bool) or not isinstance(self.chunk_lookback, int) \
                or self.chunk_lookback < 1 or self.chunk_lookback & (self.chunk_lookback - 1):
            raise ValueError(f"chunk_lookback: expected a power of two >= 1, got {self.chunk_lookback!r}")
        if self.vec != 4:
            raise ValueError(f"vec: the run bodies split 16-byte vectors into 4 steps; got {self.vec}")
        if self.run % self.vec:
            raise ValueError(f"run: expected a multiple of vec = {self.vec}, got {self.run}")
        if self.run_tile < self.run or self.run_tile & (self.run_tile - 1):
            raise ValueError(f"run_tile: expected a power of two >= run = {self.run}, got {self.run_tile}")
        for key, _ in self.forced:
            if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, bool) for k in key)):
                raise ValueError(f"forced: keys are (time_contiguous, backward) pairs of bools, got {key!r}")
        render = tuple(getattr(self, n) for n in RENDER_KNOBS)
        object.__setattr__(self, "render_key", hashlib.sha256(repr(render).encode()).hexdigest()[:12])
        object.__setattr__(self, "launch_key", tuple(getattr(self, f.name) for f in dataclasses.fields(self)
                                                     if f.init and f.name not in RENDER_KNOBS))

    def forced_config(self, time_contiguous: bool, backward: bool):
        """The Config forced for this layout and pass, or None."""
        for key, cfg in self.forced:
            if key == (time_contiguous, backward):
                return cfg
        return None

    def delta_config(self, name: str) -> dict | None:
        """The delta kernel `name`'s launch config (a fresh dict): `delta_configs`' entry, else the
        default of DELTA_CONFIGS, else None."""
        for key, items in self.delta_configs:
            if key == name:
                return dict(items)
        default = DELTA_CONFIGS.get(name)
        return None if default is None else dict(default)

    def delta_launch_configs(self) -> dict[str, dict]:
        """Every delta kernel's launch config in effect (fresh dicts): DELTA_CONFIGS with
        `delta_configs` applied (kernel names only an override gives come after)."""
        names = list(DELTA_CONFIGS) + [name for name, _ in self.delta_configs if name not in DELTA_CONFIGS]
        return {name: self.delta_config(name) for name in names}


# The delta-rule kernels' launch configs (backends/delta): the defaults of `Tuning.delta_configs`.
# Per kernel: BV = value columns per program (or per loop step in delta_bwd_*), and Triton launch options.
# state_bwd: LOCAL_DU forms the local dU = scale (Q K^T * D)^T dO inside the sequential pass (no dU_local
# kernel); bwd_dqk: BKS = key columns per program (clamped to the padded K); WY=True: one program per chunk also
# does bwd_wy's work. The values are the picks of `python -m scanlang.tools.bench_delta --sweep` (greedy, one
# kernel at a time) at B8 T4096 H16 K=V=128 bf16 on sm_90: 64 value columns keep two blocks per SM, so B8 H16's
# 256 sequential programs run in one wave, where wider blocks spill or fit one block per SM ("recurrent" was not
# swept). The sweeps, timings and offline register/spill counts: BENCHMARKS_HISTORY.md, "Notes moved from code
# comments", delta ops.CONFIG. The host-only keys (LOWP_*) and the shared-memory fits: backends/delta/ops.py.
DELTA_CONFIGS = types.MappingProxyType({name: types.MappingProxyType(cfg) for name, cfg in {
    "prep": dict(num_warps=4, num_stages=2),
    "wu": dict(BV=64, num_warps=4, num_stages=2, PER_CHUNK=True),   # one program per chunk (see delta_wu)
    "state_fwd": dict(BV=64, num_warps=4, num_stages=2),
    "state_output": dict(BV=64, num_warps=4, num_stages=1),   # the fits per dtype and K: ops.SHARED_MEMORY_FITS
    "dU_local": dict(BV=64, num_warps=4, num_stages=2),     # only for state_bwd without LOCAL_DU
    "state_bwd": dict(LOCAL_DU=True, BV=64, num_warps=4, num_stages=1, DECAY_V=True, LOWP_DU=True),   # likewise
    "bwd_dqk": dict(WY=False, BKS=64, BV=32, num_warps=4, num_stages=2, DG_SUMS=True, LOWP=True, LOWP_DK=True),
    "bwd_wy": dict(BV=64, num_warps=4, num_stages=1, LOWP=True),
    "recurrent": dict(BV=32, num_warps=4, num_stages=1),
}.items()})


DEFAULT = Tuning()
_LOCK = threading.Lock()
_ACTIVE: list[tuple[object, dict]] = []   # (token, knobs) of every open override, in entry order
_current = DEFAULT


def current() -> Tuning:
    """The Tuning in effect now (the defaults with every open `override` applied)."""
    return _current


@contextlib.contextmanager
def override(**knobs):
    """Run the block with `knobs` changed (names as in `Tuning`; `forced` may be a dict); thread-safe,
    restored on exit. An unknown name or a bad value raises before the block runs."""
    global _current
    unknown = sorted(set(knobs) - {f.name for f in dataclasses.fields(Tuning) if f.init})
    if unknown:
        raise TypeError(f"override: unknown knobs {unknown}; the knobs are the fields of scanlang.tuning.Tuning")
    token = object()
    with _LOCK:
        merged = _merge(_ACTIVE + [(token, knobs)])   # validates before anything changes
        _ACTIVE.append((token, knobs))
        _current = merged
    try:
        yield merged
    finally:
        with _LOCK:
            _ACTIVE[:] = [entry for entry in _ACTIVE if entry[0] is not token]
            _current = _merge(_ACTIVE)


def _merge(entries) -> Tuning:
    knobs: dict = {}
    delta_configs: dict = {}
    for _, more in entries:
        knobs.update(more)
        if "delta_configs" in more:   # by kernel name, on top of the enclosing overrides'
            given = more["delta_configs"]
            delta_configs.update(given if isinstance(given, dict) else {n: dict(c) for n, c in given})
            knobs["delta_configs"] = dict(delta_configs)
    return dataclasses.replace(DEFAULT, **knobs) if knobs else DEFAULT


__all__ = ["Tuning", "DEFAULT", "DELTA_CONFIGS", "RENDER_KNOBS", "current", "override"]
