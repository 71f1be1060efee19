"""autohc: generated, autotuned CPU kernels for Diffusion Transformer training.

    import autohc
    y = autohc.matmul(x, w.T)          # fp32 GEMM on a generated kernel (torch or numpy)

torch-facing names load on first use, so `autohc tune` answers from the registry without
importing torch.
"""
from .build import BuildError, CompilerNotFoundError
from .codegen import GemmParams, ParamError, default_params

__version__ = "0.1.0"
__all__ = ["matmul", "install", "uninstall", "installed", "is_installed", "GemmParams", "GemmKernel", "get_kernel", "default_params",
           "ParamError", "BuildError", "CompilerNotFoundError", "KernelError", "__version__"]

_LAZY = {"matmul": "gemm", "GemmKernel": "gemm", "KernelError": "gemm", "get_kernel": "gemm",
         "install": "override", "uninstall": "override", "installed": "override",
         "is_installed": "override"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'autohc' has no attribute {name!r}")
