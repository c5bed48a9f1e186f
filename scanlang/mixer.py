"""`sl.mixer`: a fused lift -> scan -> readout, one generated forward and one backward kernel.

API (v1)
--------
    mix = sl.mixer(monoid, axes="b t m s",
                   inputs={"v": "b t m", "k": "b t s", "a": "m s"},   # each input's axes, in order
                   lift=lambda u: (u.a, u.v * u.k),                   # inputs -> one value per field
                   readout=lambda p, u, q: (p.b * u.k,),              # prefix_t, inputs_t, prefix_{t-1}
                   outputs=("y",), reduce="s")                        # optional sum over the last axis
    out = mix(v=v, k=k, a=a, initial=None, output_final_state=False, reverse=False, cu_seqlens=None,
              cp_group=None)                                  # context parallelism: a process group
    out.y                 # [B, T, M]: sum_s readout(...) ; out.final: per field, [B, M, S] or None

Packed variable-length sequences: `cu_seqlens` ([N + 1] int tensor of starts along "t", with the
other axes usually B = 1) restarts the scan at every sequence start; `initial` is then per sequence
(broadcastable to [N, *lane axes]) and `final` is the last prefix of each sequence, [N, *lane axes].
The same generated kernels serve both cases.

Semantics, per lane (every index of `axes` but "t"):

    x_t   = lift(u_t)
    y_t   = y_{t-1} (+) x_t            y_{-1} = initial (an element, per field) or the identity
    out_t = readout(y_t, u_t, y_{t-1}) summed over the `reduce` axis when given

- `axes` names every dimension of the fused problem; "t" is time. An input lists the axes it has,
  in the same relative order; a missing axis broadcasts (a static parameter "m s" is loaded per
  lane, never expanded). `reduce` must be the last axis and a power of two.
- `lift(u)` and `readout(p, u, q)` are elementwise bodies over named fields (`u.v`, `p.b`, `q.a`)
  using `+ - * /`, constants and `sl.exp/log/sqrt`; they are traced once into sympy like a combine.
  `q` (the previous prefix) is optional to use; when unused no code is generated for it.
- `initial` fields given as Python numbers (e.g. `initial=(0, lam0, 0, 1)`) are constants of the
  program: when the lane-sequential schedule runs (very many lanes), fields that every step keeps at
  their value are not carried at all (`scanlang.ir.specialize_carry`, decided by sympy), e.g. the
  Kalman 3x3 monoid from the constant map carries 2 fields instead of 7. Numbers get no gradient.
- Differentiable in every input and in tensor `initial` fields (generated backward: the adjoint of the scan and the
  chain rule through lift and readout, gradients of broadcast inputs reduced inside the kernel).
- The elements x_t and prefixes y_t never go to memory: the forward writes the outputs and one
  checkpoint per lane and time tile; the backward replays each tile from its checkpoint.
- Any device the Triton backend accepts (CUDA, or CPU with TRITON_INTERPRET=1). Outputs are float32
  (float64 if any input is float64); bf16/fp16 inputs are computed in float32.

Example: see `help(sl.mixer)`.
"""
from __future__ import annotations

import collections
import math
from typing import Callable, Mapping, Sequence

import torch

from . import backend as registry
from . import context_parallel, pipeline, settings, tuning
from ._checks import check_cu_seqlens
from .context_parallel_ops import mixer_sharded
from .ir import lower, specialize_carry
from .monoid import Monoid
from .traced import BuiltOutsideTheTrace


def _axes(spec, what: str) -> tuple[str, ...]:
    if not isinstance(spec, str):
        raise TypeError(f"{what}: expected a string of axis names such as 'b t m s', got {type(spec).__name__}")
    names = tuple(spec.split())
    if len(set(names)) != len(names):
        raise ValueError(f"{what}: axis names must be distinct, got {spec!r}")
    return names


