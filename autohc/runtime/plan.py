"""The CPU plan: which cores compute, which run communication, which move memory.

One plan per process, read from the CPUs this process may use (hw.cpu) and two settings:

    AUTOHC_COMM_CORES    cores kept for the gradient all-reduce thread (default 0)
    AUTOHC_MEMORY_CORES  cores kept for tier-moving helper threads (AutoMem; default 0)

Kept cores come from the end of the CPU list, so compute keeps node 0's cores first. A
machine too small to give them away (fewer cores than asked + 1) shares: the kept role runs
on the last compute core, and `shared` says so. Compute cores are ordered by NUMA node, so
team thread t of the native pool (runtime.pool) runs on compute[t], and consecutive slices
of a kernel's work (GEMM JC ways, operator row blocks) land on one node.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from ..hw import cpu
from . import settings


@dataclass(frozen=True)
class CpuPlan:
    compute: tuple[int, ...]
    comm: tuple[int, ...] = ()
    memory: tuple[int, ...] = ()
    shared: bool = False            # a kept role shares a compute core (too few cores)

    def describe(self) -> str:
        s = f"compute {list(self.compute)}, comm {list(self.comm)}, memory {list(self.memory)}"
        return s + (" (shared with compute: too few cores)" if self.shared else "")


def make_plan(info: cpu.CpuInfo | None = None, comm_cores: int | None = None,
              memory_cores: int | None = None) -> CpuPlan:
    info = info or cpu.detect()
    comm_n = (settings.non_negative_int("AUTOHC_COMM_CORES", 0, "a number of cores")
              if comm_cores is None else comm_cores)
    mem_n = (settings.non_negative_int("AUTOHC_MEMORY_CORES", 0, "a number of cores")
             if memory_cores is None else memory_cores)
    ordered = tuple(c for node in info.numa_nodes for c in node) or info.cpus
    kept = comm_n + mem_n
    if kept and len(ordered) > kept:
        compute = ordered[:len(ordered) - kept]
        rest = ordered[len(ordered) - kept:]
        return CpuPlan(compute, rest[:comm_n], rest[comm_n:], False)
    if kept:                        # share: every kept role on the last core
        last = ordered[-1:]
        return CpuPlan(ordered, last * min(comm_n, 1), last * min(mem_n, 1), True)
    return CpuPlan(ordered)


@functools.lru_cache(maxsize=1)
def current() -> CpuPlan:
    """This process's plan (computed once)."""
    return make_plan()


def nodes_spanned(cores) -> int:
    """NUMA nodes holding any of `cores` (at least 1)."""
    cores = set(cores)
    return max(1, sum(1 for node in cpu.detect().numa_nodes if cores & set(node)))


def pin_this_thread(core: int | None) -> None:
    """Run the calling thread (not the process) on `core`, e.g. a helper thread on the core
    its role was given; None leaves it where it is."""
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})         # 0: the calling thread (Linux)
