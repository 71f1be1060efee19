"""What the torch override serves, and the way back to ATen for what it does not: the
admissibility of a tensor, whether this CPU's bf16 GEMMs are autohc's, ATen's own `.out` GEMM
kernels captured before the override, whether the override is installed, and the per-process
counts of the calls each ran.
Shared by dispatch.py (mm, addmm, bmm, baddbmm) and autocast.py (autocast's Linear)."""
from __future__ import annotations

import functools

import torch

from ..hw import cpu
from ..kernels.isa import BF16_ISAS
from . import fallback

# Below this many multiply-adds per GEMM, ATen's lower call overhead wins.
MIN_MACS = 32 * 32 * 32

stats = {"autohc": 0, "aten": 0}       # calls served by each, for tests and curiosity

# the override's torch.library.Library while install() is in force (dispatch.py sets it); one
# place for the installed state, which autocast.py reads too
override = {"lib": None}


def is_installed() -> bool:
    return override["lib"] is not None


def tensor_ok(*ts: torch.Tensor, dtype=torch.float32) -> bool:
    """Every tensor a strided, dense CPU tensor of `dtype` (no quantized or lazily negated ones)."""
    return all(t.dtype == dtype and t.layout == torch.strided and t.device.type == "cpu"
               and not t.is_quantized and not t.is_neg() for t in ts)


@functools.lru_cache(maxsize=None)
def bf16_served() -> bool:
    """bf16 GEMMs (what torch.autocast runs linear/matmul in) are served where this CPU has a
    bf16 back-end, whose kernels write a bf16 C themselves; elsewhere oneDNN's or ATen's."""
    return cpu.bf16_isa()[0] in BF16_ISAS


def by_autohc(out: torch.Tensor) -> torch.Tensor:
    """out, counted as a call autohc's kernels ran."""
    stats["autohc"] += 1
    return out


def by_aten(out: torch.Tensor) -> torch.Tensor:
    """out, counted as a call ATen ran."""
    stats["aten"] += 1
    return out


# ATen's own kernels of the `.out` GEMMs, captured before install() overrides them (None where
# this torch offers no handle)
ATEN_OUT = {name: fallback.captured(name) for name in ("mm.out", "addmm.out", "bmm.out", "baddbmm.out")}


def aten_out(name: str):
    """ATen's own `.out` kernel: the captured one (the `.out` ops are overridden too), else
    the op itself."""
    kernel = ATEN_OUT.get(name)
    if kernel is not None:
        return lambda *a, **kw: fallback.call_captured(kernel, *a, **kw)
    return getattr(torch.ops.aten, name.split(".")[0]).out
