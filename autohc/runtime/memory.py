"""Memory for kernel results: a caching pool of huge-page blocks.

A large result is new memory that the kernel's first write faults in page by page: glibc
mmaps blocks over 32 MB afresh on every call and unmaps them on free, so each call pays the
kernel's page-fault and zeroing cost again. Measured here on a 37 MB GELU output: 1.6 ms
for the kernel into memory it has written before, 9.5-11 ms into fresh 4 KB pages, 1.7 ms more
than the kernel with transparent huge pages.

So results of POOL_MIN_BYTES and up come from `pool`: private anonymous mappings, advised
MADV_HUGEPAGE before their first write, that go back to a free list when the tensor's storage
dies (torch.from_numpy ties the storage to a numpy array; a weakref finalizer on that array
returns the block) and are handed out again for a result of the same size class. A DiT step
asks for the same shapes every step, so after the first step its results are written into
warm pages. Free blocks are capped: past the cap a freed block is unmapped. By default the cap
follows the most bytes the pool has had in use at once (at least 2 GB, at most a quarter of
the machine's memory), so that a step whose results pass 2 GB (DiT-B/2 at batch 16: about
3 GB) gets all of them back the next step; AUTOHC_POOL_MB fixes it (0 turns the pool off).
Measured on DiT-B/2 batch 16 (`autohc train`'s step, 2 threads, Intel Xeon family 6 model
207, four interleaved pairs): 8.5-10.1 s per step with a 2 GB cap, 7.7-8.3 s with all blocks
kept, where the kernel's page zeroing (clear_page) had been 15 % of the run; peak RSS 5.8 GB either way, since the
free blocks are the ones the next step's peak uses. The first write into a new block is the kernel's
own, from the thread that owns that slice of the result, so on a machine with several NUMA
nodes the pages land on that thread's node (the worker pool pins team threads to the CPU
plan's compute cores, ordered by node).

Private mappings are copy-on-write across fork(): a forked data-loader worker never writes
into the parent's blocks.
"""
from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import sys
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from . import settings

HUGE = 1 << 21                  # x86-64 transparent huge page
HUGE_MIN_BYTES = 4 << 20        # results from this size ask for huge pages
POOL_MIN_BYTES = 1 << 20        # results from this size come from the pool
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


