"""sl.scan on the reference backend against float64 sequential loops (CPU)."""
import math

import pytest
import torch

import scanlang as sl
from scanlang import library
from scanlang.backends.reference import scan_sequential
from scanlang.testing import assert_close

LIBRARY = [m for m in vars(library).values() if isinstance(m, sl.Monoid)]


def affine_loop(a, b, dim, reverse=False, h0=None):
    """h_t = a_t h_{t-1} + b_t written out by hand, float64."""
    a, b = torch.broadcast_tensors(a.double(), b.double())
    a, b = a.movedim(dim, 0), b.movedim(dim, 0)
    steps = range(a.shape[0] - 1, -1, -1) if reverse else range(a.shape[0])
    h = torch.zeros_like(b[0]) if h0 is None else h0.double().expand_as(b[0])
    out = torch.empty_like(b)
    for t in steps:
        h = a[t] * h + b[t]
        out[t] = h
    return out.movedim(0, dim)


def positive(*shape, dtype=torch.float32):
    return (torch.rand(*shape, dtype=torch.float64) + 0.5).to(dtype)


@pytest.mark.parametrize("length", [1, 2, 7, 1000])
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("reverse", [False, True])
def test_affine_matches_hand_written_loop(length, dim, reverse):
    shape = [3, 4, 5]
    shape[dim] = length
    a = torch.rand(shape, dtype=torch.float64) * 1.2 - 0.1   # mixed signs, |a| mostly < 1
    b = torch.randn(shape, dtype=torch.float64)
    out = sl.scan(sl.Affine, (a, b), dim=dim, reverse=reverse, backend="reference")
    assert out.b.shape == b.shape and out.b.dtype == torch.float64
    assert torch.isfinite(out.a).all() and torch.isfinite(out.b).all()
    assert_close(out.b, affine_loop(a, b, dim, reverse), "scan")


@pytest.mark.parametrize("monoid", LIBRARY, ids=lambda m: m.name)
@pytest.mark.parametrize("length", [1, 2, 33])
def test_library_monoids_match_sequential_oracle(monoid, length):
    elems = tuple(positive(2, length, 3, dtype=torch.float64) for _ in monoid.fields)
    out = sl.scan(monoid, elems, dim=1)
    ref = scan_sequential(monoid, elems, dim=1)
    for field, o, r in zip(monoid.fields, out, ref):
        assert o.shape == r.shape
        assert_close(o, r, "scan", name=f"{monoid.name}.{field}")


