"""`with autohc.frozen(model):` inference on weights that do not change: each Linear weight
that autocast's bf16 forward reads (torch/autocast.py, `linear_fp32w`) is rounded to bf16 once,
into a contiguous copy; with `frozen(..., packed=True)` also packed once into the panel
layout of the GEMM kernel that reads it (`packed_weight`), so that a forward neither rounds
nor packs a weight (Inductor's CPU freezing does the same for a compiled graph). Kernels that
read B in place (M up to the skinny paths', a B-outer loop order) read the bf16 copy.

A copy is taken on a weight's first use inside the block and checked on every call: the
weight's storage address and torch's version counter (bumped by every in-place edit: copy_,
load_state_dict, an optimizer's step, `p.data[...] = ...`) must be those it was taken at,
else it is taken again, so an edited model is never served stale weights. A forward that
records autograd for the weight (torch.is_grad_enabled() and w.requires_grad: training) reads
the fp32 master as without the block. The copies (each half the fp32 weights' bytes: the bf16
copy, and the packing where a kernel reads one) are freed when the outermost block ends.
Only the bf16 Linear path uses them; fp32 runs are unchanged.

Training has working copies instead (`working_copy`): autohc.optim.AdamW's `keep_bf16_copies`
makes a bf16 copy of each weight and rewrites it in the pass that updates the weight, so the
bf16 GEMMs of the forward and of dX that pack W (torch/autocast.py `_kernel_weight`) read it
instead of rounding the fp32 master on every call (the same bits: the kernels round as torch's
cast does). The optimizer's kernel writes the
weight without touching torch's version counter, so a copy holds while the weight's version is
the one stamped after the optimizer's pass; any in-place edit through torch (copy_,
load_state_dict, `with torch.no_grad(): w.mul_(...)`) bumps it, and the next call that reads
the copy takes it again from the weight first. An edit through `w.data`, which has a counter of
its own, is not seen (here as for frozen weights).
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from ..runtime.memory import huge_page_empty


class _Frozen:
    """A frozen weight (held: its address cannot be reused while the block lasts), the version
    its copies were taken at, its bf16 copy and its packings (kernel layout -> tensor)."""
    __slots__ = ("weight", "version", "bf16", "packed")

    def __init__(self, weight: torch.Tensor):
        self.weight, self.version, self.bf16, self.packed = weight, None, None, {}


_weights: dict[int, _Frozen] = {}       # data_ptr of a frozen weight -> its entry
_depth = 0
# for tests: copies and packings taken, calls served (frozen), calls served a working copy and
# working copies taken again after an edit
stats = {"copies": 0, "served": 0, "packs": 0, "working": 0, "refreshes": 0}


class WorkingCopy:
    """A training weight's bf16 working copy, the weight's version it holds (None: none) and
    whether a GEMM read it since its owner (an optimizer, which keeps it alive) last wrote it;
    `refresh` takes it again from the weight."""
    __slots__ = ("weight", "bf16", "version", "read", "__weakref__")

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.bf16 = weight.detach().to(torch.bfloat16).contiguous()
        self.version, self.read = weight._version, True

    def refresh(self) -> None:
        self.bf16.copy_(self.weight.detach())
        self.version = self.weight._version


_working: "weakref.WeakValueDictionary[int, WorkingCopy]" = weakref.WeakValueDictionary()


def working_copy(weight: torch.Tensor) -> WorkingCopy:
    """A working copy of a contiguous float32 CPU weight, served by working_bf16
    (see the module's doc); the caller holds it (it is dropped with its last reference)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or not weight.is_contiguous():
        raise ValueError("a working copy is of a contiguous float32 CPU tensor")
    entry = WorkingCopy(weight)
    _working[weight.data_ptr()] = entry
    return entry


def working_bf16(w: torch.Tensor) -> torch.Tensor | None:
    """w's working copy (None: w has none), taken again first where w was edited through torch
    since the optimizer wrote it."""
    entry = _working.get(w.data_ptr()) if _working else None
    if entry is None or entry.weight.shape != w.shape or entry.weight.stride() != w.stride():
        return None
    if entry.version != w._version:
        entry.refresh()
        stats["refreshes"] += 1
    stats["working"] += 1
    entry.read = True
    return entry.bf16


_packing = [False]      # whether the outermost block packs the weights (frozen(packed=...))


@contextlib.contextmanager
def frozen(*modules: torch.nn.Module, packed: bool = False):
    """Inside the block, the floating-point 2-D parameters of `modules` (Linear weights) are
    served to the bf16 GEMMs from bf16 copies taken once (see the module's doc); with
    `packed`, also packed once into the reading kernel's panels (off by default: measured no
    faster than packing per call on 2 threads, docs/history.md stop 77)."""
    global _depth
    if not isinstance(packed, bool):
        raise TypeError(f"autohc.frozen: packed must be True or False, not {packed!r}")
    added = []
    for m in modules:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"autohc.frozen takes torch.nn.Module objects, not {type(m).__name__}")
        for p in m.parameters():
            if p.dim() == 2 and p.dtype == torch.float32 and p.data_ptr() not in _weights:
                _weights[p.data_ptr()] = _Frozen(p)
                added.append(p.data_ptr())
    _depth += 1
    _packing.append(packed if _depth == 1 else _packing[-1] or packed)
    try:
        yield
    finally:
        _packing.pop()
        _depth -= 1
        for k in added:
            _weights.pop(k, None)
        if _depth == 0:
            _weights.clear()


