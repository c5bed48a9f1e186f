"""Kaczmarz Linear Attention and the gated delta-rule chunk family (docs/spec/kaczmarz.md).

`delta_rule` / `kaczmarz_delta_rule` are the functional ops; `KaczmarzLinearAttention` is the layer.
"""
from .layer import KaczmarzLinearAttention, KaczmarzState
from .ops import delta_rule, kaczmarz_delta_rule

__all__ = ["delta_rule", "kaczmarz_delta_rule", "KaczmarzLinearAttention", "KaczmarzState"]
