"""Class 6 of issue 18: values outside the documented domain are refused by name, not turned into NaN.

Checks that cost no GPU synchronisation run on CPU tensors (and on any device with validate=True);
valid edge values (a hard reset g = -inf, huge precisions) still run and equal a float64 loop.
"""
import pytest
import torch

from scanlang.recipes.kaczmarz import delta_rule, kaczmarz_delta_rule
from scanlang.recipes.kalman import kalman_filter
from scanlang.recipes.kalman.reference import kalman_filter_loop
from scanlang.testing import assert_close, ratio, tolerance

INF, NAN = float("inf"), float("nan")
BACKENDS = ["reference", "triton"]


def kalman_inputs():
    B, T, M, S = 1, 5, 2, 2
    return dict(v=torch.randn(B, T, M), prec=torch.rand(B, T, M) + 0.5, k=torch.randn(B, T, S),
                q=torch.randn(B, T, S), a_bar=torch.rand(M, S) * 0.5 + 0.4, p_bar=torch.rand(M, S) * 0.2 + 0.05)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, value, match", [
    ("prec", INF, "prec: .*finite"), ("prec", -1.0, "prec: "), ("prec", NAN, "prec: "),
    ("p_bar", INF, "p_bar: .*finite"), ("p_bar", 0.0, "p_bar: "), ("a_bar", 1.5, "a_bar: "), ("a_bar", NAN, "a_bar: "),
    ("lam0", INF, "initial_state lam"), ("lam0", 0.0, "initial_state lam"), ("eta0", NAN, "initial_state eta")])
def test_kalman_filter_refuses_values_outside_its_domain(backend, name, value, match):
    ins = kalman_inputs()
    lam0, eta0 = torch.ones(1, 2, 2), torch.zeros(1, 2, 2)
    if name == "lam0":
        lam0[0, 1, 0] = value
    elif name == "eta0":
        eta0[0, 0, 1] = value
    else:
        ins[name].view(-1)[1] = value
    with pytest.raises(ValueError, match=match):
        kalman_filter(**ins, initial_state=(lam0, eta0), backend=backend)


def test_kalman_filter_validate_flag():
    ins = kalman_inputs()
    ins["prec"][0, 2, 1] = INF
    with pytest.raises(ValueError, match="prec"):
        kalman_filter(**ins, validate=True)
    y, _, _ = kalman_filter(**ins, validate=False, backend="reference")   # documented: unchecked, not refused
    assert y.shape == ins["v"].shape
    ins["prec"][0, 2, 1] = 1e30                                             # huge but finite: valid
    y, y_var, _ = kalman_filter(**ins, backend="reference")
    want, want_var, _ = kalman_filter_loop(**ins)
    assert_close(y, want, "kalman_out")
    assert_close(y_var, want_var, "kalman_out")


def delta_inputs(T=9, H=2, K=4, V=3):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    return q, k, torch.randn(1, T, H, V, generator=gen), -torch.rand(1, T, H, generator=gen) * 0.3, \
        torch.rand(1, T, H, generator=gen)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [0.5, 1e-3, NAN, INF])
@pytest.mark.parametrize("op", [delta_rule, kaczmarz_delta_rule])
def test_delta_rule_refuses_growing_or_nan_decays(backend, value, op):
    q, k, v, g, beta = delta_inputs()
    g[0, 4, 1] = value
    with pytest.raises(ValueError, match=r"g: log-decays must be <= 0"):
        op(q, k, v, g, beta, backend=backend)


def test_delta_rule_accepts_a_hard_reset():
    """g = -inf is in the domain (exp(g) = 0 forgets the state): equal to the float64 loop."""
    q, k, v, g, beta = (t.double() for t in delta_inputs())
    g[0, 3, 0] = -INF
    o, S = delta_rule(q, k, v, g, beta, backend="reference", chunk_size=16, output_final_state=True)
    Sl = torch.zeros(2, 4, 3, dtype=torch.float64)
    want = []
    for t in range(q.shape[1]):
        Sl = torch.exp(g[0, t])[:, None, None] * Sl
        e = v[0, t] - torch.einsum("hkv,hk->hv", Sl, k[0, t])
        Sl = Sl + beta[0, t][:, None, None] * k[0, t][:, :, None] * e[:, None, :]
        want.append(0.5 * torch.einsum("hkv,hk->hv", Sl, q[0, t]))
    want = torch.stack(want)[None]
    assert torch.isfinite(o).all()
    assert ratio(o, want) <= 1e-12 and ratio(S[0], Sl) <= 1e-12
