"""KalmanLinearAttention (recipes/kalman/layer.py) on CPU: wiring against a float64 composition
written here from the spec with the loop oracle, state carry down to one token, gradients, errors."""
import math

import pytest
import torch
import torch.nn.functional as F

from scanlang.recipes.kalman import KalmanLayerState, KalmanLinearAttention
from scanlang.recipes.kalman.reference import kalman_filter_loop
from scanlang.testing import assert_close

F64 = torch.float64


def spec_block(layer, x):
    """The block of docs/spec/kalman.md spelled out with plain torch ops and the float64 filter loop."""
    M, S, K = layer.d_inner, layer.d_state, layer.d_conv
    z, gate = (x @ layer.in_proj.weight.T).chunk(2, dim=-1)
    padded = F.pad(z, (0, 0, K - 1, 0))                               # causal: K-1 zeros in front
    conv = sum(padded[:, j:j + z.shape[1]] * layer.conv.weight[:, 0, j] for j in range(K)) + layer.conv.bias
    z = conv * torch.sigmoid(conv)
    proj = z @ layer.sensor_proj.weight.T
    if layer.sensor == "plain":
        v, log_var, k, q = proj[..., :M], proj[..., M:2 * M], proj[..., 2 * M:2 * M + S], proj[..., 2 * M + S:]
    else:
        r = layer.var_rank
        v, k, q = z, proj[..., r:r + S], proj[..., r + S:]
        log_var = proj[..., :r] @ layer.var_expand.weight.T
    k, q = k / k.norm(dim=-1, keepdim=True), q / q.norm(dim=-1, keepdim=True)
    prec = 1 / (torch.log1p(torch.exp(log_var)) + 1e-4)
    a = -torch.exp(layer.a_log)
    delta = torch.log1p(torch.exp(layer.delta_raw))
    a_bar = torch.exp(delta * a)
    p_bar = torch.exp(layer.p_log) / (2 * a.abs()) * (1 - torch.exp(-2 * a.abs() * delta))
    y, _, _ = kalman_filter_loop(v, prec, k, q, a_bar, p_bar)
    y = (y + layer.D * z) * (gate * torch.sigmoid(gate))
    return y @ layer.out_proj.weight.T


@pytest.mark.parametrize("sensor", ["plain", "mamba"])
def test_layer_matches_the_spec_block_in_float64(sensor):
    layer = KalmanLinearAttention(d_model=12, d_state=4, expand=2, d_conv=4, sensor=sensor).double()
    x = torch.randn(2, 19, 12, dtype=F64)
    out = layer(x)
    assert out.shape == x.shape and out.dtype == F64
    with torch.no_grad():
        ref = spec_block(layer, x)
    assert_close(out, ref, "kalman_out", F64)


def test_initialisation_follows_the_spec():
    layer = KalmanLinearAttention(d_model=16, d_state=8, dt_min=1e-3, dt_max=1e-1)
    assert torch.equal(-torch.exp(layer.a_log), torch.full((32, 8), -1.0))
    delta = F.softplus(layer.delta_raw)
    assert delta.min() >= 1e-3 * (1 - 1e-5) and delta.max() <= 1e-1 * (1 + 1e-5)
    assert torch.equal(layer.D, torch.full((32,), -1.0))
    a_bar, p_bar = layer.dynamics()
    assert ((a_bar > 0) & (a_bar < 1)).all() and (p_bar > 0).all()
    # OU noise is below the Euler step p*delta and approaches it for small delta
    euler = torch.exp(layer.p_log) * delta
    assert (p_bar <= euler).all() and torch.allclose(p_bar, euler, rtol=0.25)
    assert layer.sensor_proj.weight.shape == (2 * 32 + 16, 32)
    mamba = KalmanLinearAttention(d_model=16, d_state=8, sensor="mamba")
    assert mamba.var_rank == math.ceil(16 / 8) and mamba.sensor_proj.weight.shape == (2 + 16, 32)


