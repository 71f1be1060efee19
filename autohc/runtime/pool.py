"""The process's one native worker pool (templates/runtime/pool.c.j2), built once.

Every generated kernel runs its threads as a team: a kernel library is bound to
`run_address()` once when it is loaded, and its C code calls that runner with a body and a
thread count. The runner is torch's OpenMP threads (runtime/omp.py, the default), with this
pool as its fallback, or this pool itself where AUTOHC_TEAM=pool. Workers are pinned to the
CPU plan's compute cores (worker t on compute[t]).
"""
from __future__ import annotations

import functools
import threading

from ..build import build
from ..kernels.family import exported_declarations
from ..kernels.render import environment
from . import omp, plan

SPIN_US = 200                   # idle spin before a worker sleeps (back-to-back kernels)
_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def _library():
    src = environment().get_template("runtime/pool.c.j2").render(spin_us=SPIN_US)
    lib = build(src, exported_declarations(src), (), meta={"op": "runtime"})
    cpus = list(plan.current().compute)
    lib.lib.autohc_pool_set_cpus(lib.ffi.new("int[]", cpus), len(cpus), -1)
    return lib


def pool_run_address() -> int:
    """The address of autohc_pool_run."""
    with _lock:
        lib = _library()
    return int(lib.ffi.cast("uintptr_t", lib.ffi.addressof(lib.lib, "autohc_pool_run")))


def run_address() -> int:
    """The team runner a kernel library's <prefix>_bind gets: torch's OpenMP threads (with
    this pool as its fallback), or this pool where AUTOHC_TEAM=pool (runtime/omp.py)."""
    fallback = pool_run_address()
    if omp.team_kind() == "pool":
        return fallback
    with _lock:
        return omp.team_run_address(fallback)


def bind(library, prefix: str) -> None:
    """Hand a freshly loaded kernel library the pool: <prefix>_bind(run)."""
    getattr(library.lib, f"{prefix}_bind")(library.ffi.cast("void *", run_address()))


def workers() -> int:
    """Worker threads the pool has started (the caller of a team is not one of them)."""
    return _library().lib.autohc_pool_workers()
