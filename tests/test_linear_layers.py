"""GatedLinearAttention and KimiDeltaAttention (recipes/linear/layers.py) on CPU: each against a float64
composition written here (its own projections of the layer's weights, then a plain token loop of the
recurrence), state carry (split anywhere, one token at a time, packed sequences), gradients to every
parameter and a float64 gradcheck, the backend passed through, bad input, and the model zoo names."""
import pytest
import torch
from torch import nn

from scanlang.models import SequenceModel
from scanlang.recipes.linear import GatedLinearAttention, KimiDeltaAttention, LinearLayerState
from scanlang.testing import assert_close

F64 = torch.float64

CONFIGS = {
    "gla": lambda: GatedLinearAttention(12, num_heads=2, gate_low_rank_dim=3, chunk_size=4),
    "gla_conv": lambda: GatedLinearAttention(12, num_heads=3, expand_k=0.5, expand_v=1.5, use_short_conv=True,
                                             conv_size=3, conv_bias=True, clamp_min=-0.05, chunk_size=4),
    "gla_no_gate": lambda: GatedLinearAttention(8, num_heads=1, use_output_gate=False, gate_logit_normalizer=2,
                                                chunk_size=4),
    "kda": lambda: KimiDeltaAttention(12, num_heads=2, head_dim=3, chunk_size=4),
    "kda_plain": lambda: KimiDeltaAttention(12, num_heads=2, head_dim=3, expand_v=2, use_short_conv=False,
                                            allow_neg_eigval=True, chunk_size=4),
    "kda_conv_bias": lambda: KimiDeltaAttention(8, num_heads=1, head_dim=4, conv_size=2, conv_bias=True,
                                                chunk_size=4),
}


def make(name, seed=0):
    """A layer with every parameter moved off its initial value (unit norm weights, zero biases would
    hide a missing term)."""
    torch.manual_seed(seed)
    layer = CONFIGS[name]()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return layer


def random_state(layer, n, seed=1):
    torch.manual_seed(seed)
    S = 0.5 * torch.randn(n, layer.num_heads, layer.head_k_dim, layer.head_v_dim)
    if not layer.use_short_conv:
        return LinearLayerState(None, None, None, S)
    w = layer.conv_size - 1
    return LinearLayerState(*(torch.randn(n, w, d) for d in (layer.key_dim, layer.key_dim, layer.value_dim)), S)


# ---- the float64 composition ---------------------------------------------------------------------
def linear(x, lin):
    y = x @ lin.weight.to(F64).T
    return y if lin.bias is None else y + lin.bias.to(F64)


def silu(x):
    return x / (1 + torch.exp(-x))


def causal_conv(x, weight, bias, window):
    """y_t = sum_j full[t + j] w_j (+ bias) over full = [window; x], one tap at a time."""
    full = torch.cat([window, x], 1)
    T, W = x.shape[1], weight.shape[1]
    y = sum(full[:, j:j + T] * weight[:, j].to(F64) for j in range(W))
    return y if bias is None else y + bias.to(F64)


def composed(layer, x, state=None):
    """(y, final S) of the layer's block from its weights in float64, the recurrence as a token loop."""
    x = x.to(F64)
    B, T, _ = x.shape
    H, K, V = layer.num_heads, layer.head_k_dim, layer.head_v_dim
    kda = isinstance(layer, KimiDeltaAttention)
    q, k, v = linear(x, layer.q_proj), linear(x, layer.k_proj), linear(x, layer.v_proj)
    if layer.use_short_conv:
        w = layer.conv_size - 1
        windows = [torch.zeros(B, w, d, dtype=F64) for d in (layer.key_dim, layer.key_dim, layer.value_dim)]
        if state is not None:
            windows = [t.to(F64) for t in state[:3]]
        q, k, v = (silu(causal_conv(p, c, b, win)) for p, c, b, win in
                   zip((q, k, v), (layer.q_conv, layer.k_conv, layer.v_conv),
                       (layer.q_conv_bias, layer.k_conv_bias, layer.v_conv_bias), windows))
    elif kda:
        q, k, v = silu(q), silu(k), silu(v)
    q, k, v = q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, V)
    if kda:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        pre = linear(linear(x, layer.f_proj[0]), layer.f_proj[1]) + layer.dt_bias.to(F64)
        g = -torch.exp(layer.A_log.to(F64))[:, None] * torch.log1p(torch.exp(pre.view(B, T, H, K)))
        beta = 1 / (1 + torch.exp(-linear(x, layer.b_proj)))
        beta = 2 * beta if layer.allow_neg_eigval else beta
    else:
        g = torch.log(1 / (1 + torch.exp(-linear(linear(x, layer.gk_proj[0]), layer.gk_proj[1]))))
        g = g / layer.gate_logit_normalizer
        if layer.clamp_min is not None:
            g = torch.maximum(g, torch.tensor(layer.clamp_min, dtype=F64))
        g = g.view(B, T, H, K)
    S = torch.zeros(B, H, K, V, dtype=F64) if state is None else state.recurrent.to(F64).clone()
    outs = []
    for t in range(T):
        for b in range(B):
            for h in range(H):
                St = torch.exp(g[b, t, h])[:, None] * S[b, h]
                kt, vt = k[b, t, h], v[b, t, h]
                if kda:   # (I - beta k k^T) St + beta k v^T
                    St = St - beta[b, t, h] * torch.outer(kt, kt @ St) + beta[b, t, h] * torch.outer(kt, vt)
                else:
                    St = St + torch.outer(kt, vt)
                S[b, h] = St
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]) * K ** -0.5)
    o = torch.stack(outs, 1)
    o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + layer.norm_eps) * layer.norm_weight.to(F64)
    if kda:
        o = o / (1 + torch.exp(-linear(linear(x, layer.g_proj[0]), layer.g_proj[1]))).view(B, T, H, V)
    elif layer.g_proj is not None:
        o = o * silu(linear(x, layer.g_proj)).view(B, T, H, V)
    return linear(o.reshape(B, T, H * V), layer.o_proj), S


