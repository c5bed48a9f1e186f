"""The generated kernels as `torch.library` ops with registered autograd (no graph breaks), and the
eager fast path that runs the same code without the dispatcher.

    scanlang::scan_fwd(key, inputs, initial, cu_seqlens, dim, reverse, fp64, checkpoint)
        -> [*outputs, checkpoints, final]
    scanlang::scan_bwd(key, inputs, initial, cu_seqlens, checkpoints, grads, dfinal, dim, reverse, fp64)
        -> [*input grads, *initial grads]

`key` names a compiled program in `scanlang.pipeline.PROGRAMS` (one per lowered IR: generated once).
`inputs` are tensors broadcastable to one shape with the same ndim (size-1 dims broadcast; their
gradients come back in their own shape, reduced in the kernel, never materialised at full size).

One implementation, two entry points. `_forward` and `_backward_pass` allocate and launch. `launch`
calls them through the registered ops (and `register_autograd`) under torch.compile, graph tracing,
dispatch modes (FakeTensor, proxy), functorch transforms or tensor subclasses; with plain eager
tensors it calls them directly inside one `torch.autograd.Function` (`_EagerScan`), skipping the
dispatcher's per-call cost, takes the launch plan (layout, configs, scalar arguments) from
`plan.PLANS` instead of deriving it again, and relaunches the compiled kernels without Triton's
per-call binding (`launcher.py`).
"""
from __future__ import annotations

import collections
from typing import Optional

import torch
from torch.library import triton_op, wrap_triton
from triton.runtime.errors import OutOfResources

from scanlang import settings
from scanlang.pipeline import PROGRAMS, Program
from scanlang.second_order import refuse_second_order

from . import chunked_launch, launcher, runtime
from .plan import PLANS, BackwardPlan, ForwardPlan, chunk_of, overrides
from .runtime import eager, fit_launch, fitted, shapes_only


def _empty(shape, dtype, device) -> torch.Tensor:
    """torch.empty, or NaN-filled while settings.POISON_OUTPUTS is on (tests: an unwritten element shows)."""
    if settings.POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)



def _sequences(cu_seqlens) -> tuple[bool, int]:
    return (False, 1) if cu_seqlens is None else (True, cu_seqlens.shape[0] - 1)


def _signature(tensors) -> tuple:
    """What a plan reads of `tensors` (shapes, strides, dtypes): part of its key."""
    return tuple([(t.shape, t.stride(), t.dtype) for t in tensors]) if tensors else ()


def _fill(plan, tensors) -> list:
    """plan.fill: the plan's leading kernel arguments with `tensors` in their holes (one C-level pass)."""
    args = plan.head.copy()
    collections.deque(map(args.__setitem__, plan.slots, tensors), maxlen=0)
    return args


def _fit_launch(key, chosen, attempt, smaller):
    """runtime.fit_launch(key, chosen, attempt, smaller), going straight to `attempt` with the config
    already remembered for `key` (the usual case: no bookkeeping to redo)."""
    cfg = runtime.FITTED.get(key)
    if cfg is not None:
        try:
            return attempt(cfg)
        except OutOfResources:
            pass
    return fit_launch(key, chosen, attempt, smaller)


def _finish(grad, shape, dtype):
    """An input gradient summed to the input's shape (shape None: already) and cast to its dtype (None: same)."""
    if shape is not None:
        grad = grad.sum_to_size(shape)
    return grad if dtype is None else grad.to(dtype)


def _forward(key: str, inputs, initial, cu_seqlens, dim: int, reverse: bool, fp64: bool, checkpoint: bool,
             eager: bool, ctx=None) -> list[torch.Tensor]:
    """scan_fwd's body: [*outputs, checkpoints, final]. `eager`: plain tensors outside any tracing
    (the plan comes from the cache and kernels launch directly; `ctx`, if given, keeps it for the backward)."""
    prog = PROGRAMS[key]
    varlen, n_seq = _sequences(cu_seqlens)
    device = inputs[0].device

    def build():
        return ForwardPlan(prog, inputs, initial, n_seq, varlen, dim, reverse, fp64, checkpoint)
    if eager:
        plan = PLANS.get(("fwd", key, dim, reverse, fp64, checkpoint, device, n_seq, varlen, _signature(inputs),
                          _signature(initial), overrides()), build)
        if ctx is not None:
            ctx.plan = plan
    else:
        plan = build()
    acc = plan.acc
    outs = [_empty(plan.out_shape, acc, device) for _ in range(plan.n_out)]
    final = _empty(plan.final_shape, acc, device)
    if plan.copy_shape is not None:
        inputs = [t.expand(plan.copy_shape).contiguous() for t in inputs]
    if not plan.launches or (not eager and shapes_only(inputs[0])):
        ckpt = _empty(plan.checkpoint_shape(fitted(plan.fwd_fit_key, plan.fwd_chosen)), acc, device)
        return outs + [ckpt, final]
    args = _fill(plan, [*inputs, *outs, *(initial or [inputs[0]] * len(prog.ir.fields))])

    def attempt(cfg):
        if cfg.schedule == "chunked":   # chunked_launch: kernel/chunked.py or chunked_lookback.py
            return chunked_launch.forward(plan, cfg, args, final, eager, _empty)
        kernel, grid, meta, ckpt_shape = plan.launch(cfg)
        ckpt = _empty(ckpt_shape, acc, device)
        full = [*args, ckpt, final, cu_seqlens if varlen else ckpt, *plan.tail, ckpt_shape[1]]
        if eager:
            launcher.launch(plan, cfg, kernel, grid, full, meta)
        else:
            wrap_triton(kernel)[grid](*full, **meta)
        return ckpt
    ckpt = _fit_launch(plan.fwd_fit_key, plan.fwd_chosen, attempt, plan.smaller)
    return outs + [ckpt, final]