class Mixer(BuiltOutsideTheTrace):
    """A compiled fused scan; build it with `sl.mixer(...)` (see the module docstring). Built inside a
    torch.compile'd function, it is built (monoid proved, kernels generated) at trace time, outside
    the graph (`scanlang.traced`)."""

    def __init__(self, monoid: Monoid, axes: str, inputs: Mapping[str, str], lift: Callable,
                 readout: Callable, outputs: Sequence[str], reduce: str | None = None):
        if torch.compiler.is_dynamo_compiling():
            return   # built outside the trace by BuiltOutsideTheTrace.__new__
        if not isinstance(monoid, Monoid):
            raise TypeError(f"monoid: expected a scanlang Monoid, got {type(monoid).__name__}")
        monoid.ensure_verified()   # here, so that a Mixer built directly is proved too
        self.monoid = monoid
        self.axes = _axes(axes, "axes")
        if "t" not in self.axes:
            raise ValueError(f"axes: must contain the time axis 't', got {axes!r}")
        if not isinstance(inputs, Mapping) or not inputs:
            raise TypeError("inputs: expected a dict {name: 'axes'} such as {'x': 'b t d'}")
        self.input_axes = {}
        for name, spec in inputs.items():
            ax = _axes(spec, f"inputs[{name!r}]")
            unknown = [a for a in ax if a not in self.axes]
            if unknown:
                raise ValueError(f"inputs[{name!r}]: axes {unknown} are not in axes {self.axes}")
            order = [self.axes.index(a) for a in ax]
            if order != sorted(order):
                raise ValueError(f"inputs[{name!r}]: axes {ax} must follow the order of axes {self.axes}")
            self.input_axes[name] = ax
        if reduce is not None:
            if reduce != self.axes[-1] or reduce == "t":
                raise ValueError(f"reduce: must be the last axis of {self.axes} (and not 't'), got {reduce!r}")
        self.reduce = reduce
        outputs = (outputs,) if isinstance(outputs, str) else tuple(outputs)
        self.ir = lower(monoid, inputs=tuple(self.input_axes), lift=lift, outputs=outputs, readout=readout,
                        reduce_state=reduce is not None)
        self.outputs = self.ir.outputs
        self.result = collections.namedtuple("MixerOutput", self.outputs + ("final",))
        self.program = pipeline.build(self.ir)   # generated and loaded now, never inside a traced call
        self.key = self.program.key
        self._render = tuning.current().render_key   # the render-time knobs self.program was built under
        self._rendered: dict = {}      # other render-time knobs -> program (`_general`)
        self._specialised: dict = {}   # (constants, render-time knobs) -> program (`_program_for`)
        self._checked: dict = {}       # eager input signature -> what validation derived (`_call`)
        self._time_dim = self.axes.index("t")

    def trace_identity(self) -> str:
        """Equal for mixers that behave the same: the program (monoid, lift, readout, render knobs)
        and the axes of every input."""
        return repr((self.key, self.axes, sorted(self.input_axes.items()), self.reduce))

    def _general(self):
        """This mixer's program under the render-time knobs in effect (`scanlang.tuning`): the one
        built with the mixer, or one rendered on first use (outside a trace; inside, the first one)."""
        render = tuning.current().render_key
        if render == self._render:
            return self.program
        if render not in self._rendered:
            if torch.compiler.is_compiling():
                return self.program
            self._rendered[render] = pipeline.build(self.ir)
        return self._rendered[render]

    def _program_for(self, constants: dict, lanes: int):
        """The program to launch: this mixer's, or one specialised to initial fields given as Python
        numbers (ir.specialize_carry) when the lane-sequential schedule runs (many lanes, or forced).

        Specialised programs are built on first use and kept; inside a torch.compile trace a program
        not built yet is not generated (no sympy in a traced call): the general one runs instead."""
        kernels = _triton()
        general = self._general()
        if not constants or not (kernels.prefers_lanes(lanes) or kernels.forces_lanes()):
            return general
        key = (tuple(sorted(constants.items())), tuning.current().render_key)
        if key not in self._specialised:
            if torch.compiler.is_compiling():
                return general
            spec = specialize_carry(self.ir, constants)
            self._specialised[key] = general if spec is self.ir else pipeline.build(spec)
        return self._specialised[key]

    def source(self) -> str:
        """The generated Triton module (forward and backward)."""
        return self.program.source

    def _align(self, tensors: dict) -> tuple[list[torch.Tensor], dict]:
        sizes: dict[str, int] = {}
        for name, t in tensors.items():
            ax = self.input_axes[name]
            if t.dim() != len(ax):
                raise ValueError(f"{name}: expected {len(ax)} dims {ax}, got shape {tuple(t.shape)}")
            for a, n in zip(ax, t.shape):
                if sizes.setdefault(a, n) != n:
                    raise ValueError(f"{name}: axis {a!r} has size {n}, but another input has {sizes[a]}")
        missing = [a for a in self.axes if a not in sizes]
        if missing:
            raise ValueError(f"inputs: no input has axes {missing}; their sizes are unknown")
        views = []
        for name, t in tensors.items():
            ax = self.input_axes[name]
            shape = [sizes[a] if a in ax else 1 for a in self.axes]
            views.append(t.reshape(shape))
        return views, sizes

    def _validate(self, values: list) -> tuple:
        """Check the inputs (types, devices, dims, axis sizes, the reduced axis); return what a call
        needs of them: (each input's view shape or None (all None: None), fp64, lane shape, length)."""
        for n, t in zip(self.input_axes, values):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{n}: expected a tensor, got {type(t).__name__}")
        _triton_backend_check(values)
        views, sizes = self._align(dict(zip(self.input_axes, values)))
        if self.reduce is not None:
            s = sizes[self.reduce]
            if s & (s - 1):
                raise ValueError(f"reduce: the size of axis {self.reduce!r} must be a power of two, got {s}")
        view_shapes = [v.shape if v.shape != t.shape else None for v, t in zip(views, values)]
        return (None if all(s is None for s in view_shapes) else view_shapes,
                any(t.dtype == torch.float64 for t in views), [sizes[a] for a in self.axes if a != "t"], sizes["t"])

    def _initial(self, initial, state_shape, fp64: bool, device) -> tuple[list, dict]:
        """`initial` as one tensor per field expanded to `state_shape`, and the fields given as Python
        numbers (constants of the program, see `_program_for`)."""
        if isinstance(initial, Mapping):
            initial = [initial[f] for f in self.monoid.fields]
        if len(initial) != len(self.monoid.fields):
            raise ValueError(f"initial: expected {len(self.monoid.fields)} values (fields {self.monoid.fields})")
        init, constants = [], {}
        for f, v in zip(self.monoid.fields, initial):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                constants[f] = float(v)
            v = torch.as_tensor(v, dtype=torch.float64 if fp64 else torch.float32, device=device)
            try:
                init.append(v.expand(state_shape))
            except RuntimeError:
                raise ValueError(f"initial[{f!r}]: shape {tuple(v.shape)} does not broadcast to {state_shape} "
                                 f"([sequences] + axes {[a for a in self.axes if a != 't']})") from None
        return init, constants

    def __call__(self, initial=None, output_final_state: bool = False, reverse: bool = False, cu_seqlens=None,
                 cp_group=None, **tensors):
        """Run the fused scan on named input tensors; returns a namedtuple (outputs..., final).

        `cp_group` (a torch.distributed ProcessGroup or 1-D DeviceMesh): the "t" axis is split over
        its ranks in order, each passing its shard (and, with `cu_seqlens`, the GLOBAL offsets);
        outputs are this rank's shard, `final` the global one on every rank (two passes over the
        shard: one for its summary, one from the true carry; `scanlang.context_parallel_ops`)."""
        group = context_parallel.resolve_group(cp_group)
        if group is not None:
            return mixer_sharded(self, group, initial, output_final_state, reverse, cu_seqlens, tensors)
        return _call(self, initial, output_final_state, reverse, cu_seqlens, tensors)


