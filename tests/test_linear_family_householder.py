"""gated_delta_product (n Householder steps per token) on the delta-rule kernels with backend="triton": a delta rule
over the interleaved T*n rows (scanlang/delta_form.py, family.py; Triton's interpreter on CPU). Outputs, final
states and the gradients of q, k, v, g, beta, the per-head inputs and the initial state against an independent
float64 token loop written here, differentiated by autograd."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import scanlang as sl
from scanlang.backends.delta import ops as delta_ops
from scanlang.recipes import linear as L
from scanlang.delta_form import default_backend, delta_form, runs_on_delta
from scanlang.testing import assert_close

C = 16                # the delta kernels' chunk here: it counts rows of the interleaved stream (T*n)
D64 = torch.float64
H, K, V = 2, 6, 5     # two heads, K != V, neither a power of two

# hooks of a user's Householder member: a decay hook that is 0 at a = 0 for every per-head w (the kernels evaluate
# it, w's gradient from their dhp), and Mamba2's gate, -exp(A_log) log 2 at a = 0 (evaluated on the host)
KERNEL_DECAY = sl.matrix_state("hh_kernel_decay", decay="per_head", correction="householder", steps=2,
                               inputs={"a": "token", "w": "head", "b": "token"},
                               beta=lambda t: sl.sigmoid(t.b), log_decay=lambda t: -sl.softplus(t.w) * t.a * t.a)
HOST_DECAY = sl.matrix_state("hh_host_decay", decay="per_head", correction="householder", steps=2,
                             inputs={"a": "token", "A_log": "head", "b": "token"},
                             beta=lambda t: sl.sigmoid(t.b) / (1 + t.n2),
                             log_decay=lambda t: -sl.exp(t.A_log) * sl.softplus(t.a))


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    """Every delta-kernel buffer starts as NaN (an integer one as -1), so an element left unwritten shows."""
    monkeypatch.setattr(delta_ops, "_empty", lambda *s, device, dtype: torch.full(
        s, float("nan") if dtype.is_floating_point else -1, device=device, dtype=dtype))


def token_loop(q, k, v, g, beta, n, scale, h0, bounds):
    """Per token: S <- exp(g_t) S, then for j < n: S <- S + beta_tj k_tj (v_tj - S^T k_tj)^T on row t*n+j of k, v,
    beta; o_t = scale S^T q_t. float64, one row at a time; bounds: (batch row, first token, end) per sequence."""
    B, T = q.shape[:2]
    o = [[q.new_zeros(H, v.shape[-1])] * T for _ in range(B)]
    finals = []
    for i, (b, s, e) in enumerate(bounds):
        S = h0[i]
        for t in range(s, e):
            if g is not None:
                S = torch.exp(g[b, t])[:, None, None] * S
            for j in range(n):
                r = t * n + j
                err = v[b, r] - torch.einsum("hkv,hk->hv", S, k[b, r])
                S = S + beta[b, r][:, None, None] * k[b, r][:, :, None] * err[:, None, :]
            o[b][t] = scale * torch.einsum("hkv,hk->hv", S, q[b, t])
        finals.append(S)
    return torch.stack([torch.stack(row) for row in o]), torch.stack(finals)


def make(n, B, T, seed, N=None, heads=()):
    """float64 inputs, random and non-zero: q, k (norms about 1), v, g <= 0, beta in (0, 1), h0, and `heads` [H]."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=D64)  # noqa: E731
    x = {"q": rnd(B, T, H, K), "k": rnd(B, T * n, H, K) / K ** 0.5, "v": rnd(B, T * n, H, V),
         "g": -(0.05 + torch.rand(B, T, H, generator=gen, dtype=D64)),
         "beta": 0.01 + 0.98 * torch.rand(B, T * n, H, generator=gen, dtype=D64), "h0": rnd(N or B, H, K, V)}
    x.update({name: rnd(H) for name in heads})
    return x


def cotangents(o_shape, S_shape):
    gen = torch.Generator().manual_seed(99)
    return torch.randn(o_shape, generator=gen, dtype=D64), torch.randn(S_shape, generator=gen, dtype=D64)


def backprop(o, S, leaves):
    do, dS = cotangents(o.shape, S.shape)
    ((o.double() * do.to(o.device)).sum() + (S.double() * dS.to(S.device)).sum()).backward()
    return {name: t.grad for name, t in leaves.items()}


def bounds_of(B, T, cu):
    return [(b, 0, T) for b in range(B)] if cu is None else [(0, s, e) for s, e in zip(cu[:-1], cu[1:])]


