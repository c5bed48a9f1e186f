"""The kernel IR (backends/triton/kernel/ir.py) and its one printer (printer.py): Python's ast,
unparsed once; comments and origins as `#` lines; bad input refused naming the kernel."""
import ast
import inspect
import pathlib

import pytest

import scanlang as sl
from scanlang import pipeline
from scanlang.backends.triton.kernel import chunked, common
from scanlang.backends.triton.kernel import ir as K
from scanlang.backends.triton.kernel import lanes
from scanlang.backends.triton.kernel.printer import render, render_kernel


def kernel(body, params=(K.Param("x_ptr"), K.Param("N", constexpr=True)), origin=()):
    return K.Module("doc of the module", (K.Kernel("k", params, tuple(body), doc="doc of k", origin=origin),))


def test_statements_print_as_triton_source():
    body = [K.Comment("why this load"),
            K.Load("x", K.expr("x_ptr + tl.arange(0, N)"), K.expr("tl.arange(0, N) < 3"), K.expr("0.0")),
            K.Assign(("a", "b"), K.expr("(x * 2, x + 1)")),
            K.If(K.expr("N > 4"), (K.Store(K.expr("x_ptr"), K.expr("a")),), (K.Comment("only a comment"),)),
            K.For("i", K.expr("0"), K.expr("N"), (K.AtomicAdd(K.expr("x_ptr + i"), K.expr("b")),)),
            K.Return((K.expr("a"), K.expr("b")))]
    origin = (K.Origin("combine of Affine", "lib.py", 19),)
    src = render(kernel(body, origin=origin))
    assert src == render(kernel(body, origin=origin))   # deterministic
    lines = src.splitlines()
    assert lines[0] == '"""doc of the module"""' and "import triton.language as tl" in lines
    assert "# from combine of Affine: lib.py:19" in lines
    assert "def k(x_ptr, N: tl.constexpr):" in src
    assert "    # why this load" in lines
    assert "    x = to_acc(tl.load(x_ptr + tl.arange(0, N), mask=tl.arange(0, N) < 3, other=0.0), FP64)" in lines
    assert "        tl.atomic_add(x_ptr + i, b, mask=None, sem='relaxed')" not in lines   # no mask: none printed
    assert "        tl.atomic_add(x_ptr + i, b, sem='relaxed')" in lines
    assert "    for i in tl.range(0, N):" in lines
    assert "        # only a comment" in lines and "        pass" in lines   # a block of comments gets a pass
    ast.parse(src)


def test_augmented_assignment_and_one_value_unpacking():
    body = [K.Assign(("acc",), K.expr("0.0")), K.AugAssign("acc", K.expr("tl.sum(x, 0)")),
            K.AugAssign("acc", K.expr("2.0"), "*"), *K.assign_lines(["s, = tl.associative_scan((x,), 0, f)"]),
            K.Assign(("t",), K.expr("s"), unpack=True)]
    tree = ast.parse(render(kernel(body)))
    stmts = tree.body[-1].body[1:]   # after the docstring
    assert isinstance(stmts[1], ast.AugAssign) and isinstance(stmts[1].op, ast.Add)
    assert ast.unparse(stmts[1]) == "acc += tl.sum(x, 0)" and ast.unparse(stmts[2]) == "acc *= 2.0"
    for s, name in ((stmts[3], "s"), (stmts[4], "t")):   # a one-element tuple target, not a plain name
        assert isinstance(s.targets[0], ast.Tuple) and [e.id for e in s.targets[0].elts] == [name]
    assert K.assign_lines(["s = f(x)"])[0].unpack is False
    with pytest.raises(ValueError, match="kernel k: augmented assignment '//'= is not one of"):
        render(kernel([K.AugAssign("acc", K.expr("2"), "//")]))


def test_constexpr_assignment_prints_annotated():
    """`NB: tl.constexpr = C // 16`, a compile-time constant inside a kernel (the delta-rule kernels')."""
    src = render(kernel([K.Assign(("NB",), K.expr("N // 16"), constexpr=True), K.Return((K.expr("NB"),))]))
    assert "    NB: tl.constexpr = N // 16\n" in src
    node = ast.parse(src).body[-1].body[1]
    assert isinstance(node, ast.AnnAssign) and node.simple == 1 and ast.unparse(node.annotation) == "tl.constexpr"
    with pytest.raises(ValueError, match="kernel k: a constexpr assignment has one target"):
        render(kernel([K.Assign(("a", "b"), K.expr("(1, 2)"), constexpr=True)]))


