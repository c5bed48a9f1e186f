"""A small statement IR for generated Triton kernels.

A kernel is a tree of frozen dataclasses: `Kernel(name, params, body, doc, origin)` whose body is a
tuple of statements (`Assign`, `AugAssign`, `Load`, `Store`, `AtomicAdd`, `Eval`, `If`, `For`, `While`,
`Return`, `Comment`).
Expressions are `Expr` nodes holding one Python expression in Triton's dialect: either printed by the
symbolic layer (`scanlang.expr.render`, the one sympy -> Triton printer) or written by a schedule
(`tl.arange(0, BLOCK_T)[:, None]`). Nothing here knows Triton beyond names; `printer.py` turns a
`Module` into source by building a Python `ast` and unparsing it once.

`Origin` points a statement or a kernel at the user's declaration (file:line of a combine, scale,
lift or readout); the printer writes it as a comment.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class Expr:
    """One Python expression (source text, parsed by the printer: a syntax error surfaces there)."""

    text: str

    def __str__(self) -> str:
        return self.text


def expr(value: "Expr | str | int | float | bool") -> Expr:
    """`value` as an `Expr` (strings are taken as source text; numbers and bools as literals)."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Expr(value)
    if isinstance(value, (bool, int, float)):
        return Expr(repr(value))
    raise TypeError(f"value: expected an Expr, source text or a number, got {type(value).__name__}")


@dataclass(frozen=True)
class Origin:
    """Where a piece of a kernel comes from in the user's code: `what` (e.g. "combine of Affine")
    declared at `file`:`line`."""

    what: str
    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.what}: {self.file}:{self.line}"


@dataclass(frozen=True)
class Comment:
    """A comment line (`# text`) before the next statement."""

    text: str


@dataclass(frozen=True)
class Assign:
    """`targets = value` (several targets, or `unpack`: tuple unpacking, `x, = value` for one);
    `constexpr`: one target annotated `target: tl.constexpr = value`, a compile-time constant."""

    targets: tuple[str, ...]
    value: Expr
    unpack: bool = False
    constexpr: bool = False


@dataclass(frozen=True)
class AugAssign:
    """`target op= value` (op one of "+", "-", "*": an accumulation such as `acc += du`)."""

    target: str
    value: Expr
    op: str = "+"


@dataclass(frozen=True)
class Load:
    """`target = tl.load(pointer, mask=mask, other=other)`, optionally cast by `to_acc(..., FP64)`;
    `cache`: a cache modifier (".cg": past L1, for data another program wrote during this launch);
    `evict`: an eviction policy ("evict_first": data read once, so it leaves L2 before what is reused)."""

    target: str
    pointer: Expr
    mask: Expr | None = None
    other: Expr | None = None
    to_acc: bool = True
    cache: str | None = None
    evict: str | None = None


@dataclass(frozen=True)
class Store:
    """`tl.store(pointer, value, mask=mask)`; `cache`: a cache modifier (".cs": streamed, written once and
    not read again in this launch)."""

    pointer: Expr
    value: Expr
    mask: Expr | None = None
    cache: str | None = None


@dataclass(frozen=True)
class AtomicAdd:
    """`tl.atomic_add(pointer, value, mask=mask, sem='relaxed')`."""

    pointer: Expr
    value: Expr
    mask: Expr | None = None


@dataclass(frozen=True)
class Eval:
    """An expression evaluated for its effect only (`tl.debug_barrier()`)."""

    value: Expr


@dataclass(frozen=True)
class If:
    """`if cond: body else: orelse` (a constexpr condition folds away at compile time)."""

    cond: Expr
    body: tuple["Stmt", ...]
    orelse: tuple["Stmt", ...] = ()


@dataclass(frozen=True)
class For:
    """`for var in tl.range(start, stop, step):` (`static`: `tl.static_range`, unrolled; `builtin`:
    Python's `range`; `num_stages`: `tl.range(..., num_stages=...)`, software-pipelined). A `start`
    of None is the one-argument form `range(stop)`."""

    var: str
    start: Expr | None
    stop: Expr
    body: tuple["Stmt", ...]
    step: Expr | None = None
    static: bool = False
    builtin: bool = False
    num_stages: Expr | None = None


@dataclass(frozen=True)
class While:
    """`while cond: body` (a loop whose trip count is known only at run time)."""

    cond: Expr
    body: tuple["Stmt", ...]


@dataclass(frozen=True)
class Return:
    values: tuple[Expr, ...]


Stmt = Union[Comment, Assign, AugAssign, Load, Store, AtomicAdd, Eval, If, For, While, Return]


@dataclass(frozen=True)
class Param:
    """A kernel parameter; `constexpr` ones are compile-time constants (with an optional default)."""

    name: str
    constexpr: bool = False
    default: Expr | None = None


@dataclass(frozen=True)
class Kernel:
    """One `@triton.jit` function. `origin`: the declarations it was generated from."""

    name: str
    params: tuple[Param, ...]
    body: tuple[Stmt, ...]
    doc: str = ""
    origin: tuple[Origin, ...] = ()


@dataclass(frozen=True)
class Module:
    """A generated source file: a docstring, `import triton` / `triton.language as tl`, the kernels."""

    doc: str
    kernels: tuple[Kernel, ...]


def assign(target: str, value) -> Assign:
    """`target = value`, the one shorthand every generator calls; a target with commas unpacks
    (`beta, _ = value`; `x, = value` unpacks one value)."""
    targets = tuple(t.strip() for t in target.split(",") if t.strip())
    return Assign(targets, expr(value), unpack=len(targets) == 1 and target.rstrip().endswith(","))


def assign_lines(lines) -> tuple[Assign, ...]:
    """Statements from `name = expression` lines, the form `scanlang.expr.render` and the code
    generator's `_assign` print (shared subexpressions first); `x, = expression` unpacks one value."""
    out = []
    for line in lines:
        target, sep, value = line.partition(" = ")
        if not sep or not target.replace(",", " ").replace(" ", "").replace("_", "a").isalnum():
            raise ValueError(f"lines: expected 'name = expression', got {line!r}")
        out.append(assign(target, Expr(value)))
    return tuple(out)
