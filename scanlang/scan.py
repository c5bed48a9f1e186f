"""`sl.scan`: inclusive prefix scans of a declared monoid, the public front end.

    out_t = x_0 (+) x_1 (+) ... (+) x_t                           (reverse=False)
    out_t = x_{T-1} (+) ... (+) x_{t+1} (+) x_t                   (reverse=True: flip, scan, flip)
    with initial=e0:  out_t = e0 (+) (the prefix above)

where `(+)` is the monoid's combine with its left operand the earlier one. Projective monoids return
every prefix renormalised (`scale(out_t) == 1`), the first one included.

The front end validates and broadcasts; a backend, found by name in the registry `scanlang.backend`,
does the work: `backend.get(name).scan(monoid, elems, dim, reverse, initial, out_dtype) -> tuple[Tensor]`,
where `elems` all have the broadcast shape's number of dimensions, with size 1 where they broadcast (a
static parameter stays small: never materialised, and its gradient is reduced by the backend),
`dim >= 0`, `initial` is likewise shaped against the broadcast shape without `dim` (or None) and
`out_dtype` is float32 or float64.
"""
from __future__ import annotations

import collections
import numbers
from collections.abc import Mapping, Sequence  # isinstance checks: cheaper than typing's aliases

import torch

from . import backend as registry
from . import context_parallel, settings
from .context_parallel_ops import scan_sharded
from .monoid import DECLARED, Monoid
from .traced import passed_through_compile

BACKENDS = ("reference", "triton")
_RESULT_TYPES: dict = {}


def result_type(monoid: Monoid):
    """A namedtuple class with one attribute per field: `out.a`, `out[0]`, `a, b = out`."""
    key = (monoid.name, monoid.fields)
    if key not in _RESULT_TYPES:
        name = "".join(ch if ch.isalnum() else "_" for ch in monoid.name.title()) or "Monoid"
        _RESULT_TYPES[key] = collections.namedtuple(f"{name}Scan", monoid.fields)
    return _RESULT_TYPES[key]


def _as_field_tuple(monoid: Monoid, values, arg: str) -> tuple:
    """Accept a tuple/list in field order or a mapping by field name; return a tuple in field order."""
    fields = monoid.fields
    if isinstance(values, Mapping):
        unknown = [k for k in values if k not in fields]
        missing = [f for f in fields if f not in values]
        if unknown or missing:
            raise ValueError(f"{arg}: field names must be exactly {fields}; unknown {unknown}, missing {missing}")
        return tuple(values[f] for f in fields)
    if isinstance(values, torch.Tensor) and len(fields) == 1:
        return (values,)
    if isinstance(values, Sequence) and not isinstance(values, (str, bytes)):
        if len(values) != len(fields):
            raise ValueError(f"{arg}: expected {len(fields)} values, one per field {fields}; got {len(values)}")
        return tuple(values)
    raise TypeError(f"{arg}: expected a tuple in field order {fields} or a dict by field name; got {type(values).__name__}")


def _check_values(monoid: Monoid, values: tuple, arg: str) -> list[torch.Tensor]:
    tensors = []
    for field, v in zip(monoid.fields, values):
        if isinstance(v, torch.Tensor):
            if v.dtype == torch.bool or not (v.is_floating_point()):
                raise TypeError(f"{arg}[{field!r}]: dtype {v.dtype} is not supported; use a floating dtype "
                                f"(float16, bfloat16, float32, float64)")
            tensors.append(v)
        elif isinstance(v, numbers.Real) and not isinstance(v, bool):
            continue
        else:
            raise TypeError(f"{arg}[{field!r}]: expected a tensor or a real number, got {type(v).__name__}")
    return tensors


def _normalise_dim(dim, ndim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"dim: expected an int, got {type(dim).__name__}")
    dim = int(dim)
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim: {dim} is out of range for elements of {ndim} dimensions (expected {-ndim}..{ndim - 1})")
    return dim % ndim


