"""Every library monoid is proved, and computes the recurrence its docstring states (float64 fold)."""
import math

import pytest
import torch

import scanlang as sl
from scanlang import library as L
from scanlang.verify import clear_memory_cache, verify

# All library monoids are proved symbolically (none needs the numeric fallback).
SYMBOLIC = {m.name for m in L.LIBRARY}
COMMUTATIVE = {"Affine": False, "Mobius": False, "Matrix2": False, "MaxPlus": False, "MinPlus": False,
               "ComplexMul": True, "LogAffine": False, "LogSumExp": True, "OnlineSoftmax": True, "Welford": True, "Add": True, "Max": True}


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SCANLANG_CACHE_DIR", str(tmp_path))
    clear_memory_cache()


@pytest.mark.parametrize("m", L.LIBRARY, ids=lambda m: m.name)
def test_library_monoid_is_proved(m):
    proof = verify(m)
    assert proof.symbolic == (m.name in SYMBOLIC)
    assert all(law.method == "symbolic" for law in proof.laws)
    first = str(proof).splitlines()[0]
    assert first.startswith(f"{m.name}: associative") and "symbolic proof over the reals" in first
    if m.is_projective:
        assert proof.up_to_scale and "up to scale" in first
    assert proof.commutative is COMMUTATIVE[m.name]


# 0 / 0; the log-space monoids (OnlineSoftmax, LogAffine, LogSumExp) floor their stabilising maxima,
# so combine(e, e) = e there (no exp(-inf - (-inf)))
PADS_UNSAFELY = {"Welford"}


@pytest.mark.parametrize("m", L.LIBRARY, ids=lambda m: m.name)
def test_identity_padding_safety_is_reported(m):
    proof = verify(m)
    assert proof.identity_pads_safely == (m.name not in PADS_UNSAFELY)
    e = tuple(torch.tensor([v], dtype=torch.float64) for v in m.identity)
    ee = m.combine_direct(e, e, renormalise=False)
    same = all(torch.equal(a, b) for a, b in zip(ee, e)) if not m.is_projective else \
        bool(torch.isfinite(torch.stack(ee)).all())  # Mobius: e @ e = e
    assert same == proof.identity_pads_safely


def test_every_library_monoid_is_in_the_table():
    assert set(COMMUTATIVE) == {m.name for m in L.LIBRARY}


def _fold(m, elems):
    """Inclusive prefixes e_1 (+) ... (+) e_t, a plain loop of the user's body on float64 tensors."""
    acc = tuple(e[0] for e in elems)
    out = [acc]
    for t in range(1, elems[0].shape[0]):
        acc = m.combine_direct(acc, tuple(e[t] for e in elems))
        out.append(acc)
    return [torch.stack([o[i] for o in out]) for i in range(len(elems))]


def _nonzero(*shape):
    x = torch.randn(*shape, dtype=torch.float64)
    return x + torch.sign(x) * 0.1


T = 7


def test_affine_computes_linear_recurrence():
    a, b = torch.rand(T, dtype=torch.float64) + 0.5, _nonzero(T)
    _, h = _fold(L.Affine, (a, b))
    ref, prev = [], 0.0
    for t in range(T):
        prev = a[t] * prev + b[t]
        ref.append(prev)
    torch.testing.assert_close(h, torch.stack(ref), rtol=1e-12, atol=0)


@pytest.mark.parametrize("m, op, ident", [(L.MaxPlus, torch.maximum, -math.inf), (L.MinPlus, torch.minimum, math.inf)])
def test_tropical_maps_compute_their_recurrence(m, op, ident):
    a, b = _nonzero(T), _nonzero(T)
    _, h = _fold(m, (a, b))
    ref, prev = [], torch.tensor(ident, dtype=torch.float64)
    for t in range(T):
        prev = op(a[t] + prev, b[t])
        ref.append(prev)
    torch.testing.assert_close(h, torch.stack(ref), rtol=1e-12, atol=0)


def test_log_affine_is_the_affine_recurrence_in_log_space():
    a, b = torch.rand(T, dtype=torch.float64) + 0.5, torch.rand(T, dtype=torch.float64) + 0.1
    _, lh = _fold(L.LogAffine, (torch.log(a), torch.log(b)))
    ref, prev = [], 0.0
    for t in range(T):
        prev = a[t] * prev + b[t]
        ref.append(prev)
    torch.testing.assert_close(torch.exp(lh), torch.stack(ref), rtol=1e-12, atol=0)


