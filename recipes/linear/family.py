"""Running a declared matrix-state member (scanlang.linear): validation, hooks, backends.

`op(declaration)` returns the member's functional op

    o, S = op(q, k, v, *inputs, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, backend=None, chunk_size=None, **constants)

with the declared inputs positional after v, in declaration order (fla's order for the shipped
members). The hooks run as the traced sympy expressions, rendered for torch; their backward is
the sympy derivative (`Hook.grads`), so the reference also checks the derivatives a generated
kernel would use. backend: "reference" runs the chunked PyTorch reference (recipes/linear/chunked.py);
"triton" runs generated kernels:
the delta correction, or n Householder steps, with decay none or per head on the delta-rule kernels
(backends/delta, CUDA or Triton's interpreter; the declaration translated into a DeltaRule by
scanlang/delta_form.py; Householder steps as a delta rule over the interleaved T*n rows, `_on_delta`);
every other structure on the kernels generated from the declaration (backends/linear): without gradients
and for sequences of at most `tuning.decode_max_tokens` tokens the recurrent decode kernel (CUDA and
the interpreter), else the chunk kernels of plain writes, every decay, and of per-key decay with the delta
correction (backends/linear/kernels_delta.py), CUDA or the interpreter (per-key decay with Householder
steps raises a ValueError saying so). None / "auto": "triton" for the delta kernels' structures on CUDA
(`scanlang.backend.default`, float32 compute), the reference otherwise.
chunk_size=None: 64 on the delta-rule kernels (the chunk their launch configs are tuned for), 32 elsewhere;
with n Householder steps it counts rows of the interleaved stream on both (C/n tokens a chunk).
"""
from __future__ import annotations

import math
import numbers

import sympy
import torch

from scanlang import backend as _backend
from scanlang import expr as E
from scanlang import settings
from scanlang._checks import check_log_decay, check_scale, packed_offsets
from scanlang.delta import CHUNK_SIZES, DELTA_CHUNK, MAX_HEAD_DIM
from scanlang.delta_form import default_backend, delta_form, runs_on_delta
from scanlang.linear import KEY_NORM, REFERENCE_CHUNK, MatrixState

from .chunked import matrix_state_reference

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_STEPS = {sympy.Heaviside: lambda u: torch.where(u > 0, 1.0, torch.where(u < 0, 0.0, 0.5)).to(u.dtype),
          sympy.sign: torch.sign}   # derivatives of max / abs; Heaviside(0) = 1/2 as in sympy and torch


class _TorchHook:
    """A traced hook as torch code: forward from `Hook.expr`, backward from `Hook.grads`."""

    def __init__(self, hook, fields: tuple[str, ...]):
        self.fields = fields
        self.value = self._compile([hook.expr])
        self.grads = self._compile([hook.grads[f] for f in fields])

    def _compile(self, exprs):
        steps = sorted({a for e in exprs for kind in _STEPS for a in sympy.sympify(e).atoms(kind)},
                       key=sympy.default_sort_key)
        subs = {a: E.symbol(f"_step{i}") for i, a in enumerate(steps)}
        names = {E.symbol(f): f"x[{i}]" for i, f in enumerate(self.fields)}
        src = "def f(x):\n"
        for a, s in subs.items():
            lines, (u,) = E.render([a.args[0]], names, E.TORCH, temp_prefix=f"_u{s.name}")
            src += "".join(f"    {ln}\n" for ln in lines) + f"    {s.name} = steps[{type(a).__name__!r}]({u})\n"
            names[s] = s.name
        lines, outs = E.render([sympy.sympify(e).xreplace(subs) for e in exprs], dict(names), E.TORCH)
        src += "".join(f"    {ln}\n" for ln in lines) + f"    return ({', '.join(outs)},)\n"
        ns = {"math": math, "steps": {k.__name__: fn for k, fn in _STEPS.items()},
              **{n: getattr(E, n) for n in ("exp", "log", "sqrt", "abs", "maximum", "minimum")}}
        exec(compile(src, "<scanlang matrix-state hook>", "exec"), ns)  # noqa: S102
        return ns["f"]

    def __call__(self, values: dict, like: torch.Tensor):
        args = [values[f] for f in self.fields]
        if not any(isinstance(a, torch.Tensor) for a in args):   # a hook of constants only
            return torch.full_like(like, float(self.value(args)[0]))
        return _HookFunction.apply(self, *args)