def run_product(x, n, gated, cu=None, grad=True, backend="triton", device="cpu", chunk_size=C):
    """gated_delta_product on fp32 copies of x on `device` (g=None when not gated); (o, S, grads or {})."""
    names = ["q", "k", "v"] + (["g"] if gated else []) + ["beta", "h0"]
    ts = {name: x[name].to(device, torch.float32).clone().requires_grad_(grad) for name in names}
    o, S = L.gated_delta_product(ts["q"], ts["k"], ts["v"], ts.get("g"), ts["beta"], n, initial_state=ts["h0"],
                                 output_final_state=True, backend=backend, chunk_size=chunk_size,
                                 cu_seqlens=None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device))
    return o, S, (backprop(o, S, ts) if grad else {})


def oracle_product(x, n, gated, cu=None):
    names = ["q", "k", "v"] + (["g"] if gated else []) + ["beta", "h0"]
    ts = {name: x[name].clone().requires_grad_() for name in names}
    B, T = x["q"].shape[:2]
    o, S = token_loop(ts["q"], ts["k"], ts["v"], ts.get("g"), ts["beta"], n, K ** -0.5, ts["h0"], bounds_of(B, T, cu))
    return o.detach(), S.detach(), backprop(o, S, ts)


ROWS = {"q": "delta_grad", "k": "delta_grad", "v": "delta_grad", "h0": "delta_grad", "g": "delta_gate_grad",
        "beta": "delta_gate_grad", "a": "delta_gate_grad", "b": "delta_gate_grad", "w": "delta_param_grad",
        "A_log": "delta_param_grad"}


def check(got, want, what):
    (o, S, grads), (o_ref, S_ref, grads_ref) = got, want
    assert o.shape == o_ref.shape and S.shape == S_ref.shape
    assert_close(o, o_ref, "delta_out", torch.float32, name=f"{what} o")
    assert_close(S, S_ref, "delta_out", torch.float32, name=f"{what} S")
    assert set(grads) == set(grads_ref)
    for name, g in grads.items():
        assert g is not None, f"{what}: {name} got no gradient"
        assert_close(g, grads_ref[name], ROWS[name], torch.float32, name=f"{what} d{name}")


@pytest.mark.parametrize("n, T, gated", [
    (2, 9, True),     # 18 rows: across the chunk boundary (C = 16 rows)
    (3, 1, True),     # one token
    (2, 5, False),    # odd T, no decay
    pytest.param(3, 7, True, marks=pytest.mark.slow),     # 21 rows, a chunk ending inside a token
    pytest.param(3, 11, False, marks=pytest.mark.slow),   # 33 rows: three chunks
    pytest.param(2, 17, True, marks=pytest.mark.slow),
])
def test_product_matches_the_token_loop(n, T, gated):
    """B = 2, H = 2: outputs, final states and every gradient (chunk kernels), and the forward without
    gradients (the token-loop kernel up to 16 rows, else the chunk forward)."""
    x = make(n, 2, T, seed=10 * n + T)
    want = oracle_product(x, n, gated)
    what = f"n={n} T={T} {'gated' if gated else 'ungated'}"
    check(run_product(x, n, gated), want, what)
    decl = L.gated_delta_product_declaration(n, gated=gated)
    rule = delta_form(decl, decl.constants).rule
    assert f"{rule.name}_{rule.key}_c{C}" in delta_ops.PROGRAMS   # the delta backend's kernels ran
    o, S, _ = run_product(x, n, gated, grad=False)
    assert_close(o, want[0], "delta_out", torch.float32, name=f"{what} o (no grad)")
    assert_close(S, want[1], "delta_out", torch.float32, name=f"{what} S (no grad)")


@pytest.mark.parametrize("n, gated", [(2, True), pytest.param(3, False, marks=pytest.mark.slow)])
def test_packed_sequences_with_length_one_and_zero(n, gated):
    """cu_seqlens counts tokens of q; the kernels see them times n. Lengths 1, 0, 9 (18 rows at n = 2)."""
    cu = [0, 1, 1, 10]
    x = make(n, 1, cu[-1], seed=3 + n, N=len(cu) - 1)
    got = run_product(x, n, gated, cu=cu)
    check(got, oracle_product(x, n, gated, cu=cu), f"n={n} packed")
    assert torch.equal(got[1][1], x["h0"][1].float())    # the empty sequence keeps its initial state


