"""`scanlang verify` / `scanlang show` for the declarations that are not scans: one function per kind.

    matrix state (sl.matrix_state)   verify: the structure's proof and the traced hooks
                                     show: the declaration, then the generated Triton source of every
                                     kernel module backend='triton' runs for it, each under a comment
                                     header saying when it runs; at a shape (--shape B,T,H,K,V:
                                     `show_matrix_state_at`) only the modules the training and
                                     inference routes take there, under lines naming those routes
    delta rule (delta.DeltaRule)     verify: the delta-rule monoid's proof and the traced hooks
                                     show: the rule, then its generated module at one chunk size

The routing printed is the one recipes/linear/family.py takes: the delta correction or n Householder steps
with decay none or per head run on the delta-rule kernels (its declaration translated into a DeltaRule by
scanlang/delta_form.py); every other structure on the kernels generated from the declaration
(backends/linear). Backends are reached through the registry (`scanlang.backend.get`).
"""
from __future__ import annotations

from . import backend as registry
from . import tuning
from .delta import CHUNK_SIZES, DELTA_CHUNK, MAX_HEAD_DIM, DeltaRule, verify_delta_monoid
from .delta_form import delta_form, describe, runs_on_delta
from .linear import INPUT_KINDS, REFERENCE_CHUNK, MatrixState


def _hook_lines(role: str, hook, names) -> list[str]:
    """`role(t) = expr` and its partial derivatives (the ones the kernels' backward uses)."""
    if hook is None:
        return []
    lines = [f"  {role}(t) = {hook.expr}"]
    lines += [f"    d/d{n} = {hook.grads[n]}" for n in names if n in hook.grads]
    return lines


def describe_matrix_state(decl: MatrixState) -> str:
    """The declaration: structure, inputs (with their shapes), constants and the traced hooks."""
    steps = f", {decl.steps} steps" if decl.steps > 1 else ""
    lines = [f"matrix state {decl.name}: decay {decl.decay}, correction {decl.correction}{steps} "
             f"(declaration {decl.key})"]
    for name, kind in decl.inputs.items():
        rows = " (T*n rows, with k and v)" if decl.rows.get(name) == "sub" else ""
        lines.append(f"  input {name}: {kind} {INPUT_KINDS[kind]}{rows}")
    lines += [f"  constant {name} = {value!r}" for name, value in decl.constants.items()]
    lines += _hook_lines("beta", decl.beta, decl.used(decl.beta))
    lines += _hook_lines("log_decay", decl.log_decay, decl.used(decl.log_decay))
    return "\n".join(lines)


def verify_matrix_state(decl: MatrixState) -> str:
    """The structure's proof (proved when the declaration was built) and the traced hooks."""
    return decl.proof + "\n" + describe_matrix_state(decl)


def describe_delta_rule(rule: DeltaRule) -> str:
    """The rule: its step and decay hooks with their partial derivatives, and its per-head parameters."""
    params = f", per-head parameters {', '.join(rule.head_params)}" if rule.head_params else ""
    lines = [f"delta rule {rule.name} (rule {rule.key}{params})"]
    lines += _hook_lines("beta = step", rule.step, ("s", "n2"))
    lines += _hook_lines("g = decay", rule.decay, rule.decay.inputs)
    return "\n".join(lines)


def verify_delta_rule(rule: DeltaRule) -> str:
    """The delta-rule monoid's proof (shared by every rule; the hooks only fill beta_t and g_t) and the hooks."""
    return verify_delta_monoid() + "\n" + describe_delta_rule(rule)


def check_chunk(chunk) -> int:
    """The delta-rule kernels' chunk size; a ValueError naming --chunk unless it is one they take."""
    if chunk is None:
        return DELTA_CHUNK
    if chunk not in CHUNK_SIZES:
        raise ValueError(f"--chunk: the delta-rule kernels take a chunk of {', '.join(map(str, CHUNK_SIZES))}, "
                         f"got {chunk}")
    return chunk


