"""The kernel IR (backends/triton/kernel/ir.py) and its one printer (printer.py): Python's ast,
unparsed once; comments and origins as `#` lines; bad input refused naming the kernel."""
import ast
import inspect

import pytest

import scanlang as sl
from scanlang import pipeline
from scanlang.backends.triton.kernel import chunked, common
from scanlang.backends.triton.kernel import ir as K
from scanlang.backends.triton.kernel.printer import render


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
        assert f"# from combine of {m.name}: {inspect.getsourcefile(fn)}:{fn.__code__.co_firstlineno}" in src
        assert all(f"def {name}(" in src for name in chunked.KERNELS)
    assert common.origins(pipeline.lower(sl.Mobius))[1].what == "scale of Mobius"


def test_unpacking_add_assign_staged_loops_and_spliced_sources():
    body = [K.Assign(("s",), K.expr("tl.associative_scan((x,), 0, combine)"), unpack=True),
            K.AddAssign("acc", K.expr("tl.sum(s, 0)")),
            K.For("k", K.expr(0), K.expr("N"), (K.Assign(("t",), K.expr("k + 1")),), stages=K.expr("STAGES"))]
    helper = K.Source("helper", "@triton.jit\ndef helper(y):\n    # kept as written\n    return y + 1\n")
    mod = kernel(body)
    src = render(K.Module(mod.doc, (helper,) + mod.kernels))
    lines = src.splitlines()
    assert "    s, = tl.associative_scan((x,), 0, combine)" in lines
    assert "    acc += tl.sum(s, 0)" in lines and "    for k in tl.range(0, N, num_stages=STAGES):" in lines
    assert "    # kept as written" in lines   # a Source is spliced as written, its comments kept
    fns = [n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef)]
    assert [f.name for f in fns] == ["helper", "k"]
    assert isinstance(fns[1].body[1].targets[0], ast.Tuple) and len(fns[1].body[1].targets[0].elts) == 1
    with pytest.raises(ValueError, match="kernel other"):
        render(K.Module("d", (K.Source("other", "@triton.jit\ndef helper(y):\n    return y\n"),)))


def test_generated_lines_become_the_same_statements():
    from scanlang.backends.triton.kernel import builders
    lines = ["if DU0 == 0:", "    tl.store(p, v, mask=ok)", "elif DU0 == 1:",
             "    tl.atomic_add(p, v, mask=ok, sem='relaxed')", "else:", "    acc0 += tl.sum(v, 0)",
             "a, = f(x)", "for k in tl.range(0, n, num_stages=S):", "    b = k * 2"]
    stmts = builders.from_lines(lines)
    printed = render(kernel(stmts))
    fn = next(n for n in ast.parse(printed).body if isinstance(n, ast.FunctionDef))
    assert ast.dump(ast.Module(fn.body[1:], [])) == ast.dump(ast.parse("\n".join(lines)))
    with pytest.raises(ValueError, match="no kernel IR statement"):
        builders.from_lines(["while x:", "    x = x - 1"])
