"""The fp32 GEMM family: params (typed, validated), codegen (templates/gemm -> C + its
declaration), kernel (compiled, pool-bound kernels and the registry's choice per problem),
matmul (the public `autohc.matmul`), problem (what a training GEMM is)."""
from .params import ISAS, GemmParams, ParamError, default_params

__all__ = ["ISAS", "GemmParams", "ParamError", "default_params"]