def test_accumulations_effects_and_loop_forms_print_as_written():
    """AugAssign, Eval and the For forms the lane schedule needs (Python's range, tl.range with
    num_stages, tl.static_range(stop)); render_kernel: one kernel as a text block (no blank lines
    around it, no final newline)."""
    loops = (K.For("k", K.expr(0), K.expr("N"), (K.AugAssign("acc", K.expr("x * 2")),), builtin=True),
             K.For("s", K.expr(0), K.expr("N - 3"), (K.AugAssign("acc", K.expr("1.0"), "-"),), step=K.expr(4),
                   num_stages=K.expr(2)),
             K.For("b", None, K.expr(5), (K.AugAssign("acc", K.expr("acc"), "*"),), static=True),
             K.Eval(K.expr("tl.debug_barrier()")))
    origin = (K.Origin("combine of Affine", "lib.py", 19),)
    src = render_kernel(K.Kernel("k", (K.Param("N", True),), loops, doc="doc of k", origin=origin))
    assert src.splitlines() == [
        "# from combine of Affine: lib.py:19", "@triton.jit", "def k(N: tl.constexpr):", '    """doc of k"""',
        "    for k in range(0, N):", "        acc += x * 2",
        "    for s in tl.range(0, N - 3, 4, num_stages=2):", "        acc -= 1.0",
        "    for b in tl.static_range(5):", "        acc *= acc",
        "    tl.debug_barrier()"]
    with pytest.raises(ValueError, match=r"kernel k: augmented assignment '/'= "):
        render(kernel([K.AugAssign("a", K.expr("2"), "/")]))
    with pytest.raises(ValueError, match="kernel k: loop over i: static, builtin and num_stages exclude each other"):
        render(kernel([K.For("i", K.expr(0), K.expr(2), (), static=True, builtin=True)]))


def test_the_lane_parameters():
    ir = pipeline.lower(sl.Affine)   # inputs a, b; outputs a, b
    assert lanes.lanes_flags(ir, backward=False) == (
        *(K.Param(f"TS_{b}", True) for b in ("u0", "u1", "o0", "o1")),
        *(K.Param(f"{flag}{i}", True, K.expr("False")) for flag in ("TSTATIC", "SLOT") for i in range(2)))


def test_bad_input_is_refused_naming_the_kernel():
    with pytest.raises(ValueError, match=r"kernel k: 'x \+' is not a Python expression"):
        render(kernel([K.Assign(("y",), K.expr("x +"))]))
    with pytest.raises(ValueError, match="follows one with a default"):
        render(kernel([], params=(K.Param("A", True, K.expr("1")), K.Param("B"))))
    with pytest.raises(TypeError, match="value"):
        K.expr(object())
    with pytest.raises(ValueError, match="lines"):
        K.assign_lines(["not an assignment"])


def test_chunked_module_points_at_the_declaration_and_is_deterministic():
    for m in (sl.Affine, sl.Mobius):
        ir = pipeline.lower(m)
        src = chunked.render(ir, pipeline.differentiate(ir))
        fn = m.combine_fn
        assert f"# from combine of {m.name}: scanlang/library.py:{fn.__code__.co_firstlineno}" in src
        assert all(f"def {name}(" in src for name in chunked.KERNELS)
    assert common.origins(pipeline.lower(sl.Mobius))[1].what == "scale of Mobius"


def test_origins_print_the_same_path_from_any_working_directory(tmp_path, monkeypatch):
    """Origin comments name the declaring file relative to the working directory when it is under it,
    else to its package's root, else by file name: never an absolute path, so the source is the same
    wherever the checkout lives."""
    ir = pipeline.lower(sl.Affine)
    adj = pipeline.differentiate(ir)
    root = pathlib.Path(inspect.getsourcefile(sl.Affine.combine_fn)).resolve().parents[1]
    monkeypatch.chdir(root)
    here = chunked.render(ir, adj), pipeline.render(ir, adj)
    monkeypatch.chdir(tmp_path)
    assert (chunked.render(ir, adj), pipeline.render(ir, adj)) == here   # byte for byte
    assert str(root) not in here[0] and "# from combine of Affine: scanlang/library.py:" in here[0]
    loose = tmp_path / "sub" / "decl.py"
    loose.parent.mkdir()
    loose.write_text("")
    assert common.source_path(str(loose)) == "sub/decl.py"        # under the working directory
    monkeypatch.chdir(loose.parent.parent.parent)
    assert common.source_path(str(loose)) == f"{tmp_path.name}/sub/decl.py"
    monkeypatch.chdir(root)
    assert common.source_path(str(loose)) == "decl.py"            # neither: the file name
    assert common.source_path("<stdin>") == "<stdin>"


