"""Issue 18, classes 8 and 9 (this half): names that would break generated code, the proof budget
and its environment knob, the command line on refuted monoids and local modules, the one-time
warning for numeric-only proofs, and the messages a new user meets first."""
import ast
import threading
import time
import warnings

import pytest
import torch

import scanlang as sl
from scanlang import analysis, cli
from scanlang.backends.reference import scan_sequential
from scanlang.testing import assert_close
from scanlang.verify import clear_memory_cache, verify


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SCANLANG_CACHE_DIR", str(tmp_path / "cache"))
    clear_memory_cache()


# ---- names in generated code --------------------------------------------------------------------

def test_a_monoid_name_that_would_end_a_docstring_generates_a_module_that_loads():
    name = 'tri"""ple\nline \\ quote\'"""; import os #'
    # a field name of its own: programs are keyed by content, so an equal monoid's module would be reused
    m = sl.monoid(fields=("quirky",), identity=(0,), name=name)(lambda x, y: (x.quirky + y.quirky,))
    from scanlang import pipeline
    program = pipeline.program(m)      # rendered, parsed and imported from the cache
    ast.parse(program.source)
    assert '"""; import os' not in program.source and program.module is not None
    assert 'tri\\"\\"\\"ple' in program.source   # the name is kept, escaped


def test_name_must_be_a_string():
    with pytest.raises(TypeError, match="name"):
        sl.monoid(fields=("s",), identity=(0,), name=3)(lambda x, y: (x.s + y.s,))


# ---- the proof budget -------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["abc", "-1", "nan", ""])
def test_bad_proof_seconds_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("SCANLANG_PROOF_SECONDS", value)
    m = sl.monoid(fields=("s",), identity=(0,))(lambda x, y: (x.s + y.s,))
    with pytest.raises(ValueError, match="SCANLANG_PROOF_SECONDS"):
        verify(m)


def test_budget_is_enforced_off_the_main_thread(monkeypatch):
    def stuck(expr):   # one sympy step that would run far past the budget
        time.sleep(30)

    monkeypatch.setattr(analysis, "rational_simplify", stuck)
    m = sl.monoid(fields=("a", "b"), identity=(1, 0))(lambda x, y: (y.a * x.a, y.a * x.b + y.b))
    result = {}
    start = time.perf_counter()
    thread = threading.Thread(target=lambda: result.update(proof=verify(m, seconds=0.3)))
    thread.start()
    thread.join(25)
    assert time.perf_counter() - start < 10
    assert result["proof"].associativity.method == "numeric"
    assert "did not decide within the 0.3 s budget" in result["proof"].associativity.how


# ---- command line -------------------------------------------------------------------------------------

MODULE = '''
import scanlang as sl

@sl.monoid(fields=("s",), identity=(0,))
def clamped(x, y):
    return (sl.minimum(x.s + y.s, 1e6),)

@sl.monoid(fields=("s",), identity=(0,))
def total(x, y):
    return (x.s + y.s,)
'''


def test_show_refuses_a_refuted_monoid(tmp_path, monkeypatch, capsys):
    (tmp_path / "holes_cli_show.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["show", "holes_cli_show:clamped"]) == 1
    out = capsys.readouterr().out
    assert "NOT associative" in out and "counterexample" in out and "@triton.jit" not in out


def test_verify_finds_a_module_in_the_current_directory(tmp_path, monkeypatch, capsys):
    (tmp_path / "holes_cli_local.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    assert cli.main(["verify", "holes_cli_local:total"]) == 0
    assert "symbolic proof" in capsys.readouterr().out
    assert cli.main(["verify", "holes_cli_local:clamped"]) == 1


# ---- numeric-only proofs -------------------------------------------------------------------------------

def test_numeric_only_monoid_is_scanned_with_one_warning(monkeypatch):
    monkeypatch.setenv("SCANLANG_PROOF_SECONDS", "0")
    m = sl.monoid(fields=("s",), identity=(0,), name="only_numeric")(lambda x, y: (x.s + y.s,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sl.scan(m, (torch.ones(1, 3),), dim=1, backend="reference")
        sl.scan(m, (torch.ones(1, 3),), dim=1, backend="reference")
    mine = [w for w in caught if issubclass(w.category, sl.UnprovedWarning)]
    assert len(mine) == 1
    text = str(mine[0].message)
    assert "only_numeric" in text and "SCANLANG_PROOF_SECONDS" in text and "verify(seconds=" in text


# ---- first messages --------------------------------------------------------------------------------------

@pytest.mark.parametrize("body", [lambda x, y: (max(x.s, y.s),), lambda x, y: (min(x.s, y.s),),
                                  lambda x, y: (x.s if x.s > y.s else y.s,)])
def test_builtin_max_points_at_sl_maximum(body):
    with pytest.raises(sl.UnsupportedOperationError, match="sl.maximum"):
        sl.monoid(fields=("s",), identity=(0,))(body)


def _ema(lift):
    return sl.mixer(sl.Affine, axes="b t d", inputs={"x": "b t d", "decay": "d"}, lift=lift,
                    readout=lambda p, u, q: p.b, outputs=("h",))


def test_mixer_lift_arity_lists_the_monoid_fields():
    with pytest.raises(ValueError, match=r"one per field \('a', 'b'\)"):
        _ema(lambda u: (u.decay,))
    with pytest.raises(ValueError, match=r"\('a', 'b'\)"):
        _ema(lambda u: (u.decay, u.x, u.x))


def test_mixer_positional_inputs_are_called_keyword_only():
    ema = _ema(lambda u: (u.decay, (1 - u.decay) * u.x))
    with pytest.raises(TypeError, match="keyword-only"):
        ema(torch.ones(1, 3, 2), torch.full((2,), 0.5))
    with pytest.raises(TypeError, match=r"x=\.\.\., decay=\.\.\."):
        ema(torch.ones(1, 3, 2), decay=torch.full((2,), 0.5))
