"""The one seam between the core and its backends: a registry of backends by name.

    register(name, backend)   a backend module registers itself when it is imported
    get(name) -> backend      the registered backend, imported on first use
    default(device, ...)      the backend a call that names none gets

The core (`scan.py`, `mixer.py`, `pipeline.py`) and the recipes reach a backend only through
`get`, never by module path, so no core module imports a backend and importing `scanlang` does
not import Triton. `get` imports a known backend's module by name the first time (the only lazy
import of a backend; the module registers itself as it loads).

What a backend provides (attributes of the registered object):
- "reference": `scan(monoid, elems, dim, reverse, initial, out_dtype)` (see `scanlang.scan`).
- "triton": the same `scan`, and the compiled route `pipeline.build` / `pipeline.launch` takes:
  `render(ir, adjoint) -> str`, `load(source) -> module`, `launch(program, inputs, initial, dim,
  reverse, fp64, cu_seqlens, is_eager)`, `check(tensors, arg)`, `eager(tensors)`,
  `prefers_lanes(lanes)`.
- "delta": the chunked delta-rule kernels, `delta_rule(q, k, v, g, beta, rule, ...)`, and their source,
  `kernel_source(rule, chunk_size)`.
- "linear": the generated matrix-state kernels, `member_op(declaration)` (plain writes; per-key decay
  with the delta correction), and their
  sources, `sources(declaration)` ({"chunk": ..., "decode": ...}).
"""
from __future__ import annotations

import importlib

import torch

_REGISTERED: dict[str, object] = {}
# backends that register themselves when their module is imported (the names users pass as backend=)
_MODULES = {"reference": "scanlang.backends.reference", "triton": "scanlang.backends.triton",
            "delta": "scanlang.backends.delta.ops", "linear": "scanlang.backends.linear.ops"}


def register(name: str, backend) -> None:
    """Make `backend` (a module or any object with the attributes above) the backend called `name`."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name: expected a non-empty string, got {name!r}")
    _REGISTERED[name] = backend


def get(name: str):
    """The backend registered as `name`, importing a known backend's module on first use.

    >>> get("reference").__name__
    'scanlang.backends.reference'
    """
    if torch.compiler.is_dynamo_compiling():   # the registry may change at trace time: not read here
        return getattr(_Imported, _imported_outside_the_trace(name))
    found = _REGISTERED.get(name)
    if found is None:
        if name not in _MODULES:
            raise ValueError(f"backend: expected one of {sorted(set(_MODULES) | set(_REGISTERED))}, got {name!r}")
        importlib.import_module(_MODULES[name])
        found = _REGISTERED[name]
    return found


class _Imported:
    """Backends met in torch.compile traces, by name: the traced call reads this class attribute
    (reading the registry itself would guard on its contents, which the import changes)."""


@torch.compiler.assume_constant_result
def _imported_outside_the_trace(name: str) -> str:
    """`get(name)` at trace time, outside the graph (torch.compile runs this for real; Dynamo does
    not trace imports); returns the attribute of `_Imported` that holds the backend."""
    from .traced import passed_through_compile
    try:
        setattr(_Imported, name, get(name))
    except ValueError as err:
        raise passed_through_compile(err) from None
    return name


def default(device: torch.device, compute_dtype: torch.dtype | None = None, triton_dtypes=None) -> str:
    """The backend a call that names none runs on: "triton" (the generated kernels) for CUDA tensors,
    "reference" (PyTorch) elsewhere, and also where the computation's dtype `compute_dtype` is not
    among the ones the caller's Triton kernels take (`triton_dtypes`, None: every dtype).

    >>> default(torch.device("cpu")), default(torch.device("cuda"))
    ('reference', 'triton')
    >>> default(torch.device("cuda"), torch.float64, triton_dtypes=(torch.float32,))
    'reference'
    """
    if device.type != "cuda":
        return "reference"
    if triton_dtypes is not None and compute_dtype not in triton_dtypes:
        return "reference"
    return "triton"


__all__ = ["register", "get", "default"]
