"""Generated delta-rule Triton kernels (Triton's interpreter on CPU) against the float64 token loop and
the float64 chunked reference: outputs, states and every gradient, at awkward lengths and key norms."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton-using code

import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from scanlang.backends.delta import codegen  # noqa: E402
from scanlang.backends.delta import ops as delta_ops  # noqa: E402
from scanlang.delta import GDN_SIGMOID, GIVEN, GIVEN_MAMBA2, KACZMARZ, KACZMARZ_MAMBA2, DeltaRule  # noqa: E402
from scanlang.recipes.kaczmarz import KaczmarzLinearAttention, delta_rule, kaczmarz_delta_rule  # noqa: E402
from scanlang.recipes.kaczmarz.naive import delta_rule_naive, kaczmarz_beta  # noqa: E402
from scanlang.testing import assert_close, ratio  # noqa: E402

NAMES = ("dq", "dk", "dv", "dg", "deta", "dh0")


def kind(name: str) -> str:
    """The table row a compared tensor belongs to: outputs and states, per-token gradients, or the gradients
    of per-head decay parameters (sums over every token and state entry, with cancellation)."""
    if name in ("o", "S"):
        return "delta_out"
    return "delta_param_grad" if name in ("dA_log", "ddt_bias") else "delta_grad"


def make_inputs(B, T, H, K, V, seed=0, zero_keys=True):
    """Random non-zero inputs; key norms log-uniform over [1e-2, 10]; some keys exactly zero."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = k * torch.exp(torch.empty(B, T, H, 1).uniform_(math.log(1e-2), math.log(10), generator=gen))
    if zero_keys and T > 3:
        k[:, 2] = 0
    v = torch.randn(B, T, H, V, generator=gen)
    g = -torch.rand(B, T, H, generator=gen) * 0.3 - 1e-3
    eta = torch.rand(B, T, H, generator=gen) * 0.98 + 0.01
    h0 = torch.randn(B, H, K, V, generator=gen)
    return q, k, v, g, eta, h0


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch, tmp_path):
    """Every kernel buffer starts as NaN (so an unwritten element shows; an integer one as -1, which marks every row
    of a chunk non-finite), in a fresh cache dir."""
    monkeypatch.setattr(delta_ops, "_empty", lambda *s, device, dtype: torch.full(
        s, float("nan") if dtype.is_floating_point else -1, device=device, dtype=dtype))
    monkeypatch.setenv("SCANLANG_CACHE_DIR", str(tmp_path))


def run_with_grads(fn, inputs, dtype, seed=1):
    """fn(*inputs) -> (o, S); backprop random cotangents; returns [o, S, grads...] (float64 cotangents)."""
    ts = [t.detach().to(dtype).clone().requires_grad_() for t in inputs]
    o, S = fn(*ts)
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)).sum()
    loss = loss + (S * torch.randn(S.shape, generator=gen, dtype=torch.float64).to(S.dtype)).sum()
    loss.backward()
    return [o, S] + [t.grad for t in ts]


@pytest.mark.parametrize("T, C, K, V", [(1, 16, 16, 16), (37, 16, 16, 32), (70, 32, 32, 16), (70, 64, 16, 16)])
def test_kaczmarz_forward_and_gradients(T, C, K, V):
    inputs = make_inputs(2, T, 2, K, V)
    fn = lambda backend: lambda q, k, v, g, eta, h0: kaczmarz_delta_rule(  # noqa: E731
        q, k, v, g, eta, initial_state=h0, output_final_state=True, backend=backend, chunk_size=C)
    got = run_with_grads(fn("triton"), inputs, torch.float32)
    ref = run_with_grads(fn("reference"), inputs, torch.float64)
    q, k, v, g, eta, h0 = inputs
    o_loop, S_loop = delta_rule_naive(q, k, v, g, kaczmarz_beta(k.double(), eta.double(), 1e-6),
                                      initial_state=h0, output_final_state=True)
    assert ratio(ref[0], o_loop) < 1e-10 and ratio(ref[1], S_loop) < 1e-10   # the two references agree
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert_close(got[0], o_loop, "delta_out", torch.float32, "o")
    assert_close(got[1], S_loop, "delta_out", torch.float32, "final state")
    for name, a, b in zip(NAMES, got[2:], ref[2:]):
        assert torch.isfinite(a).all(), name
        assert_close(a, b, kind(name), torch.float32, name)


