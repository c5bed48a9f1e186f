"""The matrix-state family (docs/spec/linear.md): linear attention, gated and delta-rule variants, each
declared with `scanlang.matrix_state` and run by `op(declaration)`.

`delta_rule` and `kaczmarz_delta_rule` are scanlang.recipes.kaczmarz's ops (the same functions,
generated Triton kernels by default); the other members run on the chunked PyTorch reference by
default, and with backend="triton" on kernels generated from their declaration (backends/linear): the
recurrent decode kernel of every structure without gradients for short sequences (`scanlang.tuning`
decode_max_tokens; Triton's interpreter only so far: on CUDA the chunk kernels run instead, and delta
and Householder corrections say they need backend='reference'), else the chunk kernels of plain writes
(CPU interpreter and CUDA; the delta and Householder corrections with gradients say they are not
generated yet).

`GatedLinearAttention` and `KimiDeltaAttention` are the layers (fla's parametrisation) around `gla` and
`kda`, with state carry (`LinearLayerState`).
"""
from .family import MemberOp, op
from .members import (DECLARATIONS, delta_rule, gated_delta_product, gated_delta_product_declaration, gla, kda,
                      kaczmarz_delta_rule, linear_attention, simple_gla)
from .layers import GatedLinearAttention, KimiDeltaAttention, LinearLayerState

__all__ = ["linear_attention", "simple_gla", "gla", "delta_rule", "kda", "gated_delta_product",
           "kaczmarz_delta_rule", "op", "MemberOp", "DECLARATIONS", "gated_delta_product_declaration",
           "GatedLinearAttention", "KimiDeltaAttention", "LinearLayerState"]