def _delta_header(chunk: int) -> str:
    limit = registry.get("delta").RECURRENT_MAX_LEN
    return (f"# delta-rule kernels at chunk {chunk} (backends/delta/codegen.py), one module:\n"
            f"# delta_recurrent: no gradients, every sequence <= {limit} tokens (decode, short inputs)\n"
            f"# chunk kernels, every other call: forward delta_prep, delta_state_output; backward delta_wu,\n"
            f"#   delta_state_fwd, delta_dU_local, delta_state_bwd, delta_bwd_dqk, delta_bwd_wy")


def show_delta_rule(rule: DeltaRule, chunk=None) -> str:
    """The rule's generated module at `chunk` (default DELTA_CHUNK), under a header."""
    chunk = check_chunk(chunk)
    return _delta_header(chunk) + "\n" + registry.get("delta").kernel_source(rule, chunk)


def _steps_line(decl: MatrixState) -> str:
    if decl.steps == 1:
        return ""
    return (f"# {decl.steps} Householder steps: a delta rule over the interleaved T*n rows (each token's log-decay on "
            f"its first row, its query on its last, zeros elsewhere); the chunk and delta_recurrent's length limit "
            f"count rows\n")


def show_matrix_state(decl: MatrixState, chunk=None) -> str:
    """The generated source of every module backend='triton' runs for `decl`, each under a header."""
    if runs_on_delta(decl):
        chunk = check_chunk(chunk)
        form = delta_form(decl, decl.constants)
        return (f"# backend='triton' runs {decl.name} on the delta-rule kernels (backend=None too, on CUDA with "
                f"float32 compute and K, V <= {MAX_HEAD_DIM}):\n# {describe(form)}\n" + _steps_line(decl) +
                f"# chunk_size=None is {DELTA_CHUNK}; this is chunk {chunk}\n"
                + show_delta_rule(form.rule, chunk))
    if chunk is not None:
        raise ValueError(f"--chunk: matrix state {decl.name!r} (decay {decl.decay}, correction {decl.correction}) "
                         f"runs on backends/linear, whose chunk is a launch constant (C), not rendered; drop --chunk")
    sources = registry.get("linear").sources(decl)
    limit = tuning.current().decode_max_tokens
    parts = [f"# backend='triton' runs {decl.name} on the kernels generated from the declaration (backends/linear);"
             f"\n# backend=None runs the PyTorch reference for it."]
    if "chunk" in sources:
        where = "kernels_delta.py" if decl.correction == "delta" else "kernels.py"
        parts.append(f"# chunk kernels (backends/linear/{where}): with gradients, or a sequence longer than "
                     f"decode_max_tokens = {limit} tokens (chunk_size=None is {REFERENCE_CHUNK})\n"
                     + sources["chunk"])
    else:
        parts.append(f"# no chunk kernels for decay {decl.decay!r} with correction {decl.correction!r} yet: with "
                     f"gradients or a sequence longer than decode_max_tokens = {limit} tokens,\n"
                     f"# backend='triton' raises a ValueError (use backend='reference')")
    parts.append(f"# decode: no gradients, every sequence <= decode_max_tokens = {limit} tokens "
                 f"(backends/linear/decode.py)\n" + sources["decode"])
    return "\n\n".join(parts)


def parse_matrix_shape(text) -> tuple[int, int, int, int, int]:
    """`B,T,H,K,V` (a string, or a sequence of ints) as five positive integers; a ValueError naming --shape."""
    parts = str(text).split(",") if isinstance(text, str) else list(text)
    try:
        shape = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        shape = ()
    if len(shape) != 5 or min(shape) < 1:
        raise ValueError(f"--shape: a matrix state takes B,T,H,K,V (batch, tokens per sequence, heads, key and value "
                         f"head dims: five positive integers, e.g. 1,4096,16,128,128), got {text!r}")
    return shape