class _HookFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hook, *values):
        ctx.hook = hook
        ctx.save_for_backward(*[v for v in values if isinstance(v, torch.Tensor)])
        ctx.tensor = [isinstance(v, torch.Tensor) for v in values]
        ctx.values = [None if isinstance(v, torch.Tensor) else v for v in values]
        shape = torch.broadcast_shapes(*[v.shape for v in values if isinstance(v, torch.Tensor)])
        ref = next(v for v in values if isinstance(v, torch.Tensor))
        return (hook.value(values)[0] + ref.new_zeros(shape))

    @staticmethod
    def backward(ctx, grad):
        saved = iter(ctx.saved_tensors)
        values = [next(saved) if t else c for t, c in zip(ctx.tensor, ctx.values)]
        partials = ctx.hook.grads(values)
        out = [None]
        for v, d in zip(values, partials):
            if not isinstance(v, torch.Tensor):
                out.append(None)
                continue
            full = grad * d
            while full.dim() > v.dim():
                full = full.sum(0)
            for axis, size in enumerate(v.shape):
                if size == 1 and full.shape[axis] != 1:
                    full = full.sum(axis, keepdim=True)
            out.append(full)
        return tuple(out)


def _interleave(x: torch.Tensor, n: int, last: bool) -> torch.Tensor:
    """[B, T, H, ...] -> [B, T*n, H, ...]: token t's row at t*n + n-1 (`last`, the query) or t*n (the log-decay),
    zeros on the other n - 1 rows. Differentiable: the gradient of x is that of those rows."""
    B, T = x.shape[:2]
    pad = x.new_zeros(B, T, n - 1, *x.shape[2:])
    rows = [pad, x[:, :, None]] if last else [x[:, :, None], pad]
    return torch.cat(rows, 2).reshape(B, T * n, *x.shape[2:])


