"""The verify stage: refutations with valid counterexamples, identity failures, budget fallback,
the proof cache, and the analyses later stages use (commutativity, Jacobians, sparsity)."""
import doctest
import importlib
import json
import signal
import threading
import time

import pytest
import sympy
import torch

import scanlang as sl
from scanlang import analysis, library
from scanlang.verify import clear_memory_cache, commutativity, verify

INF = float("inf")


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SCANLANG_CACHE_DIR", str(tmp_path / "cache"))
    clear_memory_cache()


def _matrix(x, y):
    return (y.a * x.a + y.b * x.c, y.a * x.b + y.b * x.d, y.c * x.a + y.d * x.c, y.c * x.b + y.d * x.d)


# ---- plausible-looking combines that are not associative -------------------------------------------

@sl.monoid(fields=("v",), identity=(0,))
def average(x, y):
    return (x.v + y.v) / 2


@sl.monoid(fields=("a", "b", "c", "d"), identity=(1, 0, 0, 1))
def matrix_swapped(x, y):  # entry d uses x.b where the product needs x.d
    return (y.a * x.a + y.b * x.c, y.a * x.b + y.b * x.d, y.c * x.a + y.d * x.c, y.c * x.b + y.d * x.b)


@sl.monoid(fields=("a", "b"), identity=(1, 0))
def affine_cross_term(x, y):
    return y.a * x.a, y.a * x.b + y.b + x.b * y.b


@sl.monoid(fields=("a", "b", "c", "d"), identity=(1, 0, 0, 1), scale=lambda m: m.a * m.d)
def mobius_scale_degree_two(x, y):
    return _matrix(x, y)


@sl.monoid(fields=("a", "b", "c", "d"), identity=(1, 0, 0, 1), scale=lambda m: m.a + m.d + 1)
def mobius_scale_offset(x, y):
    return _matrix(x, y)


@sl.monoid(fields=("v",), identity=(0,))
def subtract(x, y):
    return x.v - y.v


@sl.monoid(fields=("m", "s"), identity=(-INF, 0))
def softmax_forgot_rescale(x, y):
    m = sl.maximum(x.m, y.m)
    return m, x.s * sl.exp(x.m - m) + y.s


@sl.monoid(fields=("n", "mean", "m2"), identity=(0, 0, 0))
def welford_missing_division(x, y):
    n = x.n + y.n
    delta = y.mean - x.mean
    return n, x.mean + delta * y.n / n, x.m2 + y.m2 + delta * delta * x.n * y.n


NOT_ASSOCIATIVE = [average, matrix_swapped, affine_cross_term, mobius_scale_degree_two, mobius_scale_offset,
                   subtract, softmax_forgot_rescale, welford_missing_division]


def _f64(element):
    return tuple(torch.tensor(v, dtype=torch.float64) for v in element)


def _floats(values):
    return tuple(float(v) for v in values)


@pytest.mark.parametrize("m", NOT_ASSOCIATIVE, ids=lambda m: m.name)
def test_refutation_has_a_valid_counterexample(m):
    with pytest.raises(sl.NotAssociativeError) as info:
        verify(m)
    err = info.value
    x, y, z = err.counterexample
    for element in (x, y, z):
        assert isinstance(element, tuple) and len(element) == len(m.fields)
        assert all(type(v) is float for v in element)
    # re-evaluate both groupings independently: the user's own body on float64 tensors (renormalised
    # by scale for projective monoids, as the scan evaluates them)
    c = m.combine_direct
    left = _floats(c(c(_f64(x), _f64(y)), _f64(z)))
    right = _floats(c(_f64(x), c(_f64(y), _f64(z))))
    assert not torch.allclose(torch.tensor(left), torch.tensor(right), rtol=1e-6, atol=0)
    assert left == pytest.approx(err.left, rel=1e-12) and right == pytest.approx(err.right, rel=1e-12)
    text = str(err)
    assert f"'{m.name}' is not associative" in text and "leaves" in text
    assert repr(x[0]) in text and "(x (+) y) (+) z = " in text and "x (+) (y (+) z) = " in text


def test_refutation_prefers_small_exact_values():
    with pytest.raises(sl.NotAssociativeError) as info:
        verify(subtract)
    assert all(v == int(v) and abs(v) <= 3 for e in info.value.counterexample for v in e)
    assert "v: -2*z_v" in str(info.value)  # the leftover (x - y) - z - (x - (y - z)), simplified


