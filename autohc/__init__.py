"""autohc: generated, autotuned CPU kernels for Diffusion Transformer training.

    import autohc
    y = autohc.matmul(x, w.T)          # fp32 GEMM on a generated kernel (torch or numpy)
"""
from .build import BuildError, CompilerNotFoundError
from .codegen import GemmParams, ParamError, default_params
from .gemm import GemmKernel, KernelError, get_kernel, matmul

__version__ = "0.1.0"
__all__ = ["matmul", "GemmParams", "GemmKernel", "get_kernel", "default_params",
           "ParamError", "BuildError", "CompilerNotFoundError", "KernelError", "__version__"]