def _tensor(name, t, shape, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {what}, got {type(t).__name__}")
    if t.dtype not in FLOATS:
        raise ValueError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if list(t.shape) != list(shape):
        raise ValueError(f"{name} must have shape {what} = {list(shape)}, got {list(t.shape)}")


class MemberOp:
    """The functional op of one declaration (module docstring). `declaration` is the MatrixState.

    Law: S_t = P_t S_{t-1} + R_t, o_t = scale S_t^T q_t (the declaration's structure); see `op`.

    >>> import scanlang as sl
    >>> from scanlang.recipes.linear import MemberOp
    >>> MemberOp(sl.matrix_state("plain_write")).__name__
    'plain_write'
    """

    def __init__(self, declaration: MatrixState, name: str | None = None, triton=None):
        if not isinstance(declaration, MatrixState):
            raise TypeError(f"op() takes a declaration from sl.matrix_state, got {type(declaration).__name__}")
        self.declaration = declaration
        self.__name__ = name or declaration.name
        # the generated-kernel op, made here, outside any torch.compile trace (it registers the declaration)
        self.triton = triton if triton is not None else _backend.get("linear").member_op(declaration)
        d = declaration
        self._beta = None if d.beta is None else _TorchHook(d.beta, d.used(d.beta))
        self._decay = None if d.log_decay is None else _TorchHook(d.log_decay, d.used(d.log_decay))
        # the delta kernels' form of the declaration with its default constants, built here, outside any
        # torch.compile trace (a call that changes a constant rendered into the rule finds or builds another)
        self._delta = delta_form(d, d.constants) if runs_on_delta(d) else None

    def __repr__(self):
        return f"<matrix-state op {self.__name__}: {self.declaration!r}>"

    def __call__(self, q, k, v, *args, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                 backend=None, chunk_size=None, **kwargs):
        d = self.declaration
        names = tuple(d.inputs)
        if len(args) > len(names):
            raise TypeError(f"{self.__name__}() takes inputs {names} after q, k, v; got {len(args)} extra arguments")
        inputs = dict(zip(names, args))
        constants = dict(d.constants)
        for key, value in kwargs.items():
            if key in inputs:
                raise TypeError(f"{self.__name__}() got input {key!r} twice")
            if key in names:
                inputs[key] = value
            elif key in constants:
                if isinstance(value, bool) or not isinstance(value, numbers.Real):
                    raise TypeError(f"{key} must be a real number, got {value!r}")
                constants[key] = float(value)
            else:
                raise TypeError(f"{self.__name__}() got an unexpected argument {key!r} (inputs {names}, "
                                f"constants {tuple(constants)})")
        missing = [n for n in names if n not in inputs]
        if missing:
            raise TypeError(f"{self.__name__}() is missing inputs {missing}")
        if backend not in (None, "auto", "reference", "triton"):
            raise ValueError(f"backend must be None, 'auto', 'reference' or 'triton', got {backend!r}")
        offsets, compute = self._validate(q, k, v, inputs, scale, initial_state, cu_seqlens,
                                          REFERENCE_CHUNK if chunk_size is None else chunk_size)
        if backend in (None, "auto"):
            backend = default_backend(d, q.device, compute, DELTA_CHUNK if chunk_size is None else chunk_size,
                                      q.shape[-1], v.shape[-1], CHUNK_SIZES, MAX_HEAD_DIM)
        if chunk_size is None:   # each backend's own: the delta kernels' tuned chunk, else the reference's
            chunk_size = DELTA_CHUNK if backend == "triton" and runs_on_delta(d) else REFERENCE_CHUNK
        if backend == "triton" and runs_on_delta(d):
            return self._on_delta(q, k, v, inputs, constants, scale, initial_state, output_final_state, offsets,
                                  chunk_size, compute)
        if backend == "triton":
            if self._decay is not None and q.device.type == "cpu" and not torch.compiler.is_compiling():
                # g <= 0 and finite, checked where it costs no synchronisation; the decode kernel's
                # token loop takes -inf (a hard reset: exp(-inf) = 0), the chunk kernels do not
                with torch.no_grad():
                    g = self._log_decay({n: t.to(compute) for n, t in inputs.items()} | constants, q)
                chunked = not _backend.get("linear").decodes(q, (k, v, initial_state, *inputs.values()), offsets)
                if chunked and bool(torch.isinf(g).any()):
                    raise ValueError(f"{self.__name__}: a log-decay of -inf (a hard reset) is not handled by the "
                                     f"generated kernels yet (their pairwise decays would be -inf - -inf); "
                                     f"use backend='reference'")
            return self.triton(q, k, v, *[inputs[n] for n in names], offsets=offsets, chunk_size=chunk_size,
                               scale=q.shape[-1] ** -0.5 if scale is None else float(scale),
                               initial_state=initial_state, output_final_state=output_final_state,
                               constants=constants, cu_seqlens=cu_seqlens)
        q, k, v = (t.to(compute) for t in (q, k, v))
        values = {n: t.to(compute) for n, t in inputs.items()}
        values.update(constants)
        beta = g = None
        if self._beta is not None:
            beta = self._host_beta(values, k)
        if self._decay is not None:
            g = self._log_decay(values, q)
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        h0 = None if initial_state is None else initial_state.to(compute)
        o, S = matrix_state_reference(q, k, v, g, beta, steps=d.steps, scale=scale, initial_state=h0,
                                      chunk_size=chunk_size, cu_seqlens=offsets)
        return o, (S if output_final_state else None)

    def _host_beta(self, values: dict, k: torch.Tensor) -> torch.Tensor:
        """beta = the beta hook of `values` (and ||k||^2), [B,T,H]. A zero key writes nothing whatever beta is,
        so where the hook is not finite for one (0/0 at eps = 0) beta is 0, as in the delta kernels; where it is
        finite (eps > 0) it stays, and so does its share of dk (beta k (v - S^T k)^T has slope beta at k = 0)."""
        d = self.declaration
        if d.uses_key_norm:
            n2 = (k * k).sum(-1)
            with torch.no_grad():
                dead = (n2 == 0) & ~torch.isfinite(self._beta({**values, KEY_NORM: n2}, like=k[..., 0]))
            values = {**values, KEY_NORM: torch.where(dead, torch.ones_like(n2), n2)}
        beta = self._beta(values, like=k[..., 0])
        if d.uses_key_norm:   # keep 0/0 out of beta and of its derivatives
            beta = torch.where(dead, torch.zeros_like(beta), beta)
        return beta.expand(k.shape[:3])

    def _on_delta(self, q, k, v, inputs, constants, scale, initial_state, output_final_state, offsets, chunk_size,
                  compute):
        """backend='triton' for a structure the delta kernels run (scanlang/delta_form.py), on CUDA or
        in Triton's interpreter: the declaration's DeltaForm, its s, a and per-head parameters, one launch.
        n > 1 Householder steps: q and a interleaved into the T*n rows k, v and s already have (q_t on row
        t*n+n-1, a_t on row t*n, zeros elsewhere; a = 0 gives g = 0 there, delta_form's _vanishes), cu_seqlens
        times n, and o_t read from row t*n+n-1. A zero query row only makes a zero output row (q enters the
        kernels through dot products alone), and its gradient is dropped with it."""
        if q.device.type != "cuda" and not settings.triton_interpret():
            raise ValueError(f"{self.__name__}: backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 to run "
                             f"the kernels in Triton's interpreter on CPU")
        if compute == torch.float64:
            raise ValueError(f"{self.__name__}: backend='triton' takes bf16/fp16/fp32 inputs; use "
                             f"backend='reference' for float64")
        if chunk_size not in CHUNK_SIZES:
            raise ValueError(f"chunk_size must be one of {CHUNK_SIZES} for backend='triton' (the delta-rule "
                             f"kernels), got {chunk_size!r}")
        for name, dim in (("q", q.shape[-1]), ("v", v.shape[-1])):
            if dim > MAX_HEAD_DIM:
                raise ValueError(f"{name}: head dim {dim} is above {MAX_HEAD_DIM}, the most the delta-rule kernels "
                                 f"take (backend='triton'); use backend='reference'")
        form = self._delta
        if any(constants[c] != value for c, value in form.baked):
            form = delta_form(self.declaration, constants)
        values = {n: t.to(compute) for n, t in inputs.items()} | constants
        if form.host_beta:
            s = self._host_beta(values, k.to(compute))
        else:
            s = inputs[form.step] if form.step else q.new_zeros(q.shape[:3], dtype=torch.float32)
        if form.host_decay:
            a = self._log_decay(values, q)
        else:
            a = inputs[form.decay] if form.decay else q.new_zeros(q.shape[:3], dtype=torch.float32)
            if self._decay is not None and q.device.type == "cpu" and not torch.compiler.is_compiling():
                with torch.no_grad():   # g <= 0, checked where it costs no synchronisation (the kernels form g)
                    self._log_decay(values, q)
        n = self.declaration.steps
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        if n > 1:   # Householder steps: a delta rule over the interleaved T*n rows (delta_form.py's docstring)
            q, a = _interleave(q, n, last=True), _interleave(a, n, last=False)
            offsets = None if offsets is None else tuple(x * n for x in offsets)
        o, S = _backend.get("delta").delta_rule(
            q, k, v, a, s, form.rule, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=offsets, chunk_size=chunk_size,
            eps=constants[form.eps] if form.eps else 0.0, decay_params=[inputs[p] for p in form.params])
        return (o if n == 1 else o[:, n - 1::n].contiguous()), S

    def _log_decay(self, values: dict, q: torch.Tensor) -> torch.Tensor:
        """g = log_decay(values), [B,T,H] or [B,T,H,K], checked to be <= 0 (CPU tensors)."""
        d = self.declaration
        wide = d.decay == "per_key"   # per-token and per-head inputs broadcast over the key axis
        g = self._decay({f: x[..., None] if wide and d.inputs.get(f) in ("token", "head") else x
                         for f, x in values.items()}, like=q if wide else q[..., 0])
        g = g.expand(q.shape[:3] + ((q.shape[3],) if wide else ()))
        try:
            check_log_decay(g)
        except ValueError as exc:
            raise ValueError(f"{self.__name__}: the log-decay (log_decay = {d.log_decay.expr}) must be "
                             f"<= 0: {exc}") from None
        return g

    def _validate(self, q, k, v, inputs, scale, initial_state, cu_seqlens, chunk_size):
        d, n = self.declaration, self.declaration.steps
        if not isinstance(q, torch.Tensor) or q.dim() != 4:
            raise ValueError(f"q must be a tensor of shape [B, T, H, K], got "
                             f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
        B, T, H, K = q.shape
        _tensor("q", q, q.shape, "[B, T, H, K]")
        rows = "T*n" if n > 1 else "T"
        if n > 1 and isinstance(k, torch.Tensor) and k.dim() == 4 and k.shape[1] % n:
            raise ValueError(f"k: its length {k.shape[1]} is not a multiple of num_householder = {n} "
                             f"(k carries n rows per token)")
        _tensor("k", k, (B, T * n, H, K), f"[B, {rows}, H, K] (B, T, H, K of q)")
        if not isinstance(v, torch.Tensor) or v.dim() != 4:
            raise ValueError(f"v must be a tensor of shape [B, {rows}, H, V]")
        _tensor("v", v, (B, T * n, H, v.shape[3]), f"[B, {rows}, H, V]")
        for name, kind in d.inputs.items():
            L = T * n if d.rows.get(name) == "sub" else T
            shape, what = {"token": ((B, L, H), f"[B, {'T*n' if L != T else 'T'}, H]"),
                           "token_key": ((B, L, H, K), "[B, T, H, K]"), "head": ((H,), "[H]")}[kind]
            _tensor(name, inputs[name], shape, what)
        device = q.device
        for name, t in (("k", k), ("v", v), *inputs.items()):
            if t.device != device:
                raise ValueError(f"{name} is on {t.device} but q is on {device}; all inputs must share a device")
        check_scale(scale)
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        offsets = packed_offsets(cu_seqlens, B, T, device)
        N = B if offsets is None else len(offsets) - 1
        tensors = (q, k, v, *inputs.values())
        compute = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
        if initial_state is not None:
            if not isinstance(initial_state, torch.Tensor):
                raise TypeError(f"initial_state must be a tensor [N, H, K, V] or None, got "
                                f"{type(initial_state).__name__}")
            want = [N, H, K, v.shape[3]]
            if list(initial_state.shape) != want:
                raise ValueError(f"initial_state must have shape [N, H, K, V] = {want}, got "
                                 f"{list(initial_state.shape)}")
            if initial_state.dtype not in (torch.float32, compute):
                raise ValueError(f"initial_state must be float32 (float64 allowed with float64 inputs), got "
                                 f"{initial_state.dtype}")
            if initial_state.device != device:
                raise ValueError(f"initial_state is on {initial_state.device} but q is on {device}")
        return offsets, compute


def op(declaration: MatrixState, name: str | None = None) -> MemberOp:
    """The functional op of a declared member (module docstring), on the reference backend.

    Law: the declaration's S_t = P_t S_{t-1} + R_t, o_t = scale S_t^T q_t; the op takes q, k, v, then
    the declared inputs in order (keyword or positional), then fla's keywords.

    >>> import torch, scanlang as sl
    >>> from scanlang.recipes.linear import op
    >>> plain = op(sl.matrix_state("plain_write"))
    >>> q = k = torch.tensor([1.0, 0.0]).expand(1, 2, 1, 2)
    >>> o, _ = plain(q, k, torch.tensor([3.0, 5.0]).reshape(1, 2, 1, 1), scale=1.0)
    >>> o.flatten().tolist()
    [3.0, 8.0]
    """
    return MemberOp(declaration, name)