def _current(w: torch.Tensor) -> _Frozen | None:
    """w's entry with its copies of w as it is now (dropped if w was edited since), or None:
    not frozen, or a forward that trains it."""
    if not _weights:
        return None
    entry = _weights.get(w.data_ptr())
    if entry is None or entry.weight.shape != w.shape or entry.weight.stride() != w.stride():
        return None
    if w.requires_grad and torch.is_grad_enabled():
        return None
    version = entry.weight._version
    if entry.version != version:
        entry.bf16, entry.packed, entry.version = None, {}, version
    return entry


def _bf16_of(entry: _Frozen) -> torch.Tensor:
    if entry.bf16 is None:
        entry.bf16 = entry.weight.detach().to(torch.bfloat16).contiguous()
        stats["copies"] += 1
    return entry.bf16


def bf16_weight(w: torch.Tensor) -> torch.Tensor | None:
    """The bf16 copy of a frozen float32 weight w (taken now if w is new or was edited), or
    None: not frozen, or a forward that trains it."""
    entry = _current(w)
    if entry is None:
        return None
    stats["served"] += 1
    return _bf16_of(entry)


def packed_weight(w: torch.Tensor):
    """For a frozen float32 weight w (N x K) of a Linear: a function that gives, for the GEMM
    kernel that runs y = x wᵀ, wᵀ packed whole in that kernel's panel layout (packed on the
    first call for each layout, again after an edit of w), so that no forward packs it; None
    where bf16_weight(w) is None or no block asked for packed weights."""
    entry = _current(w) if _packing[-1] else None
    if entry is None:
        return None

    def packed(kernel) -> torch.Tensor:
        layout = kernel.packed_b_layout
        if entry.version != entry.weight._version:      # (edited since packed_weight was asked)
            return None
        pk = entry.packed.get(layout)
        if pk is None:
            w16 = _bf16_of(entry)
            N, K = w16.shape
            pk = huge_page_empty(kernel.packed_b_elems(K, N), dtype=torch.bfloat16)   # (as the panels)
            kernel.pack_b_whole(K, N, w16.data_ptr(), 1, K, 0, pk.data_ptr())   # B = w16ᵀ
            entry.packed[layout] = pk
            stats["packs"] += 1
        return pk
    return packed