def _choose_backend(backend, device: torch.device) -> str:
    if backend is None:
        return registry.default(device)
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton" and device.type != "cuda" and not settings.triton_interpret():
        raise ValueError("backend: 'triton' needs CUDA tensors, or TRITON_INTERPRET=1 in the environment to run "
                         f"the generated kernels in Triton's interpreter on {device.type} tensors")
    return backend


@torch.compiler.assume_constant_result
def proved(key: str, name: str) -> str:
    """Verify (once) the declaration `(monoid.key, monoid.name)` and prepare its torch combine.

    torch.compile runs this at trace time, outside the graph, and keeps only the returned string: a
    monoid first scanned inside a compiled function is proved (or refused with its counterexample)
    exactly as in an eager call, and sympy never enters the trace. It takes two strings (constants to
    Dynamo) and finds the object in `scanlang.monoid.DECLARED`.
    """
    m = DECLARED[(key, name)]
    try:
        proof = m.ensure_verified()
    except (ValueError, TypeError) as err:
        raise passed_through_compile(err) from None
    m.prepare()
    return proof.method


def scan(monoid: Monoid, elems, dim: int, reverse: bool = False, initial=None, backend: str | None = None,
         cp_group=None):
    """Inclusive scan of `elems` along `dim` with `monoid`; returns a namedtuple of prefixes by field.

    Law: out_t = initial (+) x_0 (+) x_1 (+) ... (+) x_t, and with reverse=True
    out_t = initial (+) x_{T-1} (+) ... (+) x_t; (+) is `monoid.combine` (earlier operand first), x_t
    the element at step t along `dim`, and no `initial` means none is applied.

    Args:
        monoid: a declared `Monoid` (e.g. `sl.Affine`).
        elems: tensors (or numbers) broadcastable to one common shape, as a tuple in field order or a
            dict by field name. bf16/fp16 inputs are computed in float32; float64 stays float64.
        dim: the scanned dimension of the broadcast shape (negative counts from the end).
        reverse: scan from the end (`out_t` combines `x_{T-1}` first, down to `x_t`).
        initial: an element applied before step 0, broadcastable to the shape without `dim`.
        backend: "reference" (PyTorch), "triton" (generated kernels), or None: triton on CUDA,
            reference elsewhere.
        cp_group: context parallelism (`scanlang.context_parallel`): a torch.distributed ProcessGroup
            or 1-D DeviceMesh over which `dim` is split into contiguous shards in rank order; each
            rank passes its shard (lengths may differ, one may be 0) and gets that shard of the
            global scan; `initial` (the same on every rank) applies at global step 0. None: one
            process, no collective.

    >>> import torch, scanlang as sl
    >>> a = torch.tensor([[0.5, 0.5, 0.5]]); b = torch.tensor([[1.0, 1.0, 1.0]])
    >>> sl.scan(sl.Affine, (a, b), dim=1).b            # h_t = 0.5 h_{t-1} + 1, h_{-1} = 0
    tensor([[1.0000, 1.5000, 1.7500]])
    """
    group = context_parallel.resolve_group(cp_group)
    if group is not None:
        try:
            elems_b, dim, init_b, out_dtype, backend = _prepare(monoid, elems, dim, reverse, initial, backend)
        except (TypeError, ValueError) as exc:
            context_parallel.agree(group, 0, {}, exc)   # raises this error on every rank
            raise
        return scan_sharded(group, monoid, elems_b, dim, reverse, init_b, out_dtype, _backend_scan(backend),
                            result_type(monoid))
    elems_b, dim, init_b, out_dtype, backend = _prepare(monoid, elems, dim, reverse, initial, backend)
    out = _backend_scan(backend)(monoid, elems_b, dim, reverse, init_b, out_dtype)
    return result_type(monoid)(*out)


def _backend_scan(backend: str):
    return registry.get(backend).scan


