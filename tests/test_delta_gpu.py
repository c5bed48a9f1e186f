"""Delta rule / Kaczmarz on a CUDA GPU: compiled kernels against the float64 reference, torch.compile."""
from __future__ import annotations

import math

import pytest
import torch

from scanlang.recipes.kaczmarz import KaczmarzLinearAttention, delta_rule, kaczmarz_delta_rule
from scanlang.testing import assert_close, ratio

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
NAMES = ("o", "S", "dq", "dk", "dv", "dg", "deta", "dh0")
KINDS = ("delta_out", "delta_out") + ("delta_grad",) * 3 + ("delta_gate_grad",) * 2 + ("delta_grad",)


def inputs(B, T, H, K, V, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, H, K, device="cuda", generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=gen), dim=-1)
    k = k * torch.exp(torch.empty(B, T, H, 1, device="cuda").uniform_(math.log(1e-2), math.log(10), generator=gen))
    v = torch.randn(B, T, H, V, device="cuda", generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device="cuda", generator=gen))
    eta = torch.rand(B, T, H, device="cuda", generator=gen)
    h0 = torch.randn(B, H, K, V, device="cuda", generator=gen)
    return [q.to(dtype), k.to(dtype), v.to(dtype), g, eta, h0]


def with_grads(fn, ins):
    ts = [t.detach().clone().requires_grad_() for t in ins]
    o, S = fn(*ts)
    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(o.shape, device="cuda", generator=gen, dtype=torch.float64).to(o.dtype)
    dS = torch.randn(S.shape, device="cuda", generator=gen, dtype=torch.float64).to(S.dtype)
    return [o, S, *torch.autograd.grad((o * do).sum() + (S * dS).sum(), ts)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("T, K", [(1000, 128), (77, 64), (300, 256)])
def test_kaczmarz_on_gpu_against_float64(dtype, T, K):
    ins = inputs(2, T, 3, K, 96, dtype)
    got = with_grads(lambda q, k, v, g, e, h0: kaczmarz_delta_rule(
        q, k, v, g, e, initial_state=h0, output_final_state=True, backend="triton"), ins)
    ref = with_grads(lambda q, k, v, g, e, h0: kaczmarz_delta_rule(
        *(t.double() for t in (q, k, v, g, e)), initial_state=h0.double(), output_final_state=True,
        backend="reference"), ins)
    for name, kind, a, b in zip(NAMES, KINDS, got, ref):
        assert_close(a, b, kind, dtype, name)
    # the reference backend itself, at these sizes, against a loop written here (sampled rows)
    for b, h in SAMPLED_ROWS:
        loop = row_loop_with_grads(ins, b, h, seed=1)
        for name, kind, x, want in zip(NAMES, KINDS, got, loop):
            part = x[b, h] if name in ("S", "dh0") else x[b, :, h]
            assert_close(part, want, kind, dtype, f"{name} row ({b}, {h}) vs the loop")
        for name, x, want in zip(NAMES, ref, loop):   # o, S float64; gradients rounded to their leaf's dtype
            part = x[b, h] if name in ("S", "dh0") else x[b, :, h]
            bound = 1e-10 if part.dtype == torch.float64 else torch.finfo(part.dtype).eps
            assert ratio(part, want) < bound, (name, b, h, ratio(part, want))


SAMPLED_ROWS = ((0, 0), (1, 2))   # (batch, head): the first and the last of inputs(2, T, 3, ...)


def row_loop_with_grads(ins, b, h, seed):
    """o, S and every gradient for one (batch, head) row by the token loop (docs/spec/kaczmarz.md), float64,
    written out here: S' = exp(g) S; S = S' + beta k (v - S'^T k)^T, beta = eta / (|k|^2 + 1e-6);
    o = K^-1/2 S^T q. The cotangents are with_grads' for that row (same generator, same draws), so the
    gradients are those of the row's share of the loss."""
    q, k, v, g, eta = (t.detach()[b, :, h].double().requires_grad_() for t in ins[:5])
    h0 = ins[5].detach()[b, h].double().requires_grad_()
    T, K = k.shape
    V = v.shape[-1]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    B, H = ins[0].shape[0], ins[0].shape[2]
    do = torch.randn((B, T, H, V), device="cuda", generator=gen, dtype=torch.float64)[b, :, h]
    dS = torch.randn((B, H, K, V), device="cuda", generator=gen, dtype=torch.float64)[b, h]
    S, outs = h0, []
    for t in range(T):
        S = torch.exp(g[t]) * S
        beta = eta[t] / ((k[t] * k[t]).sum() + 1e-6)
        S = S + beta * torch.outer(k[t], v[t] - S.T @ k[t])
        outs.append(K ** -0.5 * (S.T @ q[t]))
    o = torch.stack(outs)
    grads = torch.autograd.grad((o * do).sum() + (S * dS).sum(), (q, k, v, g, eta, h0))
    return [o.detach(), S.detach(), *grads]


def test_varlen_and_decode_on_gpu():
    ins = inputs(1, 500, 2, 64, 64, torch.bfloat16, seed=3)
    cu = torch.tensor([0, 1, 130, 130, 500], device="cuda")
    h0 = torch.randn(4, 2, 64, 64, device="cuda")
    o, S = delta_rule(*ins[:5], initial_state=h0, output_final_state=True, cu_seqlens=cu, backend="triton")
    o_ref, S_ref = delta_rule(*(t.double() for t in ins[:5]), initial_state=h0.double(), output_final_state=True,
                              cu_seqlens=cu, backend="reference")
    assert_close(o, o_ref, "delta_out", torch.bfloat16, "o")
    assert_close(S, S_ref, "delta_out", torch.bfloat16, "S")
    layer = KaczmarzLinearAttention(256, 4).cuda()
    x = torch.randn(2, 40, 256, device="cuda")
    with torch.no_grad():
        y = layer(x)
        y1, st = layer(x[:, :37], return_state=True)
        parts = [y1]
        for t in range(37, 40):
            yt, st = layer(x[:, t:t + 1], state=st, return_state=True)
            parts.append(yt)
    assert_close(torch.cat(parts, 1), y, "delta_out", torch.float32, "decoded layer")


def test_torch_compile_fullgraph_through_the_registered_op():
    from scanlang.backends.delta import ops
    from scanlang.delta import KACZMARZ
    key = ops.program_key(KACZMARZ, 64)                       # generated and loaded outside the graph
    table = ops.ChunkTable(1, 200, None, 64, torch.device("cuda"))
    q, k, v, g, e, h0 = inputs(1, 200, 2, 64, 64, torch.bfloat16, seed=4)
    packed = [t.reshape(200, 2, -1).contiguous() for t in (q, k, v)] + [g.reshape(200, 2), e.reshape(200, 2)]
    ins = [t.requires_grad_() for t in packed + [h0]]

    def f(q, k, v, g, e, h0):
        o, S, *_ = torch.ops.scanlang.delta_chunk_fwd(key, q, k, v, g, torch.zeros(0, 2, device="cuda"), e, h0,
                                                      *table.chunks, 1e-6, 0.125)
        return o.sum() + S.sum()

    compiled = torch.compile(f, fullgraph=True)
    eager_grads = torch.autograd.grad(f(*ins), ins)
    compiled_grads = torch.autograd.grad(compiled(*ins), ins)
    for a, b in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(a, b)


def test_eager_path_matches_the_op_path_on_gpu(monkeypatch, knobs):
    """The dispatcher-free eager path launches the op path's kernels with the same configs: identical bits."""
    from scanlang.backends.delta import ops
    ins = inputs(2, 200, 2, 64, 64, torch.bfloat16, seed=5)

    def fn(q, k, v, g, e, h0):
        return kaczmarz_delta_rule(q, k, v, g, e, initial_state=h0, output_final_state=True, backend="triton")
    eager = with_grads(fn, ins)
    knobs(delta_eager_fast_path=False)
    for name, a, b in zip(NAMES, eager, with_grads(fn, ins)):
        assert torch.equal(a, b), name


GDN = (2, 1000, 4, 128, 128)   # B, T, H, K = V (GDN's head size): chunks of 64, the last one of 40 tokens
# (input, batch, token, head, column or None for all of them, value), one plant per (batch, head): mid-chunk
# (300 = 4 * 64 + 44), a chunk's first (640) and last (127) token, the short last chunk (990)
VALUE_PLANTS = [("v", 0, 300, 1, 5, float("nan")), ("v", 1, 640, 2, 100, float("inf")),
                ("v", 1, 127, 0, None, float("nan")), ("v", 0, 990, 3, 0, float("-inf"))]
# a non-finite key, step, decay or query: the token loop's gradients of the earlier tokens are NaN too, so
# only the outputs are compared
TOKEN_PLANTS = [("k", 0, 300, 1, 3, float("inf")), ("beta", 1, 640, 2, None, float("nan")),
                ("g", 1, 127, 0, None, float("nan")), ("q", 0, 990, 3, 7, float("nan"))]
GDN_NAMES = ("o", "S", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def gdn_inputs(dtype, seed=7):
    B, T, H, K, V = GDN
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, H, K, device="cuda", generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, device="cuda", generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device="cuda", generator=gen))
    beta = torch.sigmoid(torch.randn(B, T, H, device="cuda", generator=gen))
    h0 = torch.randn(B, H, K, V, device="cuda", generator=gen)
    return [q.to(dtype), k.to(dtype), v.to(dtype), g, beta, h0]


