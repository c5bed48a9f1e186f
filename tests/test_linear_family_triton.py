"""The generated plain-write matrix-state kernels (backends/linear) in Triton's interpreter: every
output, final state and gradient against an independent float64 token loop written here."""
import pytest
import torch
import torch.nn.functional as F

import scanlang as sl
from scanlang.backends.linear import kernels, ops
from scanlang.recipes import linear as L
from scanlang.testing import assert_close

C = 16          # the chunk knob in these tests: T = 1, C - 1, C + 1 and 37 cover a partial, a full and a third chunk
D64 = torch.float64
H, K, V = 2, 16, 24

# a per-key hook from two raw gates (one per key, one per token broadcast over K) with a constant
GATED = sl.matrix_state("gated_gla", decay="per_key", inputs={"a": "token_key", "b": "token"},
                        constants={"c": 0.5}, log_decay=lambda t: sl.logsigmoid(t.a) * sl.sigmoid(t.b) * t.c)
GATED_OP = L.op(GATED)
# a per-head hook: g = -softplus(a)
SOFT = sl.matrix_state("soft_gla", decay="per_head", inputs={"a": "token"}, log_decay=lambda t: -sl.softplus(t.a))
SOFT_OP = L.op(SOFT)
# Mamba2's gate with per-head parameters: g = -exp(A_log) softplus(a + dt_bias), per head; and per key
MAMBA2 = sl.matrix_state("mamba2_ssd", decay="per_head", inputs={"a": "token", "A_log": "head", "dt_bias": "head"},
                         log_decay=lambda t: -sl.exp(t.A_log) * sl.softplus(t.a + t.dt_bias))
MAMBA2_KEY = sl.matrix_state("mamba2_key", decay="per_key", inputs={"a": "token_key", "A_log": "head"},
                             log_decay=lambda t: -sl.exp(t.A_log) * sl.softplus(t.a))


def token_loop(q, k, v, g, scale=None, h0=None, cu=None):
    """S_t = D_t S_{t-1} + k_t v_t^T, o_t = scale S_t^T q_t in float64, one token at a time;
    g None | [B,T,H] | [B,T,H,K] (log-decays)."""
    q, k, v = (t.to(D64) for t in (q, k, v))
    B, T, Hn, Kn = q.shape
    scale = Kn ** -0.5 if scale is None else scale
    bounds = [(b, 0, T) for b in range(B)] if cu is None else [(0, s, e) for s, e in zip(cu[:-1], cu[1:])]
    o = torch.zeros(B, T, Hn, v.shape[-1], dtype=D64)
    finals = []
    for i, (b, s, e) in enumerate(bounds):
        S = torch.zeros(Hn, Kn, v.shape[-1], dtype=D64) if h0 is None else h0[i].to(D64)
        for t in range(s, e):
            if g is not None:
                d = torch.exp(g[b, t].to(D64))
                S = (d[:, None, None] if g.dim() == 3 else d[:, :, None]) * S
            S = S + k[b, t][:, :, None] * v[b, t][:, None, :]
            o[b, t] = scale * torch.einsum("hkv,hk->hv", S, q[b, t])
        finals.append(S)
    return o, torch.stack(finals)


def _inputs(member, B, T, gen, dtype=torch.float32, g_min=None):
    """q, k, v and the member's inputs (random, non-zero), and the oracle's g from them."""
    q, k = (torch.randn(B, T, H, K, generator=gen, dtype=D64) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, dtype=D64)
    if member == "linear_attention":
        extra, g = [], None
    elif member in ("simple_gla", "gla"):
        shape = (B, T, H) if member == "simple_gla" else (B, T, H, K)
        g = (-(0.05 + torch.rand(shape, generator=gen, dtype=D64)) if g_min is None
             else torch.full(shape, g_min, dtype=D64))
        extra = [g]
    elif member == "gated":
        a, b = torch.randn(B, T, H, K, generator=gen, dtype=D64), torch.randn(B, T, H, generator=gen, dtype=D64)
        extra, g = [a, b], F.logsigmoid(a) * torch.sigmoid(b)[..., None] * 0.5
    else:   # soft
        a = torch.randn(B, T, H, generator=gen, dtype=D64)
        extra, g = [a], -F.softplus(a)
    return [t.to(dtype) for t in (q, k, v, *extra)], g


