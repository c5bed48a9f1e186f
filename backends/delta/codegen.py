"""Render the delta-rule kernels for one family member (`scanlang.delta.DeltaRule`) and chunk size.

    hook_kernels(rule)          -> step_hook, step_hook_grad, decay_hook, store_decay_grads on the kernel IR,
                                   from the rule's sympy expressions and derivatives (render_hooks: as source)
    module(rule, C)             -> the kernel module (backends/triton/kernel/ir.py): the hooks, the helpers
                                   (parts.py), the forward kernels (kernels_fwd.py; delta_prep's merge of the
                                   C/16 row blocks of Tm = (I + A)^-1 unrolled, render_prep) and the backward
                                   kernels (kernels_bwd.py)
    kernel_source(rule, C)      -> that module printed (backends/triton/kernel/printer.py)
    load(rule, C)               -> the imported module, from a content-addressed file in the cache dir

Rendering is deterministic (sorted, CSE'd expressions; no ids), so two processes write the same bytes.

All kernels index tokens as one packed stream [TT, H, ...] (an equal-length batch is packed too), and a
chunk table gives each chunk's first token and length, so one module serves both cases.

Dots of two fp32 operands (Tm and its gradients) use PREC ("ieee", or "tf32" for half inputs); dots of
input-dtype operands use IN_PREC ("ieee" for fp32 inputs, the default for bf16/fp16 tensor cores);
all go through `mm`, which can upcast bf16 operands for Triton's CPU interpreter (UPCAST).

Kernels (per chunk c of C tokens, head h; S0 the chunk's start state, G the in-chunk cumsum of g):
    delta_prep        gcum, beta, Tm = (I + A)^-1 (16x16 diagonal blocks, then the blocks merged, each by
                      products of powers of a nilpotent matrix), w = Tm diag(beta e^G) K, u = Tm diag(beta) V,
                      and the output's in-chunk matrix Q K^T * Dec (causal), which needs no state
    delta_wu          w and u again from the saved Tm (backward)
    delta_state_fwd   sequential over a sequence's chunks, fp32 state in registers: stores S0 per chunk,
                      U = u - w S0, S_end = e^G_last S0 + (K e^(G_last - G))^T U (the backward's recomputation)
    delta_state_output the same pass in the forward, storing O = scale (e^G Q S0 + (Q K^T * Dec) U) per chunk
                      (Q K^T * Dec from delta_prep) instead of S0 and U
    delta_dU_local    per chunk and value block, in parallel: the local dU = scale (Q K^T * Dec)^T dO (and dO
                      rounded to the input dtype for the kernels after it)
    delta_state_bwd   reverse over chunks: dS_end per chunk, dU = local dU + K~ dS_end (the local part formed
                      here instead under LOCAL_DU), dS0 = e^G_last dS_end + scale (e^G Q)^T dO - w^T dU
    delta_bwd_dqk     per chunk and key block, through the outputs, S_end and U: dq, dk and dG in part, and dw
                      applied where it is formed (shares of dk, dTm, dbeta, dG; never stored); under WY one
                      program per chunk also does delta_bwd_wy's work
    delta_bwd_wy      per chunk, through u, Tm, A and the hooks, summing dqk's shares: dv, dk, d(step input),
                      d(decay input)
    delta_recurrent   token loop with the state in registers (decode / short inputs)

A NaN or inf in token t reaches token t and later ones only, as in the token loop. delta_prep stores each chunk's
first such token (over the key, step, decay and value inputs; C if none) in `nonfinite` [NC, H], and the kernels
after it take the guarded path only in chunks where that row exists, so finite chunks run the plain products:
the causal products (Tm from A, w, u, (Q K^T * Dec) U) take the non-finite entries as 0 and make each column NaN
from its first one on (`finite_or_zero`, `nan_from`, `nan_rows`; the prep's A and Tm by rows, from the first
non-finite key, step or decay); no cumsum, no `x - x`, and the products themselves never branch (one copy of
each dot: a branched copy costs registers and spills in every chunk). The backward takes U's and V's non-finite
entries as 0 (mathematically their terms reach the earlier tokens' gradients only in differences that cancel)
and makes the chunk's dq, dk and step gradients NaN from that row on and its decay gradients after it, where the
token loop's are. A key, step or decay that is not finite makes the loop's gradients of every earlier token NaN
too (through its state's backward), so only a non-finite value keeps them finite there, and here.
"""
from __future__ import annotations