def gdn(backend):
    return lambda q, k, v, g, beta, h0: delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                   backend=backend)


def planted(ins, plants):
    out = [t.clone() for t in ins]
    for name, b, t, h, col, value in plants:
        x = out["q k v g beta".split().index(name)]
        if col is None:
            x[b, t, h] = value
        else:
            x[b, t, h, col] = value
    return out


def same_kernels(got, clean, kind, what):
    """`got` equals `clean` (the same kernels on the same inputs, up to the rounding of terms that cancel: dg's
    in-chunk sums): finite, and within fp32's CPU row, not the GPU rows meant for tf32 dots against float64."""
    assert torch.isfinite(got).all(), f"{what}: not finite"
    assert_close(got.cpu(), clean.cpu(), kind, torch.float32, what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_non_finite_values_stay_causal_on_gpu(dtype):
    """NaN or inf values planted mid-chunk, at a chunk's first and last token and in the short last chunk: the
    outputs and every gradient of the tokens before each (and d initial state) equal the clean run's, the rows
    without one equal it whole; the clean run is finite and matches the float64 reference."""
    ins = gdn_inputs(dtype)
    clean = with_grads(gdn("triton"), ins)
    ref = with_grads(gdn("reference"), [t.double() for t in ins])
    for name, kind, a, b in zip(GDN_NAMES, KINDS, clean, ref):
        assert torch.isfinite(a).all(), name
        assert_close(a, b, kind, dtype, name)
    got = with_grads(gdn("triton"), planted(ins, VALUE_PLANTS))
    rows = {(b, h): t for _, b, t, h, _, _ in VALUE_PLANTS}
    for name, kind, a, c in zip(GDN_NAMES, KINDS, got, clean):
        for (b, h), t in rows.items():
            if name == "dh0":
                same_kernels(a[b, h], c[b, h], kind, f"dh0 ({b}, {h})")
            elif name != "S":     # the final state is not finite in the planted rows
                same_kernels(a[b, :t, h], c[b, :t, h], kind, f"{name} ({b}, :{t}, {h})")
    for name, kind, a, c in zip(GDN_NAMES, KINDS, got, clean):   # rows without a plant: B x H minus the planted
        for b in range(GDN[0]):
            for h in range(GDN[2]):
                if (b, h) not in rows:
                    same_kernels(a[b, h] if name in ("S", "dh0") else a[b, :, h],
                                 c[b, h] if name in ("S", "dh0") else c[b, :, h], kind, f"{name} ({b}, {h})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_non_finite_keys_steps_decays_and_queries_stay_causal_on_gpu(dtype):
    """A NaN or inf key, step, decay or query planted as above: the outputs of the tokens before it equal the clean
    run's, later ones are NaN where the plant reaches (the state from a key, step or decay on; a query's own row)."""
    ins = gdn_inputs(dtype)
    with torch.no_grad():
        clean, _ = gdn("triton")(*ins)
        got, S = gdn("triton")(*planted(ins, TOKEN_PLANTS))
    for name, b, t, h, _, _ in TOKEN_PLANTS:
        same_kernels(got[b, :t, h], clean[b, :t, h], "delta_out", f"o ({b}, :{t}, {h}), {name} planted at {t}")
        assert torch.isnan(got[b, t, h]).any(), f"o ({b}, {t}, {h}): the planted token's output is finite"
        if name == "q":
            same_kernels(got[b, t + 1:, h], clean[b, t + 1:, h], "delta_out", f"o ({b}, {t + 1}:, {h}) after a query")
        else:
            assert torch.isnan(got[b, t:, h]).all() and torch.isnan(S[b, h]).all(), f"({b}, {h}) after {name}"
