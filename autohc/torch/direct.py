"""Whether a call of one of autohc's custom ops may run its implementation directly, without
the op's Python dispatch (autograd wrapper, redispatch, dynamo's disable wrapper): at a DiT-S/2
batch's sizes that dispatch cost more than the kernel (docs/history.md, stop 79)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode


def runs_direct(*ts: torch.Tensor | None) -> bool:
    """No autograd to record, and nothing tracing or watching: torch.compile, torch.jit.trace,
    fake or functional tensors, vmap and the other functorch transforms, a dispatch mode, the
    profiler (whose tables name the op)."""
    ts = [t for t in ts if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return False
    return unwatched() and all(type(t) is torch.Tensor for t in ts)


def unwatched() -> bool:
    """Nothing tracing or watching the calls (runs_direct's second half: torch.compile,
    torch.jit.trace, a dispatch mode, a functorch transform, the profiler)."""
    return not (torch.compiler.is_compiling() or torch.jit.is_tracing()
                or torch.autograd.profiler._is_profiler_enabled or _current_dispatch_mode() is not None
                or torch._C._functorch.peek_interpreter_stack() is not None)
