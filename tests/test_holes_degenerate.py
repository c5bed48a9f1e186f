"""Issue 18, class 3: a projective `scale` that is zero at the identity (or identically zero, or
undefined there) is refused by name, never proved and scanned into inf."""
import pytest
import torch

import scanlang as sl
from scanlang.verify import clear_memory_cache, verify


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SCANLANG_CACHE_DIR", str(tmp_path / "cache"))
    clear_memory_cache()


def _mobius(scale, name):
    @sl.monoid(fields=("a", "b", "c", "d"), identity=(1, 0, 0, 1), scale=scale, name=name)
    def mobius(x, y):
        return (y.a * x.a + y.b * x.c, y.a * x.b + y.b * x.d, y.c * x.a + y.d * x.c, y.c * x.b + y.d * x.d)
    return mobius


ZERO_AT_IDENTITY = {
    "trace_difference": lambda m: m.a - m.d,          # homogeneous of degree 1, but 0 at the unit matrix
    "off_diagonal": lambda m: m.b,
    "determinant_minus_one": lambda m: m.a * m.d - m.b * m.c - 1,
    "identically_zero": lambda m: (m.a + m.d) * (m.a + m.d) - m.a * m.a - 2 * m.a * m.d - m.d * m.d,
    "constant_zero": lambda m: 0 * m.a,
}


@pytest.mark.parametrize("name", sorted(ZERO_AT_IDENTITY))
def test_scale_zero_at_the_identity_is_refused_naming_scale(name):
    m = _mobius(ZERO_AT_IDENTITY[name], name)
    with pytest.raises(ValueError, match="scale") as info:
        verify(m)
    assert isinstance(info.value, sl.IdentityError)
    assert "scale(e) = 0" in str(info.value)
    with pytest.raises(ValueError, match="scale"):
        sl.scan(m, tuple(torch.rand(1, 3) + 0.5 for _ in range(4)), dim=1, backend="reference")


def test_scale_undefined_at_an_infinite_identity_is_refused():
    @sl.monoid(fields=("m", "s"), identity=(float("-inf"), 0), scale=lambda e: e.s + e.m)
    def softmax_like(x, y):
        return sl.maximum(x.m, y.m), x.s + y.s

    with pytest.raises(sl.IdentityError, match="scale"):
        verify(softmax_like)


def test_identically_zero_scale_is_refused_even_with_an_identity_it_does_not_vanish_at(monkeypatch):
    """The identity check runs first; with it out of the way the identically-zero check names scale too."""
    import importlib
    verify_module = importlib.import_module("scanlang.verify")
    monkeypatch.setattr(verify_module, "_exact_nonzero", lambda d: True)
    m = _mobius(ZERO_AT_IDENTITY["identically_zero"], "identically_zero_again")
    with pytest.raises(ValueError, match="identically zero"):
        verify(m)


def test_usable_scales_are_still_proved():
    for scale, name in ((lambda m: m.a + m.d, "trace"), (lambda m: m.a + m.b + m.c + m.d, "entry_sum")):
        assert verify(_mobius(scale, name)).symbolic
    assert verify(sl.Mobius).symbolic