def test_unpacking_add_assign_and_staged_loops():
    body = [K.Assign(("s",), K.expr("tl.associative_scan((x,), 0, combine)"), unpack=True),
            K.AugAssign("acc", K.expr("tl.sum(s, 0)")),
            K.For("k", K.expr(0), K.expr("N"), (K.Assign(("t",), K.expr("k + 1")),), num_stages=K.expr("STAGES"))]
    helper = K.Kernel("helper", (K.Param("y"),), (K.Comment("kept"), K.Return((K.expr("y + 1"),))))
    mod = kernel(body)
    src = render(K.Module(mod.doc, (helper,) + mod.kernels))
    lines = src.splitlines()
    assert "    s, = tl.associative_scan((x,), 0, combine)" in lines
    assert "    acc += tl.sum(s, 0)" in lines and "    for k in tl.range(0, N, num_stages=STAGES):" in lines
    assert "    # kept" in lines
    fns = [n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef)]
    assert [f.name for f in fns] == ["helper", "k"]
    assert isinstance(fns[1].body[1].targets[0], ast.Tuple) and len(fns[1].body[1].targets[0].elts) == 1
    with pytest.raises(ValueError, match="kernel names repeat"):
        render(K.Module("d", (helper, helper)))


def test_statements_print_as_the_python_they_stand_for():
    x = K.expr
    stmts = [K.If(x("DU0 == 0"), (K.Store(x("p"), x("v"), x("ok")),),
                  (K.If(x("DU0 == 1"), (K.AtomicAdd(x("p"), x("v"), x("ok")),), (K.AugAssign("acc0", x("tl.sum(v, 0)")),)),)),
             K.Assign(("a",), x("f(x)"), unpack=True),
             K.For("k", x(0), x("n"), (K.assign("b", "k * 2"),), num_stages=x("S"))]
    lines = ["if DU0 == 0:", "    tl.store(p, v, mask=ok)", "elif DU0 == 1:",
             "    tl.atomic_add(p, v, mask=ok, sem='relaxed')", "else:", "    acc0 += tl.sum(v, 0)",
             "a, = f(x)", "for k in tl.range(0, n, num_stages=S):", "    b = k * 2"]
    printed = render(kernel(stmts))
    fn = next(n for n in ast.parse(printed).body if isinstance(n, ast.FunctionDef))
    assert ast.dump(ast.Module(fn.body[1:], [])) == ast.dump(ast.parse("\n".join(lines)))


def _lift(u):          # a mixer's lift and readout, declared here: the comments must point at these lines
    return u.a, u.b


def _readout(p, u, q):
    return p.b * u.c


def test_mixer_kernels_point_at_the_lift_and_readout():
    ir = pipeline.lower(sl.Affine, inputs=("a", "b", "c"), lift=_lift, outputs=("y",), readout=_readout)
    src = pipeline.render(ir, pipeline.differentiate(ir))
    here = common.source_path(inspect.getsourcefile(_lift))   # tests/test_kernel_printer.py from the root
    for what, fn in (("lift", _lift), ("readout", _readout)):
        assert f"# from {what} of Affine: {here}:{fn.__code__.co_firstlineno}" in src
    assert ir == pipeline.lower(sl.Affine, inputs=("a", "b", "c"), lift=lambda u: (u.a, u.b), outputs=("y",),
                                readout=lambda p, u, q: p.b * u.c)   # where it is declared is not its identity


def test_a_name_that_needs_escaping_is_escaped_once_in_every_docstring():
    """Kernel and module docs hold docstring text (the name escaped by E.docstring_text); the printer
    writes it between triple quotes as it is, so the docstrings Python reads hold the name itself."""
    name = 'say "hi" \\ to\n\'them\'"""'
    m = sl.monoid(fields=("esc",), identity=(0,), name=name)(lambda x, y: (x.esc + y.esc,))
    ir = pipeline.lower(m)
    adj = pipeline.differentiate(ir)
    for src in (pipeline.render(ir, adj), chunked.render(ir, adj)):
        tree = ast.parse(src)
        docs = [ast.get_docstring(n, clean=False) for n in [tree, *ast.walk(tree)]
                if isinstance(n, (ast.Module, ast.FunctionDef)) and ast.get_docstring(n, clean=False)]
        named = [d for d in docs if "say" in d]
        assert named and all(name in d for d in named), named
        assert "\\\\" + '"' not in src   # no escaped backslash before a quote: nothing escaped twice
    with pytest.raises(ValueError, match=r"kernel k: docstring .* cannot stand between triple quotes"):
        render(K.Module("d", (K.Kernel("k", (), (), doc='ends in a quote"'),)))
    with pytest.raises(ValueError, match="module: docstring"):
        render(K.Module('a """ b', ()))