def test_non_homogeneous_scale_is_explained():
    with pytest.raises(sl.NotAssociativeError) as info:
        verify(mobius_scale_degree_two)
    assert "not homogeneous of degree 1" in str(info.value)
    assert "renormalised by scale" in str(info.value)


def test_non_homogeneous_combine_is_checked_after_renormalising():
    @sl.monoid(fields=("a", "b"), identity=(1, 0), scale=lambda m: m.a)
    def affine_plus_one(x, y):  # the + 1 breaks homogeneity in x and in y
        return y.a * x.a + 1, y.a * x.b + y.b

    with pytest.raises(sl.NotAssociativeError) as info:
        verify(affine_plus_one)
    assert "combine is not homogeneous" in str(info.value)
    x, y, z = info.value.counterexample
    c = affine_plus_one.combine_direct
    left, right = c(c(_f64(x), _f64(y)), _f64(z)), c(_f64(x), c(_f64(y), _f64(z)))
    assert not torch.allclose(torch.stack(left), torch.stack(right), rtol=1e-6, atol=0)


def test_renormalising_by_a_constant_scale_keeps_the_law():
    @sl.monoid(fields=("a", "b", "c", "d"), identity=(1, 0, 0, 1), scale=lambda m: 1)
    def unit_scale(x, y):
        return _matrix(x, y)

    proof = verify(unit_scale)
    assert proof.symbolic and not proof.up_to_scale
    assert "not homogeneous" in str(proof) and "checked directly" in str(proof)


def test_alarm_interrupts_a_long_sympy_step(monkeypatch):
    def stuck(expr):  # one step that would run far past the budget
        time.sleep(30)

    monkeypatch.setattr(analysis, "rational_simplify", stuck)
    start = time.perf_counter()
    proof = verify(_fresh_affine(), seconds=0.2)
    assert time.perf_counter() - start < 5
    assert proof.associativity.method == "numeric"
    assert "did not decide within the 0.2 s budget" in proof.associativity.how


def test_refutation_shows_the_leftover_even_when_sympy_is_slow(monkeypatch):
    def stuck(expr):
        time.sleep(30)

    monkeypatch.setattr(analysis, "rational_simplify", stuck)
    with pytest.raises(sl.NotAssociativeError) as info:
        verify(average, seconds=0.2)
    assert "not simplified" in str(info.value) and "x_v" in str(info.value)


# ---- identity ---------------------------------------------------------------------------------------

@sl.monoid(fields=("a", "b"), identity=(1, 1))
def affine_wrong_identity(x, y):
    return y.a * x.a, y.a * x.b + y.b


@sl.monoid(fields=("a", "b"), identity=(0, 0))
def maxplus_wrong_identity(x, y):
    return x.a + y.a, sl.maximum(y.a + x.b, y.b)


@sl.monoid(fields=("v",), identity=(0,))
def last_wins(x, y):  # associative; every e is a left identity, none a right identity
    return y.v


@pytest.mark.parametrize("m, side", [(affine_wrong_identity, "left"), (maxplus_wrong_identity, "left"),
                                     (last_wins, "right")], ids=lambda v: getattr(v, "name", v))
def test_identity_error_with_counterexample(m, side):
    with pytest.raises(sl.IdentityError) as info:
        verify(m)
    err = info.value
    assert err.side == side and f"not a {side} identity" in str(err)
    x = err.counterexample
    assert len(x) == len(m.fields) and all(type(v) is float for v in x)
    e = _f64(m.identity)
    got = m.combine_direct(e, _f64(x)) if side == "left" else m.combine_direct(_f64(x), e)
    assert _floats(got) != x


def test_identity_that_only_holds_as_a_limit_is_refused():
    @sl.monoid(fields=("r",), identity=(INF,))
    def parallel_resistors(x, y):  # inf * r / (inf + r) is nan in floating point
        return x.r * y.r / (x.r + y.r)

    with pytest.raises(sl.IdentityError, match="in floating point") as info:
        verify(parallel_resistors)
    x = info.value.counterexample
    got = parallel_resistors.combine_direct(_f64(parallel_resistors.identity), _f64(x))
    assert not torch.isfinite(got[0])


# ---- budget and numeric fallback ----------------------------------------------------------------------

def _fresh_affine():
    @sl.monoid(fields=("a", "b"), identity=(1, 0))
    def affine(x, y):
        return y.a * x.a, y.a * x.b + y.b
    return affine


