"""Code generation: typed parameters -> Jinja templates -> C source."""
from .params import ISAS, GemmParams, ParamError, default_params
from .render import gemm_cdef, render_gemm

__all__ = ["ISAS", "GemmParams", "ParamError", "default_params", "gemm_cdef", "render_gemm"]