import sys

import sympy

from scanlang import expr as E
from scanlang import settings
from scanlang.delta import DeltaRule

from ..triton import runtime
from ..triton.kernel import ir as K
from ..triton.kernel.printer import render, render_kernel
from . import kernels_bwd, kernels_fwd, parts
from .kernels_fwd import BLOCK
from .parts import Hooks, jit, note, ret, store

_LOADED: dict = {}


_STEPS = {  # sympy's step functions, printed as selects (Heaviside(0) = 1/2 as in sympy, sign(0) = 0)
    sympy.Heaviside: ("_hv", "tl.where({u} > 0, 1.0, tl.where({u} < 0, 0.0, 0.5))"),
    sympy.sign: ("_sg", "tl.where({u} > 0, 1.0, tl.where({u} < 0, -1.0, 0.0))"),
}


def _render(exprs: list, args: tuple[str, ...], tensors: tuple[str, ...] | None = None) -> tuple[list[str], list[str]]:
    """Lines and result expressions (CSE'd) of `exprs` over the symbols named `args`, of which `tensors`
    (default: the first) are per-token tensors and the rest scalars.

    Derivatives of max/abs contain Heaviside/sign, which the expression printer does not know: each is
    bound to a temporary computed by a select first."""
    per_token = {E.symbol(a) for a in (args[:1] if tensors is None else tensors)}
    scalar = [not (sympy.sympify(e).free_symbols & per_token) for e in exprs]
    names = {E.symbol(a): a for a in args}
    steps = sorted({atom for e in exprs for kind in _STEPS for atom in sympy.sympify(e).atoms(kind)},
                   key=sympy.default_sort_key)
    lines, subs = [], {}
    if steps:
        arg_lines, arg_outs = E.render([st.args[0] for st in steps], names, E.TRITON, temp_prefix="_u")
        lines += arg_lines
        for i, (st, u) in enumerate(zip(steps, arg_outs)):
            prefix, fmt = _STEPS[type(st)]
            sym = E.symbol(f"{prefix}{i}")
            lines.append(f"{sym.name} = {fmt.format(u=u)}")
            names[sym] = sym.name
            subs[st] = sym
    exprs = [sympy.sympify(e).xreplace(subs) for e in exprs]
    body, outs = E.render(exprs, names, E.TRITON, temp_prefix="_t")
    # a result of constants and scalars only (a number, eps, a per-head parameter) still has to be a tensor of
    # the first argument's shape
    outs = [f"tl.zeros_like({args[0]}) + {o}" if sc else o for sc, o in zip(scalar, outs)]
    return lines + body, outs


def hooks(rule: DeltaRule) -> Hooks:
    """What `rule`'s hooks need (parts.Hooks), from its sympy expressions and per-head parameters: n2 and eps
    where the step reads them, the parameters' pointers where the decay has any, and the zero-key guard
    (a zero key's non-finite beta is 0) for every rule: `guard_needed` says where sympy shows it is needed,
    but dropping it where it is not costs delta_prep 45 registers under Triton 3.6 (162 -> 207 for GDN at
    K = V = 128 bf16, offline sm_90: BENCHMARKS_HISTORY.md, "Session 11"), more than it saves elsewhere."""
    return Hooks(guard=True, n2=rule.uses_key_norm, eps=E.symbol("eps") in rule.step.expr.free_symbols,
                 params=bool(rule.head_params))


def guard_needed(rule: DeltaRule) -> bool:
    """Whether the step can be non-finite at a zero key (n2 = 0) for finite s and eps (its symbols are real and
    finite): s and sigmoid(s) cannot, s / (n2 + eps) and s / (1 - s) can."""
    return rule.step.expr.subs(E.symbol("n2"), 0).is_finite is not True


def _param_loads(rule: DeltaRule) -> list:
    return [K.Assign((p,), K.expr(f"tl.load(hp_ptr + {i} * H + h)")) for i, p in enumerate(rule.head_params)]