@pytest.mark.parametrize("C, T", [(16, 20), (64, 150), (128, 150)])
def test_prep_inverse_matches_float64(C, T):
    """delta_prep's Tm = (I + A)^-1 per chunk (diagonal blocks by products of powers, blocks merged the same
    way) against torch.linalg.inv in float64; rows past a short last chunk are identity rows. (C = 128 is no
    public chunk size, but its merge has two factors where 64 has one.)"""
    q, k, v, g, eta, _ = make_inputs(1, T, 2, 16, 16, seed=3)
    table = delta_ops.ChunkTable(1, T, None, C, "cpu")
    p = delta_ops.plan(delta_ops.program_key(KACZMARZ, C), 16, 16, torch.float32, torch.device("cpu"))
    packed = [t.reshape(T, 2, -1).contiguous() for t in (q, k, v)]
    _, _, tm, gcum, beta, _ = delta_ops._chunk_forward(p, *packed, g.reshape(T, 2).contiguous(), torch.zeros(0, 2),
                                                       eta.reshape(T, 2).contiguous(), None, *table.chunks, 1e-6,
                                                       0.25, direct=True)
    kd = packed[1].double()
    for c, t0 in enumerate(range(0, T, C)):
        n = min(C, T - t0)
        for h in range(2):
            kc, G, b = kd[t0:t0 + n, h], gcum[t0:t0 + n, h].double(), beta[t0:t0 + n, h].double()
            A = torch.tril(b[:, None] * (kc @ kc.T) * torch.exp(G[:, None] - G[None, :]), -1)
            ref = torch.eye(C, dtype=torch.float64)
            ref[:n, :n] = torch.linalg.inv(torch.eye(n, dtype=torch.float64) + A)
            assert_close(tm[c, h], ref, "delta_tm", torch.float32, f"Tm chunk {c} head {h}")
            assert torch.equal(tm[c, h, n:].double(), ref[n:])


def test_given_beta_without_initial_state():
    q, k, v, g, beta, _ = make_inputs(1, 45, 2, 16, 16, seed=3)
    fn = lambda backend: lambda q, k, v, g, b: delta_rule(q, k, v, g, b * 1.5, scale=0.7,  # noqa: E731
                                                         output_final_state=True, backend=backend, chunk_size=16)
    got = run_with_grads(fn("triton"), (q, k, v, g, beta), torch.float32)
    ref = run_with_grads(fn("reference"), (q, k, v, g, beta), torch.float64)
    for name, a, b in zip(("o", "S") + NAMES[:5], got, ref):
        assert_close(a, b, kind(name), torch.float32, name)


def test_varlen_matches_reference():
    q, k, v, g, eta, _ = make_inputs(1, 40, 2, 16, 16, seed=4)
    cu = torch.tensor([0, 3, 3, 21, 40])
    h0 = torch.randn(4, 2, 16, 16)
    fn = lambda backend: lambda q, k, v, g, eta, h0: kaczmarz_delta_rule(  # noqa: E731
        q, k, v, g, eta, initial_state=h0, output_final_state=True, cu_seqlens=cu, backend=backend, chunk_size=16)
    got = run_with_grads(fn("triton"), (q, k, v, g, eta, h0), torch.float32)
    ref = run_with_grads(fn("reference"), (q, k, v, g, eta, h0), torch.float64)
    for name, a, b in zip(("o", "S") + NAMES, got, ref):
        assert_close(a, b, kind(name), torch.float32, name)


