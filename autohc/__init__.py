"""autohc: generated, autotuned CPU kernels for Diffusion Transformer training.

The flow of one kernel, one package per stage:
    hw (what the CPU is) -> kernels (params, codegen, contract per family) -> build (cffi,
    verified cache) -> tune (space, verify, time, registry) -> torch (install: dispatch,
    custom ops, optim); beside it runtime (CPU plan, native worker pool, result memory);
    bench (one timing protocol: gemm, ops, step, gate, peak); cli; dit (the trainer).

    import autohc
    y = autohc.matmul(x, w.T)          # fp32 GEMM on a generated kernel (torch or numpy)

torch-facing names load on first use, so `autohc tune` answers from the registry without
importing torch.
"""
from .build import BuildError, CompilerNotFoundError
from .kernels.gemm import GemmParams, ParamError, default_params

__version__ = "0.1.0"
__all__ = ["matmul", "install", "uninstall", "installed", "is_installed", "frozen", "GemmParams", "GemmKernel", "get_kernel", "default_params",
           "ParamError", "BuildError", "CompilerNotFoundError", "KernelError", "__version__"]

_LAZY = {"matmul": "kernels.gemm.matmul", "GemmKernel": "kernels.gemm.kernel",
         "KernelError": "kernels.gemm.kernel", "get_kernel": "kernels.gemm.kernel",
         "install": "torch.dispatch", "uninstall": "torch.dispatch", "installed": "torch.dispatch",
         "is_installed": "torch.dispatch", "frozen": "torch.frozen"}


def __getattr__(name):
    if name in ("ops", "optim"):            # autohc.ops.gelu_tanh(...), autohc.optim.AdamW
        import importlib
        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY:
        import importlib
        value = globals()[name] = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        return value                    # (kept: autohc.matmul is looked up on every call)
    raise AttributeError(f"module 'autohc' has no attribute {name!r}")
