"""The matrix-state members against fla's own naive recurrent references (fla-core, pip), where it
is installed: the same names, shapes and argument order must mean the same recurrence."""
import pytest
import torch
import torch.nn.functional as F

from scanlang.recipes import linear as L
from scanlang.testing import assert_close

fla_naive = {}
for _name in ("gla", "simple_gla", "kda", "gated_delta_rule", "gated_delta_product", "linear_attn"):
    fla_naive[_name] = pytest.importorskip(f"fla.ops.{_name}.naive", reason="fla-core (pip) is not installed")

D64 = torch.float64
B, T, H, K, V = 2, 37, 2, 8, 6


def _inputs(seed, n=1):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=D64)  # noqa: E731
    return (r(B, T, H, K), r(B, T * n, H, K) / K ** 0.5, r(B, T * n, H, V), F.logsigmoid(r(B, T, H, K)) / 4,
            torch.rand(B, T * n, H, generator=gen, dtype=D64), r(B, H, K, V))


def _check(name, ours, theirs):
    for what, a, b in zip(("o", "S"), theirs, ours):
        assert_close(b.float(), a, "delta_out", torch.float32, name=f"{name} {what}")
        assert_close(a.float(), b.float(), "delta_out", torch.float32, name=f"fla {name} {what}")


def test_members_mean_what_fla_means():
    q, k, v, gk, beta, h0 = _inputs(0)
    f32 = lambda *xs: [x.float() for x in xs]  # noqa: E731
    g = gk[..., 0]
    kw = dict(initial_state=h0, output_final_state=True, backend="reference")
    _check("linear_attention", L.linear_attention(q, k, v, **kw),
           fla_naive["linear_attn"].naive_recurrent_linear_attn(*f32(q, k, v), initial_state=h0.float(),
                                                                  output_final_state=True))
    _check("simple_gla", L.simple_gla(q, k, v, g, **kw),
           fla_naive["simple_gla"].naive_recurrent_simple_gla(*f32(q, k, v, g), initial_state=h0.float(),
                                                                output_final_state=True))
    _check("gla", L.gla(q, k, v, gk, **kw),
           fla_naive["gla"].naive_recurrent_gla(*f32(q, k, v, gk), initial_state=h0.float(), output_final_state=True))
    _check("kda", L.kda(q, k, v, gk, beta, **kw),
           fla_naive["kda"].naive_recurrent_kda(*f32(q, k, v, gk, beta), initial_state=h0.float(),
                                                  output_final_state=True))
    _check("delta_rule", L.delta_rule(q, k, v, g, beta, **kw),
           fla_naive["gated_delta_rule"].naive_recurrent_gated_delta_rule(*f32(q, k, v, beta, g),
                                                                            initial_state=h0.float(),
                                                                            output_final_state=True))
    q, k, v, gk, beta, h0 = _inputs(1, n=2)
    kw["initial_state"] = h0
    _check("gated_delta_product", L.gated_delta_product(q, k, v, gk[..., 0], beta, 2, **kw),
           fla_naive["gated_delta_product"].naive_recurrent_gated_delta_product(
               *f32(q, k, v, gk[..., 0], beta), scale=K ** -0.5, initial_state=h0.float(),
               output_final_state=True, num_householder=2))
