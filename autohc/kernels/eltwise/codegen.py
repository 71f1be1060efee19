"""Element-wise parameters -> one kernel's C source (templates/ops/eltwise.c.j2), its cffi
declaration read from that source, and the compiled library bound to the worker pool."""
from __future__ import annotations

import functools

from ...build import build
from ...runtime import pool
from ..family import exported_declarations
from ..isa import ISAS
from ..render import environment
from .params import EltwiseParams, c_types


def render_eltwise(kernel: str, params: EltwiseParams) -> str:
    p = params.validate().for_kernel(kernel)
    return environment().get_template("ops/eltwise.c.j2").render(
        kernel=kernel, isa=p.isa, vl=p.vl, unroll=p.unroll, stream_stores=p.stream_stores,
        threads=p.threads, sym=p.symbol(kernel), types=c_types(kernel))


def library(kernel: str, params: EltwiseParams):
    """The compiled, pool-bound library of one kernel at these parameters (built once)."""
    return _library(kernel, params.validate().for_kernel(kernel))


@functools.lru_cache(maxsize=None)
def _library(kernel: str, p: EltwiseParams):
    src = render_eltwise(kernel, p)
    # -fno-math-errno: sqrt becomes one vector instruction (the AdamW moments are never < 0)
    lib = build(src, exported_declarations(src), (*ISAS[p.isa].cflags, "-fno-math-errno"),
                meta={"op": "eltwise", "kernel": kernel, "params": p.to_dict()})
    pool.bind(lib, p.symbol(kernel))
    return lib