@pytest.mark.parametrize("decl", [KERNEL_DECAY, pytest.param(HOST_DECAY, marks=pytest.mark.slow)],
                         ids=lambda d: d.name)
def test_a_declared_product_with_per_head_inputs(decl):
    """A user's member: the decay hook in the kernels when it is 0 at a = 0 (the interleaved rows after a token's
    first), else on the host; the per-head inputs' gradients either way."""
    form = delta_form(decl, decl.constants)
    head = "w" if decl is KERNEL_DECAY else "A_log"
    assert form.host_decay == (decl is HOST_DECAY) and form.params == (() if form.host_decay else (head,))
    n, T = 2, 9
    x = make(n, 1, T, seed=21, heads=(head,))
    gen = torch.Generator().manual_seed(22)
    x["a"], x["b"] = torch.randn(1, T, H, generator=gen, dtype=D64), torch.randn(1, T * n, H, generator=gen, dtype=D64)
    names = ["q", "k", "v", "a", head, "b", "h0"]
    ts = {name: x[name].float().clone().requires_grad_() for name in names}
    o, S = L.op(decl)(ts["q"], ts["k"], ts["v"], ts["a"], ts[head], ts["b"], initial_state=ts["h0"],
                      output_final_state=True, backend="triton", chunk_size=C)
    got = (o, S, backprop(o, S, ts))
    ref = {name: x[name].clone().requires_grad_() for name in names}
    if decl is KERNEL_DECAY:
        g = -F.softplus(ref["w"]) * ref["a"] ** 2
        beta = torch.sigmoid(ref["b"])
    else:
        g = -torch.exp(ref["A_log"]) * F.softplus(ref["a"])
        beta = torch.sigmoid(ref["b"]) / (1 + (ref["k"] * ref["k"]).sum(-1))
    o_ref, S_ref = token_loop(ref["q"], ref["k"], ref["v"], g, beta, n, K ** -0.5, ref["h0"], bounds_of(1, T, None))
    check(got, (o_ref.detach(), S_ref.detach(), backprop(o_ref, S_ref, ref)), decl.name)


def test_householder_structures_route_to_the_delta_kernels():
    """backend=None: the delta kernels on CUDA (float32 compute, a chunk they take), the reference on CPU;
    per-key decay with Householder steps is not a delta-kernel structure."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    per_key = sl.matrix_state("hh_per_key", decay="per_key", correction="householder", steps=2,
                              inputs={"g": "token_key", "beta": "token"}, beta=lambda t: t.beta,
                              log_decay=lambda t: t.g)
    for decl in (L.gated_delta_product_declaration(2), L.gated_delta_product_declaration(3, gated=False),
                 KERNEL_DECAY, HOST_DECAY):
        assert runs_on_delta(decl), decl.name
        assert default_backend(decl, cuda, torch.float32, 64, 64, 64, (16, 32, 64), 256) == "triton"
        assert default_backend(decl, cpu, torch.float32, 64, 64, 64, (16, 32, 64), 256) == "reference"
    assert not runs_on_delta(per_key)
    assert default_backend(per_key, cuda, torch.float32, 64, 64, 64, (16, 32, 64), 256) == "reference"
    x = make(2, 1, 3, seed=5)
    o, S, _ = run_product(x, 2, True, grad=False, backend=None)    # CPU: the reference, bit for bit
    o_ref, S_ref, _ = run_product(x, 2, True, grad=False, backend="reference")
    assert torch.equal(o, o_ref) and torch.equal(S, S_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("n, gated", [(2, True), (3, False)])
def test_on_cuda_the_default_backend_is_the_delta_kernels(n, gated):
    """backend=None on CUDA runs the interleaved stream on the delta kernels at their chunk of 64 rows (the GPU rows
    of the table), equal-length and packed."""
    x = make(n, 2, 3 * 64 // n + 7, seed=7 + n)
    check(run_product(x, n, gated, backend=None, device="cuda", chunk_size=None), oracle_product(x, n, gated),
          f"n={n} (cuda)")
    decl = L.gated_delta_product_declaration(n, gated=gated)
    rule = delta_form(decl, decl.constants).rule
    assert f"{rule.name}_{rule.key}_c64" in delta_ops.PROGRAMS
    cu = [0, 1, 1, 70, 200]
    x = make(n, 1, cu[-1], seed=8 + n, N=len(cu) - 1)
    check(run_product(x, n, gated, cu=cu, backend=None, device="cuda", chunk_size=None),
          oracle_product(x, n, gated, cu=cu), f"n={n} (cuda, packed)")
