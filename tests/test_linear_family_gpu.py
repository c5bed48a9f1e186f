"""The generated matrix-state chunk kernels (backends/linear: plain writes, and KDA's per-key delta) on a
CUDA GPU, against float64.

Shapes include the ones that broke under Triton 3.6 on the H200 before the BV >= C rule of
backends/linear/ops.py `_meta` (16-bit inputs, C = 64, V = 32 and 48, not multiples of the tile), odd
lengths and cu_seqlens with an empty sequence. Every output and gradient is compared with the float64
chunked reference under the tolerance table's rows, and one (sequence, head) row with a token loop
written here.
"""
from __future__ import annotations

import pytest
import torch

from scanlang.recipes import linear
from scanlang.testing import assert_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
NAMES = ("o", "S", "dq", "dk", "dv", "dg", "dh0")
KINDS = ("delta_out", "delta_out", "delta_grad", "delta_grad", "delta_grad", "delta_gate_grad", "delta_grad")
GATE = {"linear_attention": None, "simple_gla": "head", "gla": "key"}


def inputs(member, B, T, H, K, V, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, H, K, device="cuda", generator=gen) * K ** -0.5
    k = torch.randn(B, T, H, K, device="cuda", generator=gen) * K ** -0.5
    v = torch.randn(B, T, H, V, device="cuda", generator=gen)
    shape = {None: None, "head": (B, T, H), "key": (B, T, H, K)}[GATE[member]]
    g = [] if shape is None else [torch.nn.functional.logsigmoid(torch.randn(shape, device="cuda", generator=gen) + 2)]
    h0 = torch.randn(B, H, K, V, device="cuda", generator=gen)
    return [q.to(dtype), k.to(dtype), v.to(dtype), *g], h0


def with_grads(fn, ins, h0):
    ts = [t.detach().clone().requires_grad_() for t in ins]
    s0 = h0.detach().clone().requires_grad_()
    o, S = fn(*ts, initial_state=s0)
    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(o.shape, device="cuda", generator=gen, dtype=torch.float64).to(o.dtype)
    dS = torch.randn(S.shape, device="cuda", generator=gen, dtype=torch.float64).to(S.dtype)
    grads = torch.autograd.grad((o * do).sum() + (S * dS).sum(), [*ts, s0])
    return [o, S, *grads], (do, dS)


def loop_row(member, ins, h0, b, h, scale):
    """o and S of sequence b, head h by the token loop S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,
    o_t = scale S_t^T q_t (float64, written out here)."""
    q, k, v = (t[b, :, h].double() for t in ins[:3])
    S = h0[b, h].double().clone()
    os = []
    for t in range(q.shape[0]):
        if GATE[member] == "head":
            S = torch.exp(ins[3][b, t, h].double()) * S
        elif GATE[member] == "key":
            S = torch.exp(ins[3][b, t, h].double())[:, None] * S
        S = S + torch.outer(k[t], v[t])
        os.append(scale * S.T @ q[t])
    return torch.stack(os), S