def test_recurrent_decode_kernel_for_short_inputs():
    q, k, v, g, eta, h0 = make_inputs(2, 5, 2, 16, 32, seed=5)
    with torch.no_grad():
        o, S = kaczmarz_delta_rule(q, k, v, g, eta, initial_state=h0, output_final_state=True, backend="triton")
    o_ref, S_ref = delta_rule_naive(q, k, v, g, kaczmarz_beta(k.double(), eta.double(), 1e-6),
                                    initial_state=h0, output_final_state=True)
    assert_close(o, o_ref, "delta_out", torch.float32, "o")
    assert_close(S, S_ref, "delta_out", torch.float32, "S")
    cu = torch.tensor([0, 1, 4, 4, 10])
    q, k, v, g, eta, _ = make_inputs(1, 10, 2, 16, 16, seed=6)
    h0 = torch.randn(4, 2, 16, 16)
    with torch.no_grad():
        o, S = kaczmarz_delta_rule(q, k, v, g, eta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                   backend="triton")
    o_ref, S_ref = delta_rule_naive(q, k, v, g, kaczmarz_beta(k.double(), eta.double(), 1e-6), initial_state=h0,
                                    output_final_state=True, cu_seqlens=cu)
    assert_close(o, o_ref, "delta_out", torch.float32, "o varlen")
    assert_close(S, S_ref, "delta_out", torch.float32, "S varlen")


@pytest.mark.parametrize("grad", [False, True])
def test_zero_keys_and_zero_eta_write_nothing_even_with_eps_zero(grad):
    q, k, v, g, eta, h0 = make_inputs(1, 20, 2, 16, 16, seed=7, zero_keys=False)
    g = torch.zeros_like(g)
    k[:, 4:9] = 0
    eta[:, 12:20] = 0
    ts = [t.clone().requires_grad_(grad) for t in (q, k, v, g, eta, h0)]
    o, S = kaczmarz_delta_rule(*ts[:5], eps=0.0, initial_state=ts[5], output_final_state=True, backend="triton",
                               chunk_size=16)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    _, S12 = kaczmarz_delta_rule(q[:, :12], k[:, :12], v[:, :12], g[:, :12], eta[:, :12], eps=0.0,
                                 initial_state=h0, output_final_state=True, backend="reference")
    assert ratio(S, S12) < 1e-6                      # tokens 12.. have eta = 0: nothing written
    if grad:
        (o.sum() + S.sum()).backward()
        for name, t in zip(NAMES, ts):
            assert torch.isfinite(t.grad).all(), name
        assert torch.equal(ts[4].grad[:, 4:9], torch.zeros_like(ts[4].grad[:, 4:9]))  # no step through zero keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_input_dtypes(dtype):
    """The comparison test_delta_gpu.py makes (tolerance kinds per gradient), for every input dtype: its fp32
    cases failed on the H200 because the table had no ("delta_gate_grad", float32) row."""
    q, k, v, g, eta, h0 = make_inputs(1, 37, 2, 16, 16, seed=8, zero_keys=False)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    fn = lambda backend: lambda q, k, v, g, eta, h0: kaczmarz_delta_rule(  # noqa: E731
        q, k, v, g, eta, initial_state=h0.float() if h0.dtype != torch.float64 else h0, output_final_state=True,
        backend=backend, chunk_size=16)
    got = run_with_grads(fn("triton"), (q, k, v, g, eta, h0), dtype)
    got_dtypes = [t.dtype for t in got]
    assert got_dtypes[:2] == [torch.float32, torch.float32] and got_dtypes[2] == dtype
    ref = run_with_grads(fn("reference"), (q, k, v, g, eta, h0), torch.float64)
    assert_close(got[0], ref[0], "delta_out", dtype, "o")
    assert_close(got[1], ref[1], "delta_out", dtype, "S")
    for name, a, b in zip(NAMES, got[2:], ref[2:]):
        assert_close(a, b, "delta_gate_grad" if name in ("dg", "deta") else "delta_grad", dtype, name)


def test_kaczmarz_equals_gdn_on_rescaled_inputs():
    q, k, v, g, eta, h0 = make_inputs(1, 33, 2, 16, 16, seed=9)
    r = ((k.double() ** 2).sum(-1, keepdim=True) + 1e-6).rsqrt()
    o1, S1 = kaczmarz_delta_rule(q, k, v, g, eta, initial_state=h0, output_final_state=True, backend="triton",
                                 chunk_size=16)
    o2, S2 = delta_rule(q, (k * r).float(), (v * r).float(), g, eta, initial_state=h0, output_final_state=True,
                        backend="triton", chunk_size=16)
    assert_close(o1, o2, "delta_out", torch.float32, "o")
    assert_close(S1, S2, "delta_out", torch.float32, "S")


