"""A Mamba (S6) selective state-space mixer whose scan is an `sl.mixer` declared over `sl.Affine`.

Per channel d and state entry s (Gu & Dao's selective SSM with the zero-order-hold input rule
simplified to Euler, as the Mamba reference code does):

    h_t[d, s] = exp(dt_t[d] A[d, s]) h_{t-1}[d, s] + dt_t[d] B_t[s] x_t[d]      (affine in h)
    y_t[d]    = sum_s C_t[s] h_t[d, s]

`SELECTIVE_SCAN` is that recurrence as one declaration (lift -> affine scan -> readout summed over
s); the block around it is Mamba's: in_proj to (x, z), causal depthwise conv + SiLU on x,
input-dependent dt (softplus of a low-rank projection), B and C, `y + D x`, gate SiLU(z), out_proj.
On CUDA the generated kernels run it; elsewhere `run_reference` runs the same traced declaration
in PyTorch (`selective_scan_reference`, which generates no kernels). Any other `sl.mixer` with the same inputs (x, dt, B, C, A) and output y can replace it.

>>> import torch
>>> layer = MambaMixer(d_model=8, d_state=4)
>>> layer(torch.randn(2, 5, 8)).shape
torch.Size([2, 5, 8])
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

import scanlang as sl
from scanlang.mixer import Mixer

from .declared import ReferenceMixer, run_reference

SCAN_INPUTS = ("x", "dt", "B", "C", "A")


DECLARATION = dict(
    axes="b t d s",
    inputs={"x": "b t d", "dt": "b t d", "B": "b t s", "C": "b t s", "A": "d s"},
    lift=lambda u: (sl.exp(u.dt * u.A), u.dt * u.B * u.x),   # element (a, b) of h -> a h + b
    readout=lambda p, u, q: p.b * u.C,                        # p.b is h_t
    outputs=("y",), reduce="s")


@functools.lru_cache(maxsize=None)
def selective_scan() -> Mixer:
    """The S6 scan as an `sl.mixer` over `sl.Affine` (built on first use: it generates and loads its
    kernels)."""
    return sl.mixer(sl.Affine, **DECLARATION)


@functools.lru_cache(maxsize=None)
def selective_scan_reference() -> ReferenceMixer:
    """The same declaration on the reference backend (traced, no kernels generated)."""
    return ReferenceMixer(sl.Affine, **DECLARATION)


class MambaMixer(nn.Module):
    """Mamba block with a declared selective scan, [B, T, d_model] -> [B, T, d_model].

    `scan`: an `sl.mixer` with inputs (x "b t d", dt "b t d", B "b t s", C "b t s", A "d s") and
    output y (or a `ReferenceMixer` of one, which always runs on the reference backend); default
    `selective_scan()`. `backend`: "triton" (generated kernels), "reference"
    (PyTorch), or None: triton on CUDA, reference elsewhere. `d_state` must be a power of two
    (the mixer sums over it)."""

    def __init__(self, d_model: int, d_state: int = 16, expand: float = 2, d_conv: int = 4,
                 dt_rank: int | None = None, dt_min: float = 1e-3, dt_max: float = 1e-1,
                 scan: Mixer | None = None, backend: str | None = None):
        super().__init__()
        for name, value in (("d_model", d_model), ("d_state", d_state), ("d_conv", d_conv)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if d_state & (d_state - 1):
            raise ValueError(f"d_state: the scan sums over the state axis, which must be a power of two; got {d_state}")
        if backend not in (None, "triton", "reference"):
            raise ValueError(f"backend: expected None, 'triton' or 'reference', got {backend!r}")
        if scan is not None and (not isinstance(scan, (Mixer, ReferenceMixer))
                                 or tuple(scan.input_axes) != SCAN_INPUTS or "y" not in scan.outputs):
            raise TypeError(f"scan: expected an sl.mixer (or ReferenceMixer) with inputs {SCAN_INPUTS} and an "
                            f"output 'y', got {scan!r}")
        self.d_model, self.d_state, self.d_conv = d_model, d_state, d_conv
        self.d_inner = inner = int(expand * d_model)
        self.dt_rank = dt_rank or math.ceil(d_model / 16)
        self.scan, self.backend = scan, backend
        self.in_proj = nn.Linear(d_model, 2 * inner, bias=False)
        self.conv = nn.Conv1d(inner, inner, d_conv, groups=inner, padding=d_conv - 1, bias=True)
        self.x_proj = nn.Linear(inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, inner, bias=True)
        dt = torch.exp(torch.rand(inner) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))     # softplus(bias) = dt
        # S4D-real initialisation: A[d, s] = -(s + 1)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(inner, 1))
        self.D = nn.Parameter(torch.ones(inner))
        self.out_proj = nn.Linear(inner, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x: expected shape [B, T, d_model] with d_model = {self.d_model}, got {got}")
        length = x.shape[1]
        u, z = self.in_proj(x).chunk(2, dim=-1)
        u = F.silu(self.conv(u.transpose(1, 2))[..., :length].transpose(1, 2))
        dt_low, B, C = self.x_proj(u).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.softplus(self.dt_proj(dt_low).float())
        inputs = dict(x=u.float(), dt=dt, B=B.float(), C=C.float(), A=-torch.exp(self.A_log.float()))
        backend = self.backend or ("triton" if x.is_cuda else "reference")
        if backend == "triton" and not isinstance(self.scan, ReferenceMixer):
            y = (self.scan or selective_scan())(**inputs).y
        else:
            y = run_reference(self.scan or selective_scan_reference(), **inputs).y
        y = (y + self.D.float() * inputs["x"]) * F.silu(z.float())
        return self.out_proj(y.to(x.dtype))
