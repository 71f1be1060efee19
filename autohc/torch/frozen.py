"""`with autohc.frozen(model):` inference on weights that do not change: each Linear weight
that autocast's bf16 forward reads (torch/autocast.py, `linear_fp32w`) is rounded to bf16 once,
into a contiguous copy that every later call packs from, instead of rounding the fp32 master
on every call (Inductor's CPU freezing does the same for a compiled graph).

A copy is taken on a weight's first use inside the block and checked on every call: the
weight's storage address and torch's version counter (bumped by every in-place edit: copy_,
load_state_dict, an optimizer's step, `p.data[...] = ...`) must be those it was taken at,
else it is taken again, so an edited model is never served stale weights. A forward that
records autograd for the weight (torch.is_grad_enabled() and w.requires_grad: training) reads
the fp32 master as without the block. The copies (half the fp32 weights' bytes) are freed when
the outermost block ends. Only the bf16 Linear path uses them; fp32 runs are unchanged.
"""
from __future__ import annotations

import contextlib

import torch

# data_ptr of a frozen weight -> [the weight (held: its address cannot be reused while the
# block lasts), its version when copied or None, the bf16 copy or None]
_weights: dict[int, list] = {}
_depth = 0
stats = {"copies": 0, "served": 0}      # for tests: copies taken, calls served from one


@contextlib.contextmanager
def frozen(*modules: torch.nn.Module):
    """Inside the block, the floating-point 2-D parameters of `modules` (Linear weights) are
    served to the bf16 GEMMs from bf16 copies taken once (see the module's doc)."""
    global _depth
    added = []
    for m in modules:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"autohc.frozen takes torch.nn.Module objects, not {type(m).__name__}")
        for p in m.parameters():
            if p.dim() == 2 and p.dtype == torch.float32 and p.data_ptr() not in _weights:
                _weights[p.data_ptr()] = [p, None, None]
                added.append(p.data_ptr())
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        for k in added:
            _weights.pop(k, None)
        if _depth == 0:
            _weights.clear()


def bf16_weight(w: torch.Tensor) -> torch.Tensor | None:
    """The bf16 copy of a frozen float32 weight w (taken now if w is new or was edited), or
    None: not frozen, or a forward that trains it."""
    if not _weights:
        return None
    entry = _weights.get(w.data_ptr())
    if entry is None or entry[0].shape != w.shape or entry[0].stride() != w.stride():
        return None
    if w.requires_grad and torch.is_grad_enabled():
        return None
    version = entry[0]._version
    if entry[1] != version:
        entry[2] = entry[0].detach().to(torch.bfloat16).contiguous()
        entry[1] = version
        stats["copies"] += 1
    stats["served"] += 1
    return entry[2]