def test_float32_and_half_inputs_compute_in_float32():
    a, b = torch.rand(2, 300, 4) * 0.9 + 0.1, torch.randn(2, 300, 4)
    ref = affine_loop(a, b, 1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = sl.scan(sl.Affine, (a.to(dtype), b.to(dtype)), dim=1)
        assert out.b.dtype == torch.float32
        ref_rounded = affine_loop(a.to(dtype), b.to(dtype), 1)   # same rounded inputs, float64 loop
        assert_close(out.b, ref_rounded, "scan", dtype=dtype)
    assert_close(sl.scan(sl.Affine, (a, b), dim=1).b, ref, "scan")


def test_initial_is_applied_before_step_zero():
    a, b = positive(3, 9, 4, dtype=torch.float64), torch.randn(3, 9, 4, dtype=torch.float64)
    h0 = torch.randn(3, 4, dtype=torch.float64)
    for reverse in (False, True):
        out = sl.scan(sl.Affine, {"a": a, "b": b}, dim=1, reverse=reverse, initial=(1.0, h0))
        assert_close(out.b, affine_loop(a, b, 1, reverse, h0), "scan")
        # out.a is the running product of the gates: the loop with b = 0 started from h = 1
        ones = torch.ones(3, 4, dtype=torch.float64)
        assert_close(out.a, affine_loop(a, torch.zeros_like(b), 1, reverse, ones), "scan")


def test_static_parameter_broadcasts_without_copy():
    a = torch.rand(6, dtype=torch.float64) * 0.9          # a static decay per channel [D]
    b = torch.randn(2, 11, 6, dtype=torch.float64)
    out = sl.scan(sl.Affine, (a, b), dim=1)
    assert_close(out.b, affine_loop(a.expand_as(b), b, 1), "scan")
    out2 = sl.scan(sl.Affine, (0.5, b), dim=1)            # a Python number works too
    assert_close(out2.b, affine_loop(torch.full_like(b, 0.5), b, 1), "scan")


def test_mobius_matches_matrix_product_loop():
    m = positive(4, 2, 50, 3, dtype=torch.float64)
    out = sl.scan(sl.Mobius, tuple(m), dim=1)
    mats = m.permute(1, 2, 3, 0).reshape(2, 50, 3, 2, 2)   # [[a, b], [c, d]]
    prod = torch.eye(2, dtype=torch.float64).expand(2, 3, 2, 2)
    for t in range(50):
        prod = mats[:, t] @ prod
        prod = prod / (prod[..., 0, 0] + prod[..., 1, 1])[..., None, None]
        got = torch.stack([out.a[:, t], out.b[:, t], out.c[:, t], out.d[:, t]], -1).reshape(2, 3, 2, 2)
        assert torch.allclose(got, prod, rtol=1e-12, atol=0)
    assert torch.allclose(out.a + out.d, torch.ones_like(out.a))   # every prefix renormalised


def test_result_is_a_namedtuple_in_field_order():
    a, b = positive(1, 4), torch.randn(1, 4)
    out = sl.scan(sl.Affine, (a, b), dim=1)
    first, second = out
    assert out._fields == ("a", "b") and first is out.a and second is out[1]


def test_gradcheck_float64():
    a = (torch.rand(2, 5, 3, dtype=torch.float64) * 0.8 + 0.1).requires_grad_()
    b = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    p = torch.rand(3, dtype=torch.float64, requires_grad=True)   # broadcast static parameter
    f = lambda a, b, h0, p: sl.scan(sl.Affine, (a * p, b), dim=1, reverse=True, initial=(1.0, h0))  # noqa: E731
    assert torch.autograd.gradcheck(f, (a, b, h0, p))
    m = tuple((torch.rand(1, 4, 2, dtype=torch.float64) + 0.5).requires_grad_() for _ in range(4))
    assert torch.autograd.gradcheck(lambda *m: sl.scan(sl.Mobius, m, dim=1), m)


def test_affine_gate_gradient_matches_loop_autograd():
    a = (torch.rand(2, 64, 3, dtype=torch.float64) * 0.9).requires_grad_()
    b = torch.randn(2, 64, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 64, 3, dtype=torch.float64)
    (sl.scan(sl.Affine, (a, b), dim=1).b * w).sum().backward()
    ga, gb = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    (affine_loop(a, b, 1) * w).sum().backward()
    assert_close(ga, a.grad, "scan_grad", name="grad a")
    assert_close(gb, b.grad, "scan_grad", name="grad b")


@pytest.mark.parametrize("call, exc, words", [
    (lambda a, b: sl.scan("affine", (a, b), dim=1), TypeError, "monoid"),
    (lambda a, b: sl.scan(sl.Affine, (a,), dim=1), ValueError, "elems"),
    (lambda a, b: sl.scan(sl.Affine, {"a": a, "z": b}, dim=1), ValueError, "'z'"),
    (lambda a, b: sl.scan(sl.Affine, (a, b[:, :3]), dim=1), ValueError, "do not broadcast"),
    (lambda a, b: sl.scan(sl.Affine, (a, b), dim=3), ValueError, "dim"),
    (lambda a, b: sl.scan(sl.Affine, (a, b), dim=1.0), TypeError, "dim"),
    (lambda a, b: sl.scan(sl.Affine, (a, b.long()), dim=1), TypeError, "elems['b']"),
    (lambda a, b: sl.scan(sl.Affine, (a, b.bool()), dim=1), TypeError, "elems['b']"),
    (lambda a, b: sl.scan(sl.Affine, (a, b), dim=1, backend="cuda"), ValueError, "backend"),
    (lambda a, b: sl.scan(sl.Affine, (a, b), dim=1, initial=(1.0, b)), ValueError, "initial['b']"),
    (lambda a, b: sl.scan(sl.Affine, (a, b), dim=1, initial=(1.0,)), ValueError, "initial"),
    (lambda a, b: sl.scan(sl.Affine, (a, "b"), dim=1), TypeError, "elems['b']"),
    (lambda a, b: sl.scan(sl.Affine, (1.0, 2.0), dim=0), TypeError, "tensor"),
    (lambda a, b: sl.scan(sl.Affine, (a, b), dim=1, reverse=1), TypeError, "reverse"),
])
def test_bad_input_names_the_argument(call, exc, words):
    a, b = positive(2, 6, 3), torch.randn(2, 6, 3)
    with pytest.raises(exc, match=None) as info:
        call(a, b)
    assert words in str(info.value)


def test_mixed_devices_are_refused():
    if not torch.cuda.is_available():
        meta = torch.empty(2, 6, 3, device="meta")
        with pytest.raises(ValueError, match="elems\\['b'\\].*device"):
            sl.scan(sl.Affine, (torch.rand(2, 6, 3), meta), dim=1)
    else:
        with pytest.raises(ValueError, match="device"):
            sl.scan(sl.Affine, (torch.rand(2, 6, 3), torch.rand(2, 6, 3, device="cuda")), dim=1)


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        sl.scan(sl.Affine, (positive(1, 3), torch.randn(1, 3)), dim=1, backend="triton")


def test_empty_sequence_gives_empty_prefixes():
    out = sl.scan(sl.Affine, (torch.rand(2, 0, 3), torch.rand(2, 0, 3)), dim=1)
    assert out.a.shape == (2, 0, 3)


def test_core_works_on_the_reference_backend_without_triton():
    import subprocess
    import sys
    code = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("no triton here")
sys.meta_path.insert(0, Block())
import torch, scanlang as sl
a, b = torch.rand(2, 9, 3), torch.randn(2, 9, 3)
out = sl.scan(sl.Affine, (a, b), dim=1)
h = torch.zeros(2, 3)
for t in range(9):
    h = a[:, t] * h + b[:, t]
assert torch.allclose(out.b[:, -1], h, rtol=1e-5, atol=1e-6)
assert sl.Mobius.verify().symbolic
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_non_associative_combine_is_refused_not_scanned():
    @sl.monoid(fields=("m",), identity=(0,))
    def average(x, y):
        return ((x.m + y.m) / 2,)
    with pytest.raises(sl.NotAssociativeError) as info:
        sl.scan(average, (torch.rand(2, 5),), dim=1)
    assert len(info.value.counterexample) == 3
    with pytest.raises(sl.NotAssociativeError):
        sl.mixer(average, axes="b t", inputs={"x": "b t"}, lift=lambda u: (u.x,), readout=lambda p, u, q: p.m,
                 outputs=("y",))


def test_front_end_broadcast_rule_is_torchs():
    import itertools
    from scanlang.scan import _broadcast_shape
    shapes = [(), (1,), (3,), (0,), (2, 1), (1, 3), (2, 3), (4, 1, 3), (1, 0), (5, 0)]
    for a, b in itertools.product(shapes, repeat=2):
        try:
            want = torch.broadcast_shapes(a, b)
        except RuntimeError:
            want = "error"
        try:
            got = _broadcast_shape([a, b])
        except RuntimeError:
            got = "error"
        assert got == want, (a, b)


# Lengths around the blocked schedule's chunk boundaries: `layout` gives N about sqrt(T) chunks (narrow
# steps: one chunk, several, tails of T mod N), capped where a step of all chunks would pass
# reference.SERIAL elements (wide steps: N = 4 and the fix-up split inside chunks; the demo's step of
# 4 x 256: several chunks per fix-up block, and a remainder block).
LAYOUT_CASES = [((3, 2), T) for T in (1, 2, 31, 32, 33, 63, 64, 65, 97, 1025)] + [((2, 4096), 200), ((4, 256), 300)]


@pytest.mark.parametrize("step, T", LAYOUT_CASES, ids=[f"{s[0]}x{s[1]}-T{T}" for s, T in LAYOUT_CASES])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("with_initial", [False, True])
def test_blocked_schedule_equals_the_float64_loop_at_chunk_boundaries(step, T, reverse, with_initial):
    from scanlang.backends import reference
    n_chunks, chunk = reference.layout(T, step[0] * step[1])
    assert n_chunks * chunk <= T < n_chunks * (chunk + 1) and n_chunks <= math.isqrt(T)
    assert n_chunks == 1 or n_chunks * step[0] * step[1] <= reference.SERIAL
    a = (0.5 + 0.6 * torch.rand(step[0], T, step[1], dtype=torch.float64)).requires_grad_()
    b = torch.randn(step[0], T, step[1], dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(step[0], step[1], dtype=torch.float64, requires_grad=True) if with_initial else None
    initial = (1.0, h0) if with_initial else None
    out = sl.scan(sl.Affine, (a, b), dim=1, reverse=reverse, initial=initial, backend="reference").b
    assert_close(out, affine_loop(a, b, 1, reverse=reverse, h0=h0), "scan")
    with torch.no_grad():   # the path that writes steps in place agrees with the recorded (autograd) one
        assert torch.equal(sl.scan(sl.Affine, (a, b), dim=1, reverse=reverse, initial=initial,
                                   backend="reference").b, out.detach())
    w = torch.randn_like(out)
    inputs = (a, b) + ((h0,) if with_initial else ())
    got = torch.autograd.grad((out * w).sum(), inputs, materialize_grads=True)   # T = 1: out.b is b, a unused
    want = torch.autograd.grad((affine_loop(a, b, 1, reverse=reverse, h0=h0) * w).sum(), inputs)
    for g, r in zip(got, want):
        assert_close(g, r, "scan_grad")


@pytest.mark.parametrize("T", [65, 97, 200])
def test_blocked_schedule_projective_equals_the_oracle(T):
    """Mobius (renormalised after every combine) over several chunks and a tail, float32 and float64."""
    elems = [positive(2, T, 3, dtype=torch.float64) for _ in range(4)]
    want = scan_sequential(sl.Mobius, elems, dim=1)
    for dtype in (torch.float64, torch.float32):
        got = sl.scan(sl.Mobius, [e.to(dtype) for e in elems], dim=1, backend="reference")
        for g, r in zip(got, want):
            assert_close(g, r.to(dtype), "scan")


@pytest.mark.parametrize("outer, n, c, inner", [(3, 31, 32, 2), (4, 31, 64, 256), (4, 16, 17, 256), (2, 3, 50, 4096),
                                                (1, 2, 5, 40000), (5, 1, 1, 1), (4, 31, 64, 4096)])
@pytest.mark.parametrize("limit", ["SERIAL", "BLOCK"])   # several torch threads, one
def test_fix_up_blocks_stay_serial_and_are_as_large_as_that_allows(outer, n, c, inner, limit):
    from scanlang.backends import reference
    limit = getattr(reference, limit)
    rows, chunks, steps = reference.block_sizes(outer, n, c, inner, limit)
    assert 1 <= rows <= outer and 1 <= chunks <= n and 1 <= steps <= c
    assert rows * chunks * steps * inner <= max(limit, inner)
    grown = [(min(rows + 1, outer), chunks, steps)] if chunks == n and steps == c else []
    grown += [(rows, min(chunks + 1, n), steps)] if steps == c else [(rows, chunks, min(steps + 1, c))]
    for r, k, s in grown:   # one more row, chunk or step would pass the limit (or there is none)
        assert (r, k, s) == (rows, chunks, steps) or r * k * s * inner > max(limit, inner)


def _products_loop(a, reverse=False, p0=None):
    """The Affine scan's `a` field written out by hand, float64: the running product along dim 1."""
    a = a.double().flip(1) if reverse else a.double()
    p = torch.ones_like(a[:, 0]) if p0 is None else p0.double().expand_as(a[:, 0])
    out = torch.empty_like(a)
    for t in range(a.shape[1]):
        p = a[:, t] * p
        out[:, t] = p
    return out.flip(1) if reverse else out


# The demo's step (4 x 256) and a narrow one, at lengths 1, odd, and past a multiple of the chunk (a
# tail): with one torch thread the fix-up runs in blocks of up to BLOCK elements, with more in blocks of
# up to SERIAL; the layout is the same either way, and so is every bit of the output.
@pytest.mark.parametrize("step, T", [((4, 256), 1), ((4, 256), 67), ((4, 256), 2085), ((3, 5), 1001)])
@pytest.mark.parametrize("reverse, with_initial", [(False, False), (True, True)])
def test_in_place_blocks_for_one_or_two_torch_threads_equal_the_float64_loop(step, T, reverse, with_initial):
    gen = torch.Generator().manual_seed(T)
    a = torch.rand(step[0], T, step[1], generator=gen, dtype=torch.float64) * 0.3 + 0.8
    b = torch.randn(step[0], T, step[1], generator=gen, dtype=torch.float64)
    p0 = torch.rand(step[0], step[1], generator=gen, dtype=torch.float64) + 0.5 if with_initial else None
    h0 = torch.randn(step[0], step[1], generator=gen, dtype=torch.float64) if with_initial else None
    initial = (p0, h0) if with_initial else None
    threads, outs = torch.get_num_threads(), {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs[n] = sl.scan(sl.Affine, (a, b), dim=1, reverse=reverse, initial=initial, backend="reference")
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(x, y) for x, y in zip(outs[1], outs[2]))
    assert_close(outs[1].a, _products_loop(a, reverse, p0), "scan", name="a")
    assert_close(outs[1].b, affine_loop(a, b, 1, reverse=reverse, h0=h0), "scan", name="b")   # h0 is h_{-1}


def test_in_place_fields_share_one_allocation_and_never_overlap():
    """All fields come from one block (see reference._in_place), each its own contiguous part of it."""
    a, b = torch.rand(2, 300, 3) + 0.5, torch.randn(2, 300, 3)
    out = sl.scan(sl.Affine, (a, b), dim=1, backend="reference")
    assert out.a.is_contiguous() and out.b.is_contiguous()
    assert out.a.untyped_storage().data_ptr() == out.b.untyped_storage().data_ptr()
    assert abs(out.a.data_ptr() - out.b.data_ptr()) >= out.a.numel() * out.a.element_size()
    a_before = out.a.clone()
    out.b.fill_(0)
    assert torch.equal(out.a, a_before)
    assert_close(out.a, _products_loop(a), "scan", torch.float32, name="a")


@sl.monoid(fields=("a", "b", "c", "d"), identity=(1, 0, 0, 1))
def matmul2(x, y):
    """2x2 matrices, y @ x (x earlier): every field reads two fields of y, a cycle for the in-place fix-up."""
    return (y.a * x.a + y.b * x.c, y.a * x.b + y.b * x.d, y.c * x.a + y.d * x.c, y.c * x.b + y.d * x.d)


@sl.monoid(fields=("p",), identity=(0,))
def either(x, y):
    """P(x or y) for independent events: x + y - x y (its last op a subtraction)."""
    return (x.p + y.p - x.p * y.p,)


@sl.monoid(fields=("m", "n"), identity=(float("-inf"), 0))
def max_and_count(x, y):
    """A running maximum and a count: one field's last op is a function call (no `out=` form)."""
    return (sl.maximum(x.m, y.m), x.n + y.n)


def _loop(monoid, elems, initial=None, reverse=False):
    """The scan written out by hand in float64, stepping the declaration's own body (`combine_direct`)."""
    xs = [e.double().flip(1) if reverse else e.double() for e in elems]
    p = None if initial is None else tuple(torch.as_tensor(i, dtype=torch.float64).expand_as(xs[0][:, 0])
                                            for i in initial)
    outs = []
    for t in range(xs[0].shape[1]):
        x_t = tuple(x[:, t] for x in xs)
        p = x_t if p is None else tuple(monoid.combine_direct(p, x_t))
        outs.append(p)
    out = [torch.stack([o[f] for o in outs], 1) for f in range(len(xs))]
    return [o.flip(1) for o in out] if reverse else out


@pytest.mark.parametrize("monoid", [matmul2, either, max_and_count], ids=lambda m: m.name)
@pytest.mark.parametrize("T", [5, 97, 300])
@pytest.mark.parametrize("reverse, with_initial", [(False, False), (True, True)])
def test_generated_combiner_in_place_and_recorded_equal_the_loop(monoid, T, reverse, with_initial):
    """Monoids whose combiner takes the other forms (a cycle through y, a subtraction, a call),
    over several chunks, fix-up blocks and a tail; the in-place path equals the recorded one bit for bit."""
    gen = torch.Generator().manual_seed(T)
    elems = [(torch.rand(3, T, 40, generator=gen, dtype=torch.float64) * 0.5 + 0.5).requires_grad_()
             for _ in monoid.fields]
    initial = tuple(torch.rand(3, 40, generator=gen, dtype=torch.float64) + 0.5 for _ in monoid.fields) \
        if with_initial else None
    got = sl.scan(monoid, elems, dim=1, reverse=reverse, initial=initial, backend="reference")
    for g, w in zip(got, _loop(monoid, elems, initial, reverse)):
        assert_close(g, w, "scan")
    with torch.no_grad():
        again = sl.scan(monoid, elems, dim=1, reverse=reverse, initial=initial, backend="reference")
    for g, w in zip(again, got):
        assert torch.equal(g, w.detach())
    weights = [torch.randn(g.shape, generator=gen, dtype=torch.float64) for g in got]
    loss = lambda outs: sum((o * w).sum() for o, w in zip(outs, weights))  # noqa: E731
    grads = torch.autograd.grad(loss(got), elems, allow_unused=True, materialize_grads=True)
    want = torch.autograd.grad(loss(_loop(monoid, elems, initial, reverse)), elems, materialize_grads=True)
    for g, w in zip(grads, want):
        assert_close(g, w, "scan_grad")


def test_generated_combiner_writes_into_the_given_outputs():
    from scanlang.backends import reference
    x, y = (torch.rand(2, 3), torch.rand(2, 3)), (torch.rand(2, 3), torch.rand(2, 3))
    out = (torch.empty(2, 3), torch.empty(2, 3))
    got = reference.combiner(sl.Affine)(x, y, out)
    assert got[0] is out[0] and got[1] is out[1]
    want = sl.Affine.combine(x, y)
    assert_close(got[0], want[0], "scan", torch.float32) and assert_close(got[1], want[1], "scan", torch.float32)
    fresh = reference.combiner(sl.Affine)(x, y, (None, None))
    assert all(torch.equal(f, g) for f, g in zip(fresh, got))


@pytest.mark.parametrize("T", [4096, 4099])
def test_long_scans_keep_chunks_short_so_overflowed_products_never_make_nan(T):
    """Chunks of at most CHUNK steps (in passes of N * CHUNK when the length asks for longer ones): Affine
    with a = 2, b = 0 at the demo's step is h = 0 throughout, as the loop gives, where chunks of 128 steps
    made a chunk's product 2^128 = inf in float32 and inf * 0 = NaN; the products themselves overflow."""
    from scanlang.backends import reference
    assert all(grid[1] <= reference.CHUNK for _, _, grid in reference.passes(T, 4 * 256))
    a, b = torch.full((4, T, 256), 2.0), torch.zeros(4, T, 256)
    powers = (2.0 ** torch.arange(1, T + 1, dtype=torch.float64)).float()   # exact, inf from 2^128 on
    for requires_grad in (False, True):
        out = sl.scan(sl.Affine, (a.clone().requires_grad_(requires_grad), b), dim=1, backend="reference")
        assert torch.equal(out.b.detach(), torch.zeros_like(b))
        assert torch.equal(out.a.detach(), powers[None, :, None].expand_as(a))


@pytest.mark.parametrize("reverse, with_initial", [(False, False), (True, True)])
def test_several_passes_equal_the_float64_loop_with_gradients(reverse, with_initial):
    """A narrow step over 4301 steps: chunks held at CHUNK steps make two passes (4160 steps, then 141 with
    a tail of 9), the second starting from the first's last output; in place equals recorded bit for bit."""
    from scanlang.backends import reference
    T = 4301
    assert [(s, n) for s, n, _ in reference.passes(T, 6)] == [(0, 4160), (4160, 141)]
    gen = torch.Generator().manual_seed(7)
    a = (torch.rand(2, T, 3, generator=gen, dtype=torch.float64) * 0.6 + 0.6).requires_grad_()
    b = torch.randn(2, T, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(2, 3, generator=gen, dtype=torch.float64, requires_grad=True) if with_initial else None
    initial = (1.0, h0) if with_initial else None
    out = sl.scan(sl.Affine, (a, b), dim=1, reverse=reverse, initial=initial, backend="reference")
    want = affine_loop(a, b, 1, reverse=reverse, h0=h0)
    assert_close(out.b, want, "scan")
    assert_close(out.a, _products_loop(a, reverse), "scan", name="a")
    with torch.no_grad():
        again = sl.scan(sl.Affine, (a, b), dim=1, reverse=reverse, initial=initial, backend="reference")
    assert all(torch.equal(x, y.detach()) for x, y in zip(again, out))
    w = torch.randn(out.b.shape, generator=gen, dtype=torch.float64)
    inputs = (a, b) + ((h0,) if with_initial else ())
    got = torch.autograd.grad((out.b * w).sum(), inputs)
    for g, r in zip(got, torch.autograd.grad((want * w).sum(), inputs)):
        assert_close(g, r, "scan_grad")
