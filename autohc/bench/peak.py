"""Measured FMA peak of one core, per back-end (the ceiling for % of peak figures), and the
bf16 peak (AVX512_BF16 dot products, AMX tiles) beside it."""
from __future__ import annotations

import functools
import platform

from ..build import BuildError, build
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


# every flag both probes need: the AMX code compiles on any x86 gcc >= 11, runnable or not
BF16_CFLAGS = ("-mavx512f", "-mavx512bf16", "-mavx512bw", "-mavx512vl", "-mamx-tile", "-mamx-bf16")
# independent vdpbf16ps chains: at least latency x throughput, or the probe measures the
# latency. On a Zen 5 (family 26 model 2) 12 chains gave 504-506 GFLOP/s per core, 16 and 24
# gave 547-550; 24 accumulators and the two operands fit the 32 zmm registers.
BF16_CHAINS = 24
# flops per timed iteration: CHAINS vdpbf16ps zmm (64 each), 4 tdpbf16ps (16 x 16 x 32 x 2 each)
_BF16_FLOPS_PER_ITER = {"dot": 64 * BF16_CHAINS, "tile": 4 * 16384}
# first, uncalibrated run: a few ms at either kind's likely rate (AMX is ~10x vdpbf16ps)
_BF16_FIRST_ITERS = {"dot": 1_000_000, "tile": 20_000}


def bf16_probe_source() -> str:
    return environment().get_template("peak_bf16.c.j2").render(chains=BF16_CHAINS)


@functools.lru_cache(maxsize=None)
def _bf16_lib():
    """The bf16 probe library, or None where it cannot be built (not x86, a compiler too old
    for AMX): then bf16 has no fast path here, which is an answer, not an error."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    src = bf16_probe_source()
    try:
        return build(src, exported_declarations(src), BF16_CFLAGS, meta={"op": "peak"}).lib
    except BuildError:
        return None


@functools.lru_cache(maxsize=None)
def bf16_peak_gflops(kind: str, seconds: float = 0.2) -> float | None:
    """Best of 5 short runs of one core's bf16 peak (GFLOP/s): kind "dot" (vdpbf16ps chains) or
    "tile" (AMX tdpbf16ps); None where this CPU (or its OS) cannot run that kind."""
    if kind not in _BF16_FLOPS_PER_ITER:
        raise ValueError(f"unknown bf16 peak kind {kind!r}: expected 'dot' or 'tile'")
    lib = _bf16_lib()
    if lib is None or not getattr(lib, f"autohc_bf16_{kind}_supported")():
        return None
    run = getattr(lib, f"autohc_bf16_{kind}_gflops")
    rate = run(_BF16_FIRST_ITERS[kind])
    iters = max(100, int(seconds / 5 * rate * 1e9 / _BF16_FLOPS_PER_ITER[kind]))
    return max(run(iters) for _ in range(5))


def bf16_backend_peak(isa: str) -> tuple[float | None, str]:
    """(one core's bf16 peak, its kind) for the bf16 GEMMs' back-end `isa` (hw.cpu.bf16_isa):
    the tile peak on AMX, the dot-product one on AVX512_BF16; (None, "") for any other."""
    kind = {"amx": "tile", "avx512bf16": "dot"}.get(isa)
    return (bf16_peak_gflops(kind), kind) if kind else (None, "")


def bf16_peak_summary() -> dict:
    """Both bf16 peaks, the back-end bf16 GEMMs get on this CPU (the fastest runnable one), and
    why, in a sentence."""
    dot, tile = bf16_peak_gflops("dot"), bf16_peak_gflops("tile")
    lib = _bf16_lib()
    if tile is not None:
        backend, why = "amx", "AMX-BF16 tiles (tdpbf16ps)"
    elif dot is not None:
        refused = lib is not None and lib.autohc_bf16_tile_present()
        backend, why = "avx512bf16", ("AVX512_BF16 vdpbf16ps, AMX present but the OS refused "
                                      "the tile state" if refused else
                                      "AVX512_BF16 vdpbf16ps, no AMX on this CPU")
    else:
        backend, why = "fp32 fallback", ("no AVX512_BF16 or AMX: bf16 inputs are widened to fp32 "
                                         "and run on the fp32 kernels")
    return {"dot_gflops_per_core": dot, "tile_gflops_per_core": tile, "backend": backend,
            "why": why}


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
