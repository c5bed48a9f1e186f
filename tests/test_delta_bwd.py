"""Backward kernels of the generated delta rule (Triton's interpreter on CPU): their launch configs and
variants give the same gradients, each checked against float64 autograd of the chunked reference. fp32
inputs run every dot in fp32 ("ieee"), so the kernels' algebra is checked to fp32 rounding, well inside
the spec's tolerances."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton-using code

import pytest  # noqa: E402
import torch  # noqa: E402

from scanlang import tuning  # noqa: E402
from scanlang.backends.delta import ops as delta_ops  # noqa: E402
from scanlang.recipes.kaczmarz import kaczmarz_delta_rule  # noqa: E402
from scanlang.testing import assert_close  # noqa: E402

from test_delta_triton import NAMES, make_inputs, run_with_grads  # noqa: E402


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch, tmp_path):
    """Every kernel buffer starts as NaN (so an unwritten element shows; an integer one as -1, which marks every row
    of a chunk non-finite), in a fresh cache dir."""
    monkeypatch.setattr(delta_ops, "_empty", lambda *s, device, dtype: torch.full(
        s, float("nan") if dtype.is_floating_point else -1, device=device, dtype=dtype))
    monkeypatch.setenv("SCANLANG_CACHE_DIR", str(tmp_path))


def kaczmarz(backend, C):
    return lambda q, k, v, g, eta, h0: kaczmarz_delta_rule(
        q, k, v, g, eta, initial_state=h0, output_final_state=True, backend=backend, chunk_size=C)


@pytest.fixture(scope="module")
def odd_case():
    """K = 40 (three 16-column key blocks, or one block of the padded 64), V = 20, two chunks of 32, the
    second short; float64 reference gradients."""
    inputs = make_inputs(1, 40, 2, 40, 20, seed=11)
    return inputs, run_with_grads(kaczmarz("reference", 32), inputs, torch.float64)


@pytest.mark.parametrize("state_bwd, dU_local, dqk, wy", [
    (dict(LOCAL_DU=False, BV=16, num_warps=4, num_stages=2), dict(BV=16, num_warps=4, num_stages=2),
     dict(BKS=16, BV=16, num_warps=4, num_stages=1), dict(BV=16, num_warps=4, num_stages=1)),
    (dict(LOCAL_DU=True, BV=32, num_warps=8, num_stages=2), dict(BV=16, num_warps=4, num_stages=2),
     dict(BKS=128, BV=32, num_warps=8, num_stages=2), dict(BV=32, num_warps=8, num_stages=1)),
    (dict(LOCAL_DU=False, BV=64, num_warps=8, num_stages=2), dict(BV=64, num_warps=4, num_stages=2),
     dict(WY=True, BKS=16, BV=16, num_warps=8, num_stages=1), dict(BV=16, num_warps=4, num_stages=1)),
    # the variants: sequence bounds, decays on the value side, dG by row sums, fp32 dots at the input dtype,
    # dU and the dk share stored in the input dtype (for fp32 inputs: the same products and buffers)
    (dict(LOCAL_DU=False, BV=16, num_warps=4, num_stages=2, SEQ_BOUNDS=True, DECAY_V=True, LOWP_DU=True),
     dict(BV=16, num_warps=4, num_stages=2),
     dict(BKS=16, BV=16, num_warps=4, num_stages=1, DG_SUMS=True, LOWP=True, LOWP_DK=True, LOWP_DTM=True),
     dict(BV=16, num_warps=4, num_stages=1, LOWP=True)),
    (dict(LOCAL_DU=True, BV=32, num_warps=8, num_stages=2, SEQ_BOUNDS=True, DECAY_V=True),
     dict(BV=16, num_warps=4, num_stages=2),
     dict(BKS=128, BV=32, num_warps=8, num_stages=2, DG_SUMS=True), dict(BV=32, num_warps=8, num_stages=1)),
    (dict(LOCAL_DU=True, BV=64, num_warps=4, num_stages=1, DECAY_V=True), dict(BV=64, num_warps=4, num_stages=2),
     dict(WY=True, BV=16, num_warps=8, num_stages=1, DG_SUMS=True, LOWP=True), dict(BV=16, num_warps=4, num_stages=1)),
])
def test_backward_configs_match_float64(monkeypatch, odd_case, state_bwd, dU_local, dqk, wy, knobs):
    """delta_state_bwd with the local dU from delta_dU_local or formed itself, in value blocks smaller than V
    or not; delta_bwd_dqk in several key blocks (each storing its shares of dk, dTm, dG, dbeta, summed by
    delta_bwd_wy), in one (BKS clamped to the padded K), or in one doing delta_bwd_wy's work too (WY); and the
    kernels' variants (SEQ_BOUNDS, DECAY_V, DG_SUMS, LOWP) and the host's LOWP_DU, LOWP_DK."""
    knobs(delta_key_block=16)
    for name, cfg in dict(state_bwd=state_bwd, dU_local=dU_local, bwd_dqk=dqk, bwd_wy=wy).items():
        knobs(delta_configs={name: cfg})
    inputs, ref = odd_case
    got = run_with_grads(kaczmarz("triton", 32), inputs, torch.float32)
    for name, a, b in zip(("o", "S") + NAMES, got, ref):
        assert torch.isfinite(a).all(), name
        assert_close(a, b, "delta_ieee", torch.float32, name)


def test_dqk_key_block_and_wy_from_config(monkeypatch, knobs):
    key = delta_ops.program_key(delta_ops._RULES["kaczmarz"], 16)
    knobs(delta_configs={"bwd_dqk": dict(BKS=128, BV=32, num_warps=8, num_stages=1)})
    p = delta_ops.plan(key, 40, 20, torch.float32, torch.device("cpu"))
    assert p.configs["bwd_dqk"]["BKS"] == 64 and p.configs["bwd_dqk"]["BV"] == 32
    knobs(delta_configs={"bwd_dqk": dict(BV=32, num_warps=4, num_stages=1)})
    p = delta_ops.plan(key, 40, 20, torch.float32, torch.device("cpu"))
    assert p.configs["bwd_dqk"]["BKS"] == min(tuning.current().delta_key_block, 64) and not p.configs["bwd_dqk"]["WY"]
    # WY: one block of all K columns, up to K = 128
    knobs(delta_configs={"bwd_dqk": dict(WY=True, BKS=16, BV=32, num_warps=8, num_stages=1)})
    p = delta_ops.plan(key, 100, 20, torch.float32, torch.device("cpu"))
    assert p.configs["bwd_dqk"]["BKS"] == 128 and p.configs["bwd_dqk"]["WY"]
    p = delta_ops.plan(key, 200, 20, torch.float32, torch.device("cpu"))
    assert p.configs["bwd_dqk"]["BKS"] == 16 and not p.configs["bwd_dqk"]["WY"]


def test_host_keys_leave_the_launch_configs(monkeypatch, knobs):
    """LOWP_DU, LOWP_DK (and LOWP_DTM) choose buffers: the plan keeps them in `host`, never in a kernel's
    launch config."""
    key = delta_ops.program_key(delta_ops._RULES["kaczmarz"], 16)
    knobs(delta_configs={"state_bwd": dict(LOCAL_DU=True, BV=32, num_warps=4, num_stages=1,
                                           LOWP_DU=True)})
    knobs(delta_configs={"bwd_dqk": dict(BKS=64, BV=32, num_warps=8, num_stages=1, LOWP_DK=True)})
    p = delta_ops.plan(key, 64, 32, torch.bfloat16, torch.device("cpu"))
    assert p.host == dict(LOWP_DU=True, LOWP_DK=True)
    assert not any(k in cfg for cfg in p.configs.values() for k in delta_ops.HOST_KEYS)
    assert "LOWP_DU" in delta_ops.CONFIG["state_bwd"]      # the plan copied, CONFIG kept its entry
    knobs(delta_configs={"bwd_wy": dict(BV=32, num_warps=4, num_stages=1, LOWP=True)})
    # fp16 (a narrow range): fp32 buffers and fp32 dots whatever the configs say
    p = delta_ops.plan(key, 64, 32, torch.float16, torch.device("cpu"))
    assert p.host == {} and p.configs["bwd_wy"]["LOWP"] is False and p.configs["bwd_dqk"]["LOWP"] is False
    knobs(delta_configs={"state_bwd": dict(LOCAL_DU=True, BV=32, num_warps=4, num_stages=1)})
    p = delta_ops.plan(key, 64, 32, torch.bfloat16, torch.device("cpu"))
    assert p.host == dict(LOWP_DK=True) and p.configs["bwd_wy"]["LOWP"] is True


def _bf16_inputs(seed):
    """q, k, v rounded to bf16 (the state and gates stay fp32), B1 T40 H2 K=40 V=20."""
    q, k, v, g, eta, h0 = make_inputs(1, 40, 2, 40, 20, seed=seed)
    return [t.to(torch.bfloat16) for t in (q, k, v)] + [g, eta, h0]


def _kaczmarz_fn(backend):
    """kaczmarz_delta_rule on `backend` with 32-token chunks (the initial state in fp32, or float64 for the reference)."""
    return lambda q, k, v, g, eta, h0: kaczmarz_delta_rule(
        q, k, v, g, eta, initial_state=h0.float() if h0.dtype != torch.float64 else h0,
        output_final_state=True, backend=backend, chunk_size=32)


@pytest.mark.parametrize("lowp_du", [False, True])
def test_bf16_local_dU_from_its_kernel_or_the_state_pass_same_bits(monkeypatch, lowp_du, knobs):
    """bf16 inputs: delta_dU_local (which also stores dO rounded to bf16 for the later kernels) or the local dU
    formed in the state pass (reading fp32 dO and rounding it there) give bit-identical gradients, within the
    spec's bf16 tolerances of float64 (on the bf16-rounded inputs); with dU stored in fp32 or in bf16
    (LOWP_DU: the local part then stays fp32 in its own buffer until the state pass adds to it)."""
    inputs = _bf16_inputs(seed=11)
    fn = _kaczmarz_fn
    ref = run_with_grads(fn("reference"), inputs, torch.float64)
    got = {}
    for local in (False, True):
        knobs(delta_configs={"state_bwd": dict(LOCAL_DU=local, BV=16, num_warps=4, num_stages=1,
                                               LOWP_DU=lowp_du)})
        got[local] = run_with_grads(fn("triton"), inputs, torch.bfloat16)
    for name, a, b, r in zip(("o", "S") + NAMES, got[False], got[True], ref):
        assert torch.equal(a, b), name
        kind = "delta_out" if name in ("o", "S") else "delta_gate_grad" if name in ("dg", "deta") else "delta_grad"
        assert_close(a, r, kind, torch.bfloat16, name)


def test_bf16_variants_within_tolerance_of_float64(monkeypatch, knobs):
    """bf16 inputs with every variant on (dU and the dk and dTm shares in bf16, bf16 operands for the fp32 dots, dG by
    row sums, decays on the value side): gradients within the spec's bf16 tolerances of float64; SEQ_BOUNDS alone
    changes addresses only (same bits)."""
    inputs = _bf16_inputs(seed=3)
    fn = _kaczmarz_fn
    ref = run_with_grads(fn("reference"), inputs, torch.float64)
    state_bwd = dict(LOCAL_DU=True, BV=16, num_warps=4, num_stages=1)
    knobs(delta_configs={"state_bwd": state_bwd})
    plain = run_with_grads(fn("triton"), inputs, torch.bfloat16)
    knobs(delta_configs={"state_bwd": dict(state_bwd, SEQ_BOUNDS=True)})
    bounds = run_with_grads(fn("triton"), inputs, torch.bfloat16)
    knobs(delta_configs={"state_bwd": dict(state_bwd, SEQ_BOUNDS=True, DECAY_V=True, LOWP_DU=True)})
    knobs(delta_configs={"bwd_dqk": dict(BKS=16, BV=16, num_warps=4, num_stages=1, DG_SUMS=True,
                                         LOWP=True, LOWP_DK=True, LOWP_DTM=True)})
    knobs(delta_configs={"bwd_wy": dict(BV=16, num_warps=4, num_stages=1, LOWP=True)})
    knobs(delta_key_block=16)
    got = run_with_grads(fn("triton"), inputs, torch.bfloat16)
    for name, a, b, c, r in zip(("o", "S") + NAMES, plain, bounds, got, ref):
        assert torch.equal(a, b), name
        kind = "delta_out" if name in ("o", "S") else "delta_gate_grad" if name in ("dg", "deta") else "delta_grad"
        assert_close(c, r, kind, torch.bfloat16, name)


@pytest.mark.parametrize("wy, variants", [(False, False), (True, False), (False, True), (True, True)])
def test_varlen_and_decay_parameters_through_both_backward_layouts(monkeypatch, wy, variants, knobs):
    """Packed sequences (an empty one, lengths off the chunk) with the Mamba2 decay hook's per-head parameters:
    bwd_dqk in 16-column key blocks with bwd_wy, or one WY program per chunk storing every gradient itself; with
    the kernels' variants or without (SEQ_BOUNDS takes the chunks from the sequences' bounds)."""
    from scanlang.delta import KACZMARZ_MAMBA2
    knobs(delta_key_block=16)
    flags = dict(DG_SUMS=True, LOWP=True) if variants else {}
    knobs(delta_configs={"bwd_dqk": dict(WY=wy, BKS=16, BV=16, num_warps=4, num_stages=1, **flags)})
    if variants:
        knobs(delta_configs={"bwd_wy": dict(BV=16, num_warps=4, num_stages=1, LOWP=True)})
        knobs(delta_configs={"state_bwd": dict(LOCAL_DU=True, BV=16, num_warps=4, num_stages=1,
                                               SEQ_BOUNDS=True, DECAY_V=True)})
    q, k, v, _, eta, _ = make_inputs(1, 40, 2, 24, 20, seed=4)
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(1, 40, 2, generator=gen)
    cu = torch.tensor([0, 3, 3, 21, 40])
    h0 = torch.randn(4, 2, 24, 20, generator=gen)
    A_log, dt_bias = torch.tensor([-1.0, 0.5]), torch.tensor([0.0, -2.0])

    def triton_fn(q, k, v, a, eta, h0, A_log, dt_bias):
        return delta_ops.delta_rule(q, k, v, a, eta, KACZMARZ_MAMBA2, scale=0.25, initial_state=h0,
                                    output_final_state=True, cu_seqlens=cu, chunk_size=16, eps=1e-6,
                                    decay_params=(A_log, dt_bias))

    def reference_fn(q, k, v, a, eta, h0, A_log, dt_bias):
        g = -torch.exp(A_log) * torch.nn.functional.softplus(a + dt_bias, threshold=1e9)
        return kaczmarz_delta_rule(q, k, v, g, eta, scale=0.25, initial_state=h0, output_final_state=True,
                                   cu_seqlens=cu, backend="reference", chunk_size=16)

    inputs = (q, k, v, a, eta, h0, A_log, dt_bias)
    got = run_with_grads(triton_fn, inputs, torch.float32)
    ref = run_with_grads(reference_fn, inputs, torch.float64)
    for name, x, y in zip(("o", "S", "dq", "dk", "dv", "da", "deta", "dh0", "dA_log", "ddt_bias"), got, ref):
        assert_close(x, y, "delta_ieee", torch.float32, name)