@pytest.mark.parametrize("T", [1, 9])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_layer_matches_the_float64_composition(name, T):
    layer = make(name)
    torch.manual_seed(2)
    x = torch.randn(2, T, layer.hidden_size)
    for state in (None, random_state(layer, 2)):
        y, st = layer(x, state=state, return_state=True)
        y_ref, S_ref = composed(layer, x, state)
        assert_close(y, y_ref, "delta_out", name="y")
        assert_close(st.recurrent, S_ref, "delta_out", name="state.recurrent")
        assert y.dtype == torch.float32 and st.recurrent.dtype == torch.float32


@pytest.mark.parametrize("name", list(CONFIGS))
def test_state_carry_equals_one_run(name):
    layer = make(name)
    torch.manual_seed(3)
    x = torch.randn(2, 10, layer.hidden_size)
    start = random_state(layer, 2)
    y_full, st_full = layer(x, state=start, return_state=True)
    for cuts in ([4], [1, 2, 9], list(range(1, 10))):   # down to one token at a time
        pieces, st = [], start
        for a, b in zip([0] + cuts, cuts + [10]):
            y, st = layer(x[:, a:b], state=st, return_state=True)
            pieces.append(y)
        assert_close(torch.cat(pieces, 1), y_full, "delta_out", name=f"y, cuts {cuts}")
        assert_close(st.recurrent, st_full.recurrent, "delta_out", name=f"state.recurrent, cuts {cuts}")
        for field, got, want in zip(st._fields, st[:3], st_full[:3]):   # the last projected inputs
            assert (got is None) == (want is None) == (not layer.use_short_conv)
            if got is not None:
                assert_close(got, want, "delta_out", name=f"state.{field}, cuts {cuts}")
    # an empty call changes nothing; a plain 4-tuple is taken as the state
    y0, st0 = layer(x[:, :0], state=tuple(start), return_state=True)
    assert y0.shape == (2, 0, layer.hidden_size) and torch.equal(st0.recurrent, start.recurrent)


@pytest.mark.parametrize("name", ["gla_conv", "kda"])
def test_packed_sequences_equal_separate_runs(name):
    """cu_seqlens: lengths 3, 1, 0, 5 in one row; the conv and the recurrence restart per sequence."""
    layer = make(name)
    lengths = [3, 1, 0, 5]
    cu = torch.tensor([0, 3, 4, 4, 9])
    torch.manual_seed(4)
    x = torch.randn(1, 9, layer.hidden_size)
    start = random_state(layer, 4)
    y, st = layer(x, state=start, return_state=True, cu_seqlens=cu)
    for i, (a, n) in enumerate(zip(cu[:-1].tolist(), lengths)):
        own = LinearLayerState(*(None if t is None else t[i:i + 1] for t in start))
        y_i, st_i = layer(x[:, a:a + n], state=own, return_state=True)
        if n:
            y_ref, S_ref = composed(layer, x[:, a:a + n], own)
            assert_close(y[:, a:a + n], y_ref, "delta_out", name=f"y of sequence {i}")
            assert_close(st.recurrent[i:i + 1], S_ref, "delta_out", name=f"state of sequence {i}")
        assert_close(y[:, a:a + n], y_i, "delta_out", name=f"y of sequence {i} (separate run)")
        assert_close(st.recurrent[i:i + 1], st_i.recurrent, "delta_out", name=f"state of sequence {i}")
        for field, got, want in zip(st._fields, st[:3], st_i[:3]):
            assert_close(got[i:i + 1], want, "delta_out", name=f"state.{field} of sequence {i}")
    assert torch.equal(st.recurrent[2], start.recurrent[2])   # the empty sequence keeps its state


