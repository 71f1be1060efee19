"""Training precision: fp32, or bf16 mixed precision as torch autocast does it (bf16 inputs
to the GEMMs and attention, fp32 accumulation, fp32 master weights, AdamW and EMA in fp32).

`auto` takes bf16 where the CPU multiplies bf16 in hardware (AMX tiles, AVX512_BF16 dot
products: hw.cpu.bf16_isa) and fp32 elsewhere, where bf16 would be emulated and no faster.
"""
from __future__ import annotations

import contextlib

from ..kernels.isa import BF16_ISAS

PRECISIONS = ("fp32", "bf16", "auto")


def resolve(precision: str, info=None) -> tuple[str, str]:
    """("fp32" | "bf16", why) for a --precision value; a bad value is one clear line."""
    from ..hw import cpu
    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == "fp32":
        return "fp32", "asked for (--precision fp32)"
    isa, isa_why = cpu.bf16_isa(info)
    if precision == "bf16":
        return "bf16", ("asked for (--precision bf16); " + isa_why if isa in BF16_ISAS else
                        "asked for (--precision bf16), though " + isa_why)
    if isa in BF16_ISAS:
        return "bf16", f"auto: {isa_why}"
    return "fp32", f"auto: {isa_why}"


def autocast(precision: str):
    """The forward's context: torch.autocast to bf16 on CPU for "bf16", nothing for "fp32"."""
    import torch
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()