def test_sigmoid_step_rule_chain_rule():
    """A different family member (GDN's beta = sigmoid(s)) through the same template and hooks."""
    q, k, v, g, s, _ = make_inputs(1, 21, 1, 16, 16, seed=10, zero_keys=False)
    k = torch.nn.functional.normalize(k, dim=-1)
    s = s * 6 - 3

    def triton_fn(q, k, v, g, s):
        return delta_ops.delta_rule(q, k, v, g, s, GDN_SIGMOID, scale=0.25, output_final_state=True, chunk_size=16)

    def reference_fn(q, k, v, g, s):
        return delta_rule(q, k, v, g, torch.sigmoid(s), scale=0.25, output_final_state=True, backend="reference")

    got = run_with_grads(triton_fn, (q, k, v, g, s), torch.float32)
    ref = run_with_grads(reference_fn, (q, k, v, g, s), torch.float64)
    for name, a, b in zip(("o", "S", "dq", "dk", "dv", "dg", "ds"), got, ref):
        assert_close(a, b, kind(name), torch.float32, name)


def test_the_rule_decides_which_stages_exist():
    """The kernels take eps where the step reads it, hp_ptr / dhp_ptr where the decay has per-head parameters, form
    d||k||^2 where the step reads n2, and hold the zero-key guard (step_beta) for every rule (`guard_needed` says
    where sympy cannot show the step finite at n2 = 0); dL/da is dg itself for g = a."""
    import ast
    from scanlang.backends.delta.parts import Hooks
    unproven = DeltaRule("unproven_step", step=lambda t: t.s / (1 - t.s))     # no n2, not finite at s = 1
    want = {GIVEN: Hooks(guard=True, n2=False, eps=False, params=False),
            GDN_SIGMOID: Hooks(guard=True, n2=False, eps=False, params=False),
            KACZMARZ: Hooks(guard=True, n2=True, eps=True, params=False),
            GIVEN_MAMBA2: Hooks(guard=True, n2=False, eps=False, params=True),
            KACZMARZ_MAMBA2: Hooks(guard=True, n2=True, eps=True, params=True),
            unproven: Hooks(guard=True, n2=False, eps=False, params=False)}
    needed = {GIVEN: False, GDN_SIGMOID: False, KACZMARZ: True, GIVEN_MAMBA2: False, KACZMARZ_MAMBA2: True,
              unproven: True}
    assert {rule: codegen.guard_needed(rule) for rule in needed} == needed
    for rule, hooks in want.items():
        assert codegen.hooks(rule) == hooks, rule.name
        src = codegen.kernel_source(rule, 16)
        params = {f.name: [a.arg for a in f.args.args] for f in ast.parse(src).body if isinstance(f, ast.FunctionDef)}
        for name in ("delta_prep", "delta_bwd_dqk", "delta_bwd_wy", "delta_recurrent"):
            assert ("eps" in params[name]) == hooks.eps and ("hp_ptr" in params[name]) == hooks.params, (rule, name)
        for name in ("delta_bwd_dqk", "delta_bwd_wy"):
            assert ("dhp_ptr" in params[name]) == hooks.params, (rule, name)
        assert ("step_beta" in params) == hooks.guard and ("dn2" in src) == hooks.n2, rule.name
        assert ("tl.store(da_ptr + offs, dg, mask=mask)" in src) == (not rule.head_params), rule.name


