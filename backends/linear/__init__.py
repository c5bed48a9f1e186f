"""The matrix-state family's generated Triton kernels (docs/spec/linear.md): kernels.py renders them
from a `scanlang.MatrixState` on the kernel IR, ops.py launches them under autograd."""