def _check_cu_seqlens(cu_seqlens, total: int, device) -> int:
    """The number of sequences, after `check_cu_seqlens` (the kernels take the offsets as memory bounds)."""
    check_cu_seqlens(cu_seqlens, total, device)
    return cu_seqlens.numel() - 1


_kernels = None   # the "triton" backend, bound on the first call (importing scanlang does not import Triton)


def _triton():
    global _kernels
    if _kernels is None:
        _kernels = registry.get("triton")
    return _kernels


def _call(self: Mixer, initial, output_final_state: bool, reverse: bool, cu_seqlens, tensors: dict):
    """Validate, align and launch. For plain eager tensors (outside torch.compile and tracing) what the
    inputs' shapes, dtypes and devices decide (validation, views, fp64, lane shape) is remembered per
    signature, so a repeated call does no validation work beyond the names and types."""
    kernels = _triton()
    if tensors.keys() != self.input_axes.keys():
        names = list(self.input_axes)
        positional = [v for v in (initial, output_final_state, reverse, cu_seqlens) if isinstance(v, torch.Tensor)]
        if positional and len(tensors) < len(names):
            raise TypeError(f"inputs are keyword-only: call the mixer as mix({', '.join(f'{n}=...' for n in names)}); "
                            f"got {len(positional)} tensor(s) as positional arguments")
        unknown = [n for n in tensors if n not in self.input_axes]
        missing = [n for n in names if n not in tensors]
        raise ValueError(f"inputs: expected exactly {names}; unknown {unknown}, missing {missing}")
    values = [tensors[n] for n in self.input_axes]
    # plain eager tensors only (the check also refuses non-tensors): under tracing, shapes may be
    # symbolic (and unhashable)
    eager = kernels.eager(values if cu_seqlens is None else values + [cu_seqlens])
    known = None
    if eager:
        signature = tuple([(t.shape, t.dtype, t.device) for t in values])
        known = self._checked.get(signature)
    if known is None:
        known = self._validate(values)
        if eager:
            if len(self._checked) >= 256:   # shapes that keep changing: stay bounded
                self._checked.clear()
            self._checked[signature] = known
    elif values[0].device.type != "cuda" and not settings.triton_interpret():
        _triton_backend_check(values)   # raises: the environment changed since
    view_shapes, fp64, lane_shape, length = known
    views = values if view_shapes is None else [t if s is None else t.reshape(s) for t, s in zip(values, view_shapes)]
    state_shape = lane_shape
    if cu_seqlens is not None:
        state_shape = [_check_cu_seqlens(cu_seqlens, length, values[0].device)] + lane_shape
    init, constants = None, {}
    if initial is not None:
        init, constants = self._initial(initial, state_shape, fp64, values[0].device)
        eager = None   # the initial elements' tensors count too: ops.launch decides
    program = self._program_for(constants, math.prod(lane_shape)) if constants else self._general()
    outs, final = pipeline.launch(program, views, init, self._time_dim, reverse, fp64, cu_seqlens, is_eager=eager)
    fin = tuple(final[i].reshape(state_shape) for i in range(len(self.monoid.fields))) if output_final_state else None
    return self.result(*outs, fin)