def test_given_mamba2_rule_matches_float64():
    """beta = s as given (no eps, no n2: none of their stages) with Mamba2's decay hook and its per-head parameters,
    zero keys among the tokens: every gradient against the float64 reference."""
    q, k, v, _, s, h0 = make_inputs(1, 37, 2, 16, 16, seed=14)
    gen = torch.Generator().manual_seed(15)
    a = torch.randn(1, 37, 2, generator=gen) * 2
    A_log, dt_bias = torch.tensor([-1.0, 0.5]), torch.tensor([0.5, -1.0])

    def triton_fn(q, k, v, a, s, h0, A_log, dt_bias):
        return delta_ops.delta_rule(q, k, v, a, s, GIVEN_MAMBA2, scale=0.25, initial_state=h0,
                                    output_final_state=True, chunk_size=16, decay_params=(A_log, dt_bias))

    def reference_fn(q, k, v, a, s, h0, A_log, dt_bias):
        g = -torch.exp(A_log) * torch.nn.functional.softplus(a + dt_bias, threshold=1e9)
        return delta_rule(q, k, v, g, s, scale=0.25, initial_state=h0, output_final_state=True, backend="reference")

    inputs = (q, torch.nn.functional.normalize(k, dim=-1), v, a, s, h0, A_log, dt_bias)
    got = run_with_grads(triton_fn, inputs, torch.float32)
    ref = run_with_grads(reference_fn, inputs, torch.float64)
    for name, x, y in zip(("o", "S", "dq", "dk", "dv", "da", "ds", "dh0", "dA_log", "ddt_bias"), got, ref):
        assert_close(x, y, kind(name), torch.float32, name)


def test_a_step_without_n2_that_can_be_non_finite_keeps_the_zero_key_guard():
    """beta = s / (1 - s) reads no n2 but is not finite everywhere: at a zero key with s = 1 (beta = inf) the
    kernels still take beta as 0 and its step gradient as 0 (the key writes nothing); elsewhere every gradient
    against the float64 reference."""
    rule = DeltaRule("step_without_n2", step=lambda t: t.s / (1 - t.s))
    q, k, v, g, s, h0 = make_inputs(1, 21, 2, 16, 16, seed=16)       # k[:, 2] = 0
    k = torch.nn.functional.normalize(k, dim=-1)
    s = s * 0.5
    s[:, 2] = 1.0

    def triton_fn(q, k, v, g, s, h0):
        return delta_ops.delta_rule(q, k, v, g, s, rule, scale=0.25, initial_state=h0, output_final_state=True,
                                    chunk_size=16)

    def reference_fn(q, k, v, g, s, h0):
        dead = (k * k).sum(-1) == 0
        safe = torch.where(dead, torch.zeros_like(s), s)
        beta = torch.where(dead, torch.zeros_like(s), safe / (1 - safe))
        return delta_rule(q, k, v, g, beta, scale=0.25, initial_state=h0, output_final_state=True,
                          backend="reference")

    got = run_with_grads(triton_fn, (q, k, v, g, s, h0), torch.float32)
    ref = run_with_grads(reference_fn, (q, k, v, g, s, h0), torch.float64)
    assert torch.equal(got[6][:, 2], torch.zeros_like(got[6][:, 2]))      # no step gradient through the zero key
    for name, x, y in zip(("o", "S", "dq", "dk", "dv", "dg", "ds", "dh0"), got, ref):
        assert_close(x, y, kind(name), torch.float32, name)


def test_layer_on_triton_state_carry():
    torch.manual_seed(0)
    layer = KaczmarzLinearAttention(32, 2, backend="triton", chunk_size=16)
    x = torch.randn(1, 21, 32)
    y = layer(x)
    ref = KaczmarzLinearAttention(32, 2, backend="reference", chunk_size=16)
    ref.load_state_dict(layer.state_dict())
    assert_close(y, ref(x), "delta_out", torch.float32, "layer output")
    with torch.no_grad():
        y1, st = layer(x[:, :17], return_state=True)
        ys = [y1]
        for t in range(17, 21):                     # one token at a time: the recurrent kernel
            y_t, st = layer(x[:, t:t + 1], state=st, return_state=True)
            ys.append(y_t)
    assert_close(torch.cat(ys, 1), y, "delta_out", torch.float32, "layer carried")


