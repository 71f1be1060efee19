"""The element-wise operator family (GELU-tanh, SiLU, LayerNorm + adaLN modulate, softmax,
gated residual, AdamW): params (typed, with the knobs each kernel uses) and codegen
(templates/ops -> C + its declaration -> a pool-bound library)."""
from .params import KERNELS, EltwiseParams, default_eltwise

__all__ = ["KERNELS", "EltwiseParams", "default_eltwise"]
