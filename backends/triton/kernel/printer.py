"""The one printer: a kernel `Module` (kernel/ir.py) -> Triton source text.

It builds a Python `ast.Module` (every `Expr` parsed with `ast.parse(..., mode="eval")`, so a bad
expression fails here, naming the kernel) and unparses it once with `ast.unparse`: indentation,
parentheses and quoting are the standard library's, the text is deterministic, and what is printed
parses by construction. Comments (`ir.Comment`, the kernels' `Origin`s) are not part of Python's
AST: they travel as placeholder calls `__comment__('text')` that the single unparsed text turns
back into `# text` lines. Every generated function is on the IR; no source text is spliced in.

Docstrings (`Kernel.doc`, `Module.doc`) are docstring source text, like comments: a user's name in
them is already escaped by `scanlang.expr.docstring_text` (so it cannot end the docstring or the
line). They travel as `__docstring__('text')` placeholders printed as the text between triple double
quotes, not as string constants, which `ast.unparse` would escape a second time (a name `say "hi"`
would read `say \\\\"hi\\\\"` in the module). Text that cannot stand between triple quotes is refused.
"""
from __future__ import annotations

import ast
import re

from . import ir

_COMMENT = "__comment__"
_COMMENT_LINE = re.compile(rf"^(\s*){_COMMENT}\((.*)\)$")
_DOC = "__docstring__"
_DOC_LINE = re.compile(rf"^(\s*){_DOC}\((.*)\)$")
_AUG_OPS = {"+": ast.Add, "-": ast.Sub, "*": ast.Mult}


def _expr(e: ir.Expr, where: str) -> ast.expr:
    try:
        return ast.parse(e.text.strip(), mode="eval").body
    except SyntaxError as exc:
        raise ValueError(f"{where}: {e.text!r} is not a Python expression ({exc.msg})") from None


def _name(text: str, ctx=ast.Load) -> ast.expr:
    return ast.Name(id=text, ctx=ctx())


def _call(func: str, args, keywords=()) -> ast.Call:
    return ast.Call(func=ast.parse(func, mode="eval").body, args=list(args),
                    keywords=[ast.keyword(arg=k, value=v) for k, v in keywords])


def _comment(text: str) -> ast.stmt:
    if "\n" in text:
        raise ValueError(f"comment: one line expected, got {text!r}")
    return ast.Expr(_call(_COMMENT, [ast.Constant(text)]))


def _docstring(text: str, where: str) -> ast.stmt:
    """`text` (docstring source text) as the placeholder `_lines` prints as `\"\"\"text\"\"\"`."""
    quoted = f'"""{text}"""'
    try:
        value = ast.literal_eval(quoted)
    except (SyntaxError, ValueError):
        value = None
    if '"""' in text or not isinstance(value, str):
        raise ValueError(f"{where}: docstring {text!r} cannot stand between triple quotes (escape it with "
                         "scanlang.expr.docstring_text)")
    return ast.Expr(_call(_DOC, [ast.Constant(text)]))


def _block(stmts, where: str) -> list[ast.stmt]:
    out = [s for stmt in stmts for s in _stmt(stmt, where)]
    if not any(not _is_comment(s) for s in out):
        out.append(ast.Pass())
    return out


def _is_comment(node: ast.stmt) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name) and node.value.func.id == _COMMENT)


def _stmt(s, where: str) -> list[ast.stmt]:
    x = lambda e: _expr(e, where)  # noqa: E731
    if isinstance(s, ir.Comment):
        return [_comment(s.text)]
    if isinstance(s, ir.Assign):
        if s.constexpr:
            if len(s.targets) != 1 or s.unpack:
                raise ValueError(f"{where}: a constexpr assignment has one target, got {s.targets}")
            return [ast.AnnAssign(target=_name(s.targets[0], ast.Store), annotation=_expr(ir.Expr("tl.constexpr"), where),
                                  value=x(s.value), simple=1, lineno=0)]
        if len(s.targets) == 1 and not s.unpack:
            target = _name(s.targets[0], ast.Store)
        else:
            target = ast.Tuple(elts=[_name(t, ast.Store) for t in s.targets], ctx=ast.Store())
        return [ast.Assign(targets=[target], value=x(s.value), lineno=0)]
    if isinstance(s, ir.Load):
        kw = ([("mask", x(s.mask))] if s.mask is not None else []) + (
            [("other", x(s.other))] if s.other is not None else []) + (
            [("cache_modifier", ast.Constant(s.cache))] if s.cache is not None else []) + (
            [("eviction_policy", ast.Constant(s.evict))] if s.evict is not None else [])
        value = _call("tl.load", [x(s.pointer)], kw)
        if s.to_acc:
            value = _call("to_acc", [value, _name("FP64")])
        return [ast.Assign(targets=[_name(s.target, ast.Store)], value=value, lineno=0)]
    if isinstance(s, (ir.Store, ir.AtomicAdd)):
        kw = [("mask", x(s.mask))] if s.mask is not None else []
        if isinstance(s, ir.AtomicAdd):
            kw.append(("sem", ast.Constant("relaxed")))
        elif s.cache is not None:
            kw.append(("cache_modifier", ast.Constant(s.cache)))
        fn = "tl.store" if isinstance(s, ir.Store) else "tl.atomic_add"
        return [ast.Expr(_call(fn, [x(s.pointer), x(s.value)], kw))]
    if isinstance(s, ir.If):
        return [ast.If(test=x(s.cond), body=_block(s.body, where),
                       orelse=_block(s.orelse, where) if s.orelse else [])]
    if isinstance(s, ir.AugAssign):
        if s.op not in _AUG_OPS:
            raise ValueError(f"{where}: augmented assignment {s.op!r}= is not one of {sorted(_AUG_OPS)}")
        return [ast.AugAssign(target=_name(s.target, ast.Store), op=_AUG_OPS[s.op](), value=x(s.value), lineno=0)]
    if isinstance(s, ir.Eval):
        return [ast.Expr(x(s.value))]
    if isinstance(s, ir.For):
        if s.static + s.builtin + (s.num_stages is not None) > 1:
            raise ValueError(f"{where}: loop over {s.var}: static, builtin and num_stages exclude each other")
        bounds = ([x(s.start)] if s.start is not None else []) + [x(s.stop)] + ([x(s.step)] if s.step is not None else [])
        fn = "tl.static_range" if s.static else "range" if s.builtin else "tl.range"
        it = _call(fn, bounds, [("num_stages", x(s.num_stages))] if s.num_stages is not None else [])
        return [ast.For(target=_name(s.var, ast.Store), iter=it, body=_block(s.body, where), orelse=[], lineno=0)]
    if isinstance(s, ir.While):
        return [ast.While(test=x(s.cond), body=_block(s.body, where), orelse=[])]
    if isinstance(s, ir.Return):
        values = [x(v) for v in s.values]
        value = values[0] if len(values) == 1 else ast.Tuple(elts=values, ctx=ast.Load())
        return [ast.Return(value=value)]
    raise TypeError(f"{where}: {type(s).__name__} is not a statement of kernel/ir.py")


