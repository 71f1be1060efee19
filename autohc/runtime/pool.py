"""The process's one native worker pool (templates/runtime/pool.c.j2), built once.

Every generated kernel runs its threads as a team of this pool: a kernel library is bound
to `run_address()` once when it is loaded, and its C code calls the pool with a body and a
thread count. Workers are pinned to the CPU plan's compute cores (worker t on compute[t]).
"""
from __future__ import annotations

import functools
import threading

from ..build import build
from ..kernels.family import exported_declarations
from ..kernels.render import environment
from . import plan

SPIN_US = 200                   # idle spin before a worker sleeps (back-to-back kernels)
_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def _library():
    src = environment().get_template("runtime/pool.c.j2").render(spin_us=SPIN_US)
    lib = build(src, exported_declarations(src), (), meta={"op": "runtime"})
    cpus = list(plan.current().compute)
    lib.lib.autohc_pool_set_cpus(lib.ffi.new("int[]", cpus), len(cpus), -1)
    return lib


def run_address() -> int:
    """The address of autohc_pool_run, for a kernel library's <prefix>_bind."""
    with _lock:
        lib = _library()
    return int(lib.ffi.cast("uintptr_t", lib.ffi.addressof(lib.lib, "autohc_pool_run")))


def bind(library, prefix: str) -> None:
    """Hand a freshly loaded kernel library the pool: <prefix>_bind(run)."""
    getattr(library.lib, f"{prefix}_bind")(library.ffi.cast("void *", run_address()))


def workers() -> int:
    """Worker threads the pool has started (the caller of a team is not one of them)."""
    return _library().lib.autohc_pool_workers()
