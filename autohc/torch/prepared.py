"""Prepared calls: the torch override's hot path as one lookup (issue 71 item 5).

The first call of a GEMM with given shapes, strides, dtypes and scalars takes the whole path
(whether autohc serves it, the kernel's parameters, the bias's form) and leaves a route for
the calls like it: ATen's own kernel, or autohc's kernel bound to the problem
(GemmKernel.bound), called with the operands' addresses and a fresh result. As oneDNN's
primitive cache: create once, execute many. A route holds while what it was decided under
holds (the stamp): the registry's state, the first-use hook and its forgetting, the kernel
threads, CFTP's clusters and AMX tile emulation. Any change of these empties the table.
"""
from __future__ import annotations

import threading

from ..kernels.gemm.kernel import tiles_emulated
from ..kernels.gemm.matmul import choices_stamp
from ..runtime import cftp
from .threads import kernel_threads

MAX_ROUTES = 4096       # (shapes that keep changing: the table starts again)

_routes: dict = {}
_stamp: list = [None]
_lock = threading.Lock()
stats = {"hits": 0, "misses": 0}    # for tests and curiosity


def _now() -> tuple:
    memo, hook, forgotten = choices_stamp()
    return memo, hook, forgotten, kernel_threads(), cftp.clusters(), tiles_emulated()


def route(key: tuple):
    """(the route of calls of `key`, or None where none is known yet, and the stamp that a
    route found now must be remembered under)."""
    now = _now()
    held = _stamp[0]
    if held is None or held[0] is not now[0] or held[1:] != now[1:]:
        with _lock:
            _routes.clear()
            _stamp[0] = now
        return None, now
    run = _routes.get(key)
    if run is not None:
        stats["hits"] += 1
    return run, held


def remember(key: tuple, run, stamp: tuple) -> None:
    """Keep `run` as the route of `key`, where the stamp is still the one it was decided under."""
    stats["misses"] += 1
    if run is None:
        return
    with _lock:
        if _stamp[0] is not stamp:
            return
        if len(_routes) >= MAX_ROUTES:
            _routes.clear()
        _routes[key] = run


def forget() -> None:
    """Decide every call afresh (install() and uninstall())."""
    with _lock:
        _routes.clear()
        _stamp[0] = None