def _call(member, *args, **kw):
    fn = {"gated": GATED_OP, "soft": SOFT_OP}.get(member) or getattr(L, member)
    return fn(*args, **kw)


def _check(member, B, T, with_h0=True, cu=None, dtype=torch.float32, g_min=None, seed=0, chunk=C):
    gen = torch.Generator().manual_seed(seed)
    N = B if cu is None else len(cu) - 1
    ins, _ = _inputs(member, B, T, gen, dtype, g_min)
    h0 = torch.randn(N, H, K, V, generator=gen, dtype=D64).float() if with_h0 else None
    leaves = [t.clone().requires_grad_() for t in ins] + ([h0.clone().requires_grad_()] if with_h0 else [])
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    o, S = _call(member, *leaves[:len(ins)], initial_state=leaves[-1] if with_h0 else None, output_final_state=True,
                 cu_seqlens=cu_t, backend="triton", chunk_size=chunk)
    wo = torch.randn(o.shape, generator=gen, dtype=D64)
    ws = torch.randn(S.shape, generator=gen, dtype=D64)
    ((o * wo.float()).sum() + (S * ws.float()).sum()).backward()
    # the oracle on the same (rounded) values, differentiated by autograd in float64
    refs = [t.detach().to(D64).requires_grad_() for t in leaves]
    x = refs[:len(ins)]
    g = _oracle_g(member, x)
    o_ref, S_ref = token_loop(x[0], x[1], x[2], g, h0=refs[-1] if with_h0 else None, cu=cu)
    ((o_ref * wo).sum() + (S_ref * ws).sum()).backward()
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    assert_close(o, o_ref, "delta_out", dtype, name=f"{member} o")
    assert_close(S, S_ref, "delta_out", dtype, name=f"{member} S")
    names = ["dq", "dk", "dv"] + [f"d{n}" for n in ("g0", "g1")][:len(ins) - 3] + (["dh0"] if with_h0 else [])
    for name, leaf, ref in zip(names, leaves, refs):
        row = "delta_gate_grad" if name.startswith("dg") else "delta_grad"
        assert leaf.grad is not None, f"{member}: no gradient for {name}"
        assert_close(leaf.grad, ref.grad, row, dtype, name=f"{member} {name}")
    return o, S, leaves


def _oracle_g(member, x):
    if member == "linear_attention":
        return None
    if member in ("simple_gla", "gla"):
        return x[3]
    if member == "gated":
        return F.logsigmoid(x[3]) * torch.sigmoid(x[4])[..., None] * 0.5
    return -F.softplus(x[3])


@pytest.mark.parametrize("T", [C + 1, 1, C - 1, 37])
@pytest.mark.parametrize("member", ["simple_gla", "linear_attention", "gla"])
def test_member_against_token_loop(member, T):
    """Outputs, final state and the gradients of q, k, v, g and the initial state, B = 2."""
    _check(member, 2, T)


@pytest.mark.parametrize("member", ["gated", "soft"])
def test_hooked_decay_against_token_loop(member):
    """A traced hook (logsigmoid * sigmoid * a constant per key; -softplus per head): the kernel's
    hook and its sympy derivative give every input's gradient."""
    _check(member, 1, 2 * C + 3)


@pytest.mark.parametrize("member", ["simple_gla", "linear_attention", "gla"])
def test_cu_seqlens_with_empty_and_single_token_sequences(member):
    cu = [0, 0, 1, C + 2, C + 2, 2 * C + 5]
    o, S, leaves = _check(member, 1, cu[-1], cu=cu)
    torch.testing.assert_close(S[0], leaves[-1][0].detach(), rtol=0, atol=0)   # the empty sequences keep h0
    torch.testing.assert_close(S[3], leaves[-1][3].detach(), rtol=0, atol=0)


