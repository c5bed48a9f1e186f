"""Launching the chunk-parallel schedule: three kernels per pass (kernel/chunked.py), or one with a
decoupled look-back (kernel/chunked_lookback.py) for the passes the tuning knob `chunk_single_pass`
names (the forward by default) unless torch's deterministic algorithms are on. Both variants keep the
same checkpoints, so a one-pass forward serves a three-kernel backward.

The chunked kernels live in their own generated module (one per program and variant, rendered and
loaded the first time a config picks the schedule), so the tile and lane modules stay as they are.
Each pass takes the same leading arguments as the tile kernels (the plan's `head` filled by `ops`)
plus its aggregate buffers, allocated here by the allocator `ops` passes in (NaN-filled under
settings.POISON_OUTPUTS, so an aggregate a kernel forgot to write, or read before it was written,
shows in the tests); the one-pass variant adds its tickets and flags, one zeroed int32 buffer per pass.
"""
from __future__ import annotations

import collections
import types

import torch
from torch.library import wrap_triton

from scanlang import tuning

from . import launcher
from .kernel import chunked, chunked_lookback
from .plan import chunk_of
from .runtime import Config, load
from .runtime import chunk_single_pass as single_pass   # single_pass(backward, fields, time_contiguous)

_MODULES: dict[tuple[str, bool], object] = {}
# kernel name -> launches since import: how a test sees that the chunked kernels really ran
LAUNCHED: collections.Counter = collections.Counter()


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def one_pass(plan, backward: bool) -> bool:
    """Whether the pass of `plan` (a ForwardPlan or BackwardPlan) runs the one-pass variant."""
    return single_pass(backward, len(plan.prog.ir.fields), plan.time_contiguous)


def _variant(single: bool):
    """The kernel module of a variant: kernel/chunked_lookback.py (one pass) or kernel/chunked.py."""
    return chunked_lookback if single else chunked


def kernel_names(fields: int = 2, time_contiguous: bool = True) -> tuple[str, ...]:
    """The kernels of the variants in effect for a monoid of `fields` fields in that layout, forward first."""
    return (_variant(single_pass(False, fields, time_contiguous)).FORWARD_KERNELS
            + _variant(single_pass(True, fields, time_contiguous)).BACKWARD_KERNELS)


def source(prog, single: bool) -> str:
    """The chunk-parallel module's source for `prog` (a Program of ops.PROGRAMS) in the one-pass variant
    or the three-kernel one (each variant's module holds both passes)."""
    return _variant(single).render(prog.ir, prog.adjoint)


def module(prog, single: bool):
    """The loaded chunk-parallel module of `prog` in a variant (rendered and imported once)."""
    key = (prog.key, single)
    mod = _MODULES.get(key)
    if mod is None:
        mod = _MODULES[key] = load(source(prog, single))
    return mod


def carry_tile(n_chunks: int, cfg: Config) -> int:
    """Chunks per tile of the carry kernels: all of them up to one time tile's size (a power of two)."""
    return min(1 << max(0, (n_chunks - 1).bit_length()), cfg.block_t)


def _sync(lanes: int, n_chunks: int, device) -> torch.Tensor:
    """The one-pass variant's tickets and flags: per lane block a ticket counter and one flag per chunk
    (0: nothing published yet)."""
    return torch.zeros(lanes * (n_chunks + 1), dtype=torch.int32, device=device)


def _run(plan, cfg: Config, kernel, grid, args, meta, eager: bool) -> None:
    """Launch one kernel: eager calls relaunch the compiled kernel without Triton's per-call binding
    (launcher.py, which keeps it per (holder, config): one holder per kernel of the plan)."""
    name = kernel.fn.__name__
    LAUNCHED[name] += 1
    if eager:
        holders = plan.__dict__.setdefault("_chunked_kernels", {})
        holder = holders.get(name)
        if holder is None:
            holder = holders[name] = types.SimpleNamespace()
        launcher.launch(holder, cfg, kernel, grid, args, meta)
    else:
        wrap_triton(kernel)[grid](*args, **meta)


def _meta(plan, cfg: Config, n_chunks: int, names, backward: bool, single: bool) -> dict:
    meta = dict({k: plan.common[k] for k in names}, BLOCK_T=cfg.block_t, BLOCK_L=cfg.block_l, num_warps=cfg.num_warps)
    if not backward:   # the checkpoint interval: the backward's chunk (none inside a chunk without a backward)
        meta["CHUNK"] = chunk_of(cfg, plan.checkpoint)
    if single:
        return dict(meta, LOOKBACK=tuning.current().chunk_lookback)
    return dict(meta, BLOCK_C=carry_tile(n_chunks, cfg))


