"""Issue 18, class 1: a law sympy decides false is refused, with a counterexample built from its
witness (or the leftover when none shows in float64), never reported as "numeric, not a proof"."""
import math

import pytest
import sympy
import torch

import scanlang as sl
from scanlang import analysis
from scanlang.verify import clear_memory_cache, verify

INF = math.inf


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SCANLANG_CACHE_DIR", str(tmp_path / "cache"))
    clear_memory_cache()


def _f64(values):
    return tuple(torch.tensor([float(v)], dtype=torch.float64) for v in values)


def _relative_gap(a, b) -> float:
    a = torch.cat([v.reshape(1) for v in a])
    b = torch.cat([v.reshape(1) for v in b])
    return float(((a - b).abs() / torch.maximum(a.abs(), b.abs()).clamp_min(1e-300)).max())


def _assert_groupings_differ(m, err):
    x, y, z = (_f64(e) for e in err.counterexample)
    left = m.combine_direct(m.combine_direct(x, y), z)
    right = m.combine_direct(x, m.combine_direct(y, z))
    assert _relative_gap(left, right) > 1e-6, str(err)


def _clamped_sum(bound):
    @sl.monoid(fields=("s",), identity=(0,), name=f"clamped_sum_{bound:g}")
    def clamped(x, y):  # only differs once a sum passes the bound: the random search never gets there
        return (sl.minimum(x.s + y.s, bound),)
    return clamped


@pytest.mark.parametrize("bound", [1e6, 1e9, 3e4 * 1e3])
def test_clamp_beyond_the_sampled_range_is_refused_with_a_counterexample(bound):
    m = _clamped_sum(bound)
    with pytest.raises(sl.NotAssociativeError) as info:
        verify(m)
    err = info.value
    assert "sympy decided" in str(err) and "did not decide" not in str(err)
    _assert_groupings_differ(m, err)


def test_floor_on_a_saturating_affine_map_is_refused():
    @sl.monoid(fields=("a", "b"), identity=(1, 0))
    def saturating(x, y):  # h -> max(a h + b, -1e7) does not compose into this form
        return y.a * x.a, sl.maximum(y.a * x.b + y.b, -1e7)

    with pytest.raises(sl.NotAssociativeError) as info:   # sympy cannot decide it: the witness search finds it
        verify(saturating)
    _assert_groupings_differ(saturating, info.value)


def test_tiny_cross_term_shows_at_large_magnitudes():
    @sl.monoid(fields=("s",), identity=(0,))
    def almost_sum(x, y):  # 1e-20 x^2 y: invisible below |v| = 1e3 in float64
        return (x.s + y.s + 1e-20 * x.s * x.s * y.s,)

    with pytest.raises(sl.NotAssociativeError) as info:
        verify(almost_sum)
    err = info.value
    assert "did not decide" not in str(err)
    _assert_groupings_differ(almost_sum, err)


def test_identity_decided_false_is_refused():
    @sl.monoid(fields=("s",), identity=(-INF,))
    def floored_sum(x, y):  # associative (a max); -inf is no identity below the floor -1e6
        return (sl.maximum(sl.maximum(x.s, y.s), -1e6),)

    with pytest.raises(sl.IdentityError) as info:
        verify(floored_sum)
    err = info.value
    assert "sympy decided" in str(err)
    (x,) = _f64(err.counterexample)
    got = floored_sum.combine_direct(_f64(floored_sum.identity), (x,)) if err.side == "left" else \
        floored_sum.combine_direct((x,), _f64(floored_sum.identity))
    assert float(got[0]) != float(x)


def test_clamped_max_identity_is_refused_on_both_kinds_of_bound():
    @sl.monoid(fields=("m",), identity=(-INF,))
    def capped_max(x, y):  # max is associative; -inf is not an identity once the cap 1e8 binds
        return (sl.minimum(sl.maximum(x.m, y.m), 1e8),)

    with pytest.raises(sl.IdentityError) as info:
        verify(capped_max)
    (x,) = info.value.counterexample
    assert x > 1e8


def test_projective_identity_without_homogeneity_is_checked_after_renormalising():
    @sl.monoid(fields=("a",), identity=(1,), scale=lambda m: 1 + 0 * m.a)
    def doubled_product(x, y):  # associative; e = 1 is an identity only up to scale: e (+) x = 2x
        return (2 * x.a * y.a,)

    with pytest.raises(sl.IdentityError) as info:
        verify(doubled_product)
    err = info.value
    assert "renormalis" in str(err)
    (x,) = err.counterexample
    assert doubled_product.combine_direct(_f64((1.0,)), _f64((x,)))[0].item() == pytest.approx(2 * x)


def test_refusal_without_a_float64_witness_still_refuses_with_the_leftover(monkeypatch):
    import importlib
    verify_module = importlib.import_module("scanlang.verify")
    monkeypatch.setattr(verify_module.W, "candidates", lambda exprs, symbols, rng: [])

    m = _clamped_sum(1e6)
    with pytest.raises(sl.NotAssociativeError) as info:
        verify(m)
    err = info.value
    assert err.counterexample is None
    assert "no numeric counterexample" in str(err) and "Min(" in str(err) and "sympy decided" in str(err)


def test_a_refused_monoid_is_never_scanned():
    m = _clamped_sum(1e6)
    with pytest.raises(sl.NotAssociativeError):
        sl.scan(m, (torch.ones(1, 3),), dim=1, backend="reference")


def test_lp_decisions_check_their_solution():
    """sympy 1.14's matrix linprog returned an infeasible point for max(x, -1e6) == x ("proved")."""
    x = sympy.Symbol("x_s", real=True, finite=True)
    assert analysis.decide_equal(sympy.Max(x, -10**6), x).equal is False
    assert analysis.decide_equal(sympy.Min(x, 10**6), x).equal is False
    y = sympy.Symbol("y_s", real=True, finite=True)
    assert analysis.decide_equal(sympy.Max(x, y, (x + y) / 2), sympy.Max(x, y)).equal is True
    assert analysis.decide_equal(sympy.Max(x, y) + 1, sympy.Max(x + 1, y + 1)).equal is True