@pytest.mark.parametrize("member", ["gla", "simple_gla"])
def test_strong_decay_stays_finite(member):
    """g = -20 per token: e^(G_i) reaches e^(-20 C) in a chunk; no exponent may be positive, also
    between the rows of a partial last chunk and its padding."""
    o, S, leaves = _check(member, 1, 2 * C + 10, g_min=-20.0)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert all(torch.isfinite(t.grad).all() for t in leaves)


@pytest.mark.parametrize("chunk,g_min,block", [(32, None, 1), (64, -20.0, 1), (32, -20.0, 16), (64, None, 16),
                                               (64, -20.0, 4)])
def test_per_key_row_blocks(chunk, g_min, block, knobs):
    """The pairwise products' tree (kernels.py `pairwise_kernels`) down to row blocks of
    tuning.linear_pairwise_block: pairs between the halves of each level's blocks through a reference row
    (tl.dot), pairs inside a block exactly; a partial last chunk."""
    knobs(linear_pairwise_block=block)
    _check("gla", 1, chunk + 5, g_min=g_min, chunk=chunk)


def test_without_initial_state_and_final_state_off():
    gen = torch.Generator().manual_seed(3)
    (q, k, v, g), g_ref = _inputs("gla", 1, C + 3, gen)
    with sl.tuning.override(decode_max_tokens=0):   # no gradients: the chunk kernels, not the decode kernel
        o, S = L.gla(q, k, v, g, backend="triton", chunk_size=C)
    assert S is None
    o_ref, _ = token_loop(q, k, v, g_ref.float())
    assert_close(o, o_ref, "delta_out", torch.float32, name="gla o")


@pytest.mark.parametrize("member", ["simple_gla", "linear_attention"])
def test_zero_keys_never_nan(member):
    gen = torch.Generator().manual_seed(4)
    ins, _ = _inputs(member, 1, C + 5, gen)
    ins[1] = torch.zeros_like(ins[1])
    leaves = [t.clone().requires_grad_() for t in ins]
    o, S = _call(member, *leaves, output_final_state=True, backend="triton", chunk_size=C)
    (o.sum() + S.sum()).backward()
    assert torch.count_nonzero(o) == 0 and torch.count_nonzero(S) == 0
    assert all(torch.isfinite(t.grad).all() for t in leaves)


@pytest.mark.parametrize("bad", ["v", "k"])
@pytest.mark.parametrize("member", ["simple_gla", "gla"])
def test_non_finite_token_never_reaches_earlier_outputs(member, bad):
    """Chunks of two row blocks: the NaN sits in the second block of the second chunk."""
    gen = torch.Generator().manual_seed(5)
    T, t_bad = 4 * C + 3, 3 * C + 6
    ins, g_ref = _inputs(member, 1, T, gen)
    which = {"k": 1, "v": 2}[bad]
    ins[which][0, t_bad, 1] = float("nan")
    with sl.tuning.override(decode_max_tokens=0):   # no gradients: the chunk kernels, not the decode kernel
        o, _ = _call(member, *ins, output_final_state=True, backend="triton", chunk_size=2 * C)
    clean = [t.clone() for t in ins]
    clean[which][0, t_bad:] = 0.0
    o_ref, _ = token_loop(clean[0], clean[1], clean[2], clean[3])
    assert torch.isfinite(o[:, :t_bad]).all()
    assert_close(o[:, :t_bad], o_ref[:, :t_bad], "delta_out", torch.float32, name="rows before the NaN")
    assert not torch.isfinite(o[0, t_bad:, 1]).all()   # and it does reach the later ones


def test_bf16_inputs():
    _check("gla", 1, C + 5, dtype=torch.bfloat16)


