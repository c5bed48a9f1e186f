"""`scanlang show` prints only what a launch runs: the kernels the plans of that shape launch (the
names taken from the launch path, compared with a recording of a real launch), each cut to the
branches its constexprs select (`specialise.py`), with the helpers they call; the cut source parses
and computes what the whole module computes."""
import ast
import dataclasses
import itertools
import textwrap

import pytest
import torch

import scanlang as sl
from scanlang import cli, pipeline, settings
from scanlang.backends.triton import chunked_launch, launcher, runtime
from scanlang.backends.triton import show_shape
from scanlang.backends.triton.specialise import _UNKNOWN, fold, specialise


def gpu_configs(monkeypatch, monoid):
    """choose_config's GPU configs from here on (the program loaded first, as the interpreter's)."""
    pipeline.program(monoid)
    monkeypatch.setattr(settings, "triton_interpret", lambda: False)


def launched_names(m, shape, layout):
    """The kernels show_shape's plans launch, forward then backward (the launch path's data)."""
    prog = pipeline.program(m)
    fplan, bplan = show_shape.plans(prog, shape, layout)
    fwd, bwd = show_shape.configs(prog, shape, layout)
    return [n for n, _, _ in show_shape.launches(fplan, fwd, False) + show_shape.launches(bplan, bwd, True)]


@pytest.mark.parametrize("monoid", [sl.Affine, sl.Mobius], ids=["Affine", "Mobius"])
def test_the_default_show_is_short_and_holds_every_launched_kernel(capsys, monkeypatch, monoid):
    """Without --shape: the kernels of a [4, 2048, 256] training call, with the GPU's configs."""
    gpu_configs(monkeypatch, monoid)
    assert cli.main(["show", f"scanlang.library:{monoid.name}"]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) < 2000
    whole = len(pipeline.show(monoid).splitlines())
    assert len(out.splitlines()) < whole / 5
    names = launched_names(monoid, (4, 2048, 256), "time")
    assert names == ["scan_forward", "scan_backward"]
    defined = [n.name for n in ast.parse(pipeline.show(monoid, (4, 2048, 256))).body if isinstance(n, ast.FunctionDef)]
    assert set(names) <= set(defined) and "scan_forward_lanes" not in defined and "scan_backward_lanes" not in defined
    fn = monoid.combine_fn
    assert f"# from combine of {monoid.name}: scanlang/library.py:{fn.__code__.co_firstlineno}" in out


@pytest.mark.parametrize("shape,layout", [((4, 2048, 256), "channels"), ((64, 4096, 4096), "time"),
                                          ((1, 1048576, 16), "time"), ((3, 5, 7), "channels"), ((1, 1, 1), "time")])
def test_every_shape_prints_a_module_that_parses_with_its_kernels(monkeypatch, shape, layout):
    gpu_configs(monkeypatch, sl.Affine)
    text = pipeline.show(sl.Affine, shape, layout)
    defined = {n.name for n in ast.parse(text).body if isinstance(n, ast.FunctionDef)}
    assert set(launched_names(sl.Affine, shape, layout)) <= defined
    assert len(text.splitlines()) < 2000


def _schedules(knobs, schedule):
    if schedule == "lanes":
        knobs(lanes_min=1)
    elif schedule == "chunked":
        cfg = runtime.Config(block_t=4, block_l=4, num_warps=1, schedule="chunked")
        knobs(forced={(c, b): cfg for c in (False, True) for b in (False, True)})


def _elems(shape, layout, n):
    B, T, D = shape
    dims = (B, D, T) if layout == "time" else (B, T, D)
    gen = torch.Generator().manual_seed(7)
    return [(torch.rand(dims, generator=gen) * 0.8 + 0.1).requires_grad_() for _ in range(n)], 2 if layout == "time" else 1


def _run(monoid, elems, dim):
    out = sl.scan(monoid, tuple(elems), dim=dim, backend="triton")
    grads = torch.autograd.grad(sum((o * (i + 1)).sum() for i, o in enumerate(out)), elems)
    return [o.detach() for o in out], list(grads)


@pytest.mark.parametrize("schedule", ["tile", "lanes", "chunked"])
@pytest.mark.parametrize("layout", ["time", "channels"])
def test_the_kernels_shown_are_those_a_launch_runs(knobs, monkeypatch, schedule, layout):
    """A recording of a real training call (interpreter) launches exactly the kernels show names, with
    the constexprs show prints."""
    _schedules(knobs, schedule)
    shape = (2, 9, 3)
    seen = []
    real = launcher.launch

    def record(holder, cfg, kernel, grid, args, meta):
        seen.append((kernel.fn.__name__, dict(meta)))
        return real(holder, cfg, kernel, grid, args, meta)
    monkeypatch.setattr(launcher, "launch", record)
    elems, dim = _elems(shape, layout, 2)
    _run(sl.Affine, elems, dim)
    assert [n for n, _ in seen] == launched_names(sl.Affine, shape, layout)
    first_chunked = chunked_launch.kernel_names(2, time_contiguous=layout == "time")[0]   # a one-pass forward by default
    assert seen[0][0] == {"tile": "scan_forward", "lanes": "scan_forward_lanes", "chunked": first_chunked}[schedule]
    text = pipeline.show(sl.Affine, shape, layout)
    for name, meta in seen:
        fn = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == name)
        given = [line for line in text.splitlines()[:fn.lineno] if line.startswith("# launched with")][-1]
        constexprs = {a.arg for a in fn.args.args if a.annotation is not None}
        for key in constexprs & set(meta):
            assert f"{key}={meta[key]!r}" in given


