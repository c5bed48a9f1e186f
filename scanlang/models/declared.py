"""Run a declared `sl.mixer` on the reference backend: the same traced lift, scan and readout in PyTorch.

`sl.mixer` calls launch generated Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1). A model
that should also train on a plain CPU runs the declaration here instead: the lift and readout
expressions the mixer traced are printed as torch code, the scan is `sl.scan(..., backend="reference")`
(ordinary autograd differentiates all of it), and the semantics are the mixer's own:

    x_t = lift(u_t),  y_t = y_{t-1} (+) x_t  (y_{-1} = identity),  out_t = readout(y_t, u_t, y_{t-1})

summed over the last axis when the mixer reduces it.

`ReferenceMixer` takes `sl.mixer`'s arguments and generates no kernels; `run_reference(m, ...)`
also runs a real `sl.mixer` `m` this way.

>>> import torch, scanlang as sl
>>> ema = ReferenceMixer(sl.Affine, axes="b t d", inputs={"x": "b t d", "decay": "d"},
...                      lift=lambda u: (u.decay, (1 - u.decay) * u.x), readout=lambda p, u, q: p.b,
...                      outputs=("h",))
>>> ema(x=torch.ones(1, 3, 1), decay=torch.tensor([0.5])).h.flatten().tolist()
[0.5, 0.75, 0.875]
"""
from __future__ import annotations

import collections
import math

import torch

import scanlang as sl
from scanlang import expr as E
from scanlang.ir import lower
from scanlang.mixer import Mixer, _axes

_NAMESPACE = {"math": math, "exp": E.exp, "log": E.log, "sqrt": E.sqrt, "abs": E.abs,
              "maximum": E.maximum, "minimum": E.minimum}
_COMPILED: dict = {}


class ReferenceMixer:
    """A declaration with `sl.mixer`'s arguments that runs on the reference backend only: it traces
    and lowers the lift and readout (no kernels are generated or loaded), and calling it is
    `run_reference` (same inputs, same outputs but no `final`)."""

    def __init__(self, monoid, axes: str, inputs: dict, lift, readout, outputs, reduce: str | None = None):
        if not isinstance(monoid, sl.Monoid):
            raise TypeError(f"monoid: expected a scanlang Monoid, got {type(monoid).__name__}")
        monoid.ensure_verified()
        self.monoid, self.axes = monoid, _axes(axes, "axes")
        if "t" not in self.axes:
            raise ValueError(f"axes: must contain the time axis 't', got {axes!r}")
        if reduce is not None and (reduce != self.axes[-1] or reduce == "t"):
            raise ValueError(f"reduce: must be the last axis of {self.axes} (and not 't'), got {reduce!r}")
        self.input_axes = {name: _axes(spec, f"inputs[{name!r}]") for name, spec in inputs.items()}
        outputs = (outputs,) if isinstance(outputs, str) else tuple(outputs)
        self.ir = lower(monoid, inputs=tuple(self.input_axes), lift=lift, outputs=outputs, readout=readout,
                        reduce_state=reduce is not None)
        self.outputs, self.key = self.ir.outputs, self.ir.key

    def __call__(self, **tensors):
        return run_reference(self, **tensors)


def _torch_functions(mixer):
    """(lift(u), readout(p, q, u)) as torch functions of tuples, printed from the mixer's IR."""
    key = mixer.key
    if key not in _COMPILED:
        ir = mixer.ir
        u = {s: f"u[{i}]" for i, s in enumerate(ir.input_symbols)}
        lines, outs = E.render(ir.lift, u, E.TORCH)
        src = "def lift(u):\n" + "".join(f"    {ln}\n" for ln in lines) + f"    return ({', '.join(outs)},)\n"
        names = dict(u)
        names.update({s: f"p[{i}]" for i, s in enumerate(ir.prefix_symbols)})
        names.update({s: f"q[{i}]" for i, s in enumerate(ir.previous_symbols)})
        lines, outs = E.render(ir.readout, names, E.TORCH)
        src += "def readout(p, q, u):\n" + "".join(f"    {ln}\n" for ln in lines)
        src += f"    return ({', '.join(outs)},)\n"
        namespace = dict(_NAMESPACE)
        exec(compile(src, f"<scanlang reference mixer {ir.name}>", "exec"), namespace)  # noqa: S102
        _COMPILED[key] = (namespace["lift"], namespace["readout"])
    return _COMPILED[key]


def run_reference(mixer, **tensors):
    """`mixer(**tensors)` computed with PyTorch ops (any device, float64-capable, autograd).

    Returns the mixer's outputs as a namedtuple by name (no `final`). Inputs are aligned to the
    mixer's axes as `sl.mixer` does (a missing axis broadcasts); half inputs are computed in float32."""
    if not isinstance(mixer, (Mixer, ReferenceMixer)):
        raise TypeError(f"mixer: expected an sl.mixer or a ReferenceMixer, got {type(mixer).__name__}")
    if tensors.keys() != mixer.input_axes.keys():
        raise ValueError(f"inputs: expected exactly {list(mixer.input_axes)}, got {list(tensors)}")
    sizes: dict[str, int] = {}
    views = []
    for name, ax in mixer.input_axes.items():
        t = tensors[name]
        if not isinstance(t, torch.Tensor) or t.dim() != len(ax):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected a tensor with {len(ax)} dims {ax}, got {got}")
        for a, n in zip(ax, t.shape):
            if sizes.setdefault(a, n) != n:
                raise ValueError(f"{name}: axis {a!r} has size {n}, but another input has {sizes[a]}")
        if t.dtype in (torch.float16, torch.bfloat16):
            t = t.float()
        views.append(t.reshape([t.shape[ax.index(a)] if a in ax else 1 for a in mixer.axes]))
    lift, readout = _torch_functions(mixer)
    monoid, dim = mixer.monoid, mixer.axes.index("t")
    elements = torch.broadcast_tensors(*(e if isinstance(e, torch.Tensor) else torch.as_tensor(e, dtype=views[0].dtype)
                                         for e in lift(views)))
    prefix = tuple(sl.scan(monoid, elements, dim=dim, backend="reference"))
    identity = tuple(torch.full_like(p.narrow(dim, 0, 1), float(i)) for p, i in zip(prefix, monoid.identity))
    previous = tuple(torch.cat([i, p.narrow(dim, 0, p.shape[dim] - 1)], dim) for i, p in zip(identity, prefix))
    outs = readout(prefix, previous, views)
    shape = torch.broadcast_shapes(*(p.shape for p in prefix))
    outs = [torch.as_tensor(o).expand(shape) for o in outs]
    if mixer.ir.reduce_state:
        outs = [o.sum(-1) for o in outs]
    result = collections.namedtuple("ReferenceMixerOutput", mixer.outputs)
    return result(*outs)