def _backward_pass(key: str, inputs, initial, cu_seqlens, ckpt, grads, dfinal, dim: int, reverse: bool, fp64: bool,
                   eager: bool, fwd_plan=None) -> list[torch.Tensor]:
    """scan_bwd's body: [*input grads, *initial grads]. `fwd_plan` (needed when eager): the forward's plan,
    whose cache of backward plans by the gradients' signature serves these same inputs, initial and packing."""
    prog = PROGRAMS[key]
    varlen, n_seq = _sequences(cu_seqlens)
    device = inputs[0].device
    n = len(prog.ir.fields)

    def build():
        return BackwardPlan(prog, inputs, initial, grads, dfinal is not None, n_seq, varlen, dim, reverse, fp64)
    if eager:   # counted in PLANS.built like every plan
        plan = fwd_plan.backward_plans.get((_signature(grads), dfinal is not None, ckpt.shape, overrides()),
                                           lambda: PLANS.build(build))
    else:
        plan = build()
    acc, L = plan.acc, plan.layout.L
    if plan.copy_shape is not None:
        inputs = [t.expand(plan.copy_shape).contiguous() for t in inputs]
    dus = [torch.zeros(s, dtype=acc, device=device) if zeroed else _empty(s, acc, device)
           for s, zeroed in zip(plan.du_shapes, plan.du_zeroed)]
    dinit = [_empty((n_seq, L), acc, device) for _ in range(n)] if initial else []
    if plan.launches and (eager or not shapes_only(inputs[0])):
        chunk = chunk_of(fitted(plan.fwd_fit_key, plan.fwd_chosen))   # the forward's checkpoint interval
        cfg, fit_key = plan.config(chunk)
        args = _fill(plan, [*inputs, *grads, *dus])
        args += dinit if initial else [ckpt] * n
        args += [dfinal if dfinal is not None else ckpt, ckpt, cu_seqlens if varlen else ckpt, *plan.tail,
                 ckpt.shape[1]]

        def attempt(cfg):
            if cfg.schedule == "chunked":   # chunked_launch: kernel/chunked.py or chunked_lookback.py
                return chunked_launch.backward(plan, cfg, args, eager, _empty)
            kernel, grid, meta, scratch = plan.launch(cfg)
            extra = [] if scratch is None else [_empty(scratch, acc, device)]
            if eager:
                launcher.launch(plan, cfg, kernel, grid, args + extra, meta)
            else:
                wrap_triton(kernel)[grid](*args, *extra, **meta)
        _fit_launch(fit_key, cfg, attempt, lambda c: plan.smaller(c, keep_block_t=True))
    elif initial:
        for f in range(n):
            dinit[f] = dfinal[f].clone() if dfinal is not None else torch.zeros_like(dinit[f])
    result = [_finish(d, shape, dtype) for d, (shape, dtype) in zip(dus, plan.finish)]
    for f, i in enumerate(initial):
        result.append(dinit[f].reshape(plan.init_shape).sum_to_size(i.shape).to(i.dtype))
    return result


