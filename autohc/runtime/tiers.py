"""Memory tiers for AutoMem (runtime/automem.py): where a tensor goes when it leaves the fast
tier, and how it comes back.

    put(t) -> handle      a copy of t in the tier (t itself may be freed afterwards)
    get(handle, shape, dtype) -> tensor in this process's memory, equal to t
    free(handle)          the tier's copy is no longer needed
    take(tier, handle, shape, dtype)    get + free in one (what AutoMem's prefetch does): a
                          tier may hand out its own copy, released when the tensor dies

- FileTier: one file per tensor in a directory (local SSD; the kernel's page cache keeps
  recent ones, outside the process's RSS). Bit-exact.
- Bf16Tier: float32 kept as a bfloat16 copy in memory (half the bytes); other dtypes as they
  are. Opt-in: it changes results slightly.
- NumaTier: a NUMA memory node (HBM's DDR partner in flat mode, a far socket, CXL memory):
  mappings bound with mbind before first touch. Bit-exact. SimulatedNuma stands in for a
  topology the machine does not have (tests).
"""
from __future__ import annotations

import mmap
import os
import tempfile
import threading
import weakref
from typing import Protocol

import numpy as np
import torch


class Tier(Protocol):
    name: str

    def put(self, t: torch.Tensor): ...

    def get(self, handle, shape, dtype) -> torch.Tensor: ...

    def free(self, handle) -> None: ...

    def close(self) -> None: ...


class _BySize:
    """Freed tier resources (open files, mappings) kept per byte size for the next tensor of
    that size: a training step saves the same shapes every step."""

    def __init__(self):
        self._free: dict[int, list] = {}
        self._lock = threading.Lock()
        self._drained = False

    def take(self, size: int):
        with self._lock:
            items = self._free.get(size)
            return items.pop() if items else None

    def give(self, size: int, item) -> bool:
        """Keep `item` for reuse; False once drained (the caller closes it: a tensor that held
        it outlived the tier)."""
        with self._lock:
            if not self._drained:
                self._free.setdefault(size, []).append(item)
            return not self._drained

    def drain(self, close) -> None:
        with self._lock:
            self._drained = True
            for items in self._free.values():
                for item in items:
                    close(item)
            self._free.clear()


class FileTier:
    """One file per saved tensor. A freed file is kept open for the next tensor of the same
    size (a training step saves the same shapes every step): rewriting it reuses its page-cache
    pages instead of allocating new ones, and reads go straight into the new tensor."""
    name = "file"

    def __init__(self, directory: str | os.PathLike | None = None):
        self.dir = None if directory is None else os.fspath(directory)   # None: the system's temp
        if self.dir is not None:
            os.makedirs(self.dir, exist_ok=True)
        self._free = _BySize()                          # open file descriptors to reuse

    def put(self, t: torch.Tensor) -> tuple[int, int]:
        data = t.detach().contiguous().view(torch.uint8).numpy().reshape(-1)
        size = data.nbytes
        fd = self._free.take(size)
        if fd is None:
            fd, path = tempfile.mkstemp(prefix="autohc-automem-", suffix=".bin", dir=self.dir)
            os.unlink(path)             # nothing left on disk once the descriptor closes, even on a crash
        view, done = memoryview(data), 0
        while done < size:
            done += os.pwrite(fd, view[done:], done)
        return fd, size

    def get(self, handle: tuple[int, int], shape, dtype) -> torch.Tensor:
        fd, size = handle
        out = torch.empty(size, dtype=torch.uint8)
        view, done = memoryview(out.numpy()), 0
        while done < size:
            n = os.preadv(fd, [view[done:]], done)
            if n <= 0:
                raise OSError(f"AutoMem file tier: short read ({done} of {size} bytes)")
            done += n
        return out.view(dtype).reshape(shape)

    def free(self, handle: tuple[int, int]) -> None:
        fd, size = handle
        if not self._free.give(size, fd):
            os.close(fd)

    def take(self, handle: tuple[int, int], shape, dtype) -> torch.Tensor:
        """The file's page-cache pages mapped copy-on-write, no copy: reading a saved tensor
        back cost the helper thread 2.5 s per DiT-B/2 batch-16 step (2.9 GB into fresh,
        page-faulting memory) on 2 cores whose other work is the step's. Its pages are
        touched here, on the helper thread (a page the kernel wrote back and evicted is read
        from disk now, not in backward); the file is reused once the tensor dies, and a write
        to the tensor copies the page, never reaching the file."""
        fd, size = handle
        if size == 0:
            t = self.get(handle, shape, dtype)
            self.free(handle)
            return t
        m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        pages = np.frombuffer(m, dtype=np.uint8)
        pages[::mmap.PAGESIZE].max()
        # the array holds the mapping (unmapped when the array dies), the tensor the array
        weakref.finalize(pages, self.free, handle)
        return torch.from_numpy(pages).view(dtype).reshape(shape)

    def close(self) -> None:
        """Files still mapped by live tensors close when those die."""
        self._free.drain(os.close)