@pytest.mark.parametrize("schedule", ["tile", "lanes", "chunked"])
def test_the_cut_source_computes_what_the_whole_module_computes(knobs, monkeypatch, schedule):
    """The printed source, loaded as the program's module, gives the same outputs and gradients, bit for bit."""
    _schedules(knobs, schedule)
    shape, layout = (1, 11, 5), "channels"
    prog = pipeline.program(sl.Affine)
    elems, dim = _elems(shape, layout, 2)
    want = _run(sl.Affine, elems, dim)
    cut = runtime.load(pipeline.show(sl.Affine, shape, layout))
    key = prog.key + ".shown"
    monkeypatch.setitem(pipeline.PROGRAMS, key, dataclasses.replace(prog, key=key, module=cut))
    monkeypatch.setitem(chunked_launch._MODULES, (key, False), cut)   # channels: three kernels in both passes
    monkeypatch.setattr(pipeline, "program_key", lambda *_: key)
    got = _run(sl.Affine, elems, dim)
    for w, g in zip(want[0] + want[1], got[0] + got[1]):
        assert torch.equal(w, g)


SOURCE = textwrap.dedent('''\
    """doc"""
    import triton
    import triton.language as tl


    @triton.jit
    def helper(x):
        return x + 1


    @triton.jit
    def unused(x):
        return x


    @triton.jit
    def kernel(x, A: tl.constexpr, B: tl.constexpr, N: tl.constexpr = 2):
        """k"""
        y = x
        if A:   # why A
            y = helper(y)
        elif B and N > 1:
            # a comment of the elif
            y = y * N
        elif x > 0:
            y = y - 1
        else:
            y = -y
        for i in range(N):
            if B:
                y = y + i
        if not A or x > 2:
            y = y * 3
        else:
            if N == 2:
                y = y + 7
        return y
''')


class _tl:
    constexpr = None


def _function(text, name):
    space = {"triton": type("T", (), {"jit": staticmethod(lambda f: f)}), "tl": _tl}
    exec(compile(text.replace("import triton\nimport triton.language as tl\n", ""), "<cut>", "exec"), space)
    return space[name]


def test_specialise_keeps_exactly_the_branches_the_constexprs_select():
    """Every (A, B, N) and runtime x: the cut kernel returns what the whole one returns; branches on
    constexprs are gone, those on runtime values stay; only the helpers called are kept."""
    whole = _function(SOURCE, "kernel")
    for a, b, n in itertools.product([False, True], [False, True], [1, 2, 3]):
        text = specialise(SOURCE, {"kernel": dict(A=a, B=b, N=n, num_warps=4)})
        cut = _function(text, "kernel")
        for x in (-3, 0, 1, 5):
            assert cut(x, a, b, n) == whole(x, a, b, n)
        fn = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == "kernel")
        tests = [{v.id for v in ast.walk(s.test) if isinstance(v, ast.Name)} for s in ast.walk(fn) if isinstance(s, ast.If)]
        assert all("x" in names for names in tests)   # a test left reads a runtime value
        assert ("def helper(" in text) == a and "def unused(" not in text
        assert f"# launched with A={a!r}, B={b!r}, N={n!r}" in text
        assert ("# A: why A" in text) == a
        assert ("# a comment of the elif" in text) == (not a and b and n > 1)


def test_fold_decides_what_the_constants_settle():
    known = {"A": True, "N": 3}
    value = lambda text: fold(ast.parse(text, mode="eval").body, known)
    assert value("A and N > 2") is True
    assert value("not A and x") is False and value("A or x") is True
    assert value("A and x") is _UNKNOWN and value("x.dtype == 1") is _UNKNOWN
    assert value("N // 2 == 1 and N % 2 == 1") is True


def test_all_and_shape_together_are_refused(capsys):
    assert cli.main(["show", "scanlang.library:Affine", "--all", "--shape", "1,2,3"]) == 2
    assert "--all" in capsys.readouterr().err


def test_a_refuted_monoid_is_still_refused(tmp_path, capsys):
    path = tmp_path / "broken_show.py"
    path.write_text(textwrap.dedent("""
        import scanlang as sl

        @sl.monoid(fields=("m",), identity=(0,))
        def average(x, y):
            return ((x.m + y.m) / 2,)
    """))
    for argv in ([], ["--shape", "2,8,3"], ["--all"]):
        assert cli.main(["show", f"{path}:average", *argv]) == 1
        out = capsys.readouterr().out
        assert "NOT associative" in out and "def " not in out