def _function(k: ir.Kernel) -> list[ast.stmt]:
    where = f"kernel {k.name}"
    seen_default = False
    args, defaults = [], []
    for p in k.params:
        ann = ast.parse("tl.constexpr", mode="eval").body if p.constexpr else None
        args.append(ast.arg(arg=p.name, annotation=ann))
        if p.default is not None:
            seen_default = True
            defaults.append(_expr(p.default, where))
        elif seen_default:
            raise ValueError(f"{where}: parameter {p.name} without a default follows one with a default")
    names = [p.name for p in k.params]
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: parameter names repeat: {names}")
    body = ([_docstring(k.doc, where)] if k.doc else []) + _block(k.body, where)
    fn = ast.FunctionDef(name=k.name, args=ast.arguments(posonlyargs=[], args=args, vararg=None, kwonlyargs=[],
                                                          kw_defaults=[], kwarg=None, defaults=defaults),
                         body=body, decorator_list=[ast.parse("triton.jit", mode="eval").body], returns=None,
                         type_params=[], lineno=0)
    return [_comment(f"from {o}") for o in k.origin] + [fn]


def _lines(body: list[ast.stmt]) -> list[str]:
    """`body` unparsed once, the comment and docstring placeholders turned back into `# text` lines and
    `\"\"\"text\"\"\"` (a docstring's own newlines making lines of their own)."""
    text = ast.unparse(ast.fix_missing_locations(ast.Module(body=body, type_ignores=[])))
    lines = []
    for line in text.split("\n"):
        m = _COMMENT_LINE.match(line)
        d = None if m else _DOC_LINE.match(line)
        if m:
            lines.append(f"{m.group(1)}# {ast.literal_eval(m.group(2))}")
        elif d:
            lines += f'{d.group(1)}"""{ast.literal_eval(d.group(2))}"""'.split("\n")
        else:
            lines.append(line)
    return lines


def render(module: ir.Module) -> str:
    """The source text of `module`: docstring, imports, one `@triton.jit` function per kernel."""
    names = [k.name for k in module.kernels]
    if len(set(names)) != len(names):
        raise ValueError(f"module: kernel names repeat: {names}")
    body = [_docstring(module.doc, "module"), ast.Import([ast.alias("triton")]),
            ast.Import([ast.alias("triton.language", "tl")])]
    for k in module.kernels:
        body += _function(k)
    lines = []
    for line in _lines(body):
        starts = line.startswith(("# ", "@", "def "))   # a top-level function or the comments above it
        while starts and lines and lines[-1] == "":
            lines.pop()                                  # unparse's own blank lines, replaced below
        if starts and lines and not lines[-1].startswith(("# ", "@")):
            lines += ["", ""]                            # two blank lines before each function
        lines.append(line)
    source = "\n".join(lines) + "\n"
    ast.parse(source)
    return source


def render_kernel(kernel: ir.Kernel) -> str:
    """The source text of one kernel (its origin comments, `@triton.jit`, the function; no blank
    lines and no final newline), for a module assembled from text blocks (codegen_module.render)."""
    lines = []
    for line in _lines(_function(kernel)):
        while line.startswith("@") and lines and lines[-1] == "":
            lines.pop()                                  # unparse's blank lines before the function
        lines.append(line)
    source = "\n".join(lines).strip("\n")
    ast.parse(source)
    return source