class Bf16Tier:
    name = "bf16"

    def put(self, t: torch.Tensor):
        t = t.detach()
        return t.to(torch.bfloat16) if t.dtype == torch.float32 else t.clone()

    def get(self, handle, shape, dtype) -> torch.Tensor:
        return handle.to(dtype).reshape(shape)

    def free(self, handle) -> None:
        pass

    def close(self) -> None:
        pass


# ------------------------------------------------------------------ NUMA tier

MPOL_BIND = 2
# (mbind, move_pages) syscall numbers per architecture (Linux)
_SYSCALLS = {"x86_64": (237, 279), "aarch64": (235, 239), "ppc64le": (259, 301)}


class LinuxNuma:
    """The kernel's NUMA calls through libc's syscall(): mbind (bind a mapping's pages to a
    node before they are touched) and move_pages (ask which node a page is on)."""

    def __init__(self):
        import ctypes
        import platform
        self.numbers = _SYSCALLS.get(platform.machine())
        if self.numbers is None:
            raise ValueError(f"AutoMem NUMA tier: no mbind/move_pages numbers for {platform.machine()}")
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.ctypes = ctypes

    def nodes(self) -> list[int]:
        """Online nodes with memory (CPU-less nodes too: HBM in flat mode, CXL memory)."""
        from ..hw.cpu import parse_cpulist
        path = "/sys/devices/system/node/has_memory"
        try:
            with open(path) as f:
                return list(parse_cpulist(f.read().strip()))
        except OSError:
            return [0]

    def bind(self, addr: int, length: int, node: int) -> None:
        c = self.ctypes
        mask = c.c_ulong(1 << node)
        rc = self.libc.syscall(c.c_long(self.numbers[0]), c.c_void_p(addr), c.c_ulong(length),
                               c.c_int(MPOL_BIND), c.byref(mask), c.c_ulong(node + 2), c.c_uint(0))
        if rc != 0:
            raise OSError(c.get_errno(), f"mbind to NUMA node {node}: {os.strerror(c.get_errno())}")

    def node_of(self, addr: int) -> int:
        c = self.ctypes
        page = (c.c_void_p * 1)(addr)
        status = (c.c_int * 1)(-1)
        rc = self.libc.syscall(c.c_long(self.numbers[1]), c.c_int(0), c.c_ulong(1), page, None,
                               status, c.c_int(0))
        if rc != 0:
            raise OSError(c.get_errno(), f"move_pages: {os.strerror(c.get_errno())}")
        return status[0]


