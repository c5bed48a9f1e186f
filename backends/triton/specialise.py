"""One launch's view of a generated module: the kernels it runs, with the branches its constexprs rule out
removed, and the `@triton.jit` helpers they call.

A generated module holds every variant of its kernels (forward and backward, reverse, initial element,
gradient modes, unroll factors, ...) behind `if` statements on `tl.constexpr` parameters, which Triton
resolves when it compiles a launch. `specialise(source, launches)` does the same resolution on the
text, for reading (`scanlang show --shape`): for each launched kernel it keeps the branch its
constexprs select and drops the others, keeps everything it cannot decide (a test on a runtime value,
or on a constexpr the launch does not give), and then keeps the module-level functions those kernels
call or pass, transitively, plus the module's docstring and imports. Statements are cut from the source text
by their ast positions (never unparsed), so the comments of the kept lines stay where they were; the
result parses, and compiling it with the same constexprs would give the same kernels.
"""
from __future__ import annotations

import ast
import io
import operator
import tokenize

_UNKNOWN = object()   # a test the launch's constexprs do not decide

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Mod: operator.mod, ast.BitAnd: operator.and_, ast.BitOr: operator.or_, ast.LShift: operator.lshift,
           ast.RShift: operator.rshift}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not}


def fold(node: ast.expr, known: dict):
    """The value of `node` when it is made of constants and the names in `known` only, else _UNKNOWN.
    `a and b` / `a or b` decide from one side where that side settles them."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return known.get(node.id, _UNKNOWN)
    if isinstance(node, ast.UnaryOp):
        value = fold(node.operand, known)
        if value is _UNKNOWN:
            return _UNKNOWN
        ops = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}
        return ops[type(node.op)](value)
    if isinstance(node, ast.BoolOp):
        values = [fold(v, known) for v in node.values]
        settles = (lambda v: not v) if isinstance(node.op, ast.And) else bool
        if any(v is not _UNKNOWN and settles(v) for v in values):
            return isinstance(node.op, ast.Or)
        return _UNKNOWN if any(v is _UNKNOWN for v in values) else isinstance(node.op, ast.And)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = fold(node.left, known), fold(node.right, known)
        if _UNKNOWN in (left, right):
            return _UNKNOWN
        try:
            return _BINARY[type(node.op)](left, right)
        except (ArithmeticError, TypeError):
            return _UNKNOWN
    if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
        values = [fold(node.left, known)] + [fold(c, known) for c in node.comparators]
        if _UNKNOWN in values:
            return _UNKNOWN
        return all(_COMPARE[type(op)](a, b) for op, a, b in zip(node.ops, values, values[1:]))
    return _UNKNOWN


class _Cutter:
    """Re-emits a function's statements from the source lines, with decided `if`s resolved."""

    def __init__(self, lines: list[str], known: dict):
        self.lines, self.known = lines, known

    def text(self, first: int, last: int, shift: int) -> list[str]:
        """Source lines first..last (1-based, inclusive), `shift` columns less indented."""
        out = []
        for line in self.lines[first - 1:last]:
            lead = len(line) - len(line.lstrip(" "))
            out.append(line[min(shift, lead):])
        return out

    def is_elif(self, node: ast.stmt) -> bool:
        return isinstance(node, ast.If) and self.lines[node.lineno - 1][node.col_offset:].startswith("elif")

    def block(self, stmts: list[ast.stmt], shift: int, start: int) -> list[str]:
        """`stmts` re-emitted; the comment lines before a statement (from line `start` on) go with it."""
        out = []
        for s in stmts:
            emitted = self.stmt(s, shift)
            if emitted:
                out += [line for line in self.text(start, s.lineno - 1, shift) if line.lstrip().startswith("#")] + emitted
            start = s.end_lineno + 1
        return out

    def body(self, stmts: list[ast.stmt], shift: int, start: int, indent: int) -> list[str]:
        """A block that must hold a statement: `pass` where everything in it was ruled out."""
        return self.block(stmts, shift, start) or [" " * (indent - shift) + "pass"]

    def stmt(self, s: ast.stmt, shift: int) -> list[str]:
        if isinstance(s, ast.If):
            return self.if_(s, shift, "if")
        if isinstance(s, (ast.For, ast.While, ast.With)) and not getattr(s, "orelse", None):
            first = s.body[0]
            return self.text(s.lineno, first.lineno - 1, shift) + self.body(s.body, shift, first.lineno,
                                                                            first.col_offset)
        return self.text(s.lineno, s.end_lineno, shift)

    def header(self, s: ast.If, shift: int, spell: str) -> list[str]:
        """The `if` / `elif` line(s) of `s`, spelt `spell`."""
        head = self.text(s.lineno, s.body[0].lineno - 1, shift)
        col = s.col_offset - min(shift, s.col_offset)
        word = "elif" if self.is_elif(s) else "if"
        head[0] = head[0][:col] + spell + head[0][col + len(word):]
        return head

    def dedent(self, s: ast.If, branch: list[ast.stmt]) -> int:
        return branch[0].col_offset - s.col_offset

    def if_(self, s: ast.If, shift: int, spell: str) -> list[str]:
        """`s` where its header would be spelt `spell`: "if" (a statement of its own) or "elif" (the
        continuation of an emitted chain)."""
        value = fold(s.test, self.known)
        pad = " " * (s.col_offset - shift)
        if value is _UNKNOWN:
            return (self.header(s, shift, spell) + self.body(s.body, shift, s.body[0].lineno, s.body[0].col_offset)
                    + self.else_(s, shift))
        if spell == "if":   # the statement becomes the branch taken
            if value:   # the test's comment (why the branch exists) stays, above it
                why = _trailing_comment(self.lines[s.lineno - 1])
                kept = self.block(s.body, shift + self.dedent(s, s.body), s.test.end_lineno + 1)
                return ([f"{pad}# {ast.unparse(s.test)}: {why.lstrip('# ')}"] if why and kept else []) + kept
            if not s.orelse:
                return []
            if self.is_elif(s.orelse[0]):
                return self.if_(s.orelse[0], shift, "if")
            return self.block(s.orelse, shift + self.dedent(s, s.orelse), s.body[-1].end_lineno + 1)
        if value:           # a decided elif ends the chain it continues
            return [pad + "else:"] + self.body(s.body, shift, s.test.end_lineno + 1, s.body[0].col_offset)
        return self.else_(s, shift)

    def else_(self, s: ast.If, shift: int) -> list[str]:
        """What follows the emitted body of `s`: its elif chain or else block (nothing where ruled out)."""
        if not s.orelse:
            return []
        if self.is_elif(s.orelse[0]):
            return self.if_(s.orelse[0], shift, "elif")
        first = s.orelse[0]
        return (self.text(s.body[-1].end_lineno + 1, first.lineno - 1, shift)
                + self.body(s.orelse, shift, first.lineno, first.col_offset))