@pytest.mark.parametrize("name", ["gla_conv", "gla", "kda_conv_bias", "kda_plain"])
def test_every_parameter_gets_a_finite_nonzero_gradient(name):
    layer = make(name)
    if name == "gla_conv":
        layer.clamp_min = None   # a clamped gate passes no gradient
    torch.manual_seed(5)
    x = torch.randn(2, 7, layer.hidden_size, requires_grad=True)
    y, st = layer(x, state=random_state(layer, 2), return_state=True)
    (y.square().sum() + st.recurrent.square().sum()).backward()
    for pname, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, f"{pname}: zero gradient"
    assert x.grad.abs().sum() > 0


@pytest.mark.parametrize("cls, kwargs", [
    (GatedLinearAttention, dict(hidden_size=4, num_heads=1, gate_low_rank_dim=2, use_short_conv=True,
                                conv_size=2, conv_bias=True, chunk_size=2)),
    (KimiDeltaAttention, dict(hidden_size=4, num_heads=1, head_dim=2, conv_size=2, conv_bias=True,
                              chunk_size=2)),
])
def test_float64_gradcheck(cls, kwargs):
    """Gradients of y and the final state in x, every parameter and the incoming state."""
    torch.manual_seed(6)
    layer = cls(**kwargs).double()
    names = [n for n, _ in layer.named_parameters()]
    params = [0.5 * torch.randn_like(p) + p.detach() for p in layer.parameters()]
    x = torch.randn(1, 3, layer.hidden_size, dtype=F64)
    st = random_state(layer, 1)
    st = LinearLayerState(*(t.to(F64) for t in st))
    leaves = [t.requires_grad_() for t in (x, *st, *params)]

    def f(x, cq, ck, cv, S, *ps):
        y, out = torch.func.functional_call(layer, dict(zip(names, ps)), (x,),
                                            dict(state=LinearLayerState(cq, ck, cv, S), return_state=True))
        return y, out.recurrent

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_backend_is_passed_through():
    """GLA's generated plain-write kernels (Triton's interpreter here) give the reference's output and
    gradients, and KDA's layer on the per-key delta kernels (backends/linear/kernels_delta.py) too."""
    layer = GatedLinearAttention(16, num_heads=2, use_short_conv=True, backend="triton", chunk_size=16)
    torch.manual_seed(7)
    x = torch.randn(1, 5, 16, requires_grad=True)
    y, st = layer(x, return_state=True)
    y.square().sum().backward()
    gx, gw = x.grad.clone(), layer.gk_proj[1].weight.grad.clone()
    x.grad = None
    layer.zero_grad()
    layer.backend = "reference"
    y_ref, st_ref = layer(x, return_state=True)
    y_ref.square().sum().backward()
    assert_close(y, y_ref, "delta_out", name="y")
    assert_close(st.recurrent, st_ref.recurrent, "delta_out", name="state")
    assert_close(gx, x.grad, "delta_grad", name="dx")
    assert_close(gw, layer.gk_proj[1].weight.grad, "delta_param_grad", name="dgk_proj")
    kda = KimiDeltaAttention(8, num_heads=1, head_dim=4, backend="triton", chunk_size=16)
    x = torch.randn(1, 19, 8, requires_grad=True)
    y = kda(x)
    y.square().sum().backward()
    gx = x.grad.clone()
    x.grad = None
    kda.backend = "reference"
    y_ref = kda(x)
    y_ref.square().sum().backward()
    assert_close(y, y_ref, "delta_out", name="y (kda)")
    assert_close(gx, x.grad, "delta_grad", name="dx (kda)")


def test_recurrence_runs_without_autocast():
    """Under bf16 autocast the projections run in bf16, the recurrence's matmuls in fp32 (what the
    member's reference computes with), and the state stays fp32."""
    layer = make("kda")
    seen = []
    inner = layer._recurrence

    def spy(*args):
        seen.append(torch.is_autocast_enabled("cpu"))
        return inner(*args)

    layer._recurrence = spy
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, st = layer(torch.randn(1, 5, layer.hidden_size), return_state=True)
    assert seen == [False] and y.dtype == torch.bfloat16 and st.recurrent.dtype == torch.float32


GLA = lambda: GatedLinearAttention(8, num_heads=2)                           # noqa: E731
GLA_CONV = lambda: GatedLinearAttention(8, num_heads=2, use_short_conv=True)   # noqa: E731
KDA = lambda: KimiDeltaAttention(8, num_heads=2, head_dim=2)                  # noqa: E731
S_OK = torch.zeros(1, 2, 2, 2)