def test_log_affine_does_not_overflow():
    la = torch.full((T,), 300.0, dtype=torch.float64)  # a = e^300: the plain product overflows
    lb = torch.full((T,), 600.0, dtype=torch.float64)
    _, lh = _fold(L.LogAffine, (la, lb))
    # h_t = e^300 h_{t-1} + e^600 from h_0 = 0 gives log h_t = 300 (t + 1) + log(1 + e^-300 + ...)
    torch.testing.assert_close(lh, 300.0 * torch.arange(2, T + 2, dtype=torch.float64), rtol=1e-15, atol=0)


def test_complex_mul_is_the_running_complex_product():
    re, im = _nonzero(T), _nonzero(T)
    pre, pim = _fold(L.ComplexMul, (re, im))
    ref = torch.cumprod(torch.complex(re, im), dim=0)
    torch.testing.assert_close(torch.complex(pre, pim), ref, rtol=1e-12, atol=0)


@pytest.mark.parametrize("m", [L.Matrix2, L.Mobius], ids=lambda m: m.name)
def test_matrix_monoids_hold_the_product_later_on_the_left(m):
    mats = _nonzero(T, 2, 2) + 2 * torch.eye(2, dtype=torch.float64)
    elems = (mats[:, 0, 0], mats[:, 0, 1], mats[:, 1, 0], mats[:, 1, 1])
    out = torch.stack(_fold(m, elems), dim=-1).reshape(T, 2, 2)
    prod = torch.eye(2, dtype=torch.float64)
    for t in range(T):
        prod = mats[t] @ prod
        got = out[t] if t == 0 or not m.is_projective else out[t] * torch.trace(prod)
        torch.testing.assert_close(got, prod, rtol=1e-12, atol=1e-12)


def test_online_softmax_gives_running_max_and_normaliser():
    v = 3 * _nonzero(T)
    m, s = _fold(L.OnlineSoftmax, (v, torch.ones(T, dtype=torch.float64)))
    for t in range(T):
        mt = v[: t + 1].max()
        torch.testing.assert_close(m[t], mt, rtol=0, atol=0)
        torch.testing.assert_close(s[t], torch.exp(v[: t + 1] - mt).sum(), rtol=1e-12, atol=0)
        torch.testing.assert_close(m[t] + torch.log(s[t]), torch.logsumexp(v[: t + 1], 0), rtol=1e-12, atol=0)


def test_welford_gives_running_mean_and_variance():
    v = _nonzero(T)
    n, mean, m2 = _fold(L.Welford, (torch.ones(T, dtype=torch.float64), v, torch.zeros(T, dtype=torch.float64)))
    for t in range(T):
        torch.testing.assert_close(mean[t], v[: t + 1].mean(), rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(m2[t] / n[t], v[: t + 1].var(unbiased=False), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("m, ref", [(L.Add, lambda v: torch.cumsum(v, 0)),
                                    (L.LogSumExp, lambda v: torch.logcumsumexp(v, 0)),
                                    (L.Max, lambda v: torch.cummax(v, 0).values)], ids=["Add", "LogSumExp", "Max"])
def test_single_field_monoids(m, ref):
    v = _nonzero(T)
    (out,) = _fold(m, (v,))
    torch.testing.assert_close(out, ref(v), rtol=1e-12, atol=0)


@pytest.mark.parametrize("m", [m for m in L.LIBRARY if not m.is_projective], ids=lambda m: m.name)
def test_identity_is_neutral_on_tensors(m):
    x = tuple(_nonzero(5).abs() if m.name == "Welford" else _nonzero(5) for _ in m.fields)
    e = tuple(torch.full((5,), v, dtype=torch.float64) for v in m.identity)
    for got in (m.combine_direct(e, x), m.combine_direct(x, e)):
        for g, want in zip(got, x):
            torch.testing.assert_close(g, want, rtol=1e-12, atol=0)


def test_library_names_are_the_declared_names():
    for m in L.LIBRARY:
        assert getattr(L, m.name) is m
    assert sl.Affine is L.Affine and sl.Mobius is L.Mobius
