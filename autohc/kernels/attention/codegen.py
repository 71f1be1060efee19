"""Attention parameters -> C source (templates/ops/attention.c.j2), its cffi declaration read
from that source, and the compiled library bound to the worker pool."""
from __future__ import annotations

import functools

from ...build import EMULATED_TILE_FLAGS, build
from ...runtime import pool
from ..family import exported_declarations
from ..render import environment
from .params import AttentionParams


def render_attention(params: AttentionParams, emulate_tiles: bool = False) -> str:
    """emulate_tiles (isa amx only): the tile instructions run in C (gemm/amx_emulated.h.j2),
    for tests on CPUs without AMX; never for speed."""
    p = params.validate()
    if emulate_tiles and not p.amx:
        raise ValueError(f"emulate_tiles: only the amx back-end has tiles, not {p.isa}")
    return environment().get_template("ops/attention.c.j2").render(
        sym=p.symbol(), bf16=p.dtype == "bf16", dot=p.dot, amx=p.amx, emulate_tiles=emulate_tiles,
        elem="uint16_t" if p.dtype == "bf16" else "float", pk="pk_t" if p.dot else "float",
        **p.to_dict())


@functools.lru_cache(maxsize=None)
def library(params: AttentionParams, emulate_tiles: bool = False):
    """The compiled, pool-bound library at these parameters (built once per process)."""
    src = render_attention(params, emulate_tiles)
    flags = tuple(params.cflags) + (EMULATED_TILE_FLAGS if emulate_tiles else ())
    lib = build(src, exported_declarations(src), flags,
                meta={"op": "attention", "params": params.to_dict(), "emulate_tiles": emulate_tiles})
    pool.bind(lib, params.symbol())
    return lib
