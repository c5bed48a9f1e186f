"""The generated kernels as `torch.library` ops with registered autograd (no graph breaks).

    scanlang::scan_fwd(key, inputs, initial, cu_seqlens, dim, reverse, fp64) -> [*outputs, checkpoints, final]
    scanlang::scan_bwd(key, inputs, initial, cu_seqlens, checkpoints, grads, dfinal, dim, reverse, fp64)
        -> [*input grads, *initial grads]

`key` names a compiled program in `PROGRAMS` (one per lowered IR: its kernels are generated once).
`inputs` are tensors broadcastable to one shape with the same ndim (size-1 dims broadcast; their
gradients come back in their own shape, reduced in the kernel, never materialised at full size).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from torch.library import triton_op, wrap_triton

from .runtime import Config, broadcast_strides, choose_config, fit_launch, fitted, lane_layout, smaller_config


@dataclass
class Program:
    """One lowered scan with its adjoint, generated source and loaded module."""

    key: str
    ir: object
    adjoint: object
    source: str
    module: object


PROGRAMS: dict[str, Program] = {}


def _fake(t: torch.Tensor) -> bool:
    """Shape propagation only (FakeTensor or meta, not recording a graph): allocate, launch nothing.

    While a graph is being recorded (torch.compile, make_fx) the launch must run: it records the kernel.
    """
    from torch._subclasses.fake_tensor import is_fake
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    return t.device.type == "meta" or (is_fake(t) and get_proxy_mode() is None)


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _plan(prog: Program, inputs, extra_strides, dim: int):
    """Shape, layout (or None -> copy), and config for a launch; `extra_strides` of other tensors."""
    ir = prog.ir
    shape = list(torch.broadcast_shapes(*(t.shape for t in inputs)))
    strides = [broadcast_strides(t, shape) for t in inputs] + extra_strides
    layout = lane_layout(shape, dim, strides, keep_last=ir.reduce_state)
    return shape, layout


def _time_contiguous(inputs, dim) -> bool:
    for t in inputs:
        if t.shape[dim] > 1 and t.stride(dim) != 0:
            return t.stride(dim) == 1
    return False


def _state(prog: Program, layout) -> int:
    return layout.sizes[-1] if prog.ir.reduce_state else 1


def _config(prog: Program, inputs, layout, dim, fp64: bool, backward: bool = False) -> tuple[Config, tuple]:
    """(config, fit key): the chosen config, or the smaller one that fitted the device for this
    program, pass and shape bucket (runtime.fit_launch)."""
    contiguous = _time_contiguous(inputs, dim)
    chosen = choose_config(layout.T, layout.L, contiguous, _state(prog, layout), len(prog.ir.fields), backward,
                           sequential=prog.ir.sequential_only)
    key = (prog.key, backward, contiguous, max(layout.T - 1, 0).bit_length(), _state(prog, layout), fp64, chosen)
    return fitted(key, chosen), key


def _out_strides(t: torch.Tensor, shape, reduce_state: bool) -> list[int]:
    st = list(t.stride())
    return st + [0] if reduce_state else st


def _init_strides(t: torch.Tensor, shape, dim: int, n_seq: int, varlen: bool) -> tuple[int, list[int]]:
    """(per-sequence stride, strides in `shape` with 0 at `dim`) of an initial element."""
    lane_shape = shape[:dim] + shape[dim + 1:]
    st = broadcast_strides(t, ([n_seq] if varlen else []) + lane_shape)
    sn, st = (st[0], st[1:]) if varlen else (0, st)
    return sn, st[:dim] + [0] + st[dim:]


def _contiguous_inputs(inputs, shape):
    return [t.expand(shape).contiguous() for t in inputs]


def _chunk(cfg: Config, checkpoint: bool = True) -> int:
    """The forward's checkpoint interval under `cfg` (the backward recomputes it the same way).

    Tile schedule: without a backward to serve (`checkpoint=False`) the interval is the whole tile,
    the cheapest forward; with one, the config's `chunk`, the backward's (shorter) tile. Lanes
    schedule: `chunk` (or block_t) either way.
    """
    if cfg.schedule == "lanes":
        return cfg.chunk or cfg.block_t
    return min(cfg.chunk or cfg.block_t, cfg.block_t) if checkpoint else cfg.block_t


def _context(key: str, inputs, cu_seqlens, fp64: bool):
    """What both ops derive first: program, IR, accumulation dtype, device, packing, broadcast shape."""
    prog = PROGRAMS[key]
    varlen = cu_seqlens is not None
    n_seq = cu_seqlens.shape[0] - 1 if varlen else 1
    shape = list(torch.broadcast_shapes(*(t.shape for t in inputs)))
    return (prog, prog.ir, torch.float64 if fp64 else torch.float32, inputs[0].device, varlen, n_seq, shape)


@triton_op("scanlang::scan_fwd", mutates_args=())
def scan_fwd(key: str, inputs: list[torch.Tensor], initial: list[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
             dim: int, reverse: bool, fp64: bool, checkpoint: bool) -> list[torch.Tensor]:
    prog, ir, acc, device, varlen, n_seq, shape = _context(key, inputs, cu_seqlens, fp64)
    out_shape = shape[:-1] if ir.reduce_state else shape
    outs = [torch.empty(out_shape, dtype=acc, device=device) for _ in ir.outputs]
    init_st = [_init_strides(i, shape, dim, n_seq, varlen) for i in initial]
    extra = [_out_strides(o, shape, ir.reduce_state) for o in outs] + [s for _, s in init_st]
    shape, layout = _plan(prog, inputs, extra, dim)
    if layout is None:
        inputs = _contiguous_inputs(inputs, shape)
        shape, layout = _plan(prog, inputs, extra, dim)
    cfg, fit_key = _config(prog, inputs, layout, dim, fp64)
    n = len(ir.fields)

    def checkpoints(cfg):
        return torch.empty((n, _cdiv(layout.T, _chunk(cfg, checkpoint)) + n_seq, layout.L), dtype=acc, device=device)
    final = torch.empty((n, n_seq, layout.L), dtype=acc, device=device)
    if _fake(inputs[0]) or layout.L == 0 or n_seq == 0:
        return outs + [checkpoints(cfg), final]
    st = layout.strides
    n_in, n_out = len(inputs), len(outs)
    args = []
    for i, t in enumerate(inputs):
        args += [t, *st[i]]
    for j, o in enumerate(outs):
        args += [o, *st[n_in + j]]
    for f in range(n):
        if initial:
            args += [initial[f], init_st[f][0], *st[n_in + n_out + f][1:]]
        else:
            args += [inputs[0], 0, 0, 0, 0, 0]

    def attempt(cfg):
        ckpt = checkpoints(cfg)
        meta = dict(BLOCK_L=cfg.block_l, CHUNK=_chunk(cfg, checkpoint), REVERSE=reverse, HAS_INIT=bool(initial),
                    VARLEN=varlen, STATE=_state(prog, layout), FP64=fp64, num_warps=cfg.num_warps)
        if cfg.schedule == "lanes":
            kernel, meta = prog.module.scan_forward_lanes, dict(meta, UNROLL=cfg.unroll)
        else:
            kernel, meta = prog.module.scan_forward, dict(meta, BLOCK_T=cfg.block_t, STAGES=cfg.stages)
        grid = (_cdiv(layout.L, cfg.block_l), n_seq)
        wrap_triton(kernel)[grid](*args, ckpt, final, cu_seqlens if varlen else ckpt, layout.T, layout.L,
                                  *layout.sizes[1:], n_seq, ckpt.shape[1], **meta)
        return ckpt
    ckpt = fit_launch(fit_key, cfg, attempt, lambda c: smaller_config(c, _state(prog, layout)))
    return outs + [ckpt, final]


def _contiguous_strides(shape) -> list[int]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return out[::-1]


def _buffer_strides(buffer_shape, shape) -> list[int]:
    """Broadcast strides of a contiguous buffer of `buffer_shape` seen in `shape`."""
    return [0 if (n == 1 and m != 1) else s for n, m, s in zip(buffer_shape, shape, _contiguous_strides(buffer_shape))]


def _du_mode(du_strides, lane_sizes, reduce_state: bool, T: int) -> int:
    """0 store, 1 atomic add, 2 summed over time, 3 summed over the state lanes, 4 that plus atomic."""
    if T > 1 and du_strides[0] == 0:
        return 2
    broadcast = [s == 0 and n > 1 for s, n in zip(du_strides[1:], lane_sizes)]
    if not any(broadcast):
        return 0
    if reduce_state and broadcast[-1]:
        return 3 if not any(broadcast[:-1]) else 4
    return 1


@triton_op("scanlang::scan_bwd", mutates_args=())
def scan_bwd(key: str, inputs: list[torch.Tensor], initial: list[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
             ckpt: torch.Tensor, grads: list[torch.Tensor], dfinal: Optional[torch.Tensor], dim: int, reverse: bool,
             fp64: bool) -> list[torch.Tensor]:
    prog, ir, acc, device, varlen, n_seq, shape = _context(key, inputs, cu_seqlens, fp64)
    in_shapes = [t.shape for t in inputs]
    du_shapes = [list(t.shape) for t in inputs]
    extra = [_out_strides(g, shape, ir.reduce_state) for g in grads]
    extra += [_buffer_strides(s, shape) for s in du_shapes]
    _, layout = _plan(prog, inputs, extra, dim)
    if layout is None:  # too many lane dims: full-size copies and full-size gradients
        inputs = _contiguous_inputs(inputs, shape)
        du_shapes = [shape for _ in inputs]
        extra = extra[:len(grads)] + [_contiguous_strides(shape) for _ in inputs]
        _, layout = _plan(prog, inputs, extra, dim)
    n_in, n_out, n = len(inputs), len(grads), len(ir.fields)
    st = layout.strides
    du_st = st[n_in + n_out:]
    modes = [_du_mode(s, layout.sizes, ir.reduce_state, layout.T) for s in du_st]
    dus = [torch.zeros(s, dtype=acc, device=device) if m in (1, 2, 4) else torch.empty(s, dtype=acc, device=device)
           for s, m in zip(du_shapes, modes)]
    dinit = [torch.empty((n_seq, layout.L), dtype=acc, device=device) for _ in range(n)] if initial else []
    if layout.L > 0 and n_seq > 0 and not _fake(inputs[0]):
        chunk = _chunk(_config(prog, inputs, layout, dim, fp64)[0])   # the forward's checkpoint interval
        cfg, fit_key = _config(prog, inputs, layout, dim, fp64, backward=True)
        cfg = dataclasses.replace(cfg, block_t=chunk)
        args = []
        for i, t in enumerate(inputs):
            args += [t, *st[i]]
        for j, g in enumerate(grads):
            args += [g, *st[n_in + j]]
        for d, s in zip(dus, du_st):
            args += [d, *s]
        args += dinit if initial else [ckpt] * n
        args += [dfinal if dfinal is not None else ckpt, ckpt, cu_seqlens if varlen else ckpt, layout.T, layout.L,
                 *layout.sizes[1:], n_seq, ckpt.shape[1]]

        def attempt(cfg):
            meta = dict(BLOCK_L=cfg.block_l, CHUNK=chunk, REVERSE=reverse, HAS_INIT=bool(initial),
                        HAS_DFINAL=dfinal is not None, VARLEN=varlen, STATE=_state(prog, layout), FP64=fp64,
                        **{f"DU{i}": m for i, m in enumerate(modes)}, num_warps=cfg.num_warps)
            grid = (_cdiv(layout.L, cfg.block_l), n_seq)
            if cfg.schedule == "lanes":   # per-lane scratch for one chunk's replayed prefixes
                scratch = torch.empty((n, n_seq, chunk, layout.L), dtype=acc, device=device)
                wrap_triton(prog.module.scan_backward_lanes)[grid](*args, scratch, UNROLL=cfg.unroll, **meta)
            else:
                wrap_triton(prog.module.scan_backward)[grid](*args, BLOCK_T=cfg.block_t, STAGES=cfg.stages, **meta)
        # the backward's time tile is the forward's checkpoint interval: only lanes and warps shrink
        fit_launch(fit_key, cfg, attempt, lambda c: smaller_config(c, _state(prog, layout), keep_block_t=True))
    elif initial:
        for f in range(n):
            dinit[f] = dfinal[f].clone() if dfinal is not None else torch.zeros_like(dinit[f])
    result = []
    for t_shape, t, d in zip(in_shapes, inputs, dus):
        result.append((d.sum_to_size(t_shape) if d.shape != t_shape else d).to(t.dtype))
    init_shape = ([n_seq] if varlen else []) + shape[:dim] + shape[dim + 1:]
    for f, i in enumerate(initial):
        result.append(dinit[f].reshape(init_shape).sum_to_size(i.shape).to(i.dtype))
    return result


def _setup_context(ctx, inputs, output):
    key, ins, initial, cu_seqlens, dim, reverse, fp64, _ = inputs
    ctx.key, ctx.dim, ctx.reverse, ctx.fp64 = key, dim, reverse, fp64
    ctx.n_inputs, ctx.n_initial = len(ins), len(initial)
    ctx.varlen = cu_seqlens is not None
    ctx.save_for_backward(*ins, *initial, *([cu_seqlens] if ctx.varlen else []), output[-2])
    ctx.out_meta = [(o.shape, o.dtype, o.device) for o in output[:-2]]
    ctx.mark_non_differentiable(output[-2])


def _backward(ctx, grads):
    saved = ctx.saved_tensors
    ins = list(saved[:ctx.n_inputs])
    initial = list(saved[ctx.n_inputs:ctx.n_inputs + ctx.n_initial])
    cu_seqlens = saved[-2] if ctx.varlen else None
    ckpt = saved[-1]
    out_grads = []
    for g, (shape, dtype, device) in zip(grads[:-2], ctx.out_meta):
        out_grads.append(g if g is not None else torch.zeros((), dtype=dtype, device=device).expand(shape))
    res = torch.ops.scanlang.scan_bwd(ctx.key, ins, initial, cu_seqlens, ckpt, out_grads, grads[-1], ctx.dim,
                                      ctx.reverse, ctx.fp64)
    return None, list(res[:ctx.n_inputs]), list(res[ctx.n_inputs:]), None, None, None, None, None


scan_fwd.register_autograd(_backward, setup_context=_setup_context)


def launch(prog: Program, inputs, initial, dim: int, reverse: bool, fp64: bool, cu_seqlens=None):
    """Run the forward op: returns (outputs, final prefix [n_fields, sequences, lanes])."""
    tensors = list(inputs) + list(initial or [])
    checkpoint = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    res = torch.ops.scanlang.scan_fwd(prog.key, list(inputs), list(initial or []), cu_seqlens, dim, reverse, fp64,
                                      checkpoint)
    n_out = len(prog.ir.outputs)
    return list(res[:n_out]), res[-1]
