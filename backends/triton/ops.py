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

from .runtime import Config, broadcast_strides, choose_config, lane_layout


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


def _config(prog: Program, inputs, layout, dim, backward: bool = False) -> Config:
    state = layout.sizes[-1] if prog.ir.reduce_state else 1
    return choose_config(layout.T, layout.L, _time_contiguous(inputs, dim), state, len(prog.ir.fields), backward)


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


def _chunk(prog: Program, inputs, layout, dim, checkpoint: bool = True) -> tuple[Config, int]:
    """The forward's config and checkpoint interval (the backward recomputes both the same way).

    Without a backward to serve (`checkpoint=False`) the interval is the whole tile: the cheapest
    forward. With one, it is the config's `chunk`, the backward's (shorter) tile.
    """
    cfg = _config(prog, inputs, layout, dim)
    return cfg, min(cfg.chunk or cfg.block_t, cfg.block_t) if checkpoint else cfg.block_t


@triton_op("scanlang::scan_fwd", mutates_args=())
def scan_fwd(key: str, inputs: list[torch.Tensor], initial: list[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
             dim: int, reverse: bool, fp64: bool, checkpoint: bool) -> list[torch.Tensor]:
    prog = PROGRAMS[key]
    ir = prog.ir
    acc = torch.float64 if fp64 else torch.float32
    device = inputs[0].device
    varlen = cu_seqlens is not None
    n_seq = cu_seqlens.shape[0] - 1 if varlen else 1
    shape = list(torch.broadcast_shapes(*(t.shape for t in inputs)))
    out_shape = shape[:-1] if ir.reduce_state else shape
    outs = [torch.empty(out_shape, dtype=acc, device=device) for _ in ir.outputs]
    init_st = [_init_strides(i, shape, dim, n_seq, varlen) for i in initial]
    extra = [_out_strides(o, shape, ir.reduce_state) for o in outs] + [s for _, s in init_st]
    shape, layout = _plan(prog, inputs, extra, dim)
    if layout is None:
        inputs = _contiguous_inputs(inputs, shape)
        shape, layout = _plan(prog, inputs, extra, dim)
    cfg, chunk = _chunk(prog, inputs, layout, dim, checkpoint)
    n = len(ir.fields)
    n_slots = _cdiv(layout.T, chunk) + n_seq
    ckpt = torch.empty((n, n_slots, layout.L), dtype=acc, device=device)
    final = torch.empty((n, n_seq, layout.L), dtype=acc, device=device)
    if _fake(inputs[0]) or layout.L == 0 or n_seq == 0:
        return outs + [ckpt, final]
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
    args += [ckpt, final, cu_seqlens if varlen else ckpt, layout.T, layout.L, *layout.sizes[1:], n_seq, n_slots]
    grid = (_cdiv(layout.L, cfg.block_l), n_seq)
    wrap_triton(prog.module.scan_forward)[grid](
        *args, BLOCK_T=cfg.block_t, BLOCK_L=cfg.block_l, CHUNK=chunk, REVERSE=reverse, HAS_INIT=bool(initial),
        VARLEN=varlen, STATE=layout.sizes[-1] if ir.reduce_state else 1, FP64=fp64, STAGES=cfg.stages,
        num_warps=cfg.num_warps)
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
    prog = PROGRAMS[key]
    ir = prog.ir
    acc = torch.float64 if fp64 else torch.float32
    device = inputs[0].device
    varlen = cu_seqlens is not None
    n_seq = cu_seqlens.shape[0] - 1 if varlen else 1
    shape = list(torch.broadcast_shapes(*(t.shape for t in inputs)))
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
        _, chunk = _chunk(prog, inputs, layout, dim)
        cfg = dataclasses.replace(_config(prog, inputs, layout, dim, backward=True), block_t=chunk)
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
        grid = (_cdiv(layout.L, cfg.block_l), n_seq)
        wrap_triton(prog.module.scan_backward)[grid](
            *args, BLOCK_T=cfg.block_t, BLOCK_L=cfg.block_l, CHUNK=chunk, REVERSE=reverse, HAS_INIT=bool(initial),
            HAS_DFINAL=dfinal is not None, VARLEN=varlen, STATE=layout.sizes[-1] if ir.reduce_state else 1,
            FP64=fp64, **{f"DU{i}": m for i, m in enumerate(modes)}, STAGES=cfg.stages, num_warps=cfg.num_warps)
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
