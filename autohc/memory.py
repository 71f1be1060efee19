"""Memory for kernel results: fresh tensors that ask for transparent huge pages.

A large result is new memory that the kernel's first write faults in 4 KB page by page
(glibc mmaps blocks over 32 MB afresh on every call): about 9 ms for a 37 MB GELU output
here, three times the kernel's own time. Advising transparent huge pages (MADV_HUGEPAGE on the
2 MB-aligned inside) before that first write makes it 1.7 ms. It is advice only: where THP is
off, or off Linux, nothing changes.
"""
from __future__ import annotations

import ctypes
import functools
import sys

import torch

HUGE = 1 << 21                  # x86-64 transparent huge page
HUGE_MIN_BYTES = 4 << 20        # results from this size ask for huge pages
MADV_HUGEPAGE = 14              # <sys/mman.h>, Linux


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc madvise(addr, len, advice), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


def advise_huge(t: torch.Tensor) -> torch.Tensor:
    if t.nbytes >= HUGE_MIN_BYTES and (madvise := _madvise()) is not None:
        p = t.data_ptr()
        lo, hi = -(-p // HUGE) * HUGE, (p + t.nbytes) // HUGE * HUGE
        if hi > lo:
            madvise(lo, hi - lo, MADV_HUGEPAGE)     # a failure changes nothing
    return t


def fresh_empty(*shape: int) -> torch.Tensor:
    """torch.empty(shape) (float32) for a kernel to write."""
    return advise_huge(torch.empty(shape, dtype=torch.float32))


def fresh_like(t: torch.Tensor) -> torch.Tensor:
    """torch.empty_like(t), contiguous, for a kernel to write."""
    return advise_huge(torch.empty_like(t, memory_format=torch.contiguous_format))