@pytest.mark.parametrize("call, error, match", [
    (lambda: GLA()(torch.randn(2, 8)), ValueError, r"^x: expected shape \[B, T, 8\]"),
    (lambda: GLA()(torch.randn(1, 3, 7)), ValueError, r"^x: expected shape \[B, T, 8\]"),
    (lambda: KDA()(torch.randn(1, 3, 8, 1)), ValueError, r"^x: expected shape"),
    (lambda: GLA()(torch.ones(1, 3, 8, dtype=torch.long)), TypeError, r"^x: expected a floating"),
    (lambda: GLA()(torch.randn(1, 3, 8), state=LinearLayerState(None, None, None, torch.zeros(1, 2, 4, 2))),
     ValueError, r"^state.recurrent: expected shape \[N, H, K, V\] = \[1, 2, 2, 4\]"),
    (lambda: GLA()(torch.randn(2, 3, 8), state=LinearLayerState(None, None, None, torch.zeros(1, 2, 2, 4))),
     ValueError, r"^state.recurrent"),
    (lambda: GLA()(torch.randn(1, 3, 8), state=LinearLayerState(None, None, None, torch.zeros(1, 2, 2, 4,
                                                                                          dtype=torch.half))),
     TypeError, r"^state.recurrent: dtype"),
    (lambda: GLA()(torch.randn(1, 3, 8), state=torch.zeros(1, 2, 2, 4)), TypeError, r"^state: expected"),
    (lambda: GLA()(torch.randn(1, 3, 8), state=LinearLayerState(torch.zeros(1, 3, 4), None, None,
                                                                torch.zeros(1, 2, 2, 4))),
     ValueError, r"^state.conv_q: this layer has no short convolution"),
    (lambda: GLA_CONV()(torch.randn(1, 3, 8), state=LinearLayerState(torch.zeros(1, 2, 4), torch.zeros(1, 3, 4),
                                                                     torch.zeros(1, 3, 8), torch.zeros(1, 2, 2, 4))),
     ValueError, r"^state.conv_q: expected shape \[N, conv_size - 1, dim\] = \[1, 3, 4\]"),
    (lambda: KDA()(torch.randn(1, 3, 8), state=LinearLayerState(torch.zeros(1, 3, 4), torch.zeros(1, 3, 4),
                                                                None, S_OK)),
     ValueError, r"^state.conv_v: expected shape"),
    (lambda: KDA()(torch.randn(2, 3, 8), cu_seqlens=torch.tensor([0, 3])), ValueError, r"^cu_seqlens: .*B == 1"),
    (lambda: KDA()(torch.randn(1, 3, 8), cu_seqlens=torch.tensor([0, 2])), ValueError, r"^cu_seqlens"),
    (lambda: KDA()(torch.randn(1, 3, 8), cu_seqlens=torch.tensor([0, 1, 3]),
                   state=LinearLayerState(None, None, None, S_OK)), ValueError, r"^state.recurrent: .*\[2, 2, 2, 2\]"),
    (lambda: GatedLinearAttention(8, num_heads=3), ValueError, r"^num_heads: 3 must divide"),
    (lambda: GatedLinearAttention(8, expand_k=0.3), ValueError, r"^expand_k"),
    (lambda: GatedLinearAttention(8, num_heads=2, clamp_min=0.5), ValueError, r"^clamp_min"),
    (lambda: GatedLinearAttention(8, num_heads=2, backend="cuda"), ValueError, r"^backend"),
    (lambda: KimiDeltaAttention(8, num_heads=2, head_dim=3, expand_v=0.5), ValueError, r"^expand_v"),
    (lambda: KimiDeltaAttention(8, num_heads=0, head_dim=4), ValueError, r"^num_heads"),
    (lambda: KimiDeltaAttention(8, num_heads=2, head_dim=4, conv_size=0), ValueError, r"^conv_size"),
])
def test_bad_input_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("mixer", ["gla", "kda"])
def test_model_zoo_builds_each_layer_and_takes_a_training_step(mixer):
    torch.manual_seed(8)
    model = SequenceModel(vocab_size=7, d_model=16, num_layers=2, mixer=mixer, num_heads=2)
    assert all(isinstance(b.mixer, GatedLinearAttention if mixer == "gla" else KimiDeltaAttention)
               for b in model.blocks)
    tokens, targets = torch.randint(0, 7, (2, 6)), torch.randint(0, 7, (12,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets)
    loss.backward()
    assert torch.isfinite(loss)
    for i, block in enumerate(model.blocks):
        grads = [p.grad for p in block.mixer.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads), f"layer {i}"
        assert sum(float(g.abs().sum()) for g in grads) > 0, f"layer {i}: the mixer got no gradient"
    before = [p.detach().clone() for p in model.blocks[0].mixer.parameters()]
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.blocks[0].mixer.parameters()))
    with torch.no_grad():
        assert torch.isfinite(nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets))
