"""kalman_filter (recipes/kalman) against float64 oracles on CPU.

Oracles: a covariance-form Kalman filter written here, independently of the information form
(P- = a^2 P + p; K = P- k / (k^2 P- + 1/prec); mu = a mu + K (v - k a mu); P = (1 - K k) P-), and
float64 autograd of the information-form loop (`recipes/kalman/reference.py`) for every gradient.
"""
import pytest
import torch

import scanlang as sl
from scanlang.backends.reference import scan_sequential
from scanlang.recipes.kalman import KalmanJoint, kalman_filter
from scanlang.recipes.kalman import monoids as K
from scanlang.recipes.kalman.filter import SCAN_FORMS as FORMS
from scanlang.recipes.kalman.reference import kalman_filter_loop
from scanlang.testing import assert_close

F64 = torch.float64


def covariance_filter(v, prec, k, q, a_bar, p_bar, initial_state=None):
    """The textbook covariance-form filter, float64, per entry; heads given as [B,T,H,S]."""
    v, prec, k, q, a_bar, p_bar = (x.to(F64) for x in (v, prec, k, q, a_bar, p_bar))
    batch, length, channels = v.shape
    if k.dim() == 3:
        k, q = k.unsqueeze(2), q.unsqueeze(2)
    group = channels // k.shape[2]
    head_of = torch.arange(channels) // group
    if initial_state is None:
        cov = torch.ones(batch, channels, a_bar.shape[1], dtype=F64)
        mean = torch.zeros_like(cov)
    else:
        cov = 1 / initial_state[0].to(F64)
        mean = initial_state[1].to(F64) * cov
    ys, y_vars = [], []
    for t in range(length):
        key, query = k[:, t, head_of], q[:, t, head_of]        # [B,M,S]
        cov_pred = a_bar ** 2 * cov + p_bar
        gain = cov_pred * key / (key ** 2 * cov_pred + 1 / prec[:, t, :, None])
        mean = a_bar * mean + gain * (v[:, t, :, None] - key * a_bar * mean)
        cov = (1 - gain * key) * cov_pred
        ys.append((query * mean).sum(-1))
        y_vars.append((query ** 2 * cov).sum(-1))
    return torch.stack(ys, 1), torch.stack(y_vars, 1), (1 / cov, mean / cov)


def make_inputs(batch, length, channels, state, heads=None, dtype=torch.float32, decay=(0.5, 0.999),
                noise=(0.01, 0.3), precision=(0.05, 20.0)):
    """Random non-zero inputs in the ranges the layer produces (log-uniform precisions)."""
    kshape = (batch, length, state) if heads is None else (batch, length, heads, state)
    lo, hi = torch.tensor(precision).log()
    ins = dict(
        v=torch.randn(batch, length, channels, dtype=F64),
        prec=(lo + (hi - lo) * torch.rand(batch, length, channels, dtype=F64)).exp(),
        k=torch.nn.functional.normalize(torch.randn(kshape, dtype=F64), dim=-1),
        q=torch.nn.functional.normalize(torch.randn(kshape, dtype=F64), dim=-1),
        a_bar=decay[0] + (decay[1] - decay[0]) * torch.rand(channels, state, dtype=F64),
        p_bar=noise[0] + (noise[1] - noise[0]) * torch.rand(channels, state, dtype=F64),
    )
    return {n: x.to(dtype) for n, x in ins.items()}


def make_state(batch, channels, state, dtype=torch.float32):
    lam = torch.rand(batch, channels, state, dtype=F64) * 2 + 0.3
    eta = torch.randn(batch, channels, state, dtype=F64)
    return lam.to(dtype), eta.to(dtype)


# ---- the monoids --------------------------------------------------------------------------------

@pytest.mark.parametrize("monoid", [K.PRECISION, K.INFORMATION, KalmanJoint], ids=lambda m: m.name)
def test_monoids_are_proved(monoid):
    proof = monoid.verify()
    assert proof.symbolic, str(proof)
    assert proof.projective is not None if monoid.is_projective else proof.projective is None