def test_bad_input_errors():
    gen = torch.Generator().manual_seed(6)
    (q, k, v, g), _ = _inputs("simple_gla", 1, 5, gen)
    with pytest.raises(ValueError, match="chunk_size must be a power of two"):
        L.simple_gla(q, k, v, g, backend="triton", chunk_size=24)
    with pytest.raises(ValueError, match="float64"):
        L.simple_gla(q.double(), k.double(), v.double(), g.double(), backend="triton", chunk_size=C)
    with pytest.raises(ValueError, match="log-decay"):
        L.simple_gla(q, k, v, -g, backend="triton", chunk_size=C)
    with pytest.raises(ValueError, match="log-decay"):   # NaN is no decay (checked where it costs no sync)
        L.simple_gla(q, k, v, torch.where(g < -0.5, float("nan"), g), backend="triton", chunk_size=C)
    with pytest.raises(ValueError, match="hard reset"), sl.tuning.override(decode_max_tokens=0):
        L.simple_gla(q, k, v, torch.where(g < -0.5, float("-inf"), g), backend="triton", chunk_size=C)
    with pytest.raises(ValueError, match=r"g must have shape \[B, T, H\]"):
        L.simple_gla(q, k, v, g[..., None], backend="triton", chunk_size=C)
    per_key_product = sl.matrix_state("per_key_product", decay="per_key", correction="householder", steps=2,
                                      inputs={"g": "token_key", "beta": "token"}, beta=lambda t: t.beta,
                                      log_decay=lambda t: t.g)   # the structure without chunk kernels
    with pytest.raises(ValueError, match="correction 'householder'"), sl.tuning.override(decode_max_tokens=0):
        L.op(per_key_product)(q, torch.cat([k, k], 1), torch.cat([v, v], 1), g[..., None].expand(q.shape),
                              torch.rand(1, 10, H), backend="triton")
    with pytest.raises(ValueError, match="plain writes"):
        kernels.module(L.members.KDA)


def test_generated_source_follows_the_structure():
    """none: no cumsum kernel and no decay input; per head: scalar decays; per key: the pairwise tree."""
    plain, head, key = (kernels.render(d) for d in (L.members.LINEAR_ATTENTION, L.members.SIMPLE_GLA, L.members.GLA))
    assert "decay_cumsum" not in plain and "G_ptr" not in plain
    assert "def simple_gla_decay_cumsum" in head and "pairwise_qk" not in head and "pairwise" not in plain
    assert "pairwise_qk(b_q, b_k, b_G, k_ptr, G_ptr" in key and "pairwise_grads(dA" in key and "def tree_level(" in key
    assert "log_decay = g" in key     # the declaration, cited in the kernels
    assert ops.module(L.members.GLA) is ops.module(L.members.GLA)   # rendered and loaded once


def test_torch_compile_with_cu_seqlens_runs_the_same_kernels():
    """Under torch.compile the op reads the offsets itself (a graph break: while tracing, the caller cannot),
    then the chunk kernels are traced through the torch.library ops (Dynamo's "eager" backend: Triton's
    interpreter cannot run on AOT's fake tensors)."""
    gen = torch.Generator().manual_seed(7)
    (q, k, v, g), g_ref = _inputs("simple_gla", 1, C + 9, gen)
    cu = [0, 3, 3, C + 9]
    cu_t = torch.tensor(cu, dtype=torch.int32)
    fn = lambda *x: L.simple_gla(*x, cu_seqlens=cu_t, output_final_state=True, backend="triton",  # noqa: E731
                                 chunk_size=C)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]
    torch._dynamo.reset()
    o, S = torch.compile(fn, backend="eager")(*leaves)
    o_eager, S_eager = fn(*leaves)   # with gradients, as compiled: the chunk kernels (not the decode kernel)
    torch.testing.assert_close(o, o_eager, rtol=0, atol=0)
    torch.testing.assert_close(S, S_eager, rtol=0, atol=0)
    o_ref, S_ref = token_loop(q, k, v, g_ref.float(), cu=cu)
    assert_close(o, o_ref, "delta_out", torch.float32, name="compiled o")
    assert_close(S, S_ref, "delta_out", torch.float32, name="compiled S")
    (o.sum() + S.sum()).backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)


