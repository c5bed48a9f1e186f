"""Class 8 of issue 18 (the layers' rough edges): T = 0, plain-tuple states, state dtypes.

Both layers treat an empty chunk of tokens as the op does (an empty output, the state unchanged),
accept their state as a plain tuple, and refuse a state of another dtype with a TypeError naming
`state.<field>`. Continuing after an empty call reproduces one pass over the whole sequence.
"""
import pytest
import torch

from scanlang.recipes.kaczmarz import KaczmarzLinearAttention
from scanlang.recipes.kalman import KalmanLinearAttention


def layers():
    torch.manual_seed(1)
    return [(KalmanLinearAttention(8, d_state=4), 8, "state.lam"),
            (KaczmarzLinearAttention(32, 2), 32, "state.recurrent")]


@pytest.mark.parametrize("index", [0, 1])
def test_empty_input_returns_empty_output_and_the_unchanged_state(index):
    layer, d, _ = layers()[index]
    x = torch.randn(2, 5, d)
    empty, fresh = layer(x[:, :0], return_state=True)
    assert empty.shape == (2, 0, d)
    assert layer(x[:, :0]).shape == (2, 0, d)
    y1, st = layer(x[:, :3], return_state=True)
    y0, st0 = layer(x[:, 3:3], state=st, return_state=True)
    assert y0.shape == (2, 0, d) and all(torch.equal(a, b) for a, b in zip(st, st0))
    y2 = layer(x[:, 3:], state=st0)
    full = layer(x)
    assert torch.allclose(torch.cat([y1, y2], 1), full, atol=1e-5)
    # the state of an empty first call is the state before any token
    y_from_fresh = layer(x, state=fresh)
    assert torch.allclose(y_from_fresh, full, atol=1e-5)


@pytest.mark.parametrize("index", [0, 1])
def test_plain_tuple_state_is_accepted(index):
    layer, d, _ = layers()[index]
    x = torch.randn(2, 6, d)
    y1, st = layer(x[:, :4], return_state=True)
    assert torch.equal(layer(x[:, 4:], state=tuple(st)), layer(x[:, 4:], state=st))


@pytest.mark.parametrize("index", [0, 1])
def test_state_of_another_dtype_is_refused_by_name(index):
    layer, d, field = layers()[index]
    x = torch.randn(1, 4, d)
    _, st = layer(x, return_state=True)
    wide = st._replace(**{field.split(".")[1]: getattr(st, field.split(".")[1]).double()})
    with pytest.raises(TypeError, match=field.replace(".", r"\.")):
        layer(x, state=wide)
