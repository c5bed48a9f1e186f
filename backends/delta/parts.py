"""Small builders of the delta-rule kernels' statements (on backends/triton/kernel/ir.py) and the
helper functions every module holds (`mm`, `rnd`, the non-finite guards, the chunk table's reader).

The kernels index tokens as one packed stream [TT, H, ...]: a chunk's rows are tokens `tok` (valid
where `ok`) of head `h`, so a [C, D] tile of a [TT, H, D] tensor is at `tile_off(D, cols)`, a per-token
scalar at `TOK`, one of a chunk's [C, C] matrices ([NC, H, C, C]) at `CHUNK_MAT`.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass

from ..triton.kernel import ir as K

TOK = "tok * H + h"                                                  # per-token scalars [TT, H]
CHUNK_MAT = "((c * H + h) * C + rows[:, None]).to(tl.int64) * C + rows[None, :]"   # [NC, H, C, C]
STATE_BLOCK = "((c * H + h) * K + kk[:, None]).to(tl.int64) * V + vv[None, :]"     # [NC, H, K, V]
FP64_NOTE = "torch.compile types a Python float as fp64"


@dataclass(frozen=True)
class Hooks:
    """What a rule's hooks need, which decides the stages the kernels hold (codegen.hooks(rule); the default:
    every stage).

    guard: the step can be non-finite at a zero key (n2 = 0; 0/0 at eps = 0): `step_beta` takes beta there
    as 0, and its mask zeroes the step's gradients (the step stages then take n2, whether the step reads it or not).
    n2: the step reads ||k||^2: the step hooks take it, and the backward forms d beta / d n2 and dk's term
    through it (2 dbeta dbeta_dn2 k).
    eps: the step reads eps: the kernels that evaluate the step (delta_prep, delta_bwd_dqk, delta_bwd_wy,
    delta_recurrent) take it as a scalar argument (cast to fp32).
    params: the decay reads per-head parameters: the kernels that evaluate it take hp_ptr [P, H] (and the backward's
    dhp_ptr [P, TT, H], with TTH its per-parameter stride), and the decay hooks load them per head."""

    guard: bool = True
    n2: bool = True
    eps: bool = True
    params: bool = True

    @property
    def takes_n2(self) -> bool:
        """Whether the step stages take ||k||^2: the step reads it, or the zero-key guard tests it."""
        return self.n2 or self.guard

    @property
    def step_inputs(self) -> tuple[str, ...]:
        """The step hooks' arguments."""
        return ("s",) + (("n2",) if self.takes_n2 else ()) + (("eps",) if self.eps else ())

    @property
    def step_args(self) -> str:
        return ", ".join(self.step_inputs)

    @property
    def eps_param(self) -> str:
        """The kernels' eps parameter ("eps, "), or nothing."""
        return "eps, " if self.eps else ""

    @property
    def hp_param(self) -> str:
        """The kernels' per-head parameter pointer ("hp_ptr, "), or nothing."""
        return "hp_ptr, " if self.params else ""

    @property
    def dhp_param(self) -> str:
        """The backward kernels' parameter gradient pointer ("dhp_ptr, "), or nothing."""
        return "dhp_ptr, " if self.params else ""

    @property
    def decay_args(self) -> str:
        """decay_hook's arguments: the decay input, and the parameters' pointer and head where it has them."""
        return "a, hp_ptr, h, H" if self.params else "a"

    @property
    def eps_cast(self) -> tuple[str, ...]:
        """The scalars of eps to cast to fp32 (`fp32`)."""
        return ("eps",) if self.eps else ()


def doc(text: str) -> str:
    """A kernel's docstring as the function holds it: continuation lines indented by 4 (written here
    at any indentation)."""
    first, _, rest = text.strip("\n").partition("\n")
    if not rest:
        return first.strip()
    return first.strip() + "".join("\n    " + line for line in textwrap.dedent(rest).split("\n"))


