"""A matrix-state member no library ships: Kaczmarz's step with KDA's per-key decay.

Kaczmarz's step beta = eta / (||k||^2 + eps) makes each write solve for v exactly (the residual of
the current key is projected out), and KDA's per-key gate forgets each key channel at its own rate.
Declared in ten lines, proved by scanlang, run on the chunked reference backend and checked against a
plain token loop in float64; backend="triton" runs it on chunk kernels generated from the declaration
(backends/linear/kernels_delta.py, forward and backward; tests/test_linear_family_kda.py).

    python examples/new_matrix_state_member.py
"""
import time

import torch
import torch.nn.functional as F

import scanlang as sl
from scanlang.recipes.linear import op

kaczmarz_kda = sl.matrix_state(
    "kaczmarz_kda",
    decay="per_key",                       # S <- diag(exp(g_t)) S
    correction="delta",                    # S <- S + beta_t k_t (v_t - S^T k_t)^T
    inputs={"a": "token_key", "b": "token"},
    constants={"eps": 1e-6},
    beta=lambda t: sl.sigmoid(t.b) / (t.n2 + t.eps),     # Kaczmarz: eta = sigmoid(b) in (0, 1)
    log_decay=lambda t: sl.logsigmoid(t.a),              # KDA-style gate, <= 0 by construction
)
run = op(kaczmarz_kda)


def token_loop(q, k, v, a, b, eps=1e-6):
    """The definition, one token at a time, float64."""
    B, T, H, K = q.shape
    S = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64)
    o = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    for t in range(T):
        kt = k[:, t]
        beta = torch.sigmoid(b[:, t]) / ((kt * kt).sum(-1) + eps)
        S = torch.exp(F.logsigmoid(a[:, t]))[..., None] * S
        err = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, kt)
        S = S + beta[..., None, None] * kt[..., None] * err[..., None, :]
        o[:, t] = K ** -0.5 * torch.einsum("bhkv,bhk->bhv", S, q[:, t])
    return o, S


def main():
    print(kaczmarz_kda)
    print(kaczmarz_kda.proof)
    print("d beta / d b =", kaczmarz_kda.beta.grads["b"], "  d g / d a =", kaczmarz_kda.log_decay.grads["a"])
    torch.manual_seed(0)
    B, T, H, K, V = 2, 100, 2, 16, 16
    q, k = torch.randn(B, T, H, K, dtype=torch.float64), torch.randn(B, T, H, K, dtype=torch.float64)
    v, a = torch.randn(B, T, H, V, dtype=torch.float64), torch.randn(B, T, H, K, dtype=torch.float64)
    b = torch.randn(B, T, H, dtype=torch.float64)
    o, S = run(q, k, v, a, b, output_final_state=True, backend="reference")
    o_ref, S_ref = token_loop(q, k, v, a, b)
    err = max(float((o - o_ref).abs().max()), float((S - S_ref).abs().max()))
    print(f"float64 reference vs token loop: max |error| = {err:.1e}")
    assert err < 1e-10, err
    x = [t.float().requires_grad_(True) for t in (q, k, v, a, b)]
    start = time.perf_counter()
    o32, _ = run(*x)
    o32.square().mean().backward()
    print(f"fp32 forward + backward on the CPU reference, B{B} T{T} H{H} K{K} V{V}: "
          f"{1e3 * (time.perf_counter() - start):.0f} ms; every gradient finite: "
          f"{all(bool(torch.isfinite(t.grad).all()) for t in x)}")


if __name__ == "__main__":
    main()
