"""The delta rule's forward kernels in their alternative launch configs (Triton's interpreter on CPU) against
float64: state_output with several value blocks per head (varlen, an empty sequence, lengths off the chunk size),
delta_wu per chunk and per column block, and the bf16 path of w and u (Tm diag(scale) split into two bf16
matrices) against the float64 WY factors."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton-using code

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from scanlang.backends.delta import ops as delta_ops  # noqa: E402
from scanlang.delta import KACZMARZ  # noqa: E402
from scanlang.recipes.kaczmarz import kaczmarz_delta_rule  # noqa: E402
from scanlang.recipes.kaczmarz.naive import delta_rule_naive, kaczmarz_beta  # noqa: E402
from scanlang.testing import assert_close  # noqa: E402


def make_inputs(B, T, H, K, V, seed):
    """Random non-zero inputs, key norms log-uniform over [1e-2, 10], one key exactly zero."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = k * torch.exp(torch.empty(B, T, H, 1).uniform_(math.log(1e-2), math.log(10), generator=gen))
    k[:, min(2, T - 1)] = 0
    v = torch.randn(B, T, H, V, generator=gen)
    g = -torch.rand(B, T, H, generator=gen) * 0.3 - 1e-3
    eta = torch.rand(B, T, H, generator=gen) * 0.98 + 0.01
    return q, k, v, g, eta


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch, tmp_path):
    """Every kernel buffer starts as NaN (so an unwritten element shows; an integer one as -1, which marks every row
    of a chunk non-finite), in a fresh cache dir."""
    monkeypatch.setattr(delta_ops, "_empty", lambda *s, device, dtype: torch.full(
        s, float("nan") if dtype.is_floating_point else -1, device=device, dtype=dtype))
    monkeypatch.setenv("SCANLANG_CACHE_DIR", str(tmp_path))


@pytest.mark.parametrize("BV, num_warps", [(16, 4), (32, 8)])
def test_state_output_in_value_blocks_varlen(monkeypatch, BV, num_warps, knobs):
    """V = 48 in blocks of 16 or 32 (a partial last block), sequences of 0, 1, 17 and 40 tokens at C = 16: the
    chunk addresses each program derives from its sequence's bounds, the output and the final state."""
    knobs(delta_configs={"state_output": dict(BV=BV, num_warps=num_warps, num_stages=1)})
    q, k, v, g, eta = make_inputs(1, 58, 2, 16, 48, seed=21)
    cu = torch.tensor([0, 0, 1, 18, 58])
    h0 = torch.randn(4, 2, 16, 48, generator=torch.Generator().manual_seed(22))
    with torch.no_grad():
        o, S = kaczmarz_delta_rule(q, k, v, g, eta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                   backend="triton", chunk_size=16)
    o_ref, S_ref = delta_rule_naive(q, k, v, g, kaczmarz_beta(k.double(), eta.double(), 1e-6), initial_state=h0,
                                    output_final_state=True, cu_seqlens=cu)
    assert_close(o, o_ref, "delta_out", torch.float32, "o")
    assert_close(S, S_ref, "delta_out", torch.float32, "final state")
    assert torch.equal(S[0], h0[0])                      # the empty sequence keeps its initial state