@pytest.mark.parametrize("sensor", ["plain", "mamba"])
@pytest.mark.parametrize("cuts", [[5, 6, 7, 20], list(range(1, 21))], ids=["chunks", "one_token"])
def test_state_carry_reproduces_the_full_pass(sensor, cuts):
    """Split the sequence into calls (down to one token at a time): same output, same final state."""
    layer = KalmanLinearAttention(d_model=8, d_state=4, sensor=sensor).double()
    x = torch.randn(2, 20, 8, dtype=F64)
    full, full_state = layer(x, return_state=True)
    outs, state, start = [], None, 0
    for end in cuts:
        out, state = layer(x[:, start:end], state=state, return_state=True)
        outs.append(out)
        start = end
    assert isinstance(state, KalmanLayerState)
    assert_close(torch.cat(outs, 1), full, "kalman_out", F64)
    for got, ref, name in zip(state, full_state, ("conv", "lam", "eta")):
        assert_close(got, ref, "kalman_out", F64, name=name)


def test_float32_decode_and_state_dtype():
    layer = KalmanLinearAttention(d_model=8, d_state=4)
    x = torch.randn(1, 9, 8)
    full = layer(x)
    state, outs = None, []
    for t in range(9):
        out, state = layer(x[:, t:t + 1], state=state, return_state=True)
        outs.append(out)
    assert state.lam.dtype == state.eta.dtype == torch.float32
    assert_close(torch.cat(outs, 1), full, "kalman_out", torch.float32)


def test_bfloat16_layer_scans_in_float32():
    """bf16 parameters and activations, the scan in float32: values against the same layer (the same
    bf16-rounded parameters) in float64 on the same inputs; the error is bf16's rounding of the projections
    and output, the ("kalman_out", bfloat16) row."""
    layer = KalmanLinearAttention(d_model=8, d_state=4).to(torch.bfloat16)
    x = torch.randn(2, 7, 8, dtype=torch.bfloat16)
    out, state = layer(x, return_state=True)
    assert out.dtype == torch.bfloat16 and state.lam.dtype == torch.float32
    ref = KalmanLinearAttention(d_model=8, d_state=4).double()
    ref.load_state_dict({n: p.double() for n, p in layer.state_dict().items()})
    want, want_state = ref(x.double(), return_state=True)
    assert_close(out, want, "kalman_out", torch.bfloat16)
    assert_close(state.lam, want_state.lam, "kalman_out", torch.bfloat16, name="lam")
    assert_close(state.eta, want_state.eta, "kalman_out", torch.bfloat16, name="eta")


def test_every_parameter_gets_a_finite_gradient_matching_the_spec_block():
    layer = KalmanLinearAttention(d_model=8, d_state=3, sensor="mamba").double()
    x = torch.randn(2, 11, 8, dtype=F64, requires_grad=True)
    w = torch.randn(2, 11, 8, dtype=F64)
    params = [x, *layer.parameters()]
    got = torch.autograd.grad((layer(x) * w).sum(), params)
    ref = torch.autograd.grad((spec_block(layer, x) * w).sum(), params)
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    for name, g, r in zip(names, got, ref):
        assert torch.isfinite(g).all(), name
        assert_close(g, r, "kalman_grad", F64, name=f"d{name}")


def test_bad_inputs():
    layer = KalmanLinearAttention(d_model=8, d_state=4)
    with pytest.raises(ValueError, match=r"x: expected shape \[B,T,d_model\] with d_model = 8"):
        layer(torch.randn(2, 5, 6))
    _, state = layer(torch.randn(2, 5, 8), return_state=True)
    with pytest.raises(ValueError, match=r"state.conv: expected shape \(3, 16, 3\) for batch 3"):
        layer(torch.randn(3, 5, 8), state=state)
    with pytest.raises(ValueError, match="state: expected a KalmanLayerState"):
        layer(torch.randn(2, 5, 8), state=(state.lam, state.eta))
    with pytest.raises(ValueError, match="sensor: expected one of"):
        KalmanLinearAttention(8, sensor="gru")
    with pytest.raises(ValueError, match="d_state: expected a positive int"):
        KalmanLinearAttention(8, d_state=0)


def test_layer_on_generated_kernels_decodes_like_the_full_pass():
    """backend="triton" (the fused mixer; Triton's interpreter on CPU) against the reference layer."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layer = KalmanLinearAttention(d_model=8, d_state=4, backend="triton").to(device)
    x = torch.randn(2, 6, 8, device=device)
    full = layer(x)
    state, outs = None, []
    for t in range(6):
        out, state = layer(x[:, t:t + 1], state=state, return_state=True)
        outs.append(out)
    assert_close(torch.cat(outs, 1), full, "kalman_out", torch.float32)
    layer.backend = "reference"
    assert_close(full, layer(x), "kalman_out", torch.float32)
