"""Class 9 of issue 18: packed offsets (`cu_seqlens`) are checked before any kernel trusts them.

One helper (`scanlang._checks.check_cu_seqlens`) checks them for the mixers and the delta-rule ops:
offsets ending before or past T, not starting at 0, or decreasing are a ValueError naming
`cu_seqlens`; valid ones give what a float64 loop per sequence gives.
"""
import pytest
import torch

import scanlang as sl
from scanlang._checks import check_cu_seqlens
from scanlang.recipes.kaczmarz import delta_rule
from scanlang.testing import assert_close

BAD = [([0, 4, 7], "ends before T"), ([0, 4, 12], "runs past T"), ([0, 5, 3, 9], "decreasing"),
       ([1, 9], "not from 0"), ([0], "one offset")]


def ema_mixer():
    return sl.mixer(sl.Affine, axes="b t d", inputs={"a": "b t d", "x": "b t d"},
                    lift=lambda u: (u.a, u.x), readout=lambda p, u, q: p.b, outputs=("h",))


@pytest.mark.parametrize("cu, why", BAD)
def test_mixer_refuses_bad_offsets(cu, why):
    a, x = torch.rand(1, 9, 3), torch.randn(1, 9, 3)
    with pytest.raises(ValueError, match="cu_seqlens"):
        ema_mixer()(a=a, x=x, cu_seqlens=torch.tensor(cu))


@pytest.mark.parametrize("cu, why", BAD)
def test_delta_rule_refuses_bad_offsets_with_the_same_check(cu, why):
    q = torch.randn(1, 9, 1, 4)
    with pytest.raises(ValueError, match="cu_seqlens") as err:
        delta_rule(q, q, torch.randn(1, 9, 1, 3), -torch.rand(1, 9, 1), torch.rand(1, 9, 1),
                   cu_seqlens=torch.tensor(cu), backend="reference")
    with pytest.raises(ValueError) as same:
        check_cu_seqlens(torch.tensor(cu), 9)
    assert str(err.value) == str(same.value)


def test_offset_types_are_checked():
    with pytest.raises(TypeError, match="cu_seqlens: expected int32 or int64"):
        check_cu_seqlens(torch.tensor([0.0, 9.0]), 9)
    with pytest.raises(TypeError, match="cu_seqlens"):
        check_cu_seqlens([0, 9], 9)
    with pytest.raises(ValueError, match="cu_seqlens: expected a 1-d"):
        check_cu_seqlens(torch.tensor([[0, 9]]), 9)
    assert check_cu_seqlens(torch.tensor([0, 0, 4, 9], dtype=torch.int32), 9) == (0, 0, 4, 9)


def test_valid_offsets_equal_a_loop_per_sequence():
    cu = [0, 3, 3, 8, 9]                          # an empty sequence and a one-token one
    a, x = torch.rand(1, 9, 2, dtype=torch.float64) + 0.2, torch.randn(1, 9, 2, dtype=torch.float64)
    h = ema_mixer()(a=a, x=x, cu_seqlens=torch.tensor(cu)).h
    want = torch.zeros_like(x)
    for s, e in zip(cu, cu[1:]):
        state = torch.zeros(2, dtype=torch.float64)
        for t in range(s, e):
            state = a[0, t] * state + x[0, t]
            want[0, t] = state
    assert_close(h, want, "scan")