@pytest.mark.parametrize("per_chunk", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_recomputation_of_w_u_per_chunk_or_per_block(monkeypatch, per_chunk, dtype, knobs):
    """delta_wu writing all of a chunk's column blocks in one program or one block per program (K = 40 in
    16-column blocks, V = 20): the gradients, which use the recomputed w and u, against float64."""
    knobs(delta_key_block=16)
    monkeypatch.setattr(delta_ops, "SHARED_MEMORY_FITS", {})      # fp32 would otherwise take per-block programs
    knobs(delta_configs={"wu": dict(BV=16, num_warps=4, num_stages=1, PER_CHUNK=per_chunk)})
    q, k, v, g, eta = make_inputs(1, 37, 2, 40, 20, seed=23)
    ins = [t.to(dtype) if t.dim() == 4 else t for t in (q, k, v)] + [g, eta]

    def grads(backend, cast):
        ts = [cast(t).clone().requires_grad_() for t in ins]
        o, S = kaczmarz_delta_rule(*ts, output_final_state=True, backend=backend, chunk_size=16)
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(24), dtype=torch.float64)
        (o * w.to(o.dtype)).sum().backward()
        return [t.grad for t in ts]

    got = grads("triton", lambda t: t)
    ref = grads("reference", lambda t: t.double())
    for name, a, b in zip(("dq", "dk", "dv", "dg", "deta"), got, ref):
        assert torch.isfinite(a).all(), name
        kind = "delta_gate_grad" if name in ("dg", "deta") else "delta_grad"
        assert_close(a, b, kind, dtype, name)


def test_bf16_wy_factors_match_float64():
    """w = Tm diag(beta e^G) K and u = Tm diag(beta) V for bf16 inputs (two bf16 products of the split
    Tm diag(scale), the inputs as stored) against the float64 factors of the same inputs, T = 45 at C = 32."""
    T, H, K, V, C = 45, 2, 32, 16, 32
    q, k, v, g, eta = make_inputs(1, T, H, K, V, seed=25)
    packed = [t.reshape(T, H, -1).to(torch.bfloat16).contiguous() for t in (q, k, v)]
    a, s = g.reshape(T, H).contiguous(), eta.reshape(T, H).contiguous()
    table = delta_ops.ChunkTable(1, T, None, C, "cpu")
    p = delta_ops.plan(delta_ops.program_key(KACZMARZ, C), K, V, torch.bfloat16, torch.device("cpu"))
    hp = torch.zeros(0, H)
    _, _, tm, gcum, beta, nonfinite = delta_ops._chunk_forward(p, *packed, a, hp, s, None, *table.chunks, 1e-6,
                                                               0.25, direct=True)
    w, _, _ = delta_ops._states(p, packed[1], packed[2], hp, None, *table.chunks, tm, gcum, beta, nonfinite,
                                direct=True)
    kd, vd = packed[1].double(), packed[2].double()
    w_ref = torch.empty(T, H, K, dtype=torch.float64)
    for t0 in range(0, T, C):
        n = min(C, T - t0)
        for h in range(H):
            kc = kd[t0:t0 + n, h]
            G = torch.cumsum(a[t0:t0 + n, h].double(), 0)
            b = eta[0, t0:t0 + n, h].double() / ((kc ** 2).sum(-1) + 1e-6)
            A = torch.tril(b[:, None] * (kc @ kc.T) * torch.exp(G[:, None] - G[None, :]), -1)
            Tm = torch.linalg.inv(torch.eye(n, dtype=torch.float64) + A)
            w_ref[t0:t0 + n, h] = Tm @ ((b * torch.exp(G))[:, None] * kc)
            assert_close(tm[t0 // C, h, :n, :n], Tm, "delta_tm", torch.float32, "Tm")
    assert w.dtype == torch.bfloat16
    assert_close(w, w_ref, "delta_out", torch.bfloat16, "w")


def test_fp32_plans_recompute_w_u_per_block():
    """fp32's delta_wu takes a column block per program (per chunk its FMA products spill, ops.SHARED_MEMORY_FITS);
    half inputs keep CONFIG's one program per chunk."""
    key = delta_ops.program_key(KACZMARZ, 64)
    cpu = torch.device("cpu")
    for K in (64, 128, 256):
        assert delta_ops.plan(key, K, 96, torch.float32, cpu).configs["wu"]["PER_CHUNK"] is False
        for dtype in (torch.bfloat16, torch.float16):
            assert delta_ops.plan(key, K, 96, dtype, cpu).configs["wu"] == delta_ops._clamp(delta_ops.CONFIG["wu"], 96)
