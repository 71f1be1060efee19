"""Attention parameters -> C source (templates/ops/attention.c.j2), its cffi declaration read
from that source, and the compiled library bound to the worker pool."""
from __future__ import annotations

import functools

from ...build import build
from ...runtime import pool
from ..family import exported_declarations
from ..render import environment
from .params import AttentionParams


def render_attention(params: AttentionParams) -> str:
    p = params.validate()
    return environment().get_template("ops/attention.c.j2").render(
        sym=p.symbol(), bf16=p.dtype == "bf16", dot=p.dot,
        elem="uint16_t" if p.dtype == "bf16" else "float", pk="pk_t" if p.dot else "float",
        **p.to_dict())


@functools.lru_cache(maxsize=None)
def library(params: AttentionParams):
    """The compiled, pool-bound library at these parameters (built once per process)."""
    src = render_attention(params)
    lib = build(src, exported_declarations(src), params.cflags,
                meta={"op": "attention", "params": params.to_dict()})
    pool.bind(lib, params.symbol())
    return lib