def hook_kernels(rule: DeltaRule) -> list:
    """step_hook, step_hook_grad, decay_hook and store_decay_grads on the kernel IR."""
    step, decay, need = rule.step, rule.decay, hooks(rule)
    origin = note(f"delta rule '{rule.name}': {rule!r}")
    args = need.step_inputs                   # s, n2 where the step reads it (or the guard tests it), eps
    per_token = tuple(n for n in args if n != "eps")
    lines, outs = _render([step.expr], args, tensors=per_token)
    out = [jit("step_hook", need.step_args, [origin, *K.assign_lines(lines), ret(outs[0])], f"beta = {step.expr}")]
    lines, outs = _render([step.grads[n] for n in ("s", "n2")[:1 + need.n2]], args, tensors=per_token)
    out.append(jit("step_hook_grad", need.step_args, [*K.assign_lines(lines), ret(*outs)],
                   "(d beta / d s, d beta / d n2)" if need.n2 else "d beta / d s (the step does not read n2)"))
    inputs = ("a",) + rule.head_params
    lines, outs = _render([decay.expr], inputs)
    out.append(jit("decay_hook", need.decay_args, [*_param_loads(rule), *K.assign_lines(lines), ret(outs[0])],
                   f"g = {decay.expr}; per-head parameters {rule.head_params} from hp_ptr [P, H]" if need.params
                   else f"g = {decay.expr}"))
    grads = [decay.grads[n] for n in inputs]
    lines, outs = _render(grads, inputs)
    # dg times each derivative; dg itself where the derivative is the constant 1 (g = a: dL/da = dg)
    prods = ["dg" if grad == 1 else f"dg * ({o})" for grad, o in zip(grads, outs)]
    stores = [store("da_ptr + offs", prods[0], "mask")]
    stores += [store(f"dhp_ptr + {i} * TTH + offs", p, "mask") for i, p in enumerate(prods[1:])]
    if need.params:
        out.append(jit("store_decay_grads", "dg, a, hp_ptr, h, H, da_ptr, dhp_ptr, offs, TTH, mask",
                       [*_param_loads(rule), *K.assign_lines(lines), *stores],
                       "dL/da = dg dg/da per token; dL/d(parameter) per token into dhp_ptr [P, TT, H] (summed later)."))
    else:
        out.append(jit("store_decay_grads", "dg, a, da_ptr, offs, mask", [*K.assign_lines(lines), *stores],
                       "dL/da = dg dg/da per token."))
    return out


def render_hooks(rule: DeltaRule) -> str:
    """step_hook, step_hook_grad, decay_hook and store_decay_grads as Triton source."""
    return "\n\n\n".join(render_kernel(k) for k in hook_kernels(rule)) + "\n"


def render_prep(chunk_size: int) -> str:
    """The prep kernel for C = chunk_size (`kernels_fwd.prep`: its block merge unrolled) as Triton source."""
    return render_kernel(kernels_fwd.prep(chunk_size))


def module(rule: DeltaRule, chunk_size: int) -> K.Module:
    """The kernel module of `rule` at `chunk_size`: the hooks, the helpers, the forward and backward kernels."""
    if chunk_size % BLOCK or chunk_size < BLOCK:
        raise ValueError(f"chunk_size must be a positive multiple of {BLOCK}, got {chunk_size}")
    need = hooks(rule)
    kernels = [*hook_kernels(rule), *parts.helpers_before_prep(need), kernels_fwd.prep(chunk_size, need),
               *kernels_fwd.wy(), *kernels_fwd.state(), *kernels_bwd.kernels(need), kernels_fwd.recurrent(need)]
    return K.Module("Generated by scanlang (backends/delta): chunkwise gated delta rule kernels. Do not edit.",
                    tuple(kernels))


def kernel_source(rule: DeltaRule, chunk_size: int) -> str:
    """The complete generated module for `rule` at `chunk_size` (printed once: it parses by construction)."""
    return render(module(rule, chunk_size))


def load(rule: DeltaRule, chunk_size: int):
    """Import the generated module through the shared content-addressed kernel cache."""
    cache_key = (rule.key, chunk_size)
    if cache_key not in _LOADED:
        src = kernel_source(rule, chunk_size)
        if settings.debug():
            print(f"# scanlang: delta-rule kernels for {rule.name}, C={chunk_size}\n{src}", file=sys.stderr)
        _LOADED[cache_key] = runtime.load(src)
    return _LOADED[cache_key]