@pytest.mark.parametrize("decl", [MAMBA2, MAMBA2_KEY], ids=lambda d: d.name)
def test_per_head_parameters_in_the_hook(decl):
    """Per-head parameters ([H]) in the decay hook: their gradients are sums over every token (and key)
    of every sequence (cu_seqlens with an empty one)."""
    gen = torch.Generator().manual_seed(8)
    T, cu = 2 * C + 3, [0, 5, 5, 2 * C + 3]
    q, k = (torch.randn(1, T, H, K, generator=gen, dtype=D64) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen, dtype=D64)
    a = torch.randn(1, T, H, *((K,) if decl.decay == "per_key" else ()), generator=gen, dtype=D64)
    params = [0.3 * torch.randn(H, generator=gen, dtype=D64) for _ in range(len(decl.inputs) - 1)]
    leaves = [t.float().requires_grad_() for t in (q, k, v, a, *params)]
    o, S = L.op(decl)(*leaves, cu_seqlens=torch.tensor(cu), output_final_state=True, backend="triton", chunk_size=C)
    w = torch.randn(o.shape, generator=gen, dtype=D64)
    ((o * w.float()).sum() + S.sum()).backward()
    refs = [t.detach().to(D64).requires_grad_() for t in leaves]
    A_log = refs[4][:, None] if decl.decay == "per_key" else refs[4]
    shift = refs[5] if len(refs) > 5 else 0.0
    g = -torch.exp(A_log) * F.softplus(refs[3] + shift)
    o_ref, S_ref = token_loop(refs[0], refs[1], refs[2], g, cu=cu)
    ((o_ref * w).sum() + S_ref.sum()).backward()
    assert_close(o, o_ref, "delta_out", torch.float32, name="o")
    assert_close(S, S_ref, "delta_out", torch.float32, name="S")
    for name, leaf, ref in zip(["dq", "dk", "dv", "da", "dA_log", "ddt_bias"], leaves, refs):
        row = "delta_param_grad" if name in ("dA_log", "ddt_bias") else (
            "delta_gate_grad" if name == "da" else "delta_grad")
        assert_close(leaf.grad, ref.grad, row, torch.float32, name=name)


@pytest.mark.parametrize("decl", [GATED, MAMBA2_KEY], ids=lambda d: d.name)
def test_per_key_backward_in_key_blocks(decl, knobs):
    """Per-key decay's backward split into key blocks (tuning.linear_key_block = 16 at K = 40: blocks of
    16, 16 and 8 keys, the last masked): dv and the per-token and per-head hook inputs' gradients are
    sums over the blocks (atomics), every other gradient is per key; all against the float64 loop."""
    knobs(linear_key_block=16)
    gen = torch.Generator().manual_seed(11)
    T, Kw = C + 5, 40
    q, k = (torch.randn(2, T, H, Kw, generator=gen, dtype=D64) for _ in range(2))
    v = torch.randn(2, T, H, V, generator=gen, dtype=D64)
    a = torch.randn(2, T, H, Kw, generator=gen, dtype=D64)
    second = (torch.randn(2, T, H, generator=gen, dtype=D64) if decl is GATED
              else 0.3 * torch.randn(H, generator=gen, dtype=D64))
    h0 = torch.randn(2, H, Kw, V, generator=gen, dtype=D64)
    leaves = [t.float().requires_grad_() for t in (q, k, v, a, second, h0)]
    o, S = L.op(decl)(*leaves[:5], initial_state=leaves[5], output_final_state=True, backend="triton", chunk_size=C)
    wo, ws = torch.randn(o.shape, generator=gen, dtype=D64), torch.randn(S.shape, generator=gen, dtype=D64)
    ((o * wo.float()).sum() + (S * ws.float()).sum()).backward()
    refs = [t.detach().to(D64).requires_grad_() for t in leaves]
    if decl is GATED:
        g = F.logsigmoid(refs[3]) * torch.sigmoid(refs[4])[..., None] * 0.5
    else:
        g = -torch.exp(refs[4])[:, None] * F.softplus(refs[3])
    o_ref, S_ref = token_loop(refs[0], refs[1], refs[2], g, h0=refs[5])
    ((o_ref * wo).sum() + (S_ref * ws).sum()).backward()
    assert_close(o, o_ref, "delta_out", torch.float32, name="o")
    assert_close(S, S_ref, "delta_out", torch.float32, name="S")
    rows = ["delta_grad"] * 3 + ["delta_gate_grad", "delta_gate_grad" if decl is GATED else "delta_param_grad",
                                 "delta_grad"]
    for name, row, leaf, ref in zip(["dq", "dk", "dv", "da", "d" + list(decl.inputs)[1], "dh0"], rows, leaves, refs):
        assert_close(leaf.grad, ref.grad, row, torch.float32, name=name)


