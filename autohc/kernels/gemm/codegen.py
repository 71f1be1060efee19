"""GEMM parameters -> C source (templates/gemm) and its cffi declaration, read from the
rendered source itself (kernels/family.py)."""
from __future__ import annotations

import dataclasses

from ..family import exported_declarations
from ..isa import GEMM_ISAS
from ..render import environment
from .params import GemmParams


def render_gemm(params: GemmParams, emulate_tiles: bool = False) -> str:
    """C source of one GEMM kernel; its public functions are prefixed with params.symbol.
    emulate_tiles (isa amx only): the tile instructions run in C (gemm/amx_emulated.h.j2),
    checked as a CPU checks them, so the AMX back-end is tested on CPUs without AMX."""
    p = params.validate()
    if emulate_tiles and p.isa != "amx":
        raise ValueError(f"emulate_tiles: only the amx back-end has tiles, not {p.isa}")
    ctx = dataclasses.asdict(p)                # every field (to_dict leaves some out at their defaults)
    ctx["emulate_tiles"] = bool(emulate_tiles)
    ctx["fn"] = p.symbol
    ctx["buffer_k"] = p.buffer_k
    ctx["regs"] = GEMM_ISAS[p.isa].registers  # sizes the skinny path's register tile
    ctx["params_comment"] = ", ".join(f"{k}={v}" for k, v in sorted(p.to_dict().items()))
    return environment().get_template("gemm/gemm.c.j2").render(**ctx)


def gemm_cdef(params: GemmParams, source: str | None = None) -> str:
    """The C declarations of a rendered kernel (cffi cdef and the exported header)."""
    return exported_declarations(source if source is not None else render_gemm(params))