def _triton_backend_check(values):
    """The Triton backend's device and dtype checks of the inputs."""
    _triton().check(values, "inputs")


def mixer(monoid: Monoid, axes: str, inputs: Mapping[str, str], lift: Callable, readout: Callable,
          outputs: Sequence[str], reduce: str | None = None) -> Mixer:
    """Declare a fused lift -> scan -> readout (the module docstring has the whole API).

    Law, per lane (every index of `axes` but "t"), with (+) the monoid's combine:
        x_t = lift(u_t);  y_t = y_{t-1} (+) x_t, y_{-1} = initial or the identity;
        out_t = readout(y_t, u_t, y_{t-1}), summed over the `reduce` axis when given.
    The monoid is verified first: a non-associative combine raises `sl.NotAssociativeError`. The
    mixer runs the generated Triton kernels (on CPU: in Triton's interpreter, TRITON_INTERPRET=1).

    >>> import torch, scanlang as sl
    >>> ema = sl.mixer(sl.Affine, axes="b t d", inputs={"x": "b t d", "decay": "d"},
    ...                lift=lambda u: (u.decay, (1 - u.decay) * u.x), readout=lambda p, u, q: p.b,
    ...                outputs=("h",))
    >>> out = ema(x=torch.ones(1, 3, 1), decay=torch.tensor([0.5]))   # h_t = 0.5 h_{t-1} + 0.5 x_t
    >>> out.h.flatten().tolist()
    [0.5, 0.75, 0.875]
    """
    if not isinstance(monoid, Monoid):
        raise TypeError(f"monoid: expected a scanlang Monoid (declare one with @sl.monoid), got {type(monoid).__name__}")
    return Mixer(monoid, axes, inputs, lift, readout, outputs, reduce)