def test_chunk_tables_are_built_once_per_shape_and_offsets(knobs):
    """The chunk table (four host-to-device copies when built) is shared by calls of one shape, or one set
    of offsets; its entries: first token, length and sequence of every chunk, first chunk of each sequence."""
    cpu = torch.device("cpu")
    ops.TABLES.clear()
    a = ops.chunk_table(2, 37, None, 16, cpu)
    assert ops.chunk_table(2, 37, None, 16, cpu) is a and ops.chunk_table(2, 38, None, 16, cpu) is not a
    assert a.chunk_tok.tolist() == [0, 16, 32, 37, 53, 69] and a.chunk_len.tolist() == [16, 16, 5] * 2
    packed = ops.chunk_table(1, 40, [0, 5, 5, 40], 16, cpu)
    assert ops.chunk_table(1, 40, (0, 5, 5, 40), 16, cpu) is packed and len(ops.TABLES) == 3
    assert packed.chunk_tok.tolist() == [0, 5, 21, 37] and packed.chunk_len.tolist() == [5, 16, 16, 3]
    assert packed.chunk_seq.tolist() == [0, 2, 2, 2] and packed.seq_chunk0.tolist() == [0, 1, 1, 4]
    knobs(decode_max_tokens=0)   # the chunk kernels, not the decode kernel
    q = torch.randn(1, 19, H, 16)
    before = len(ops.TABLES)
    for _ in range(2):
        L.simple_gla(q, q, q, -torch.rand(1, 19, H), backend="triton", chunk_size=16)
    assert len(ops.TABLES) == before + 1


def test_deterministic_algorithms_keep_at_most_two_key_blocks(knobs):
    """Key blocks add their shares atomically: two give the same bits in either order (a + b == b + a),
    more need not, so torch.use_deterministic_algorithms(True) widens the blocks to at most two."""
    knobs(linear_key_block=16)
    q = torch.empty(1, 1, 40)
    meta = ops._meta(40, 8, C, torch.float32, q.device)
    assert ops._per_chunk_meta(GATED, meta, q)[1] == 3
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        out, blocks = ops._per_chunk_meta(GATED, meta, q)
    finally:
        torch.use_deterministic_algorithms(before)
    assert blocks == 2 and out["BK"] == 32 and out["SPLIT_K"]


@pytest.mark.parametrize("forward", ["fused", "split"])
@pytest.mark.parametrize("member", ["simple_gla", "linear_attention", "gla"])
def test_both_forwards_against_token_loop(member, forward, knobs):
    """tuning.linear_forward: the fused pass and the split one (state pass + per-chunk output kernel), each
    against the loop, with a length that ends in a partial chunk and two sequences."""
    knobs(linear_forward=forward)
    _check(member, 2, 2 * C + 5, seed=3)