def params(spec: str) -> tuple[K.Param, ...]:
    """Parameters from "a, b, C:, D:=False": a trailing ':' marks a constexpr, '=value' a default."""
    out = []
    for item in spec.split(","):
        item = item.strip()
        name, _, default = item.partition("=")
        const = name.endswith(":")
        out.append(K.Param(name.rstrip(":"), constexpr=const, default=K.expr(default) if default else None))
    return tuple(out)


def jit(name: str, spec: str, body, text: str = "") -> K.Kernel:
    return K.Kernel(name, params(spec), tuple(body), doc=doc(text) if text else "")


def const(target: str, value: str) -> K.Assign:
    return K.Assign((target,), K.expr(value), constexpr=True)


def aug(target: str, value: str, op: str = "+") -> K.AugAssign:
    return K.AugAssign(target, K.expr(value), op)


def note(text: str) -> K.Comment:
    return K.Comment(text)


def ret(*values: str) -> K.Return:
    return K.Return(tuple(K.expr(v) for v in values))


def call(text: str) -> K.Eval:
    return K.Eval(K.expr(text))


def store(ptr: str, value: str, mask: str | None = None) -> K.Store:
    return K.Store(K.expr(ptr), K.expr(value), K.expr(mask) if mask else None)


def when(cond: str, body, orelse=()) -> K.If:
    return K.If(K.expr(cond), tuple(body), tuple(orelse))


def loop(var: str, stop: str, body, start: str = "0") -> K.For:
    """`for var in range(start, stop)` (Python's range: a loop Triton does not pipeline)."""
    return K.For(var, K.expr(start), K.expr(stop), tuple(body), builtin=True)


def mm(x: str, y: str, prec: str = "IN_PREC") -> str:
    """x @ y with fp32 accumulation (the `mm` helper)."""
    return f"mm({x}, {y}, {prec}, UPCAST)"


def rnd(x: str, dtype: str) -> str:
    return f"rnd({x}, {dtype}, UPCAST)"


def tile_off(D: str, cols: str) -> str:
    """Offsets of the chunk's rows, columns `cols`, of a [TT, H, D] tensor."""
    return f"(tok[:, None] * H + h) * {D} + {cols}[None, :]"


def tile(ptr: str, D: str, cols: str, mask: str) -> str:
    return f"tl.load({ptr} + {tile_off(D, cols)}, mask={mask}, other=0.0)"


def per_token(ptr: str) -> str:
    """The chunk's rows of a per-token [TT, H] tensor."""
    return f"tl.load({ptr} + {TOK}, mask=ok, other=0.0)"


def fp32(*names: str) -> list[K.Stmt]:
    """Scalar arguments cast to fp32 (a comment before each: why)."""
    return [s for n in names for s in (note(FP64_NOTE), K.assign(n, f"tl.cast({n}, tl.float32)"))]


def chunk_rows() -> list[K.Stmt]:
    """The chunk's rows and its entry in the chunk table (program c)."""
    return [K.assign("rows", "tl.arange(0, C)"), K.assign("t0, nv, tok, ok", "chunk_tokens(chunk_tok, chunk_len, c, rows)")]


def load_tm() -> K.Assign:
    """Tm of chunk c, zero outside the causal mask; unmasked: delta_prep wrote every element."""
    return K.assign("Tm", f"tl.where(causal, tl.load(tm_ptr + {CHUNK_MAT}), 0.0)")


def guard(x: str, cond: str = "nonfinite") -> K.If:
    """x's non-finite entries as 0 in a chunk with a non-finite token."""
    return when(cond, [K.assign(x, f"finite_or_zero({x})")])


def nan_after(x: str, bad: str = "bad_row") -> K.If:
    """x NaN from the chunk's first non-finite row on, in a chunk that has one."""
    return when(f"{bad} < nv", [K.assign(x, f"tl.where(rows[:, None] < {bad}, {x}, float('nan'))")])


def g_last() -> K.Assign:
    return K.assign("G_last", "tl.load(gcum_ptr + (t0 + nv - 1) * H + h)")


