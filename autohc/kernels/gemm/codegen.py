"""GEMM parameters -> C source (templates/gemm) and its cffi declaration, read from the
rendered source itself (kernels/family.py)."""
from __future__ import annotations

from ..family import exported_declarations
from ..isa import GEMM_ISAS
from ..render import environment
from .params import GemmParams


def render_gemm(params: GemmParams) -> str:
    """C source of one GEMM kernel; its public functions are prefixed with params.symbol."""
    p = params.validate()
    ctx = p.to_dict()
    ctx["fn"] = p.symbol
    ctx["regs"] = GEMM_ISAS[p.isa].registers  # sizes the skinny path's register tile
    ctx["dtype"] = p.dtype                    # (to_dict leaves out fp32)
    ctx["params_comment"] = ", ".join(f"{k}={v}" for k, v in sorted(p.to_dict().items()))
    return environment().get_template("gemm/gemm.c.j2").render(**ctx)


def gemm_cdef(params: GemmParams, source: str | None = None) -> str:
    """The C declarations of a rendered kernel (cffi cdef and the exported header)."""
    return exported_declarations(source if source is not None else render_gemm(params))
