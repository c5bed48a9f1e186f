"""The matrix-state family (docs/spec/linear.md): linear attention, gated and delta-rule variants, each
declared with `scanlang.matrix_state` and run by `op(declaration)`.

`delta_rule` and `kaczmarz_delta_rule` are scanlang.recipes.kaczmarz's ops (the same functions,
generated Triton kernels by default). With backend="triton", a declaration with the delta correction or
n Householder steps and decay none or per head (deltanet, gated_delta_rule, kaczmarz, gated_delta_product,
or a user's) runs on the delta-rule kernels (backends/delta) with gradients, its hooks translated into a
DeltaRule (scanlang/delta_form.py), on CUDA too, and backend=None picks them on CUDA; Householder steps run as a
delta rule over the interleaved T*n rows (chunk_size counts those rows). The other structures run with
backend="triton" on kernels generated from their declaration (backends/linear): the recurrent decode
kernel of every structure without gradients for short sequences (`scanlang.tuning` decode_max_tokens;
CUDA and the interpreter), else the chunk kernels of plain writes and of per-key decay with the delta
correction (kda; backends/linear/kernels_delta.py); per-key decay with Householder steps and gradients
says it is not generated yet. By default (backend=None) everything but the delta kernels' structures runs
on the chunked PyTorch reference.

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