class SimulatedNuma:
    """A topology of `nodes` memory nodes on a machine with fewer: binding is recorded, not
    done (the tests' stand-in for a two-node machine; the data path is the real one)."""

    def __init__(self, nodes: int = 2):
        self._nodes = list(range(nodes))
        self.bound: dict[int, int] = {}     # mapping address -> node

    def nodes(self) -> list[int]:
        return list(self._nodes)

    def bind(self, addr: int, length: int, node: int) -> None:
        if node not in self._nodes:
            raise OSError(22, f"mbind to NUMA node {node}: no such node")
        self.bound[addr] = node

    def node_of(self, addr: int) -> int:
        return self.bound.get(addr, 0)


class NumaTier:
    """Tensors moved to one NUMA node (the capacity tier: DDR beside HBM in flat mode, or a
    far node): an anonymous mapping bound to the node before its pages are touched, then the
    bytes copied in; back by a copy into a new tensor. Bit-exact. Mappings of a freed size are
    reused (a step saves the same shapes every step)."""
    name = "numa"

    def __init__(self, node: int, numa=None):
        self.numa = numa or LinuxNuma()
        if node not in self.numa.nodes():
            raise ValueError(f"AutoMem NUMA tier: node {node} is not a memory node here "
                             f"(nodes {self.numa.nodes()})")
        self.node = node
        self._free = _BySize()

    def _mapping(self, size: int):
        import mmap
        m = self._free.take(size)
        if m is not None:
            return m
        m = mmap.mmap(-1, max(size, 1))
        import ctypes
        self.numa.bind(ctypes.addressof(ctypes.c_char.from_buffer(m)), max(size, 1), self.node)
        return m

    def put(self, t: torch.Tensor):
        import numpy as np
        data = t.detach().contiguous().view(torch.uint8).numpy().reshape(-1)
        m = self._mapping(data.nbytes)
        np.frombuffer(m, dtype=np.uint8, count=data.nbytes)[:] = data
        return m, data.nbytes

    def address(self, handle) -> int:
        import ctypes
        return ctypes.addressof(ctypes.c_char.from_buffer(handle[0]))

    def get(self, handle, shape, dtype) -> torch.Tensor:
        import numpy as np
        m, size = handle
        out = torch.empty(size, dtype=torch.uint8)
        out.numpy()[:] = np.frombuffer(m, dtype=np.uint8, count=size)
        return out.view(dtype).reshape(shape)

    def free(self, handle) -> None:
        m, size = handle
        if not self._free.give(size, m):
            m.close()

    def close(self) -> None:
        self._free.drain(lambda m: m.close())


TIERS = {"file": FileTier, "bf16": Bf16Tier, "numa": NumaTier}


def take(tier: Tier, handle, shape, dtype) -> torch.Tensor:
    """get + free: the tier's own `take` where it has one (FileTier maps its file), else a
    copy in this process's memory and the tier's copy freed."""
    own = getattr(tier, "take", None)
    if own is not None:
        return own(handle, shape, dtype)
    t = tier.get(handle, shape, dtype)
    tier.free(handle)
    return t


def make_tier(spec: str) -> Tier:
    """'file' (a temporary directory), 'file:DIR', 'bf16', or 'numa:NODE' (a memory node;
    'numa' alone: the last one, where there is more than one)."""
    name, _, arg = spec.partition(":")
    if name == "file":
        return FileTier(arg or os.environ.get("AUTOHC_AUTOMEM_DIR") or None)
    if name == "bf16" and not arg:
        return Bf16Tier()
    if name == "numa":
        numa = LinuxNuma()
        if arg:
            if not arg.isdigit():
                raise ValueError(f"AutoMem tier {spec!r}: numa:NODE takes a node number")
            return NumaTier(int(arg), numa)
        nodes = numa.nodes()
        if len(nodes) < 2:
            raise ValueError(f"AutoMem tier 'numa': this machine has one memory node ({nodes}); "
                             "name it (numa:0) or use file")
        return NumaTier(nodes[-1], numa)
    raise ValueError(f"AutoMem tier {spec!r}: one of file, file:DIR, bf16, numa[:NODE]")