def test_joint_leaf_is_one_filter_step():
    """The 3x3 leaf applied to (lam, 1, eta) is exactly one step of the information-form recursion."""
    phi, r = torch.rand(50, dtype=F64) * 3, torch.randn(50, dtype=F64)
    a_bar, p_bar = torch.rand(50, dtype=F64) * 0.9 + 0.05, torch.rand(50, dtype=F64) + 0.01
    lam, eta = torch.rand(50, dtype=F64) + 0.1, torch.randn(50, dtype=F64)
    a, a2, p = K.floored_dynamics(a_bar, p_bar)
    den = a2 + p * lam
    lam_next, eta_next = K.apply_joint(K.joint_leaf(phi, r, a, a2, p), lam, eta)
    torch.testing.assert_close(lam_next, lam / den + phi, rtol=1e-14, atol=0)
    torch.testing.assert_close(eta_next, a / den * eta + r, rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(K.apply_precision(K.precision_leaf(phi, a2, p), lam), lam / den + phi,
                               rtol=1e-14, atol=0)


@pytest.mark.parametrize("length", [1, 2, 9, 40])
def test_joint_scan_matches_its_own_sequential_body(length):
    """The traced 3x3 combine, scanned log-depth, equals the user's body stepped in a loop."""
    ins = make_inputs(2, length, 3, 4, dtype=F64)
    phi, r = K.increments(ins["v"].unsqueeze(-1), ins["prec"].unsqueeze(-1), ins["k"].unsqueeze(2))
    leaf = K.joint_leaf(phi, r, *K.floored_dynamics(ins["a_bar"], ins["p_bar"]))
    leaf = torch.broadcast_tensors(*leaf)
    out = sl.scan(KalmanJoint, leaf, dim=1, backend="reference")
    ref = scan_sequential(KalmanJoint, leaf, dim=1)
    for field, o, r_ in zip(KalmanJoint.fields, out, ref):
        assert_close(o, r_, "scan", name=f"KalmanJoint.{field}")


# ---- forward against the covariance-form filter ---------------------------------------------------

@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("length", [1, 2, 7, 33])
@pytest.mark.parametrize("heads", [None, 2])
def test_matches_covariance_filter_float64(form, length, heads):
    ins = make_inputs(2, length, 6, 4, heads=heads, dtype=F64)
    state = make_state(2, 6, 4, dtype=F64)
    y, y_var, (lam, eta) = kalman_filter(**ins, initial_state=state, output_final_state=True, form=form)
    ref_y, ref_var, (ref_lam, ref_eta) = covariance_filter(**ins, initial_state=state)
    assert y.dtype == F64 and y.shape == (2, length, 6) and lam.shape == (2, 6, 4)
    for name, out, ref in (("y", y, ref_y), ("y_var", y_var, ref_var), ("lam", lam, ref_lam), ("eta", eta, ref_eta)):
        assert_close(out, ref, "kalman_out", F64, name=name)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_scan_in_float32(form, dtype):
    ins = make_inputs(2, 65, 5, 3, dtype=dtype)
    y, y_var, (lam, eta) = kalman_filter(**ins, output_final_state=True, form=form)
    assert y.dtype == y_var.dtype == lam.dtype == eta.dtype == torch.float32
    ref_y, ref_var, (ref_lam, ref_eta) = covariance_filter(**ins)   # the same rounded inputs, in float64
    for name, out, ref in (("y", y, ref_y), ("y_var", y_var, ref_var), ("lam", lam, ref_lam), ("eta", eta, ref_eta)):
        assert_close(out, ref, "kalman_out", torch.float32, name=name)


@pytest.mark.parametrize("form", FORMS)
def test_long_sequence_stays_finite_and_accurate(form):
    """T = 3000 with slow decay, small noise and precisions up to 1e3: the normalised products stay finite."""
    ins = make_inputs(1, 3000, 4, 4, dtype=torch.float32, decay=(0.9, 0.99995), noise=(1e-4, 0.05),
                      precision=(1e-3, 1e3))
    y, y_var, (lam, eta) = kalman_filter(**ins, output_final_state=True, form=form)
    ref_y, ref_var, (ref_lam, ref_eta) = kalman_filter_loop(**ins)
    for name, out, ref in (("y", y, ref_y), ("y_var", y_var, ref_var), ("lam", lam, ref_lam), ("eta", eta, ref_eta)):
        assert torch.isfinite(out).all(), name
        assert_close(out, ref, "kalman_out", torch.float32, name=name)


@pytest.mark.parametrize("form", FORMS)
def test_state_carry_equals_one_pass(form):
    ins = make_inputs(2, 23, 4, 3, heads=1)
    y, y_var, state = kalman_filter(**ins, output_final_state=True, form=form)
    cut = 10
    first = {n: (x[:, :cut] if x.dim() >= 3 else x) for n, x in ins.items()}
    second = {n: (x[:, cut:] if x.dim() >= 3 else x) for n, x in ins.items()}
    y1, v1, mid = kalman_filter(**first, output_final_state=True, form=form)
    y2, v2, end = kalman_filter(**second, initial_state=mid, output_final_state=True, form=form)
    assert_close(torch.cat([y1, y2], 1), y, "kalman_out", name="y")
    assert_close(torch.cat([v1, v2], 1), y_var, "kalman_out", name="y_var")
    assert_close(end[0], state[0], "kalman_out", name="lam")
    assert_close(end[1], state[1], "kalman_out", name="eta")
    assert kalman_filter(**ins)[2] is None


def test_heads_equal_separate_filters_per_channel_group():
    ins = make_inputs(2, 11, 6, 3, heads=3, dtype=F64)
    y, y_var, _ = kalman_filter(**ins)
    for h in range(3):
        part = slice(2 * h, 2 * h + 2)
        yh, vh, _ = kalman_filter(ins["v"][..., part], ins["prec"][..., part], ins["k"][:, :, h], ins["q"][:, :, h],
                                  ins["a_bar"][part], ins["p_bar"][part])
        assert_close(y[..., part], yh, "kalman_out", name=f"y head {h}")
        assert_close(y_var[..., part], vh, "kalman_out", name=f"y_var head {h}")


def test_empty_sequence_returns_the_initial_state():
    ins = make_inputs(2, 0, 3, 2)
    state = make_state(2, 3, 2)
    y, y_var, (lam, eta) = kalman_filter(**ins, initial_state=state, output_final_state=True)
    assert y.shape == y_var.shape == (2, 0, 3)
    assert torch.equal(lam, state[0]) and torch.equal(eta, state[1])


# ---- zero keys and vanishing precision ------------------------------------------------------------

@pytest.mark.parametrize("form", FORMS)
def test_zero_keys_and_tiny_precision_only_predict(form):
    """Steps without information only predict: their v and prec change nothing, and nothing is NaN."""
    ins = make_inputs(2, 17, 4, 3, dtype=F64)
    silent = torch.zeros(17, dtype=torch.bool)
    silent[5:9] = True                       # zero keys
    ins["k"][:, 5:9] = 0.0
    ins["prec"][:, 12:] = 1e-300             # precision -> 0: no information either
    y, y_var, state = kalman_filter(**ins, output_final_state=True, form=form)
    other = dict(ins)
    other["v"] = torch.where(silent[None, :, None], torch.randn_like(ins["v"]) * 100, ins["v"])
    other["prec"] = torch.where(silent[None, :, None], ins["prec"] * 1e6, ins["prec"])
    y2, y_var2, state2 = kalman_filter(**other, output_final_state=True, form=form)
    torch.testing.assert_close(y2, y, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(y_var2, y_var, rtol=1e-12, atol=0)
    torch.testing.assert_close(state2[0], state[0], rtol=1e-12, atol=0)
    ref = covariance_filter(**ins)
    assert_close(y, ref[0], "kalman_out", F64, name="y")
    assert_close(y_var, ref[1], "kalman_out", F64, name="y_var")
    # the tail without information: lam follows the prediction lam -> lam / (a^2 + p lam) exactly
    lam_tail = kalman_filter(**{n: (x[:, :12] if x.dim() >= 3 else x) for n, x in ins.items()},
                             output_final_state=True, form=form)[2][0]
    for _ in range(12, 17):
        lam_tail = lam_tail / (ins["a_bar"] ** 2 + ins["p_bar"] * lam_tail)
    torch.testing.assert_close(state[0], lam_tail, rtol=1e-12, atol=0)
    assert torch.isfinite(state[0]).all() and torch.isfinite(state[1]).all()


def test_zero_keys_give_zero_not_nan_gradients():
    ins = make_inputs(1, 9, 3, 2, dtype=F64)
    ins["k"][:, 3] = 0.0
    leaves = {n: x.clone().requires_grad_() for n, x in ins.items()}
    y, y_var, _ = kalman_filter(**leaves)
    (y.sum() + y_var.sum()).backward()
    for n, x in leaves.items():
        assert torch.isfinite(x.grad).all(), n
    assert torch.equal(leaves["v"].grad[:, 3], torch.zeros_like(leaves["v"].grad[:, 3]))
    assert torch.equal(leaves["prec"].grad[:, 3], torch.zeros_like(leaves["prec"].grad[:, 3]))


# ---- gradients ------------------------------------------------------------------------------------

NAMES = ("v", "prec", "k", "q", "a_bar", "p_bar", "lam0", "eta0")


def _loss_and_grads(fn, ins, state, seed, **kw):
    leaves = {n: x.detach().clone().requires_grad_() for n, x in ins.items()}
    lam0, eta0 = (s.detach().clone().requires_grad_() for s in state)
    y, y_var, (lam, eta) = fn(**leaves, initial_state=(lam0, eta0), **kw)
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(x.shape, generator=gen, dtype=F64).to(x.device, x.dtype) for x in (y, y_var, lam, eta)]
    loss = sum((w * x).sum() for w, x in zip(weights, (y, y_var, lam, eta)))
    return torch.autograd.grad(loss, [*leaves.values(), lam0, eta0])


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("heads", [None, 2])
def test_every_gradient_matches_float64_autograd_of_the_loop(form, dtype, heads):
    ins = make_inputs(2, 29, 4, 3, heads=heads, dtype=dtype)
    state = make_state(2, 4, 3, dtype=dtype)
    got = _loss_and_grads(kalman_filter, ins, state, seed=1, output_final_state=True, form=form)
    ref = _loss_and_grads(kalman_filter_loop, {n: x.to(F64) for n, x in ins.items()},
                          tuple(s.to(F64) for s in state), seed=1)
    for name, g, r in zip(NAMES, got, ref):
        assert g.dtype == dtype, name
        assert_close(g, r, "kalman_grad", dtype, name=f"d{name}")


def test_gradients_over_a_long_sequence_in_float32():
    ins = make_inputs(1, 3000, 2, 3, decay=(0.9, 0.9999), noise=(1e-3, 0.05), precision=(1e-2, 1e2))
    state = make_state(1, 2, 3)
    got = _loss_and_grads(kalman_filter, ins, state, seed=2, output_final_state=True)
    ref = _loss_and_grads(kalman_filter_loop, {n: x.to(F64) for n, x in ins.items()},
                          tuple(s.to(F64) for s in state), seed=2)
    for name, g, r in zip(NAMES, got, ref):
        assert torch.isfinite(g).all(), name
        assert_close(g, r, "kalman_grad", torch.float32, name=f"d{name}")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("heads", [None, 2])
def test_gradcheck_float64(form, heads):
    ins = make_inputs(1, 4, 2, 2, heads=heads, dtype=F64)
    state = make_state(1, 2, 2, dtype=F64)

    def fn(v, prec, k, q, a_bar, p_bar, lam0, eta0):
        y, y_var, (lam, eta) = kalman_filter(v, prec, k, q, a_bar, p_bar, initial_state=(lam0, eta0),
                                             output_final_state=True, form=form)
        return y, y_var, lam, eta

    args = [x.clone().requires_grad_() for x in (*ins.values(), *state)]
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_float32_gradient_tolerance_is_met():
    """Guard against a silently degraded backward: every float32 gradient within the measured CPU row
    (scanlang.testing: RMS and element-wise; tests/test_testing.py keeps the row near what is measured)."""
    ins = make_inputs(2, 50, 3, 4)
    state = make_state(2, 3, 4)
    got = _loss_and_grads(kalman_filter, ins, state, seed=3, output_final_state=True)
    ref = _loss_and_grads(kalman_filter_loop, {n: x.to(F64) for n, x in ins.items()},
                          tuple(s.to(F64) for s in state), seed=3)
    for name, g, r in zip(NAMES, got, ref):
        assert_close(g, r, "kalman_grad", torch.float32, name=f"d{name}")


# ---- bad input ------------------------------------------------------------------------------------

def _bad(**changes):
    ins = make_inputs(2, 5, 4, 3)
    ins.update(changes)
    return ins


@pytest.mark.parametrize("changes, pattern", [
    (dict(prec=torch.rand(2, 5, 3) + 0.1), "prec: expected shape"),
    (dict(v=torch.randn(2, 5)), r"v: expected shape \[B,T,M\]"),
    (dict(k=torch.randn(2, 5, 4)), "q: expected the shape of k"),
    (dict(k=torch.randn(2, 6, 3), q=torch.randn(2, 6, 3)), "k: expected shape"),
    (dict(a_bar=torch.full((4, 2), 0.9)), r"a_bar: expected shape \[M,S\]"),
    (dict(p_bar=torch.full((3, 3), 0.1)), r"p_bar: expected shape \[M,S\]"),
    (dict(k=torch.randn(2, 5, 3, 3), q=torch.randn(2, 5, 3, 3)), "3 heads do not divide"),
    (dict(prec=torch.zeros(2, 5, 4)), "prec: observation precisions must be > 0"),
    (dict(p_bar=torch.zeros(4, 3)), "p_bar: the discrete process noise must be > 0"),
    (dict(a_bar=torch.full((4, 3), 1.5)), r"a_bar: the discrete decay must lie in \(0, 1\]"),
    (dict(a_bar=torch.zeros(4, 3)), r"a_bar: the discrete decay must lie in \(0, 1\]"),
])
def test_bad_inputs_raise_value_errors_naming_the_argument(changes, pattern):
    with pytest.raises(ValueError, match=pattern):
        kalman_filter(**_bad(**changes))


def test_bad_state_and_options():
    ins = _bad()
    lam, eta = make_state(2, 4, 3)
    with pytest.raises(ValueError, match=r"initial_state lam: expected shape \[B,M,S\]"):
        kalman_filter(**ins, initial_state=(lam[:1], eta))
    with pytest.raises(ValueError, match="initial_state eta: dtype torch.bfloat16"):
        kalman_filter(**ins, initial_state=(lam, eta.bfloat16()))
    with pytest.raises(ValueError, match="initial_state lam: precisions must be > 0"):
        kalman_filter(**ins, initial_state=(-lam, eta))
    with pytest.raises(ValueError, match="initial_state: expected a pair"):
        kalman_filter(**ins, initial_state=lam)
    with pytest.raises(TypeError, match="k: dtype torch.int64"):
        kalman_filter(**dict(ins, k=torch.ones(2, 5, 3, dtype=torch.long)))
    with pytest.raises(ValueError, match="form: expected one of"):
        kalman_filter(**ins, form="three_scans")
    with pytest.raises(ValueError, match="backend"):
        kalman_filter(**ins, backend="cuda")


def test_validate_false_skips_value_checks_and_floors_keep_it_finite():
    ins = _bad(p_bar=torch.zeros(4, 3))
    y, y_var, _ = kalman_filter(**ins, validate=False)
    assert torch.isfinite(y).all() and torch.isfinite(y_var).all()


# ---- generated kernels (Triton's interpreter on CPU, the GPU when present) -----------------------

@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("heads", [None, 2])
def test_generated_scan_kernels_match_float64(form, heads):
    """backend="triton": every scan (forward and the adjoint's reverse scans) is a generated kernel."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ins = make_inputs(2, 11, 4, 2, heads=heads)
    state = make_state(2, 4, 2)
    on_device = {n: x.to(device) for n, x in ins.items()}
    got = _loss_and_grads(kalman_filter, on_device, tuple(s.to(device) for s in state), seed=4,
                          output_final_state=True, form=form, backend="triton")
    ref = _loss_and_grads(kalman_filter_loop, {n: x.to(F64) for n, x in ins.items()},
                          tuple(s.to(F64) for s in state), seed=4)
    for name, g, r in zip(NAMES, got, ref):
        assert_close(g, r, "kalman_grad", torch.float32, name=f"d{name}")
    y, y_var, (lam, eta) = kalman_filter(**on_device, initial_state=tuple(s.to(device) for s in state),
                                         output_final_state=True, form=form, backend="triton")
    ref_y, ref_var, (ref_lam, ref_eta) = covariance_filter(**ins, initial_state=state)
    for name, out, r in (("y", y, ref_y), ("y_var", y_var, ref_var), ("lam", lam, ref_lam), ("eta", eta, ref_eta)):
        assert_close(out, r, "kalman_out", torch.float32, name=name)
