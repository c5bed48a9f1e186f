"""The one tolerance table, and the comparison helpers every test and benchmark uses.

Errors are ratios RMS(out - ref) / RMS(ref) against a float64 reference (the metric
flash-linear-attention uses; spec/kaczmarz.md gives its values), or max relative errors where noted.
"""
from __future__ import annotations

import torch

# (what, dtype) -> largest accepted ratio RMS(err)/RMS(ref).
TOLERANCES = {
    # plain scans of library monoids against the float64 sequential loop
    ("scan", torch.float64): 1e-12,
    ("scan", torch.float32): 1e-5,
    ("scan", torch.bfloat16): 1e-5,   # bf16 inputs, fp32 compute: only input rounding is shared
    ("scan", torch.float16): 1e-5,
    ("scan_grad", torch.float64): 1e-10,
    ("scan_grad", torch.float32): 1e-4,
    # delta rule / Kaczmarz (spec/kaczmarz.md): outputs and states, dq dk dv dh0, dbeta dg
    ("delta_out", torch.float32): 0.005,
    ("delta_grad", torch.float32): 0.01,
    ("delta_gate_grad", torch.float32): 0.01,   # the spec's fp32 gradient row (dbeta, dg included)
    ("delta_out", torch.bfloat16): 0.005,
    ("delta_grad", torch.bfloat16): 0.008,
    ("delta_gate_grad", torch.bfloat16): 0.02,
    ("delta_out", torch.float16): 0.005,
    ("delta_grad", torch.float16): 0.008,
    ("delta_gate_grad", torch.float16): 0.02,
    ("delta_tm", torch.float32): 1e-5,   # delta_prep's Tm = (I + A)^-1 (fp32, all ieee) vs the float64 inverse
    ("delta_ieee", torch.float32): 1e-5,   # fp32 inputs, every dot ieee (interpreter): outputs, gradients vs float64
    # Kalman filter (spec/kalman.md): fp32 scan arithmetic
    ("kalman_out", torch.float32): 1e-4,
    ("kalman_grad", torch.float32): 1e-3,
    ("kalman_out", torch.float64): 1e-10,
    ("kalman_grad", torch.float64): 1e-8,
}


def tolerance(what: str, dtype: torch.dtype) -> float:
    try:
        return TOLERANCES[(what, dtype)]
    except KeyError:
        raise KeyError(f"no tolerance for ({what!r}, {dtype}); add one to scanlang/testing.py") from None


def ratio(out: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS(out - ref) / RMS(ref), computed in float64; NaN anywhere gives inf."""
    out = out.detach().to(torch.float64).cpu()
    ref = ref.detach().to(torch.float64).cpu()
    if out.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(out.shape)} vs reference {tuple(ref.shape)}")
    if not torch.isfinite(out).all() and not torch.equal(torch.isnan(out), torch.isnan(ref)):
        return float("inf")
    mask = torch.isfinite(ref)
    err = (out - ref)[mask]
    denom = ref[mask].pow(2).mean().sqrt().clamp_min(1e-30)
    return float(err.pow(2).mean().sqrt() / denom) if err.numel() else 0.0


def assert_close(out: torch.Tensor, ref: torch.Tensor, what: str, dtype: torch.dtype | None = None, name: str = "output"):
    """Fail unless ratio(out, ref) is within the table's tolerance for (what, dtype)."""
    tol = tolerance(what, dtype or out.dtype)
    r = ratio(out, ref)
    if not r <= tol:
        raise AssertionError(f"{name}: ratio RMS(err)/RMS(ref) = {r:.3e} exceeds {tol:.1e} ({what}, {dtype or out.dtype})")


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer filled with NaN, to prove every element gets written."""
    return torch.full_like(t, float("nan"))
