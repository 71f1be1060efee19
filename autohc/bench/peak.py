"""Measured FMA peak of one core, per back-end (the ceiling for % of peak figures)."""
from __future__ import annotations

import functools

from ..build import build
from ..kernels.family import exported_declarations
from ..kernels.isa import ISAS
from ..kernels.render import environment

@functools.lru_cache(maxsize=None)
def fma_peak_gflops(isa: str, seconds: float = 0.2) -> float:
    """Best of 5 short runs of independent FMA chains on the calling thread (GFLOP/s)."""
    if isa not in ISAS:
        raise ValueError(f"unknown isa {isa!r}")
    vl = max(ISAS[isa].vector_lanes) if isa != "portable" else 8
    src = environment().get_template("peak.c.j2").render(isa=isa, vl=vl, chains=12)
    lib = build(src, exported_declarations(src), ISAS[isa].cflags, meta={"op": "peak"}).lib
    if not lib.autohc_peak_isa_supported():
        raise RuntimeError(f"this CPU cannot run {isa}")
    iters = 1_000_000
    rate = lib.autohc_peak_gflops(iters)
    iters = max(1000, int(seconds / 5 * rate * 1e9 / (2 * vl * 12)))
    return max(lib.autohc_peak_gflops(iters) for _ in range(5))


@functools.lru_cache(maxsize=None)
def memory_bandwidth_gbps(mbytes: int = 256) -> float:
    """Copy bandwidth of one thread through memory (bytes read + written / s), best of 5."""
    import time

    import numpy as np
    src = np.ones(mbytes * (1 << 20) // 4, np.float32)
    dst = np.empty_like(src)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, 2 * src.nbytes / (time.perf_counter() - t0) / 1e9)
    return best