@triton_op("scanlang::scan_fwd", mutates_args=())
def scan_fwd(key: str, inputs: list[torch.Tensor], initial: list[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
             dim: int, reverse: bool, fp64: bool, checkpoint: bool) -> list[torch.Tensor]:
    return _forward(key, inputs, initial, cu_seqlens, dim, reverse, fp64, checkpoint, eager=False)


@triton_op("scanlang::scan_bwd", mutates_args=())
def scan_bwd(key: str, inputs: list[torch.Tensor], initial: list[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
             ckpt: torch.Tensor, grads: list[torch.Tensor], dfinal: Optional[torch.Tensor], dim: int, reverse: bool,
             fp64: bool) -> list[torch.Tensor]:
    return _backward_pass(key, inputs, initial, cu_seqlens, ckpt, grads, dfinal, dim, reverse, fp64, eager=False)


def _save(ctx, key, ins, initial, cu_seqlens, dim, reverse, fp64, output):
    """What the backward needs: inputs, initial elements, packing and the forward's checkpoints."""
    ctx.key, ctx.dim, ctx.reverse, ctx.fp64 = key, dim, reverse, fp64
    ctx.n_inputs, ctx.n_initial = len(ins), len(initial)
    ctx.varlen = cu_seqlens is not None
    ctx.save_for_backward(*ins, *initial, *([cu_seqlens] if ctx.varlen else []), output[-2])
    ctx.out_meta = [(o.shape, o.dtype, o.device) for o in output[:-2]]
    ctx.mark_non_differentiable(output[-2])


def _gradients(ctx, grads, eager: bool) -> list[torch.Tensor]:
    """Input and initial gradients from the outputs' (None: zero) and the final prefix's gradients."""
    saved = ctx.saved_tensors
    ins = list(saved[:ctx.n_inputs])
    initial = list(saved[ctx.n_inputs:ctx.n_inputs + ctx.n_initial])
    cu_seqlens = saved[-2] if ctx.varlen else None
    ckpt = saved[-1]
    out_grads = []
    for g, (shape, dtype, device) in zip(grads[:-2], ctx.out_meta):
        out_grads.append(g if g is not None else torch.zeros((), dtype=dtype, device=device).expand(shape))
    if eager:
        return _backward_pass(ctx.key, ins, initial, cu_seqlens, ckpt, out_grads, grads[-1], ctx.dim, ctx.reverse,
                              ctx.fp64, eager=True, fwd_plan=ctx.plan)
    return torch.ops.scanlang.scan_bwd(ctx.key, ins, initial, cu_seqlens, ckpt, out_grads, grads[-1], ctx.dim,
                                       ctx.reverse, ctx.fp64)


def _setup_context(ctx, inputs, output):
    key, ins, initial, cu_seqlens, dim, reverse, fp64, _ = inputs
    _save(ctx, key, ins, initial, cu_seqlens, dim, reverse, fp64, output)


_OP = "sl.scan / sl.mixer (backend='triton')"


def _backward(ctx, grads):
    if torch.is_grad_enabled():   # create_graph=True: the kernels' gradients are not differentiable
        with torch.no_grad():
            res = _gradients(ctx, grads, eager=False)
        res = refuse_second_order(_OP, res, [*ctx.saved_tensors, *grads])
    else:
        res = _gradients(ctx, grads, eager=False)
    return None, list(res[:ctx.n_inputs]), list(res[ctx.n_inputs:]), None, None, None, None, None


scan_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerScan(torch.autograd.Function):
    """scan_fwd with its registered autograd, for plain eager tensors: the same `_forward`,
    `_save`, `_gradients` and `_backward_pass`, called without the dispatcher. The non-tensor
    arguments travel as one tuple `call` = (key, cu_seqlens, dim, reverse, fp64, number of inputs):
    Function.apply walks every argument on every call."""

    @staticmethod
    def forward(ctx, call, *tensors):
        key, cu_seqlens, dim, reverse, fp64, n_inputs = call
        ins, initial = list(tensors[:n_inputs]), list(tensors[n_inputs:])
        output = _forward(key, ins, initial, cu_seqlens, dim, reverse, fp64, True, eager=True, ctx=ctx)
        _save(ctx, key, ins, initial, cu_seqlens, dim, reverse, fp64, output)
        ctx.set_materialize_grads(False)
        return tuple(output)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():   # create_graph=True: the kernels' gradients are not differentiable
            with torch.no_grad():
                res = _gradients(ctx, grads, eager=True)
            return (None, *refuse_second_order(_OP, res, [*ctx.saved_tensors, *grads]))
        return (None, *_gradients(ctx, grads, eager=True))


def launch(prog: Program, inputs, initial, dim: int, reverse: bool, fp64: bool, cu_seqlens=None,
           use_ops: bool = False, is_eager: bool | None = None):
    """Run the forward (autograd attached): returns (outputs, final prefix [n_fields, sequences, lanes]).

    Plain eager tensors skip the dispatcher (see the module docstring); `use_ops=True` forces the
    registered ops (the path torch.compile takes). `is_eager`: the caller's `eager(...)` of these
    tensors (inputs, initial, cu_seqlens) when it has it already; None: decided here."""
    inputs = list(inputs)
    initial = list(initial) if initial else []
    tensors = inputs + initial if initial else inputs
    checkpoint = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if use_ops:
        is_eager = False
    elif is_eager is None:
        is_eager = eager(tensors if cu_seqlens is None else tensors + [cu_seqlens])
    if is_eager:
        if checkpoint:
            res = _EagerScan.apply((prog.key, cu_seqlens, dim, reverse, fp64, len(inputs)), *tensors)
        else:
            res = _forward(prog.key, inputs, initial, cu_seqlens, dim, reverse, fp64, False, eager=True)
    else:
        res = torch.ops.scanlang.scan_fwd(prog.key, inputs, initial, cu_seqlens, dim, reverse, fp64, checkpoint)
    return list(res[:len(prog.ir.outputs)]), res[-1]
