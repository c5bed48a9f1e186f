"""torch.compile(fullgraph=True) through the generated matrix-state chunk kernels (backends/linear): the
member call traces whole into the torch.library ops `scanlang::linear_chunk_fwd` / `linear_chunk_bwd`,
and the compiled outputs and every gradient equal the eager call's bit for bit (the same kernels with the
same launch arguments; eager skips the dispatcher), which equal a float64 token loop within the spec's
tolerance. Dynamo's "eager" backend: Triton's interpreter cannot run on AOT's fake tensors."""
import pytest
import torch
import torch.nn.functional as F

import scanlang as sl
from scanlang.recipes import linear as L
from scanlang.second_order import SecondOrderError
from scanlang.testing import assert_close

C = 16
H, K, V = 2, 16, 24
D64 = torch.float64

GATED = sl.matrix_state("compile_gated", decay="per_key", inputs={"a": "token_key", "b": "token"},
                        constants={"c": 0.5}, log_decay=lambda t: sl.logsigmoid(t.a) * sl.sigmoid(t.b) * t.c)
HEADS = sl.matrix_state("compile_heads", decay="per_head", inputs={"a": "token", "A_log": "head"},
                        log_decay=lambda t: -sl.exp(t.A_log) * sl.softplus(t.a))
KACZMARZ_KDA = sl.matrix_state("compile_kaczmarz_kda", decay="per_key", correction="delta",
                               inputs={"a": "token_key", "eta": "token"}, constants={"eps": 1e-6},
                               beta=lambda t: t.eta / (t.n2 + t.eps), log_decay=lambda t: sl.logsigmoid(t.a))
OPS = {d.name: L.op(d) for d in (GATED, HEADS, KACZMARZ_KDA)} | {"linear_attention": L.linear_attention}


def _inputs(name, T, gen):
    q, k = (torch.randn(1, T, H, K, generator=gen, dtype=D64) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen, dtype=D64)
    if name == "compile_gated":
        extra = [torch.randn(1, T, H, K, generator=gen, dtype=D64), torch.randn(1, T, H, generator=gen, dtype=D64)]
    elif name == "compile_heads":
        extra = [torch.randn(1, T, H, generator=gen, dtype=D64), 0.3 * torch.randn(H, generator=gen, dtype=D64)]
    elif name == "compile_kaczmarz_kda":
        extra = [torch.randn(1, T, H, K, generator=gen, dtype=D64), torch.rand(1, T, H, generator=gen, dtype=D64)]
    else:
        extra = []
    return [q, k, v, *extra]


def _log_decay(name, extra):
    if name == "compile_gated":
        a, b = extra
        return F.logsigmoid(a) * torch.sigmoid(b)[..., None] * 0.5
    if name == "compile_heads":
        a, A_log = extra
        return -torch.exp(A_log) * F.softplus(a)
    if name == "compile_kaczmarz_kda":
        return F.logsigmoid(extra[0])
    return None


def token_loop(name, q, k, v, extra, h0):
    """S_t = D_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T (beta = 1 and no projection for plain
    writes), o_t = K^-1/2 S_t^T q_t, in float64 one token at a time."""
    g = _log_decay(name, extra)
    T = q.shape[1]
    S = h0.to(D64).clone()
    o = torch.zeros(1, T, H, V, dtype=D64)
    for t in range(T):
        for h in range(H):
            if g is not None:
                d = torch.exp(g[0, t, h])
                S[0, h] = (d[:, None] if d.dim() else d) * S[0, h]
            kt, vt = k[0, t, h], v[0, t, h]
            if name == "compile_kaczmarz_kda":
                beta = extra[1][0, t, h] / (kt @ kt + 1e-6)
                S[0, h] = S[0, h] + beta * torch.outer(kt, vt - S[0, h].T @ kt)
            else:
                S[0, h] = S[0, h] + torch.outer(kt, vt)
            o[0, t, h] = K ** -0.5 * S[0, h].T @ q[0, t, h]
    return o, S