def seq_bounds() -> list[K.Stmt]:
    """A sequence's first token and end, from the chunk table at its chunks c0 and c1 - 1."""
    return [K.assign("some", "c1 > c0"), K.assign("first", "tl.load(chunk_tok + c0, mask=some, other=0).to(tl.int64)"),
            K.assign("end", "tl.load(chunk_tok + c1 - 1, mask=some, other=0).to(tl.int64) + "
                     "tl.load(chunk_len + c1 - 1, mask=some, other=0)")]


def chunk_from_bounds() -> list[K.Stmt]:
    """Chunk c's tokens from its sequence's bounds: consecutive runs of C tokens (no table load)."""
    return [K.assign("t0", "first + (c - c0) * C"), K.assign("nv", "tl.minimum(end - t0, C).to(tl.int32)"), K.assign("ok", "rows < nv"),
            K.assign("tok", "t0 + rows")]


def state_program() -> list[K.Stmt]:
    """Program (sequence n, head h, value block): the state block's rows kk, columns vv and mask."""
    return [K.assign("n", "tl.program_id(0)"), K.assign("h", "tl.program_id(1)"), K.assign("vv", "tl.program_id(2) * BV + tl.arange(0, BV)"),
            K.assign("kk", "tl.arange(0, BK)")]


def store_final(flag: str, ptr: str, value: str):
    """The sequence's final state (or initial-state gradient) block, when `flag`."""
    return when(flag, [store(f"{ptr} + state_offsets(n, h, H, kk, vv, K, V)", value, "sm")])


# ---- helpers every module holds ------------------------------------------------------------------

def step_to_beta(hooks: Hooks) -> K.Assign:
    """beta = the step (of s, n2, eps as the rule reads them): through `step_beta` (the zero-key guard) where the
    rule needs it."""
    args = hooks.step_args
    return K.assign("beta, _", f"step_beta({args})") if hooks.guard else K.assign("beta", f"step_hook({args})")


def step_beta(hooks: Hooks) -> K.Kernel:
    return jit("step_beta", hooks.step_args, [
        K.assign("b", f"step_hook({hooks.step_args})"),
        K.assign("dead", "(n2 == 0) & ((b != b) | (tl.abs(b) == float('inf')))"),
        ret("tl.where(dead, 0.0, b)", "dead")], """
        beta from the step hook. A zero key writes nothing whatever beta is, so where the rule gives a
        non-finite beta for one (0/0 at eps = 0) it becomes 0; returns (beta, that mask).""")