def test_generated_source_is_deterministic_and_cached(tmp_path):
    src = codegen.kernel_source(KACZMARZ, 64)
    assert src == codegen.kernel_source(KACZMARZ, 64)
    assert "return s / (eps + n2)" in src            # the rendered Kaczmarz step hook
    prep = lambda C: codegen.render_prep(C)  # noqa: E731
    # the block merge (I + N)(I + N^2)... Td: log2(C/16) factors, none for a single block
    assert "N1 = mm(N0, N0, PREC, UPCAST)" in prep(64) and "N2 = mm(N1, N1, PREC, UPCAST)" in prep(128)
    assert prep(64).count("Tm = Tm + mm(N") == 2 and prep(128).count("Tm = Tm + mm(N") == 3
    assert "Tm = Tm + mm(N0, Tm, PREC, UPCAST)" in prep(32) and "N1" not in prep(32)
    assert "def delta_prep" in codegen.kernel_source(KACZMARZ, 16) and "N0" not in prep(16)
    mod = codegen.load(GDN_SIGMOID, 32)
    files = [f for f in (tmp_path / "triton").glob("scanlang_*.py")       # the shared kernel cache
             if f.read_text() == codegen.kernel_source(GDN_SIGMOID, 32)]
    assert len(files) == 1 and mod.__file__ == str(files[0])


def test_triton_on_cpu_without_interpreter_is_a_value_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    q, k, v, g, eta, _ = make_inputs(1, 4, 1, 16, 16)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        kaczmarz_delta_rule(q, k, v, g, eta, backend="triton")
    with pytest.raises(ValueError, match="float64"):
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        kaczmarz_delta_rule(q.double(), k, v, g, eta, backend="triton")