CASES = [  # T, K, V, C
    (1000, 128, 128, 64),
    (77, 64, 32, 64),
    (300, 128, 48, 32),
    (1, 32, 32, 64),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T, K, V, C", CASES)
@pytest.mark.parametrize("member", list(GATE))
def test_member_on_gpu_against_float64(member, T, K, V, C, dtype):
    ins, h0 = inputs(member, 2, T, 3, K, V, dtype)
    fn = getattr(linear, member)
    got, _ = with_grads(lambda *xs, **kw: fn(*xs, **kw, output_final_state=True, backend="triton", chunk_size=C),
                          ins, h0)
    ref, _ = with_grads(lambda *xs, **kw: fn(*(x.double() for x in xs), initial_state=kw["initial_state"].double(),
                                             output_final_state=True, backend="reference"), ins, h0)
    names = [n for n in NAMES if n != "dg" or GATE[member]]
    kinds = [kd for n, kd in zip(NAMES, KINDS) if n != "dg" or GATE[member]]
    for name, kind, a, b in zip(names, kinds, got, ref):
        assert_close(a, b, kind, dtype, f"{member} {name}")
    for b, h in ((0, 0), (1, 2)):
        o_row, S_row = loop_row(member, ins, h0, b, h, K ** -0.5)
        assert_close(got[0][b, :, h], o_row, "delta_out", dtype, f"{member} o row ({b}, {h}) vs the loop")
        assert_close(got[1][b, h], S_row, "delta_out", dtype, f"{member} S row ({b}, {h}) vs the loop")


@pytest.mark.parametrize("member", list(GATE))
def test_member_on_gpu_with_cu_seqlens(member):
    """Packed sequences of lengths 65, 0, 1 and 130 (C = 64) equal the sequences run one at a time."""
    lens = (65, 0, 1, 130)
    ins, _ = inputs(member, 1, sum(lens), 2, 64, 64, torch.bfloat16)
    h0 = torch.randn(len(lens), 2, 64, 64, device="cuda")
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    fn = getattr(linear, member)
    o, S = fn(*ins, initial_state=h0, output_final_state=True, cu_seqlens=cu, backend="triton", chunk_size=64)
    for n, (s, e) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        part = [x[:, s:e].double() for x in ins]
        o_n, S_n = fn(*part, initial_state=h0[n:n + 1].double(), output_final_state=True, backend="reference")
        if e > s:
            assert_close(o[:, s:e], o_n, "delta_out", torch.bfloat16, f"{member} o of sequence {n}")
        assert_close(S[n:n + 1], S_n, "delta_out", torch.bfloat16, f"{member} S of sequence {n}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T, K, V, C", CASES)
def test_kda_on_gpu_against_float64(T, K, V, C, dtype):
    """Per-key decay with the delta correction (backends/linear/kernels_delta.py; fp32 inputs' dots in tf32 on
    CUDA): every output and gradient against the float64 reference, one row against a token loop."""
    ins, h0 = inputs("gla", 2, T, 3, K, V, dtype)
    gen = torch.Generator(device="cuda").manual_seed(2)
    ins[1] = torch.nn.functional.normalize(ins[1].float(), dim=-1).to(dtype)
    ins.append(torch.rand(2, T, 3, device="cuda", generator=gen).to(dtype))   # beta
    got, _ = with_grads(lambda *xs, **kw: linear.kda(*xs, **kw, output_final_state=True, backend="triton",
                                                     chunk_size=C), ins, h0)
    ref, _ = with_grads(lambda *xs, **kw: linear.kda(*(x.double() for x in xs),
                                                     initial_state=kw["initial_state"].double(),
                                                     output_final_state=True, backend="reference"), ins, h0)
    names = ("o", "S", "dq", "dk", "dv", "dg", "dbeta", "dh0")
    kinds = ("delta_out", "delta_out", "delta_grad", "delta_grad", "delta_grad", "delta_gate_grad",
             "delta_gate_grad", "delta_grad")
    for name, kind, a, b in zip(names, kinds, got, ref):
        assert_close(a, b, kind, dtype, f"kda {name}")
    q, k, v, g, beta = (t[1, :, 2].double() for t in ins)
    S = h0[1, 2].double().clone()
    for t in range(T):   # sequence 1, head 2 by the token loop
        S = torch.exp(g[t])[:, None] * S
        S = S + beta[t] * torch.outer(k[t], v[t] - S.T @ k[t])
    assert_close(got[1][1, 2], S, "delta_out", dtype, "kda S row (1, 2) vs the loop")


def test_kda_on_gpu_with_cu_seqlens():
    """KDA on packed sequences of lengths 65, 0, 1 and 130 (C = 64) equals the sequences run one at a time."""
    lens = (65, 0, 1, 130)
    ins, _ = inputs("gla", 1, sum(lens), 2, 64, 64, torch.bfloat16)
    ins[1] = torch.nn.functional.normalize(ins[1].float(), dim=-1).to(torch.bfloat16)
    ins.append(torch.rand(1, sum(lens), 2, device="cuda").to(torch.bfloat16))   # beta
    h0 = torch.randn(len(lens), 2, 64, 64, device="cuda")
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    o, S = linear.kda(*ins, initial_state=h0, output_final_state=True, cu_seqlens=cu, backend="triton", chunk_size=64)
    for n, (s, e) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        part = [x[:, s:e].double() for x in ins]
        o_n, S_n = linear.kda(*part, initial_state=h0[n:n + 1].double(), output_final_state=True, backend="reference")
        if e > s:
            assert_close(o[:, s:e], o_n, "delta_out", torch.bfloat16, f"kda o of sequence {n}")
        assert_close(S[n:n + 1], S_n, "delta_out", torch.bfloat16, f"kda S of sequence {n}")