def test_zero_budget_falls_back_to_numeric_and_says_so():
    proof = verify(_fresh_affine(), seconds=0)
    assert [law.method for law in proof.laws] == ["numeric"] * 3
    first = str(proof).splitlines()[0]
    assert "associative" in first and "numeric, not a proof" in first and "symbolic proof" not in first
    assert "did not decide within the 0 s budget" in str(proof)
    assert "small integers" in str(proof.associativity) and "log-uniform" in str(proof.associativity)
    assert not proof.symbolic


def test_budget_comes_from_settings(monkeypatch):
    monkeypatch.setenv("SCANLANG_PROOF_SECONDS", "0")
    assert verify(_fresh_affine()).associativity.method == "numeric"


def test_numeric_results_are_not_cached():
    m = _fresh_affine()
    assert verify(m, seconds=0).associativity.method == "numeric"
    assert verify(m).associativity.method == "symbolic"


def test_undecided_by_sympy_is_reported_as_numeric(monkeypatch):
    def undecided(lhs, rhs, *args, **kwargs):
        return analysis.Decision(None, "undecided", lhs - rhs)

    monkeypatch.setattr(analysis, "decide_equal", undecided)
    proof = verify(_fresh_affine())
    assert [law.method for law in proof.laws] == ["numeric"] * 3
    assert "sympy did not decide whether" in proof.associativity.how
    assert "no counterexample" in proof.associativity.how


def test_max_of_affine_terms_is_decided_by_linear_programming():
    @sl.monoid(fields=("v",), identity=(-INF,))
    def max_with_midpoint(x, y):  # equals max(x, y); the midpoints are dominated only jointly
        return sl.maximum(sl.maximum(x.v, y.v), (x.v + y.v) / 2)

    proof = verify(max_with_midpoint)
    assert proof.symbolic and "linear programming" in proof.associativity.how


def test_nonnegative_factors_are_pushed_through_max():
    @sl.monoid(fields=("a", "b"), identity=(1, -INF))
    def max_times_squared(x, y):  # h -> max(a^2 h, b) composes associatively since a^2 >= 0
        return x.a * y.a, sl.maximum(y.a * y.a * x.b, y.b)

    proof = verify(max_times_squared)
    assert proof.associativity.symbolic and "max/min normal form" in proof.associativity.how


def test_verify_off_the_main_thread_uses_the_cooperative_deadline():
    results = {}
    thread = threading.Thread(target=lambda: results.update(zero=verify(_fresh_affine(), seconds=0),
                                                            full=verify(library.Welford)))
    thread.start()
    thread.join(60)
    assert results["zero"].associativity.method == "numeric"
    assert results["full"].symbolic


def test_alarm_outside_the_proof_body_never_escapes():
    """An alarm landing in the budget's set-up or clean-up must not raise: a ProofTimeout there
    would skip the clean-up and leave a repeating timer that later kills the process (it did, once,
    at the end of a CI run). Inside the body it ends the attempt; afterwards no timer is left."""
    if not hasattr(signal, "setitimer"):
        pytest.skip("no interval timers on this platform")
    from scanlang import budget
    before = signal.getsignal(signal.SIGALRM)
    with budget._alarm(30) as armed:
        assert armed
        signal.raise_signal(signal.SIGALRM)   # outside the body: ignored
        with pytest.raises(analysis.ProofTimeout):
            budget._run_body(lambda deadline: signal.raise_signal(signal.SIGALRM), None)
        signal.raise_signal(signal.SIGALRM)   # back outside: ignored again
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is before


def test_tiny_budgets_leave_no_timer_behind():
    from scanlang import budget
    before = signal.getsignal(signal.SIGALRM)
    squares = sum(i * i for i in range(20000))
    for seconds in (0, 1e-9, 1e-5, 1e-3):
        out, why = budget.symbolic(lambda deadline: sum(i * i for i in range(20000)), seconds)
        assert (out, why) == (squares, None) or (out is None and "budget" in why)
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        assert signal.getsignal(signal.SIGALRM) is before


def test_bad_budget():
    with pytest.raises(ValueError, match="seconds"):
        verify(_fresh_affine(), seconds=-1)


# ---- cache ----------------------------------------------------------------------------------------------