def forward(plan, cfg: Config, args, final, eager: bool, empty):
    """Run the forward for a `plan.ForwardPlan`; returns the checkpoints.

    `args`: the plan's leading arguments (inputs, outputs, initial elements); `final` the final
    prefix buffer; `empty(shape, dtype, device)` the allocator."""
    prog, layout = plan.prog, plan.layout
    n_chunks = _cdiv(layout.T, cfg.block_t)
    ckpt = empty(plan.checkpoint_shape(cfg), plan.acc, final.device)
    agg = empty((len(prog.ir.fields), n_chunks, layout.L), plan.acc, final.device)
    full = [*args, ckpt, final, ckpt, *plan.tail, ckpt.shape[1], agg]
    single = one_pass(plan, False)
    if single:
        full.append(_sync(_cdiv(layout.L, cfg.block_l), n_chunks, final.device))
    mod = module(prog, single)
    for name, grid, meta in forward_launches(plan, cfg):
        _run(plan, cfg, getattr(mod, name), grid, full, meta, eager)
    return ckpt


def forward_launches(plan, cfg: Config) -> list[tuple[str, tuple, dict]]:
    """The forward's kernels in launch order as (name, grid, constexpr/meta kwargs) (`forward` runs these)."""
    n_chunks, lanes = _cdiv(plan.layout.T, cfg.block_t), _cdiv(plan.layout.L, cfg.block_l)
    single = one_pass(plan, False)
    meta = _meta(plan, cfg, n_chunks, ("REVERSE", "HAS_INIT", "FP64"), False, single)
    if single:   # one program per (chunk, lane block), lane blocks fastest
        return [("chunk_scan", (n_chunks * lanes,), meta)]
    return [("chunk_reduce", (n_chunks, lanes), meta), ("chunk_carry", (lanes,), meta),
            ("chunk_rescan", (n_chunks, lanes), meta)]


def backward(plan, cfg: Config, args, eager: bool, empty) -> None:
    """Run the backward for a `plan.BackwardPlan` whose forward checkpointed every cfg.block_t steps;
    `args` as `ops` built them for the tile kernel."""
    prog, layout = plan.prog, plan.layout
    launches = backward_launches(plan, cfg)
    n, nb = len(prog.ir.fields), len(prog.adjoint.b_entries)
    n_chunks = _cdiv(layout.T, cfg.block_t)
    device = args[0].device
    agg = empty((nb + n, n_chunks, layout.L), plan.acc, device)
    single = one_pass(plan, True)
    if single:   # G_c of every chunk but the last; tickets and flags
        full = [*args, agg, empty((n, n_chunks, layout.L), plan.acc, device),
                _sync(_cdiv(layout.L, cfg.block_l), n_chunks, device)]
    else:               # G_c of every chunk and G_n = 0
        full = [*args, agg, empty((n, n_chunks + 1, layout.L), plan.acc, device)]
    mod = module(prog, single)
    for name, grid, meta in launches:
        _run(plan, cfg, getattr(mod, name), grid, full, meta, eager)


def backward_launches(plan, cfg: Config) -> list[tuple[str, tuple, dict]]:
    """The backward's kernels in launch order as (name, grid, constexpr/meta kwargs) (`backward` runs these)."""
    du = {k: v for k, v in plan.common.items() if k.startswith("DU")}
    if any(m not in (0, 1, 2) for m in du.values()):
        raise ValueError(f"plan: gradient modes {du} need the state-lane kernels, not the chunk-parallel ones")
    n_chunks, lanes = _cdiv(plan.layout.T, cfg.block_t), _cdiv(plan.layout.L, cfg.block_l)
    n_in = len(plan.prog.ir.inputs)
    gstatic = {f"GSTATIC{j}": plan.layout.T > 1 and plan.layout.strides[n_in + j][0] == 0
               for j in range(len(plan.prog.ir.outputs))}   # a gradient constant in time: one load per lane
    single = one_pass(plan, True)
    meta = dict(_meta(plan, cfg, n_chunks, ("REVERSE", "HAS_INIT", "HAS_DFINAL", "FP64"), True, single), **du, **gstatic)
    if single:
        return [("chunk_bwd_scan", (n_chunks * lanes,), meta)]
    return [("chunk_bwd_reduce", (n_chunks, lanes), meta), ("chunk_bwd_carry", (lanes,), meta),
            ("chunk_bwd_rescan", (n_chunks, lanes), meta)]