def _advise_range(p: int, nbytes: int) -> None:
    if nbytes >= HUGE_MIN_BYTES and (madvise := _madvise()) is not None:
        lo, hi = -(-p // HUGE) * HUGE, (p + nbytes) // HUGE * HUGE
        if hi > lo:
            madvise(lo, hi - lo, MADV_HUGEPAGE)     # a failure changes nothing


def advise_huge(t: torch.Tensor) -> torch.Tensor:
    _advise_range(t.data_ptr(), t.nbytes)
    return t


def _size_class(nbytes: int) -> int:
    """Bytes of the block that serves a request: 2 MB steps from HUGE_MIN_BYTES, 64 KB below."""
    step = HUGE if nbytes >= HUGE_MIN_BYTES else 1 << 16
    return -(-nbytes // step) * step


AUTO_CAP_MIN_BYTES = 2 << 30            # the automatic cap's least value
AUTO_CAP_RAM_FRACTION = 4               # and its most: 1/4 of the machine's memory


def _pool_mb_from_env() -> int | None:
    """AUTOHC_POOL_MB as a whole number of MB; None when unset (the automatic cap)."""
    return settings.non_negative_int("AUTOHC_POOL_MB", None, "a whole number of MB (0 turns the pool off)")


def _machine_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


@dataclass(frozen=True)
class CapSetting:
    """How the pool caps its free bytes: `floor` always; up to `ceiling` (0: never) when the
    bytes in use at once have been more than the floor."""
    floor: int
    ceiling: int = 0


def _setting_from_env() -> CapSetting:
    mb = _pool_mb_from_env()
    if mb is not None:
        return CapSetting(mb << 20)
    return CapSetting(AUTO_CAP_MIN_BYTES, max(AUTO_CAP_MIN_BYTES, _machine_bytes() // AUTO_CAP_RAM_FRACTION))


class BufferPool:
    """Free blocks by size class. `empty(shape)` gives a float32 tensor on a block; the block
    comes back when the tensor's storage is freed, and stays while the free bytes are under
    `cap_bytes`: the setting's floor, or the most bytes in use at once (its high water) up to
    the setting's ceiling."""

    def __init__(self, cap: int | CapSetting):
        self._setting = cap if isinstance(cap, CapSetting) else CapSetting(cap)
        self._free: dict[int, list[mmap.mmap]] = {}
        self._free_bytes = 0
        self._in_use = self.high_water = 0     # bytes of blocks handed out and not yet back
        self._lock = threading.RLock()      # re-entrant: a finalizer may run inside a locked call
        self.hits = self.misses = 0

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    @property
    def cap_bytes(self) -> int:
        s = self._setting
        return max(s.floor, min(self.high_water, s.ceiling))

    @cap_bytes.setter
    def cap_bytes(self, cap: int) -> None:
        self.set_cap(cap)

    def describe(self) -> str:
        """The cap in words (`autohc info`)."""
        s = self._setting
        if not s.ceiling:
            return f"{s.floor >> 20} MB of free blocks (AUTOHC_POOL_MB)" if s.floor else "off (AUTOHC_POOL_MB=0)"
        return (f"free blocks up to the most in use at once, {s.floor >> 20}-{s.ceiling >> 20} MB "
                f"(AUTOHC_POOL_MB fixes it)")

    def _take(self, size: int) -> mmap.mmap | None:
        with self._lock:
            blocks = self._free.get(size)
            if blocks:
                self._free_bytes -= size
                self.hits += 1
                return blocks.pop()
            self.misses += 1
        return None

    def _give(self, size: int, block: mmap.mmap) -> None:
        with self._lock:
            self._in_use -= size
            if self._free_bytes + size <= self.cap_bytes:
                self._free.setdefault(size, []).append(block)
                self._free_bytes += size
        # else: dropped; unmapped once its last buffer export is gone

    def set_cap(self, cap: int | CapSetting) -> CapSetting:
        """A new cap on the free bytes, fixed (an int) or a setting (free blocks past it are
        let go now); the previous setting back, for a later set_cap."""
        with self._lock:
            old = self._setting
            self._setting = cap if isinstance(cap, CapSetting) else CapSetting(cap)
            limit = self.cap_bytes
            for size in sorted(self._free, reverse=True):
                blocks = self._free[size]
                while blocks and self._free_bytes > limit:
                    blocks.pop()
                    self._free_bytes -= size
            return old

    def clear(self) -> None:
        """Unmap every free block (blocks in use come back later as usual)."""
        with self._lock:
            self._free.clear()
            self._free_bytes = 0

    def _map(self, nbytes: int) -> mmap.mmap:
        """A new private mapping; when the system refuses, the free blocks are let go first
        and the mapping tried once more."""
        try:
            return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError:
            self.clear()
        try:
            return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as e:
            raise MemoryError(f"autohc: cannot map {nbytes / 2**20:.0f} MB for a kernel result "
                              f"({e.strerror or e})") from None

    def empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        n = math.prod(shape)
        size = _size_class(n * 4)
        block = self._take(size)
        new = block is None
        if new:
            # + HUGE: room to start the tensor on a 2 MB boundary, so whole huge pages back it
            pad = HUGE if size >= HUGE_MIN_BYTES else 0
            block = self._map(size + pad)
        with self._lock:
            self._in_use += size
            self.high_water = max(self.high_water, self._in_use)
        base = np.frombuffer(block, dtype=np.uint8)
        offset = (-base.ctypes.data) % HUGE if size >= HUGE_MIN_BYTES else 0
        arr = np.frombuffer(block, dtype=np.float32, count=n, offset=offset)
        if new:
            _advise_range(base.ctypes.data + offset, size)     # before the first write
        del base
        weakref.finalize(arr, self._give, size, block).atexit = False   # nothing to return at exit
        return torch.from_numpy(arr).view(shape)


pool = BufferPool(_setting_from_env())


def fresh_empty(*shape: int) -> torch.Tensor:
    """An uninitialised float32 tensor of `shape` for a kernel to write: from the pool when it
    is large, else torch.empty."""
    if math.prod(shape) * 4 >= POOL_MIN_BYTES and pool.cap_bytes > 0:
        return pool.empty(tuple(shape))
    return torch.empty(shape, dtype=torch.float32)


def fresh_like(t: torch.Tensor) -> torch.Tensor:
    """torch.empty_like(t) (float32, contiguous) for a kernel to write."""
    return fresh_empty(*t.shape)
