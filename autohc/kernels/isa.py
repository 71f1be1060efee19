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
