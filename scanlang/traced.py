"""Declarations met inside a torch.compile trace are built outside it, at trace time.

A `Monoid`, `Mixer`, `DeltaRule` or `MatrixState` built inside a `torch.compile(fullgraph=True)`
function traces its bodies with sympy (and a mixer generates and loads kernels): code Dynamo cannot
trace. Each of these classes derives from `BuiltOutsideTheTrace`, whose `__new__`, when Dynamo is
tracing it, hands the constructor's arguments to `_build`, which torch.compile runs for real (outside
the graph, once per trace) and whose only result Dynamo keeps is a string: the name under which the
object is stored on `Built`. The traced code then reads that class attribute, a source Dynamo can
guard, so the declaration is an ordinary constant of the graph.

Law: `cls(*args)` inside a compiled function is the object `cls(*args)` builds eagerly (the first
one built with the same declaration identity: proofs and kernels are made once), and an error of
the declaration (ValueError / TypeError, e.g. `NotAssociativeError` with its counterexample) reaches
the caller as that error, not wrapped by Dynamo (also an AttributeError of a body reading a field
that is not declared).

What Dynamo must turn into constants: the arguments, so bodies given as nested functions or lambdas
may close over constants of the compiled function but not over its tensor or number inputs.
"""
from __future__ import annotations

import hashlib

import torch


class Built:
    """Declarations built at trace time, one class attribute each (`_build` names them)."""


@torch.compiler.assume_constant_result
def _build(cls, /, *args, **kwargs) -> str:
    """Build `cls(*args, **kwargs)` now (torch.compile runs this outside the graph) and return the
    attribute of `Built` that holds it: the first object of the same `trace_identity()` built so far."""
    try:
        obj = cls(*args, **kwargs)
    except (ValueError, TypeError, AttributeError) as err:   # AttributeError: a body reads no such field
        raise passed_through_compile(err) from None
    identity = repr((cls.__module__, cls.__qualname__, obj.trace_identity()))
    name = f"{cls.__name__}_{hashlib.sha256(identity.encode()).hexdigest()[:24]}"
    if not hasattr(Built, name):
        setattr(Built, name, obj)
    return name


class BuiltOutsideTheTrace:
    """Base of the declarations: built for real when Dynamo traces their construction (module
    docstring). A subclass defines `trace_identity() -> str` (equal for declarations that behave the
    same) and starts its `__init__` with `if torch.compiler.is_dynamo_compiling(): return`, because
    the object `__new__` returns there is already built."""

    def __new__(cls, *args, **kwargs):
        if torch.compiler.is_dynamo_compiling():
            return getattr(Built, _build(cls, *args, **kwargs))   # each argument one constant for Dynamo
        return super().__new__(cls)

    def trace_identity(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} must define trace_identity()")


_TRACED_ERRORS: dict = {}


def passed_through_compile(err: Exception) -> Exception:
    """`err` as an instance of a subclass of its own class and of Dynamo's UserError, which
    torch.compile re-raises unchanged (any other exception raised at trace time reaches the caller
    wrapped in InternalTorchDynamoError): `except sl.NotAssociativeError` works around a compiled
    call, with the counterexample attached. `err` itself where this torch has no such class."""
    try:   # torch._dynamo is loaded by torch.compile before this runs; nothing to import otherwise
        from torch._dynamo import exc as dynamo_exc
        if isinstance(err, dynamo_exc.UserError):
            return err
        cls = _TRACED_ERRORS.get(type(err))
        if cls is None:
            cls = _TRACED_ERRORS[type(err)] = type(type(err).__name__, (type(err), dynamo_exc.UserError),
                                                   {"__module__": type(err).__module__})
        out = cls.__new__(cls, str(err))
        dynamo_exc.UserError.__init__(out, dynamo_exc.UserErrorType.INVALID_INPUT, str(err))
        out.__dict__.update(err.__dict__)
        return out
    except Exception:   # noqa: BLE001 - a torch without this mechanism: the error as it is
        return err
