"""NUMA-aware first touch for the operators: on a machine with several memory nodes, the
thread that computes slice i of an operator's result runs on the CPUs of node
i * nodes // slices while it does, so the pages of the result that it writes first land on
that node, and the next operator over the same split reads them locally (Linux places a page
on the node of the CPU that first writes it).

Nodes come from /sys/devices/system/node, limited to the CPUs this process may use. With one
node (or off Linux) nothing is pinned and nothing costs more than a cached length check.
"""
from __future__ import annotations

import functools
import os
import threading
from pathlib import Path

SYSFS = Path("/sys/devices/system/node")
_pinned = threading.local()      # the CPU set this thread was last pinned to


def parse_cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


@functools.lru_cache(maxsize=1)
def nodes() -> tuple[frozenset[int], ...]:
    """CPU sets of the NUMA nodes that hold CPUs this process may use, by node number."""
    try:
        allowed = os.sched_getaffinity(0)
        found = []
        for d in sorted(SYSFS.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
            cpus = frozenset(parse_cpulist((d / "cpulist").read_text())) & allowed
            if cpus:
                found.append(cpus)
        return tuple(found)
    except (OSError, ValueError, AttributeError):
        return ()


def node_of(part: int, parts: int) -> int:
    """The node that slice `part` of `parts` belongs to: consecutive slices share a node."""
    return part * len(nodes()) // parts


def pin(part: int, parts: int) -> None:
    """Run the calling thread on the CPUs of slice `part`'s node (no-op with one node)."""
    ns = nodes()
    if len(ns) < 2:
        return
    want = ns[node_of(part, parts)]
    if getattr(_pinned, "cpus", None) != want:
        os.sched_setaffinity(0, want)            # 0: this thread
        _pinned.cpus = want
