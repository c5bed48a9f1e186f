"""The matrix-state family (docs/spec/linear.md): linear attention, gated and delta-rule variants, each
declared with `scanlang.matrix_state` and run by `op(declaration)`.

`delta_rule` and `kaczmarz_delta_rule` are scanlang.recipes.kaczmarz's ops (the same functions,
generated Triton kernels by default); the other members run on the chunked PyTorch reference by
default, and with backend="triton" on kernels generated from their declaration (backends/linear, in
Triton's interpreter: on CUDA they are refused until their first GPU run's illegal memory access is
found): the recurrent decode kernel of every structure without gradients for short sequences
(`scanlang.tuning` decode_max_tokens), else the chunk kernels of plain writes (the delta and
Householder corrections with gradients say they are not generated yet).
"""
from .family import MemberOp, op
from .members import (DECLARATIONS, delta_rule, gated_delta_product, gated_delta_product_declaration, gla, kda,
                      kaczmarz_delta_rule, linear_attention, simple_gla)

__all__ = ["linear_attention", "simple_gla", "gla", "delta_rule", "kda", "gated_delta_product",
           "kaczmarz_delta_rule", "op", "MemberOp", "DECLARATIONS", "gated_delta_product_declaration"]
