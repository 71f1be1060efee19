"""Transparent huge pages for the whole process, on or off: the A/B switch behind the
huge-page measurements (README "Huge pages").

autohc asks for huge pages where they pay (MADV_HUGEPAGE on result blocks of 4 MB and up,
runtime/memory.py, and on packed GEMM panels of 2 MB and up, templates/gemm/gemm.c.j2);
with the kernel's THP mode at "madvise" those are the only huge pages a process gets.
AUTOHC_HUGE_PAGES=0 turns THP off for the process (prctl PR_SET_THP_DISABLE, inherited by
its children), so the same run can be timed with and without them.
"""
from __future__ import annotations

import ctypes
import os

PR_SET_THP_DISABLE = 41


def apply_env() -> bool:
    """Apply AUTOHC_HUGE_PAGES (1 default, 0 off); True if huge pages stay allowed."""
    raw = os.environ.get("AUTOHC_HUGE_PAGES", "").strip()
    if raw in ("", "1"):
        return True
    if raw != "0":
        raise ValueError(f"AUTOHC_HUGE_PAGES={raw!r}: expected 0 or 1")
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_THP_DISABLE) failed")
    return False


def mode() -> str:
    """The kernel's THP mode (always, madvise, never), or "unknown"."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
        return text[text.index("[") + 1:text.index("]")]
    except (OSError, ValueError):
        return "unknown"


def anon_huge_kb() -> int:
    """This process's anonymous memory in huge pages (kB), from /proc/self/smaps_rollup."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0
