"""The Kalman filter's recursions declared as scanlang monoids, and the lifts that build their leaves.

Per entry (b, m, s) with `a = a_bar[m, s]`, `p = p_bar[m, s]` (docs/spec/kalman.md):

    phi_t = prec_t k_t^2,   r_t = prec_t v_t k_t
    den_t = a^2 + p lam_{t-1}
    lam_t = lam_{t-1} / den_t + phi_t              (Möbius in lam_{t-1})
    eta_t = (a / den_t) eta_{t-1} + r_t            (affine in eta_{t-1}, gate depends on lam_{t-1})

Two ways to scan it:

* two scans: `PRECISION = sl.Mobius` over the 2x2 leaf `[[1 + p phi, a^2 phi], [p, a^2]]`
  (lam -> (A lam + B) / (C lam + D)), then `INFORMATION = sl.Affine` over `(a / den_t, r_t)` once
  `lam_{t-1}` is known;
* one scan: `KalmanJoint`, the 3x3 block-lower-triangular matrices
  `[[A, B, 0], [C, D, 0], [E, F, G]]` acting on homogeneous `(u, v, w)` with `lam = u / v`,
  `eta = w / v`; the leaf is `[[A, B, 0], [C, D, 0], [r C, r D, a]]`. Products compose as
  `later @ earlier` and are renormalised by the trace of the 2x2 block, `A + D` (all leaf entries
  are >= 0, so that trace is > 0 and the scale never changes a sign).

Every lift below is a plain function of its arguments using only DSL operations, so it runs on
tensors and also traces into sympy.
"""
from __future__ import annotations

import scanlang as sl

# Floors from docs/spec/kalman.md. `phi` is never floored: zero keys are legal.
A2_FLOOR = 1e-12
P_FLOOR = 1e-12
DEN_FLOOR = 1e-12
LAM_FLOOR = 1e-12

PRECISION = sl.Mobius
INFORMATION = sl.Affine


@sl.monoid(fields=("a", "b", "c", "d", "e", "f", "g"), identity=(1, 0, 0, 1, 0, 0, 1),
           scale=lambda m: m.a + m.d, name="KalmanJoint")
def KalmanJoint(x, y):
    """3x3 block-lower-triangular matrices [[a, b, 0], [c, d, 0], [e, f, g]]; combine = Y @ X.

    The upper-left 2x2 block is the precision Möbius map; the last row carries the information mean.
    Law: the matrix product is associative and the trace a + d of the upper-left block is homogeneous
    of degree 1, so the trace-normalised product keeps the law up to scale; identity: the unit matrix.

    >>> import torch, scanlang as sl
    >>> from scanlang.recipes.kalman import KalmanJoint
    >>> eye = [torch.full((2,), v) for v in (1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0)]
    >>> [f.tolist() for f in sl.scan(KalmanJoint, eye, dim=0)][:4]        # the identity, scanned
    [[0.5, 0.5], [0.0, 0.0], [0.0, 0.0], [0.5, 0.5]]
    """
    return (y.a * x.a + y.b * x.c,
            y.a * x.b + y.b * x.d,
            y.c * x.a + y.d * x.c,
            y.c * x.b + y.d * x.d,
            y.e * x.a + y.f * x.c + y.g * x.e,
            y.e * x.b + y.f * x.d + y.g * x.f,
            y.g * x.g)


def increments(v, prec, k):
    """(phi, r) = (prec k^2, prec v k): the precision and information increments of one observation."""
    pk = prec * k
    return pk * k, pk * v


def floored_dynamics(a_bar, p_bar):
    """(a, a^2, p) with the spec's floors on a^2 and p."""
    return a_bar, sl.maximum(a_bar * a_bar, A2_FLOOR), sl.maximum(p_bar, P_FLOOR)


def precision_leaf(phi, a2, p):
    """The 2x2 Möbius leaf [[1 + p phi, a^2 phi], [p, a^2]] as (a, b, c, d): lam -> lam / den + phi."""
    return 1 + p * phi, a2 * phi, p, a2


def information_leaf(lam_prev, r, a, a2, p):
    """The affine leaf (f, r) with f = a / den, den = max(a^2 + p lam_{t-1}, floor)."""
    return a / sl.maximum(a2 + p * lam_prev, DEN_FLOOR), r


def joint_leaf(phi, r, a, a2, p):
    """The 3x3 leaf [[A, B, 0], [C, D, 0], [r C, r D, a]] as the 7 fields of `KalmanJoint`."""
    big_a, big_b, big_c, big_d = precision_leaf(phi, a2, p)
    return big_a, big_b, big_c, big_d, r * big_c, r * big_d, a


def apply_precision(prefix, lam0):
    """lam_t from a 2x2 prefix (a, b, c, d) applied to lam0: (a lam0 + b) / (c lam0 + d)."""
    pa, pb, pc, pd = prefix
    return (pa * lam0 + pb) / (pc * lam0 + pd)


def apply_joint(prefix, lam0, eta0):
    """(lam_t, eta_t) from a 3x3 prefix applied to the homogeneous vector (lam0, 1, eta0)."""
    pa, pb, pc, pd, pe, pf, pg = prefix
    v = pc * lam0 + pd
    return (pa * lam0 + pb) / v, (pe * lam0 + pf + pg * eta0) / v

