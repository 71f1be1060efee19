"""The vector back-ends every kernel family is generated for, and what the compiler needs
to emit each (the table the families' parameter validation reads)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IsaSpec:
    name: str
    vector_lanes: tuple[int, ...]   # fp32 lanes per vector register (allowed)
    registers: int                  # architectural vector registers
    cflags: tuple[str, ...]         # what the compiler needs to emit this ISA


ISAS: dict[str, IsaSpec] = {
    "avx2": IsaSpec("avx2", (8,), 16, ("-mavx2", "-mfma")),
    "avx512": IsaSpec("avx512", (16,), 32, ("-mavx512f", "-mavx2", "-mfma")),
    # GCC vector extensions: 4 lanes = one NEON / SSE register, 8 or 16 for wider machines
    "portable": IsaSpec("portable", (4, 8, 16), 32, ()),
}

# The bf16 back-ends of the GEMM family only (bf16 products, fp32 accumulators): AVX512_BF16's
# vdpbf16ps on pairs of K (Zen 4/5, Cooper Lake and later) and AMX-BF16's tdpbf16ps on 16x16
# tiles (Sapphire Rapids and later; `registers` counts the 8 tile registers there). On every
# other back-end in ISAS a bf16 GEMM widens its operands to fp32 while packing.
BF16_ISAS: dict[str, IsaSpec] = {
    "avx512bf16": IsaSpec("avx512bf16", (16,), 32,
                          ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx2", "-mfma")),
    "amx": IsaSpec("amx", (16,), 8,
                   ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx2", "-mfma",
                    "-mamx-tile", "-mamx-bf16")),
}
GEMM_ISAS: dict[str, IsaSpec] = {**ISAS, **BF16_ISAS}
