"""The fused paths: the Kalman scan as generated `sl.mixer` kernels (lift, scan and readout in one kernel).

Two monoid forms (docs/spec/kalman.md), both measured by recipes/kalman/bench.py:
- "fused": the merged 3x3 monoid as ONE mixer (one forward and one backward kernel; the elements
  and prefixes never leave registers);
- "fused_two": the Möbius mixer (its readout forms the information gate from the previous prefix,
  `a / (a^2 + p lam_{t-1})`, and `1 / lam_t`), then the affine mixer for eta with the (y, y_var)
  readout: two kernels each way, with two [B,T,M,S] intermediates in memory, but cheaper scans
  (4 and 2 fields) and a scalar adjoint for the affine one.

Axes `b t h g s` (heads h, channels per head g, M = h g; without heads h = 1):

    x_t = lift(v, prec, k, a_bar, p_bar) = [[1 + p phi, a^2 phi, 0], [p, a^2, 0], [r p, r a^2, a]]
          with phi = prec k^2, r = prec v k                          (docs/spec/kalman.md's 3x3 leaf)
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

import scanlang as sl

from . import monoids as K

A_FLOOR = math.sqrt(K.A2_FLOOR)


def _lift(u):
    phi, r = K.increments(u.v, u.prec, u.k)
    return K.joint_leaf(phi, r, u.a_bar, u.a_bar * u.a_bar, u.p_bar)


def _readout(p, u, q):
    """(y, y_var) per state entry, summed over s by the mixer: q eta / lam and q^2 / lam."""
    return u.q * p.f / p.b, u.q * u.q * p.d / p.b


def _precision_lift(u):
    return K.precision_leaf(u.prec * u.k * u.k, u.a_bar * u.a_bar, u.p_bar)


def _precision_readout(p, u, q):
    """(gate_t, 1/lam_t): gate_t = a / (a^2 + p lam_{t-1}) with lam = b / d (constant-map initial)."""
    return u.a_bar * q.d / (u.a_bar * u.a_bar * q.d + u.p_bar * q.b), p.d / p.b


def _information_lift(u):
    return u.gate, u.prec * u.v * u.k


def _information_readout(p, u, q):
    return u.q * p.b * u.inv_lam, u.q * u.q * u.inv_lam


@functools.lru_cache(maxsize=None)
def precision_mixer():
    """Möbius scan of the precision; per entry outputs the information gate and 1 / lam."""
    return sl.mixer(K.PRECISION, axes="b t h g s",
                 inputs={"prec": "b t h g", "k": "b t h s", "a_bar": "h g s", "p_bar": "h g s"},
                 lift=_precision_lift, readout=_precision_readout, outputs=("gate", "inv_lam"))


@functools.lru_cache(maxsize=None)
def information_mixer():
    """Affine scan of the information mean with the (y, y_var) readout summed over s."""
    return sl.mixer(K.INFORMATION, axes="b t h g s",
                 inputs={"gate": "b t h g s", "inv_lam": "b t h g s", "v": "b t h g", "prec": "b t h g",
                         "k": "b t h s", "q": "b t h s"},
                 lift=_information_lift, readout=_information_readout, outputs=("y", "y_var"), reduce="s")


@functools.lru_cache(maxsize=None)
def joint_mixer():
    """The fused program (built and generated once per process)."""
    return sl.mixer(K.KalmanJoint, axes="b t h g s",
                 inputs={"v": "b t h g", "prec": "b t h g", "k": "b t h s", "q": "b t h s",
                         "a_bar": "h g s", "p_bar": "h g s"},
                 lift=_lift, readout=_readout, outputs=("y", "y_var"), reduce="s")


def supports(state_size: int) -> bool:
    """The fused readout sums over S inside a tile: S must be a power of two."""
    return state_size > 0 and state_size & (state_size - 1) == 0


def _time_major(x: torch.Tensor) -> torch.Tensor:
    """The same [B,T,...] tensor stored with time contiguous (stride 1 along dim 1)."""
    order = [0, *range(2, x.dim()), 1]
    inverse = [order.index(i) for i in range(x.dim())]
    return x.permute(order).contiguous().permute(inverse)


def fused_filter(v, prec, k, q, a_bar, p_bar, lam0, eta0, output_final_state: bool, two_scans: bool = False,
                 time_major: bool = False):
    """kalman_filter's fused paths on checked, same-dtype inputs; k, q are [B,T,S] or [B,T,H,S].

    `time_major` hands the mixer time-contiguous copies of the inputs (the generator then picks its
    long-time-tile schedule); the outputs keep their [B,T,M] shape.
    """
    batch, length, channels = v.shape
    heads = 1 if k.dim() == 3 else k.shape[2]
    group, state = channels // heads, k.shape[-1]
    lanes = (batch, heads, group, state)
    ins = dict(v=v.reshape(batch, length, heads, group), prec=prec.reshape(batch, length, heads, group),
               k=k.reshape(batch, length, heads, state), q=q.reshape(batch, length, heads, state))
    if time_major:
        ins = {n: _time_major(x) for n, x in ins.items()}
    a_bar = a_bar.clamp_min(A_FLOOR).reshape(heads, group, state)
    p_bar = p_bar.clamp_min(K.P_FLOOR).reshape(heads, group, state)
    zero, one = 0.0, 1.0   # numbers, not tensors: the generator drops the fields they keep constant
    lam0, eta0 = lam0.reshape(lanes), eta0.reshape(lanes)
    if two_scans:
        gate, inv_lam, _ = precision_mixer()(prec=ins["prec"], k=ins["k"], a_bar=a_bar, p_bar=p_bar,
                                             initial=(zero, lam0, zero, one))
        out = information_mixer()(gate=gate, inv_lam=inv_lam, **ins, initial=(zero, eta0),
                                  output_final_state=output_final_state)
        final = (1 / inv_lam[:, -1], out.final[1]) if output_final_state else None
    else:
        out = joint_mixer()(**ins, a_bar=a_bar, p_bar=p_bar, initial=(zero, lam0, zero, one, zero, eta0, zero),
                            output_final_state=output_final_state)
        final = (out.final[1] / out.final[3], out.final[5] / out.final[3]) if output_final_state else None
    state_out = None if final is None else tuple(x.reshape(batch, channels, state) for x in final)
    return out.y.reshape(batch, length, channels), out.y_var.reshape(batch, length, channels), state_out
