"""Kalman linear attention (docs/spec/kalman.md) written on top of scanlang.

    from scanlang.recipes.kalman import kalman_filter, KalmanLinearAttention
    y, y_var, state = kalman_filter(v, prec, k, q, a_bar, p_bar, output_final_state=True)

`monoids` declares the recursions (Möbius + affine, or the merged 3x3 `KalmanJoint`), `filter` runs
them with `sl.scan` and an exact backward, `layer` is the paper's block, `reference` the float64 loop.
"""
from .filter import kalman_filter
from .layer import KalmanLayerState, KalmanLinearAttention
from .monoids import KalmanJoint

__all__ = ["kalman_filter", "KalmanLinearAttention", "KalmanLayerState", "KalmanJoint"]