def _delta_at(decl: MatrixState, shape: tuple, chunk: int) -> str:
    """show_matrix_state at a shape, for a structure on the delta-rule kernels: the routes' kernels, then the module."""
    B, T, H, K, V = shape
    n = decl.steps
    form = delta_form(decl, decl.constants)
    rows = f"{T} tokens" if n == 1 else f"{T} tokens = {T * n} rows (T*n)"
    head = [f"# backend='triton' at [B, T, H, K, V] = [{B}, {T}, {H}, {K}, {V}] (float32 inputs): {decl.name} on "
            f"the delta-rule kernels at chunk {chunk} (backends/delta/codegen.py), {rows} a sequence",
            f"# {describe(form)}"]
    if n > 1:
        head.append(_steps_line(decl).rstrip("\n"))
    too_wide = [f"{name} = {dim}" for name, dim in (("K", K), ("V", V)) if dim > MAX_HEAD_DIM]
    if too_wide:
        head.append(f"# {', '.join(too_wide)} is above {MAX_HEAD_DIM}, the most the delta-rule kernels take: "
                    f"backend='triton' raises a ValueError and backend=None runs the PyTorch reference; no kernels")
        return "\n".join(head)
    kernels = registry.get("delta").route_kernels
    for what, grad in (("training (with gradients)", True), ("inference (no gradients)", False)):
        fwd, bwd = kernels(form.rule, chunk, K, V, T * n, grad)
        launched = f"forward {', '.join(fwd)}" + (f"; backward {', '.join(bwd)}" if bwd else "")
        why = "" if grad else (f" (every sequence <= {registry.get('delta').RECURRENT_MAX_LEN} rows: the token loop)"
                               if fwd == ["delta_recurrent"] else " (the chunk forward)")
        head.append(f"# {what}: {launched}{why}")
    head.append("# backend=None: the same on CUDA with float32 compute, the PyTorch reference on CPU; below, the one "
                "module those kernels are in")
    return "\n".join(head) + "\n" + registry.get("delta").kernel_source(form.rule, chunk)


def _linear_at(decl: MatrixState, shape: tuple) -> str:
    """show_matrix_state at a shape, for a structure on the kernels generated from the declaration (backends/linear):
    the chunk module when a route takes it, the decode module when T <= decode_max_tokens."""
    B, T, H, K, V = shape
    limit = tuning.current().decode_max_tokens
    sources = registry.get("linear").sources(decl)
    chunked, decodes = "chunk" in sources, T <= limit
    head = [f"# backend='triton' at [B, T, H, K, V] = [{B}, {T}, {H}, {K}, {V}]: {decl.name} on the kernels "
            f"generated from the declaration (backends/linear); backend=None runs the PyTorch reference for it"]
    where = "kernels_delta.py" if decl.correction == "delta" else "kernels.py"
    head.append("# training (with gradients): " + (
        f"the chunk kernels (backends/linear/{where}), forward and backward" if chunked else
        f"none: no chunk kernels for decay {decl.decay!r} with correction {decl.correction!r} yet, backend='triton' "
        f"raises a ValueError (use backend='reference')"))
    if decodes:
        head.append(f"# inference (no gradients): T = {T} <= decode_max_tokens = {limit}: the decode kernel "
                    f"(backends/linear/decode.py)")
    else:
        head.append(f"# inference (no gradients): T = {T} > decode_max_tokens = {limit}: "
                    + ("the chunk forward" if chunked else "a ValueError (use backend='reference')"))
    if not (chunked or decodes):
        head.append("# no generated module runs at this shape")
    parts = ["\n".join(head)]
    if chunked:
        parts.append(f"# chunk kernels (backends/linear/{where}; chunk_size=None is {REFERENCE_CHUNK})\n"
                     + sources["chunk"])
    if decodes:
        parts.append("# decode (backends/linear/decode.py)\n" + sources["decode"])
    return "\n\n".join(parts)


def show_matrix_state_at(decl: MatrixState, shape, chunk=None) -> str:
    """The modules backend='triton' runs for `decl` at `shape` (B,T,H,K,V: validated, a ValueError naming --shape),
    under header lines naming the route a training call (gradients) and an inference call (none) take there."""
    shape = parse_matrix_shape(shape)
    if runs_on_delta(decl):
        return _delta_at(decl, shape, check_chunk(chunk))
    if chunk is not None:
        raise ValueError(f"--chunk: matrix state {decl.name!r} (decay {decl.decay}, correction {decl.correction}) "
                         f"runs on backends/linear, whose chunk is a launch constant (C), not rendered; drop --chunk")
    return _linear_at(decl, shape)


__all__ = ["describe_matrix_state", "verify_matrix_state", "describe_delta_rule", "verify_delta_rule",
           "check_chunk", "show_delta_rule", "show_matrix_state", "show_matrix_state_at", "parse_matrix_shape"]
