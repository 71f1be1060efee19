"""GEMM parameters -> C source (templates/gemm) and its cffi declaration, read from the
rendered source itself (kernels/family.py)."""
from __future__ import annotations

import dataclasses

from ..family import exported_declarations
from ..isa import GEMM_ISAS
from ..render import environment
from .params import CHOICES, INSTANCE_FIELDS, MAX_THREADS, RANGES, GemmParams


def render_gemm(params: GemmParams, emulate_tiles: bool = False, fixed: bool = False) -> str:
    """C source of the GEMM library that serves `params`: its public functions are prefixed
    with params.library_symbol and take an instance (<prefix>_new: the blocks and thread ways,
    INSTANCE_FIELDS) as their first argument; nothing else in it depends on those fields.
    fixed: the kernel on its own (`autohc export`), prefixed with params.symbol, its instance
    made of params' own blocks and ways inside it, and no instance argument.
    emulate_tiles (isa amx only): the tile instructions run in C (gemm/amx_emulated.h.j2),
    checked as a CPU checks them, so the AMX back-end is tested on CPUs without AMX."""
    p = params.validate()
    if emulate_tiles and p.isa != "amx":
        raise ValueError(f"emulate_tiles: only the amx back-end has tiles, not {p.isa}")
    ctx = dataclasses.asdict(p)                # every field (to_dict leaves some out at their defaults)
    if not fixed:                              # (StrictUndefined: the template cannot read them)
        for name in INSTANCE_FIELDS:
            del ctx[name]
    ctx["fixed"] = bool(fixed)
    # (what the instance's C check and arrays are bounded by: validate()'s own table)
    ctx.update(ranges=RANGES, max_threads=MAX_THREADS, max_depth=max(CHOICES["depth"]))
    ctx["emulate_tiles"] = bool(emulate_tiles)
    ctx["fn"] = p.symbol if fixed else p.library_symbol
    shown = p.to_dict() if fixed else p.library_dict()
    ctx["params_comment"] = ", ".join(f"{k}={v}" for k, v in sorted(shown.items()))
    ctx["sk"] = skinny_symbol(p, emulate_tiles)
    return environment().get_template("gemm/gemm.c.j2").render(**ctx)


def skinny_symbol(params: GemmParams, emulate_tiles: bool = False) -> str | None:
    """The prefix of a kernel's skinny paths' object: one per what renders it (isa, vector
    width, skinny_m, and for bf16 skinny_unit and emulated tiles), whatever the kernel's tiles
    and blocks. None: the kernel has no skinny paths (skinny_m 0)."""
    if params.skinny_m <= 0:
        return None
    if params.dtype != "bf16":
        return f"autohc_sk_{params.isa}_v{params.vl}_m{params.skinny_m}"
    return (f"autohc_sk_{params.isa}_m{params.skinny_m}_{params.skinny_unit}"
            + ("_emu" if emulate_tiles else ""))


def render_gemm_objects(params: GemmParams, emulate_tiles: bool = False) -> dict[str, str]:
    """C sources compiled apart and linked into the kernel (render_gemm's source declares
    what it calls in them), by the prefix of their symbols: the skinny paths' object, where
    the kernel has them."""
    p = params.validate()
    sk = skinny_symbol(p, emulate_tiles)
    if sk is None:
        return {}
    return {sk: environment().get_template("gemm/skinny_object.c.j2").render(
        isa=p.isa, vl=p.vl, dtype=p.dtype, skinny_m=p.skinny_m, skinny_unit=p.skinny_unit,
        regs=GEMM_ISAS[p.isa].registers, emulate_tiles=bool(emulate_tiles), sk=sk)}


def gemm_cdef(params: GemmParams, source: str | None = None) -> str:
    """The C declarations of a rendered kernel (cffi cdef and the exported header)."""
    return exported_declarations(source if source is not None else render_gemm(params))