@pytest.mark.parametrize("name", list(OPS))
def test_fullgraph_compile_equals_eager_and_the_token_loop(name):
    gen = torch.Generator().manual_seed(3)
    T = C + 3   # two chunks, the second partial
    ins = _inputs(name, T, gen)
    h0 = torch.randn(1, H, K, V, generator=gen, dtype=D64)
    op = OPS[name]

    def f(q, k, v, h0, *extra):
        return op(q, k, v, *extra, initial_state=h0, output_final_state=True, backend="triton", chunk_size=C)

    def run(fn):
        leaves = [t.float().requires_grad_() for t in (*ins[:3], h0, *ins[3:])]
        o, S = fn(*leaves)
        weights = torch.Generator().manual_seed(4)   # the same cotangents for both calls
        do, dS = torch.randn(o.shape, generator=weights), torch.randn(S.shape, generator=weights)
        grads = torch.autograd.grad((o * do).sum() + (S * dS).sum(), leaves)
        return o, S, grads

    torch._dynamo.reset()
    o_c, S_c, grads_c = run(torch.compile(f, fullgraph=True, backend="eager"))
    o_e, S_e, grads_e = run(f)
    torch.testing.assert_close(o_c, o_e, rtol=0, atol=0)
    torch.testing.assert_close(S_c, S_e, rtol=0, atol=0)
    for i, (gc, ge) in enumerate(zip(grads_c, grads_e)):
        torch.testing.assert_close(gc, ge, rtol=0, atol=0, msg=f"gradient {i} of {name}")
        assert torch.isfinite(gc).all() and gc.abs().sum() > 0, f"gradient {i} of {name} is zero or not finite"
    o_ref, S_ref = token_loop(name, *ins[:3], ins[3:], h0)
    assert_close(o_c, o_ref, "delta_out", torch.float32, name=f"compiled o of {name}")
    assert_close(S_c, S_ref, "delta_out", torch.float32, name=f"compiled S of {name}")


def test_compiled_call_refuses_a_second_derivative():
    """create_graph=True through the compiled op still refuses the second differentiation, by name."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, a, b = (t.float().requires_grad_() for t in _inputs("compile_gated", C + 1, gen))
    fn = torch.compile(lambda *x: OPS["compile_gated"](*x, backend="triton", chunk_size=C)[0], fullgraph=True,
                       backend="eager")
    torch._dynamo.reset()
    (dq,) = torch.autograd.grad(fn(q, k, v, a, b).sum(), [q], create_graph=True)
    with pytest.raises(SecondOrderError, match="compile_gated"):
        dq.sum().backward()


@pytest.mark.parametrize("cu", [None, [0, 1, 1, 4]], ids=["batch", "packed"])
@pytest.mark.parametrize("name", ["compile_heads", "compile_kaczmarz_kda"])
def test_compile_of_a_decode_step(name, cu):
    """Without gradients a short sequence takes the decode kernel, compiled too (`scanlang::linear_decode`):
    a generation step of a compiled model. A batch of 2 x 1 token traces whole (fullgraph); packed
    sequences of 1, 0 and 3 tokens break the graph where the op reads the offsets."""
    gen = torch.Generator().manual_seed(6)
    T = 1 if cu is None else cu[-1]
    ins = [t.float() for t in _inputs(name, T, gen)]
    if cu is None:   # two sequences of one token: a batch of 2
        ins = [torch.cat([t, t.flip(-1)]) if t.dim() > 1 else t for t in ins]
    bounds = [(b, 0, T) for b in range(ins[0].shape[0])] if cu is None else [(0, s, e) for s, e in zip(cu, cu[1:])]
    h0 = torch.randn(len(bounds), H, K, V, generator=gen)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    f = lambda q, k, v, h0, *extra: OPS[name](q, k, v, *extra, initial_state=h0, output_final_state=True,  # noqa: E731
                                              cu_seqlens=cu_t, backend="triton", chunk_size=C)
    torch._dynamo.reset()
    with torch.no_grad():
        o_c, S_c = torch.compile(f, fullgraph=cu is None, backend="eager")(*ins[:3], h0, *ins[3:])
        o_e, S_e = f(*ins[:3], h0, *ins[3:])
    torch.testing.assert_close(o_c, o_e, rtol=0, atol=0)
    torch.testing.assert_close(S_c, S_e, rtol=0, atol=0)
    for n, (b, s, e) in enumerate(bounds):
        piece = lambda t: t[b:b + 1, s:e] if t.dim() > 1 else t  # noqa: E731
        o_ref, S_ref = token_loop(name, *(piece(t).double() for t in ins[:3]), [piece(t).double() for t in ins[3:]],
                                  h0[n:n + 1].double())
        assert_close(o_c[b:b + 1, s:e], o_ref, "delta_out", torch.float32, name=f"o of sequence {n}")
        assert_close(S_c[n:n + 1], S_ref, "delta_out", torch.float32, name=f"S of sequence {n}")