def constexprs(fn: ast.FunctionDef) -> dict:
    """The `tl.constexpr` parameters of `fn` -> their default (None: no default)."""
    args = fn.args.args
    defaults = [None] * (len(args) - len(fn.args.defaults)) + list(fn.args.defaults)
    out = {}
    for a, d in zip(args, defaults):
        if a.annotation is not None and ast.unparse(a.annotation) == "tl.constexpr":
            out[a.arg] = ast.literal_eval(d) if d is not None else None
    return out


def _named(fn: ast.FunctionDef) -> set[str]:
    """Every name `fn` reads: the functions it calls and those it passes (`tl.associative_scan(..., combine)`)."""
    return {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _comments_above(lines: list[str], fn: ast.FunctionDef) -> int:
    """The first line of the comment lines just above `fn`'s decorators (its origin comments)."""
    first = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
    while first > 1 and lines[first - 2].startswith("#"):
        first -= 1
    return first


def _trailing_comment(line: str) -> str | None:
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    return next((t.string for t in tokens if t.type == tokenize.COMMENT), None)


def specialise(source: str, launches: dict[str, dict], notes: dict[str, list[str]] | None = None) -> str:
    """The part of the module `source` that the kernels named in `launches` run, each specialised to
    its constexprs (`launches[name]`: constexpr name -> value, other keys ignored), followed by the
    helpers they call. `notes[name]`: comment lines printed above that kernel or helper. Raises KeyError for a
    name the module does not define."""
    tree = ast.parse(source)
    lines = source.split("\n")
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    missing = sorted(set(launches) - set(functions))
    if missing:
        raise KeyError(f"kernels {missing} are not in the module (it defines {sorted(functions)})")
    kernels, named = [], set()
    for name, meta in launches.items():   # the kernels, in launch order, cut first
        fn = functions[name]
        params = constexprs(fn)
        known = {k: v for k, v in params.items() if v is not None} | {k: meta[k] for k in params if k in meta}
        given = ", ".join(f"{k}={known[k]!r}" for k in params if k in known)
        head = [f"# {line}" for line in (notes or {}).get(name, [])] + [f"# launched with {given}"]
        first = min(d.lineno for d in fn.decorator_list) if fn.decorator_list else fn.lineno
        body = fn.body
        cut = lines[first - 1:body[0].lineno - 1] + _Cutter(lines, known).block(body, 0, body[0].lineno)
        named |= _named(ast.parse("\n".join(cut)).body[0])   # what the kept branches use
        kernels += ["", ""] + lines[_comments_above(lines, fn) - 1:first - 1] + head + cut
    keep, todo = set(), list(named & set(functions))
    while todo:   # the helpers those use, transitively
        name = todo.pop()
        if name not in keep and name not in launches:
            keep.add(name)
            todo += _named(functions[name]) & set(functions)
    out = []
    for node in tree.body:   # header (docstring, imports, module constants) and helpers in module order
        if not isinstance(node, ast.FunctionDef):
            out += lines[node.lineno - 1:node.end_lineno]
        elif node.name in keep:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            out += ["", ""] + lines[_comments_above(lines, node) - 1:start - 1]
            out += [f"# {line}" for line in (notes or {}).get(node.name, [])] + lines[start - 1:node.end_lineno]
    out += kernels
    text = "\n".join(out).strip("\n") + "\n"
    ast.parse(text)   # the cut keeps a valid module
    return text


__all__ = ["specialise", "fold", "constexprs"]
