"""Memory tiers for AutoMem (runtime/automem.py): where a tensor goes when it leaves the fast
tier, and how it comes back.

    put(t) -> handle      a copy of t in the tier (t itself may be freed afterwards)
    get(handle, shape, dtype) -> tensor in this process's memory, equal to t
    free(handle)          the tier's copy is no longer needed

- FileTier: one file per tensor in a directory (local SSD; the kernel's page cache keeps
  recent ones, outside the process's RSS). Bit-exact.
- Bf16Tier: float32 kept as a bfloat16 copy in memory (half the bytes); other dtypes as they
  are. Opt-in: it changes results slightly.
"""
from __future__ import annotations

import os
import tempfile
import threading
from typing import Protocol

import torch


class Tier(Protocol):
    name: str

    def put(self, t: torch.Tensor): ...

    def get(self, handle, shape, dtype) -> torch.Tensor: ...

    def free(self, handle) -> None: ...

    def close(self) -> None: ...


class FileTier:
    """One file per saved tensor. A freed file is kept open for the next tensor of the same
    size (a training step saves the same shapes every step): rewriting it reuses its page-cache
    pages instead of allocating new ones, and reads go straight into the new tensor."""
    name = "file"

    def __init__(self, directory: str | os.PathLike | None = None):
        self.dir = None if directory is None else os.fspath(directory)   # None: the system's temp
        if self.dir is not None:
            os.makedirs(self.dir, exist_ok=True)
        self._free: dict[int, list[int]] = {}        # size -> open file descriptors to reuse
        self._lock = threading.Lock()

    def put(self, t: torch.Tensor) -> tuple[int, int]:
        data = t.detach().contiguous().view(torch.uint8).numpy().reshape(-1)
        size = data.nbytes
        with self._lock:
            fds = self._free.get(size)
            fd = fds.pop() if fds else None
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
        with self._lock:
            self._free.setdefault(size, []).append(fd)

    def close(self) -> None:
        with self._lock:
            for fds in self._free.values():
                for fd in fds:
                    os.close(fd)
            self._free.clear()


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


TIERS = {"file": FileTier, "bf16": Bf16Tier}


def make_tier(spec: str) -> Tier:
    """'file' (a temporary directory), 'file:DIR', or 'bf16'."""
    name, _, arg = spec.partition(":")
    if name == "file":
        return FileTier(arg or os.environ.get("AUTOHC_AUTOMEM_DIR") or None)
    if name == "bf16" and not arg:
        return Bf16Tier()
    raise ValueError(f"AutoMem tier {spec!r}: one of file, file:DIR, bf16")
