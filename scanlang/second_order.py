"""Refusing second derivatives of once-differentiable backward passes, loudly.

A backward pass that runs generated kernels is differentiable once: its gradients are correct, but
nothing records how they depend on the inputs. Under `create_graph=True` (double backward,
`torch.autograd.grad(..., create_graph=True)`, `torch.autograd.functional.hvp`, gradient penalties)
torch would then hand back gradients with no history, and a second differentiation would silently
give None or zeros (`once_differentiable` only attaches its error when an upstream gradient itself
requires grad, which `loss.backward()` never does).

`refuse_second_order(op, grads, inputs)` attaches every gradient to a node that depends on the
op's differentiable inputs and raises when it is differentiated, so each second-order request
fails with the op's name and the way out (`backend="reference"`, plain torch ops, differentiable
any number of times). Outside `create_graph` (grad mode off in the backward) it returns the
gradients unchanged at the cost of one check.
"""
from __future__ import annotations

from typing import Sequence

import torch


class SecondOrderError(RuntimeError):
    """A second derivative was requested through a backward pass that is differentiable once."""


class _Refuse(torch.autograd.Function):
    """Identity on the gradients (aliases), connected to the op's inputs; its backward raises."""

    @staticmethod
    def forward(message: str, n_grads: int, *tensors):
        return tuple(t.view_as(t) for t in tensors[:n_grads])

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.message = inputs[0]

    @staticmethod
    def backward(ctx, *_):
        raise SecondOrderError(ctx.message)


def message(op: str) -> str:
    return (f"{op}: cannot differentiate twice; second derivatives are not implemented (its backward runs "
            "generated kernels and is differentiable once, so a second differentiation would otherwise be "
            "silently zero); use "
            "backend='reference' for double backward, torch.autograd.grad(..., create_graph=True) or "
            "torch.autograd.functional.hvp")


def refuse_second_order(op: str, grads: Sequence, inputs: Sequence) -> tuple:
    """`grads` as they are, or (under create_graph) aliases whose differentiation raises SecondOrderError.

    `inputs`: the tensors the gradients depend on (the op's saved inputs); None entries are skipped.
    """
    grads = tuple(grads)
    if not torch.is_grad_enabled():
        return grads
    live = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
    sources = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    sources += [grads[i] for i in live if grads[i].requires_grad]
    if not live or not sources:
        return grads   # nothing here can be differentiated again
    aliases = _Refuse.apply(message(op), len(live), *[grads[i] for i in live], *sources)
    out = list(grads)
    for i, alias in zip(live, aliases):
        out[i] = alias
    return tuple(out)
