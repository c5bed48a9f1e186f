"""`scanlang show MODULE:NAME --shape B,T,D --layout time|channels`: the kernels that would run.

For a [B, T, D] scan (time contiguous: the tensors are [B, D, T] scanned along the last dim;
channels contiguous: [B, T, D] scanned along dim 1) this builds the launch plans a training call of
that shape builds (`plan.ForwardPlan` / `plan.BackwardPlan`, on meta tensors: nothing is allocated),
takes from them the configs `runtime.choose_config` picks and the kernels and constexprs those
configs launch, and prints those kernels only, each specialised to its constexprs
(`specialise.py`: the variants the launch rules out are cut), with the helpers they call and
comments pointing at the monoid's declaration. The call is `sl.scan`'s default one: float32,
forward in time, no initial element, gradients of the outputs (none of the final prefix).
"""
from __future__ import annotations

import torch

from . import chunked_launch, runtime
from .kernel.common import origins
from .plan import BackwardPlan, ForwardPlan, chunk_of
from .specialise import specialise

LAYOUTS = ("time", "channels")


def parse_shape(text: str) -> tuple[int, int, int]:
    """`B,T,D` as three positive integers; a ValueError naming --shape otherwise."""
    parts = str(text).split(",")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"--shape: expected B,T,D (three positive integers, e.g. 1,1048576,16), got {text!r}")
    return shape


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"--layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
    return layout


def plans(prog, shape: tuple[int, int, int], layout: str):
    """(forward plan, backward plan) of a training call of `shape` in `layout` (meta tensors)."""
    B, T, D = shape
    dims, dim = ((B, D, T), 2) if layout == "time" else ((B, T, D), 1)
    inputs = [torch.empty(dims, device="meta") for _ in prog.ir.inputs]
    fwd = ForwardPlan(prog, inputs, [], n_seq=1, varlen=False, dim=dim, reverse=False, fp64=False, checkpoint=True)
    grads = [torch.empty(fwd.out_shape, device="meta") for _ in prog.ir.outputs]
    bwd = BackwardPlan(prog, inputs, [], grads, has_dfinal=False, n_seq=1, varlen=False, dim=dim, reverse=False,
                       fp64=False)
    return fwd, bwd


def launches(plan, cfg: runtime.Config, backward: bool) -> list[tuple[str, tuple, dict]]:
    """(kernel name, grid, constexpr/meta kwargs) of every kernel `plan` launches under `cfg`: what
    ops._forward / ops._backward_pass run (the chunk-parallel schedule's kernels, or the plan's one)."""
    if cfg.schedule == "chunked":
        return (chunked_launch.backward_launches if backward else chunked_launch.forward_launches)(plan, cfg)
    kernel, grid, meta, _ = plan.launch(cfg)
    return [(kernel.fn.__name__, grid, meta)]


def configs(prog, shape: tuple[int, int, int], layout: str) -> tuple[runtime.Config, runtime.Config]:
    """(forward, backward) configs of a training call of this shape and layout: the forward's chosen
    config and the backward's for the forward's checkpoint interval (as ops._backward_pass takes it)."""
    fwd, bwd = plans(prog, shape, layout)
    return fwd.fwd_chosen, bwd.config(chunk_of(fwd.fwd_chosen))[0]


def _source(prog, cfg: runtime.Config, plan, backward: bool) -> str:
    """The module the config's kernels are in: the chunk-parallel one of the pass's variant or the
    tile/lanes one."""
    if cfg.schedule == "chunked":
        return chunked_launch.source(prog, chunked_launch.one_pass(plan, backward))
    return prog.source


def show(prog, shape, layout: str = "time") -> str:
    """The configs and the kernels they run (specialised), for the program `prog` at `shape` and `layout`."""
    shape = parse_shape(",".join(map(str, shape)) if isinstance(shape, (tuple, list)) else shape)
    layout = check_layout(layout)
    fplan, bplan = plans(prog, shape, layout)
    fwd = fplan.fwd_chosen
    bwd = bplan.config(chunk_of(fwd))[0]
    B, T, D = shape
    ran = [("forward", fwd, launches(fplan, fwd, False)), ("backward", bwd, launches(bplan, bwd, True))]
    head = [f"# [B, T, D] = [{B}, {T}, {D}], {layout} contiguous: {B * D} lanes of {T} steps "
            "(float32, forward in time, no initial element)",
            f"# forward config:  {fwd}", f"# backward config: {bwd}"]
    origin = [f"from {o}" for o in origins(prog.ir)]
    if prog.ir.is_plain:
        head.append("# lift: identity (one input per field), readout: the prefix (a plain sl.scan)")
    parts = []
    sources = [(_source(prog, cfg, pl, p == "backward"), cfg.schedule) for (p, cfg, _), pl in zip(ran, (fplan, bplan))]
    for source, schedule in dict.fromkeys(sources):   # one module per schedule and variant, in pass order
        kernels = [(p, name, grid, meta) for (p, _, found), key in zip(ran, sources) if key == (source, schedule)
                   for name, grid, meta in found]
        names = ", ".join(f"{p} {name}" for p, name, _, _ in kernels)
        head.append(f"# schedule: {schedule} ({names}); below: those kernels, specialised to their constexprs, "
                    "and the helpers they call")
        notes = {name: ([] if schedule == "chunked" else origin) + [f"{p} kernel, grid {grid}"]
                 for p, name, grid, _ in kernels}
        if schedule != "chunked":   # the chunk-parallel printer puts the origins above its combine itself
            notes["combine"] = origin
        parts.append(specialise(source, {name: meta for _, name, _, meta in kernels}, notes))
    return "\n".join(head) + "\n\n" + "\n\n".join(parts)