def test_chunk_op_is_a_registered_torch_library_op():
    key = delta_ops.program_key(KACZMARZ, 16)
    TT, H, K, V = 20, 2, 16, 16
    table = delta_ops.ChunkTable(1, TT, None, 16, "cpu")
    floats = [torch.randn(TT, H, K), torch.randn(TT, H, K), torch.randn(TT, H, V), -torch.rand(TT, H),
              torch.rand(TT, H), torch.randn(1, H, K, V)]
    args = (key, *(t.requires_grad_() for t in floats[:4]), torch.zeros(0, H), *(t.requires_grad_() for t in floats[4:]),
            *table.chunks, 1e-6, 0.25)
    # the aot-dispatch checks trace through the launches, which Triton's CPU interpreter cannot do
    torch.library.opcheck(torch.ops.scanlang.delta_chunk_fwd.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_backward_in_key_blocks_and_odd_head_dims(monkeypatch, knobs):
    """K split across programs / loop steps of 16 columns; K and V not powers of two."""
    knobs(delta_key_block=16)
    knobs(delta_configs={"bwd_wy": dict(BV=16, num_warps=4, num_stages=1)})
    inputs = make_inputs(1, 40, 2, 40, 20, seed=11)
    fn = lambda backend: lambda q, k, v, g, eta, h0: kaczmarz_delta_rule(  # noqa: E731
        q, k, v, g, eta, initial_state=h0, output_final_state=True, backend=backend, chunk_size=32)
    got = run_with_grads(fn("triton"), inputs, torch.float32)
    ref = run_with_grads(fn("reference"), inputs, torch.float64)
    for name, a, b in zip(("o", "S") + NAMES, got, ref):
        assert_close(a, b, kind(name), torch.float32, name)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_empty_sequence_returns_the_initial_state(backend):
    q, k, v, g, eta, h0 = make_inputs(2, 0, 2, 16, 16)
    o, S = kaczmarz_delta_rule(q, k, v, g, eta, initial_state=h0, output_final_state=True, backend=backend)
    assert o.shape == (2, 0, 2, 16) and torch.equal(S, h0)


def test_mamba2_gate_fused_as_decay_hook():
    """g = -exp(A_log) softplus(a + dt_bias) computed in the kernels, gradients to a, A_log and dt_bias;
    pre-activations far outside exp's range and exactly at softplus's kink stay finite and exact."""
    q, k, v, _, eta, h0 = make_inputs(1, 37, 2, 16, 16, seed=12)
    gen = torch.Generator().manual_seed(13)
    a = torch.randn(1, 37, 2, generator=gen) * 3
    a[0, 5, 0], a[0, 6, 1], a[0, 7, 0] = 150.0, -150.0, 0.0
    A_log, dt_bias = torch.tensor([-1.0, 0.5]), torch.tensor([0.0, -2.0])
    a[0, 8, 1] = 2.0                                   # a + dt_bias = 0 exactly for head 1

    def triton_fn(q, k, v, a, eta, h0, A_log, dt_bias):
        return delta_ops.delta_rule(q, k, v, a, eta, KACZMARZ_MAMBA2, scale=0.25, initial_state=h0,
                                    output_final_state=True, chunk_size=16, eps=1e-6, decay_params=(A_log, dt_bias))

    def reference_fn(q, k, v, a, eta, h0, A_log, dt_bias):
        g = -torch.exp(A_log) * torch.nn.functional.softplus(a + dt_bias, threshold=1e9)
        return kaczmarz_delta_rule(q, k, v, g, eta, scale=0.25, initial_state=h0, output_final_state=True,
                                   backend="reference")

    inputs = (q, k, v, a, eta, h0, A_log, dt_bias)
    got = run_with_grads(triton_fn, inputs, torch.float32)
    ref = run_with_grads(reference_fn, inputs, torch.float64)
    for name, x, y in zip(("o", "S", "dq", "dk", "dv", "da", "deta", "dh0", "dA_log", "ddt_bias"), got, ref):
        assert torch.isfinite(x).all(), name
        assert_close(x, y, kind(name), torch.float32, name)
    with pytest.raises(ValueError, match="decay_params"):
        delta_ops.delta_rule(q, k, v, a, eta, KACZMARZ_MAMBA2, scale=0.25, decay_params=(A_log,))


@pytest.mark.parametrize("mode", ["kaczmarz", "gdn"])
def test_layer_fused_gate_matches_reference_layer(mode):
    torch.manual_seed(2)
    layer = KaczmarzLinearAttention(32, 2, mode=mode, backend="triton", chunk_size=16)
    ref = KaczmarzLinearAttention(32, 2, mode=mode, backend="reference", chunk_size=16).double()
    ref.load_state_dict({n: p.double() for n, p in layer.state_dict().items()})
    x = torch.randn(2, 21, 32)
    y, y_ref = layer(x), ref(x.double())
    assert_close(y, y_ref, "delta_out", torch.float32, "layer output")
    y.square().sum().backward()
    y_ref.square().sum().backward()
    for (name, p), p_ref in zip(layer.named_parameters(), ref.parameters()):
        assert_close(p.grad, p_ref.grad, "delta_grad", torch.float32, name)


def test_rendering_is_byte_identical_across_processes():
    import hashlib
    code = ("import hashlib; from scanlang.backends.delta import codegen; from scanlang.delta import KACZMARZ_MAMBA2; "
            "print(hashlib.sha256(codegen.kernel_source(KACZMARZ_MAMBA2, 32).encode()).hexdigest())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == hashlib.sha256(codegen.kernel_source(KACZMARZ_MAMBA2, 32).encode()).hexdigest()


@pytest.mark.parametrize("save_wu", [True, False])
def test_launch_sequence_of_forward_and_backward(save_wu, knobs):
    """What `python -m scanlang.tools.offline_compile --workload delta` compiles: every kernel of one forward +
    backward, in order (bf16: state_bwd forms the local dU itself; with tuning.delta_save_wu the backward reads the
    forward's w, u instead of launching delta_wu)."""
    from scanlang.tools import offline_compile
    knobs(delta_save_wu=save_wu)
    names = [name for name, *_ in offline_compile.capture_launches(32, 16, torch.bfloat16, T=40)]
    assert names == ["prep", "state_output"] + ([] if save_wu else ["wu"]) + ["state_fwd", "state_bwd", "bwd_dqk",
                                                                               "bwd_wy"]


def test_kernels_compile_with_fp64_scalars_as_torch_compile_passes_them():
    """torch.compile's inductor types the Python-float arguments (eps, scale) fp64; every kernel converts them
    at entry, so Triton's front end compiles each one (no GPU: source -> TTIR in a subprocess, since this
    session interprets kernels). Without the conversion prep, state_bwd and recurrent fail to compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("from scanlang.tools import offline_compile\n"
            "for name, err in offline_compile.frontend_errors('fp64').items(): print(name, '|', err)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = dict(line.split(" | ", 1) for line in out.stdout.splitlines() if " | " in line)
    assert {"prep", "state_output", "state_bwd", "bwd_dqk", "bwd_wy", "dU_local", "recurrent"} <= rows.keys(), rows
    assert all(err == "None" for err in rows.values()), rows