def helpers_before_prep(hooks: Hooks = Hooks()) -> list[K.Kernel]:
    mm_ = jit("mm", "a, b, precision:, upcast:", [
        when("upcast", [ret("tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision='ieee')")],
             [ret("tl.dot(a, b, input_precision=precision)")])], """
        a @ b with fp32 accumulation. `upcast` widens bf16 operands first: Triton's CPU interpreter
        multiplies bf16 tensors as raw integers.""")
    finite = jit("finite", "x", [ret("tl.abs(x) < float('inf')")],
                 "Where x is neither NaN nor +-inf (NaN compares false).")
    finite_or_zero = jit("finite_or_zero", "x", [ret("tl.where(finite(x), x, 0.0)")], """
        x with its NaN and inf entries as 0: the right operand of a causal product L @ x (L lower triangular over a
        chunk's rows), whose exact zeros above the diagonal would carry 0 * NaN into the rows before them.""")
    nan_from = jit("nan_from", "y, x, rows, C:", [
        K.assign("first", "tl.min(tl.where(finite(x), C, rows[:, None]), 0)"),
        ret("tl.where(rows[:, None] < first[None, :], y, float('nan'))")], """
        The causal product y = L @ finite_or_zero(x) with each column NaN from x's first non-finite row in it on, as
        the token loop's state is after a NaN or inf (a min-reduction of row indices).""")
    chunk_tokens = jit("chunk_tokens", "chunk_tok, chunk_len, c, rows", [
        K.assign("t0", "tl.load(chunk_tok + c).to(tl.int64)"), K.assign("nv", "tl.load(chunk_len + c)"),
        ret("t0", "nv", "t0 + rows", "rows < nv")],
        "Chunk c of the chunk table: its first token (int64), its length, its rows' tokens and which exist.")
    state_offsets = jit("state_offsets", "n, h, H, kk, vv, K:, V:", [
        ret("((n * H + h) * K + kk[:, None]).to(tl.int64) * V + vv[None, :]")],
        "Offsets of rows kk and columns vv of sequence n's head-h state in a [N, H, K, V] tensor.")
    initial_state = jit("initial_state", "ptr, n, h, H, kk, vv, sm, PRESENT:, K:, V:, BK:, BV:", [
        when("PRESENT", [K.assign("state", "tl.load(ptr + state_offsets(n, h, H, kk, vv, K, V), mask=sm, other=0.0)"
                                    ".to(tl.float32)")],
             [K.assign("state", "tl.zeros([BK, BV], dtype=tl.float32)")]),
        ret("state")], """
        The [BK, BV] block of a state (or state gradient) a sequence starts from, in fp32: loaded when
        PRESENT, else zeros.""")
    rnd_ = jit("rnd", "x, dtype:, emulate:", [
        when("x.dtype == dtype", [ret("x")], [
            when("emulate and dtype == tl.bfloat16", [
                K.assign("bits", "x.to(tl.float32).to(tl.uint32, bitcast=True)"),
                K.assign("bits", "(bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000"),
                ret("bits.to(tl.float32, bitcast=True).to(dtype)")],
                [ret("x.to(dtype)")])])], """
        x in `dtype`. With `emulate` (Triton's CPU interpreter, which truncates fp32 -> bf16), bf16 is
        rounded to nearest even by hand, as the GPU does.""")
    return [*([step_beta(hooks)] if hooks.guard else []), mm_, finite, finite_or_zero, nan_from, chunk_tokens,
            state_offsets, initial_state, rnd_, inv_unit_lower_blocks()]


def inv_unit_lower_blocks() -> K.Kernel:
    """The helper kernel `inv_unit_lower_blocks(A, C, PRECISION)` (the delta-rule prep kernels' and the per-key
    delta prep kernel's, backends/linear/kernels_delta.py)."""
    return jit("inv_unit_lower_blocks", "A, C:, PRECISION:", [
        const("NB", "C // 16"),
        K.assign("rows", "tl.arange(0, C)"),
        K.assign("same", "(rows[:, None] // 16) == (rows[None, :] // 16)"),
        K.assign("M", "-tl.sum(tl.reshape(tl.where(same, A, 0.0), (NB, 16, NB, 16)), 2)"),
        K.assign("r", "tl.arange(0, 16)"),
        K.assign("P", "tl.where(r[None, :, None] == r[None, None, :], 1.0, 0.0) + M"),
        K.For("_", None, K.expr("3"), (K.assign("M", "tl.dot(M, M, input_precision=PRECISION)"),
                                       K.assign("P", "tl.dot(P, M, P, input_precision=PRECISION)")), static=True),
        K.assign("T", "tl.reshape(tl.broadcast_to(P[:, :, None, :], (NB, 16, NB, 16)), (C, C))"),
        ret("tl.where(same, T, 0.0)")], """
        The 16x16 diagonal blocks of (I + A)^-1 for a strictly lower [C, C] A, as a block-diagonal [C, C]
        matrix. Per block, M = -A_bb is nilpotent (M^16 = 0), so (I + A_bb)^-1 = sum_{j<16} M^j
        = (I + M)(I + M^2)(I + M^4)(I + M^8): six [16, 16] products (all blocks at once, batched) of fp32
        operands, instead of 15 dependent row steps. PRECISION "ieee" runs them on FMA units; "tf32x3" (each
        operand split into two tf32 parts, three tensor-core products: about fp32's accuracy) on tensor cores,
        which for half inputs' prep halves the shared-memory traffic and cuts 219 registers to 161 (Triton 3.6,
        sm_90a, K = 128).""")