def test_cache_hit_from_memory_and_disk(tmp_path, monkeypatch):
    m = _fresh_affine()
    first = verify(m)
    assert first.symbolic and not any(law.cached for law in first.laws)
    files = list((tmp_path / "cache" / "proofs").glob("*.json"))
    assert len(files) == 1 and m.key in files[0].name
    data = json.loads(files[0].read_text())
    assert set(data["laws"]) == {"associativity", "left identity", "right identity"}

    def no_sympy(*args, **kwargs):
        raise AssertionError("a cached proof must not be re-derived")

    monkeypatch.setattr(analysis, "equal_tuples", no_sympy)
    again = verify(_fresh_affine())  # a new object with the same content hash: memory hit
    assert again.symbolic and all(law.cached for law in again.laws)
    clear_memory_cache()
    from_disk = verify(_fresh_affine())
    assert from_disk.symbolic and all(law.cached for law in from_disk.laws)
    assert "cached" in str(from_disk.associativity)


def test_unwritable_cache_dir_is_tolerated(tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    monkeypatch.setenv("SCANLANG_CACHE_DIR", str(blocker))
    assert verify(_fresh_affine()).symbolic


def test_corrupt_cache_file_is_ignored(tmp_path):
    m = _fresh_affine()
    verify(m)
    (path,) = (tmp_path / "cache" / "proofs").glob("*.json")
    path.write_text("{not json")
    clear_memory_cache()
    proof = verify(m)
    assert proof.symbolic and not proof.associativity.cached


# ---- what later stages need -----------------------------------------------------------------------------

def test_affine_commutativity_sparsity_and_jacobians():
    proof = verify(library.Affine)
    assert proof.commutative is False
    sp = proof.sparsity
    assert sp.x == {"a": ("a",), "b": ("b",)} and sp.y == {"a": ("a",), "b": ("a", "b")}
    assert sp.mask("y") == ((True, False), (True, True))
    xa, xb = library.Affine.x_symbols
    ya, yb = library.Affine.y_symbols
    assert proof.jacobian_x == sympy.Matrix([[ya, 0], [0, ya]])
    assert proof.jacobian_y == sympy.Matrix([[xa, 0], [xb, 1]])
    # available without a proof
    assert analysis.sparsity(library.Affine).y == sp.y
    assert analysis.commutative(library.Affine) is False


def test_commutativity_decided_numerically_when_sympy_has_no_time():
    assert commutativity(_fresh_affine(), seconds=0) is False
    assert commutativity(library.Add, seconds=0) is None
    assert commutativity(library.ComplexMul) is True


def test_projective_jacobians_are_of_the_renormalised_combine():
    m = library.Mobius
    raw = analysis.sparsity(m, renormalised=False)
    assert raw.x["a"] == ("a", "c") and raw.y["a"] == ("a", "b")
    full = analysis.sparsity(m)
    assert all(full.x[f] == m.fields for f in m.fields)
    jx, _ = analysis.jacobians(m)
    point = dict(zip(m.x_symbols + m.y_symbols, [2, 1, 1, 3, 1, 2, 0, 1]))
    eps = sympy.Rational(1, 10**8)
    out = analysis.renormalised_exprs(m)
    for j, s in enumerate(m.x_symbols):
        bumped = {k: (v + eps if k == s else v) for k, v in point.items()}
        for i in range(4):
            fd = (out[i].subs(bumped) - out[i].subs(point)) / eps
            assert abs(float(fd - jx[i, j].subs(point))) < 1e-6


def test_lattice_normal_form_pushes_sums_and_scalings_through_max():
    x, y, z = (sympy.Symbol(n, real=True, finite=True) for n in "xyz")
    lhs = 2 * (z + sympy.Max(x, y)) - sympy.Min(x, -y)
    rhs = sympy.Max(2 * z + 2 * x - x, 2 * z + 2 * x + y, 2 * z + 2 * y - x, 2 * z + 3 * y)
    assert analysis.decide_equal(lhs, rhs).equal is True
    assert analysis.decide_equal(sympy.Max(x, y) + 1, sympy.Max(x, y + 1), use_simplify=False).equal is False
    assert analysis.decide_equal(sympy.Min(x, y, (x + y) / 2), sympy.Min(x, y)).equal is True
    assert analysis.decide_equal(sympy.Max(x, y, (x + y) / 2 + 1), sympy.Max(x, y)).equal is False


def test_monoid_docstring_example_runs():
    module = importlib.import_module("scanlang.monoid")  # `scanlang.monoid` is the decorator
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
