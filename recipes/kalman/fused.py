"""The fused path: the merged 3x3 monoid as one `sl.mixer` — one generated forward and one backward kernel.

Axes `b t h g s` (heads h, channels per head g, M = h g; without heads h = 1):

    x_t = lift(v, prec, k, a_bar, p_bar) = [[1 + p phi, a^2 phi, 0], [p, a^2, 0], [r p, r a^2, a]]
          with phi = prec k^2, r = prec v k                          (spec/kalman.md's 3x3 leaf)
    y_t = y_{t-1} (+) x_t,  y_{-1} = [[0, lam0, 0], [0, 1, 0], [0, eta0, 0]]   (a constant map)
    y   = sum_s q eta_t / lam_t,  y_var = sum_s q^2 / lam_t

Starting from the constant map keeps every prefix of the form [[0, lam, 0], [0, 1, 0], [0, eta, 0]]
up to scale (only its middle column is non-zero), so the readout is `lam = b / d`, `eta = f / d`.
The elements and prefixes stay in registers: the forward moves only v, prec, k, q in and y, y_var
out. The backward is the generator's adjoint of this program (replayed per tile from checkpoints).

Floors: the generated backward differentiates `+ - * /` only, so the static floors are applied
outside the kernel (a_bar >= 1e-6, i.e. a^2 >= 1e-12; p_bar >= 1e-12), by ordinary autograd.
"""
from __future__ import annotations

import functools
import math

import torch

from . import monoids as K

A_FLOOR = math.sqrt(K.A2_FLOOR)


def _lift(u):
    phi, r = K.increments(u.v, u.prec, u.k)
    return K.joint_leaf(phi, r, u.a_bar, u.a_bar * u.a_bar, u.p_bar)


def _readout(p, u, q):
    """(y, y_var) per state entry, summed over s by the mixer: q eta / lam and q^2 / lam."""
    return u.q * p.f / p.b, u.q * u.q * p.d / p.b


@functools.lru_cache(maxsize=None)
def joint_mixer():
    """The fused program (built and generated once per process)."""
    from scanlang.mixer import mixer
    return mixer(K.KalmanJoint, axes="b t h g s",
                 inputs={"v": "b t h g", "prec": "b t h g", "k": "b t h s", "q": "b t h s",
                         "a_bar": "h g s", "p_bar": "h g s"},
                 lift=_lift, readout=_readout, outputs=("y", "y_var"), reduce="s")


def supports(state_size: int) -> bool:
    """The fused readout sums over S inside a tile: S must be a power of two."""
    return state_size > 0 and state_size & (state_size - 1) == 0


def fused_filter(v, prec, k, q, a_bar, p_bar, lam0, eta0, output_final_state: bool):
    """kalman_filter's fused path on checked, same-dtype inputs; k, q are [B,T,S] or [B,T,H,S]."""
    batch, length, channels = v.shape
    heads = 1 if k.dim() == 3 else k.shape[2]
    group, state = channels // heads, k.shape[-1]
    k4 = k.reshape(batch, length, heads, state)
    q4 = q.reshape(batch, length, heads, state)
    lanes = (batch, heads, group, state)
    zero = torch.zeros((), dtype=lam0.dtype, device=lam0.device)
    one = torch.ones((), dtype=lam0.dtype, device=lam0.device)
    initial = (zero, lam0.reshape(lanes), zero, one, zero, eta0.reshape(lanes), zero)
    out = joint_mixer()(v=v.reshape(batch, length, heads, group), prec=prec.reshape(batch, length, heads, group),
                        k=k4, q=q4, a_bar=a_bar.clamp_min(A_FLOOR).reshape(heads, group, state),
                        p_bar=p_bar.clamp_min(K.P_FLOOR).reshape(heads, group, state),
                        initial=initial, output_final_state=output_final_state)
    state_out = None
    if output_final_state:
        fin = out.final
        lam, eta = fin[1] / fin[3], fin[5] / fin[3]
        state_out = (lam.reshape(batch, channels, state), eta.reshape(batch, channels, state))
    return out.y.reshape(batch, length, channels), out.y_var.reshape(batch, length, channels), state_out