def _prepare(monoid: Monoid, elems, dim, reverse, initial, backend):
    """Validate and broadcast; return (elems, dim >= 0, initial or None, out dtype, backend name)."""
    if not isinstance(monoid, Monoid):
        raise TypeError(f"monoid: expected a scanlang Monoid (declare one with @sl.monoid), got {type(monoid).__name__}")
    if torch.compiler.is_compiling():
        proved(monoid.key, monoid.name)   # at trace time, outside the graph
    else:
        monoid.ensure_verified()
    values = _as_field_tuple(monoid, elems, "elems")
    tensors = _check_values(monoid, values, "elems")
    if not tensors:
        raise TypeError("elems: at least one element field must be a tensor")
    device = tensors[0].device
    for field, v in zip(monoid.fields, values):
        if isinstance(v, torch.Tensor) and v.device != device:
            raise ValueError(f"elems[{field!r}]: on {v.device}, but other elements are on {device}; "
                             "move every tensor to one device")
    try:
        shape = _broadcast_shape([t.shape for t in tensors])
    except RuntimeError:
        shapes = {f: tuple(v.shape) for f, v in zip(monoid.fields, values) if isinstance(v, torch.Tensor)}
        raise ValueError(f"elems: shapes {shapes} do not broadcast to one common shape") from None
    if len(shape) == 0:
        raise ValueError("elems: need at least one dimension to scan over; got scalars")
    dim = _normalise_dim(dim, len(shape))
    if not isinstance(reverse, bool):
        raise TypeError(f"reverse: expected a bool, got {type(reverse).__name__}")
    out_dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    backend = _choose_backend(backend, device)

    elems_b = _broadcast(values, shape, device, out_dtype)
    init_b = None
    if initial is not None:
        init_values = _as_field_tuple(monoid, initial, "initial")
        init_tensors = _check_values(monoid, init_values, "initial")
        for field, v in zip(monoid.fields, init_values):
            if isinstance(v, torch.Tensor) and v.device != device:
                raise ValueError(f"initial[{field!r}]: on {v.device}, but the elements are on {device}")
        init_shape = shape[:dim] + shape[dim + 1:]
        for field, v in zip(monoid.fields, init_values):
            if isinstance(v, torch.Tensor):
                try:
                    ok = _broadcast_shape([v.shape, init_shape]) == init_shape
                except RuntimeError:
                    ok = False
                if not ok:
                    raise ValueError(f"initial[{field!r}]: shape {tuple(v.shape)} does not broadcast to "
                                     f"{tuple(init_shape)} (the elements' shape without dim {dim})")
        if any(t.dtype == torch.float64 for t in init_tensors):
            out_dtype = torch.float64
        init_b = _broadcast(init_values, init_shape, device, out_dtype)
    return elems_b, dim, init_b, out_dtype, backend


def _broadcast_shape(shapes) -> torch.Size:
    """torch.broadcast_shapes for plain int shapes without its per-call overhead (torch's own when
    compiling, where sizes may be symbolic). Raises RuntimeError when they do not broadcast."""
    if torch.compiler.is_compiling():
        return torch.broadcast_shapes(*shapes)
    first = shapes[0]
    if all(s == first for s in shapes):   # the usual case: nothing broadcasts
        return torch.Size(first)
    out = [1] * max(len(s) for s in shapes)
    for s in shapes:
        for i, n in enumerate(s, len(out) - len(s)):
            if n != 1:
                if out[i] == 1:
                    out[i] = n
                elif out[i] != n:
                    raise RuntimeError(f"shape {tuple(s)} does not broadcast")
    return torch.Size(out)


def _broadcast(values: tuple, shape, device, dtype) -> tuple[torch.Tensor, ...]:
    """Numbers become tensors; every tensor gets len(shape) dims (leading size-1 dims, a view; a tensor
    that has them already is passed as it is)."""
    tensors = [v if isinstance(v, torch.Tensor) else torch.tensor(float(v), dtype=dtype, device=device)
               for v in values]
    return tuple([t if t.dim() == len(shape) else t.reshape((1,) * (len(shape) - t.dim()) + tuple(t.shape))
                  for t in tensors])
