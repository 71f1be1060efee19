"""Under install(), a kernel that cannot be built or started must not take the user's job
down: that call goes to ATen (same result), with one warning per cause, and the process keeps
running. `autohc.matmul` and the autohc ops called directly still raise (they are asked for
by name)."""
from __future__ import annotations

import threading
import warnings

from ..build import BuildError
from ..kernels.gemm.kernel import KernelError
from ..kernels.gemm.matmul import AtenFaster

# what a kernel can fail with before computing anything: no compiler, a compile error, a
# library that cannot load, a pool that cannot start threads
FAILURES = (BuildError, KernelError, OSError, ImportError)
_seen: set[str] = set()
_lock = threading.Lock()


def report(error: BaseException, what: str) -> None:
    """Warn the first time this cause is seen in the process."""
    cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    with _lock:
        if cause in _seen:
            return
        _seen.add(cause)
    warnings.warn(f"autohc: {what} runs on ATen instead of autohc's kernels ({cause}); "
                  "results are the same, only slower", RuntimeWarning, stacklevel=3)


def kernel_or(kernel, aten, what: str, served: bool = True):
    """kernel() where autohc serves the call, else aten(); aten() too if the kernel cannot
    run here (reported once per cause) or first-use tuning timed ATen faster on it (silently)."""
    if served:
        try:
            return kernel()
        except AtenFaster:
            pass                        # first-use tuning timed ATen faster here: no warning
        except FAILURES as e:
            report(e, what)
    return aten()


def captured(name: str):
    """ATen's own CPU kernel of aten::name ("mm.out", ...), taken before install() registers
    autohc's, so that a call autohc does not serve can still reach it (an overridden `.out`
    op has no other way back to ATen). None where this torch offers no such handle."""
    import torch
    try:
        return torch._C._dispatch_get_computed_kernel_for_dispatch_key(f"aten::{name}", torch._C.DispatchKey.CPU)
    except (AttributeError, RuntimeError):
        return None


def call_captured(kernel, *args, **kwargs):
    import torch
    return kernel.call_boxed(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **kwargs)
