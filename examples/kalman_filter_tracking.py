"""Kalman linear attention is a Kalman filter: track noisy random walks, then decode a layer token by token.

1. Hidden Ornstein-Uhlenbeck walks x_t = a x_{t-1} + noise(p) are observed through random unit keys
   with noise 1/prec. `kalman_filter` (scans declared as monoids and proved by scanlang) gives the
   posterior mean and variance; we compare with the textbook covariance-form filter and check that
   the posterior variance is calibrated (the squared error matches the predicted variance).
2. `KalmanLinearAttention` runs a sequence in one call and one token at a time; the outputs agree.

Runs on CPU in a few seconds (`python examples/kalman_filter_tracking.py`); on a GPU it uses the
generated kernels.
"""
import torch

from scanlang.recipes.kalman import KalmanJoint, KalmanLinearAttention, kalman_filter
from scanlang.recipes.kalman.monoids import PRECISION

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
F64 = torch.float64

for monoid in (PRECISION, KalmanJoint):
    proof = monoid.verify()
    print(proof)
    assert proof.symbolic, f"{monoid.name}: {proof.method}, not a symbolic proof"

# ---- 1. filtering -------------------------------------------------------------------------------
B, T, M, S = 64, 400, 1, 1
a_bar = torch.full((M, S), 0.98, dtype=F64)
p_bar = torch.full((M, S), 0.05, dtype=F64)
prec = torch.full((B, T, M), 4.0, dtype=F64)                     # observation noise variance 0.25
k = torch.ones(B, T, S, dtype=F64)
q = torch.ones(B, T, S, dtype=F64)
x = torch.zeros(B, dtype=F64)
truth, obs = [], []
for t in range(T):
    x = a_bar[0, 0] * x + p_bar[0, 0].sqrt() * torch.randn(B, dtype=F64)
    truth.append(x)
    obs.append(x + prec[0, 0, 0].rsqrt() * torch.randn(B, dtype=F64))
truth = torch.stack(truth, 1)[..., None]
v = torch.stack(obs, 1)[..., None]
lam0 = torch.full((B, M, S), 1e-2, dtype=F64)                    # a vague prior, variance 100

y, y_var, _ = kalman_filter(*(z.to(device) for z in (v, prec, k, q, a_bar, p_bar)),
                            initial_state=(lam0.to(device), torch.zeros_like(lam0).to(device)))
y, y_var = y.cpu(), y_var.cpu()

cov, mean = 1 / lam0[:, 0, 0], torch.zeros(B, dtype=F64)         # the covariance form, written out
ref_mean, ref_var = [], []
for t in range(T):
    pred = a_bar[0, 0] ** 2 * cov + p_bar[0, 0]
    gain = pred / (pred + 1 / prec[:, t, 0])
    mean = a_bar[0, 0] * mean + gain * (v[:, t, 0] - a_bar[0, 0] * mean)
    cov = (1 - gain) * pred
    ref_mean.append(mean)
    ref_var.append(cov)
ref_mean, ref_var = torch.stack(ref_mean, 1), torch.stack(ref_var, 1)

err_mean = (y[..., 0] - ref_mean).abs().max().item()
err_var = (y_var[..., 0] - ref_var).abs().max().item()
raw_mse = ((v - truth) ** 2).mean().item()
filtered_mse = ((y - truth) ** 2)[:, 50:].mean().item()
predicted = y_var[:, 50:].mean().item()
print(f"\nfilter vs covariance form: max |d mean| = {err_mean:.1e}, max |d var| = {err_var:.1e}")
print(f"observation MSE {raw_mse:.4f} -> filtered MSE {filtered_mse:.4f}; "
      f"posterior variance predicts {predicted:.4f}")
assert err_mean < 1e-9 and err_var < 1e-9
assert filtered_mse < 0.6 * raw_mse
assert abs(filtered_mse / predicted - 1) < 0.15, "posterior variance is not calibrated"

# ---- 2. the layer: one call versus token-by-token decoding --------------------------------------
layer = KalmanLinearAttention(d_model=32, d_state=16, sensor="mamba").to(device)
xs = torch.randn(2, 48, 32, device=device)
with torch.no_grad():
    full = layer(xs)
    state, steps = None, []
    for t in range(xs.shape[1]):
        out, state = layer(xs[:, t:t + 1], state=state, return_state=True)
        steps.append(out)
decode_err = (torch.cat(steps, 1) - full).abs().max().item()
print(f"layer: one call vs {xs.shape[1]} single-token calls, max |difference| = {decode_err:.1e}")
assert decode_err < 1e-4
print("all checks passed")
