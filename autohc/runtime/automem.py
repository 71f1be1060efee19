"""AutoMem (the DiT-HC paper's Algorithm 1), for activations: the tensors autograd saves for
backward leave the fast tier (this process's memory) after the forward pass has made them,
and come back, prefetched one ahead on a helper thread, before backward needs them.

    with AutoMem(FileTier(dir)) as am:       # or autohc train --automem file
        loss = model(x); loss.backward()

- Hooks: torch.autograd.graph.saved_tensors_hooks. pack() hands a tensor to the helper thread,
  which writes it to the tier and then drops the reference, so the memory is freed once
  autograd's own references are gone; unpack() returns it (waiting for its prefetch).
- Never offloaded: parameters (and views of them: the storage of every nn.Parameter of the
  wrapped model is known), tensors under `min_bytes` (not worth a round trip), anything that
  is not a dense CPU tensor.
- Order: the first step records the order in which backward unpacks the saved tensors (by
  their pack index); every later step prefetches, when backward unpacks one, the next one of
  that recorded order (backward runs the forward's saves in reverse, so the recorded order is
  that, but it is measured, not assumed).
- Back-pressure: at most AUTOHC_AUTOMEM_PENDING_MB (1024) wait to be written; the forward
  pass waits above it, so the peak cannot grow by what the tier has not taken yet.
- Optimizer state (StateOffload, `--automem-state`): AdamW's moments in the tier between
  steps, back on a helper thread while backward runs.
- Kernel results: while AutoMem runs, the result pool (runtime/memory.py) keeps at most
  AUTOHC_AUTOMEM_POOL_MB (256) of freed blocks, so offloaded activations leave RSS; a helper
  (memory.Prefaulter, on the memory core) fills that room with the blocks the step will ask
  for next, faulted in, so the compute threads do not zero fresh pages.
- Helper threads: one thread each for offload and prefetch, pinned to the CPU plan's memory
  cores (AUTOHC_MEMORY_CORES; shared with compute on a machine too small), never the compute
  threads. Tiers are pluggable (runtime/tiers.py): a file (mmap'able, on local SSD), a bf16
  copy (opt-in: changes results slightly).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from . import memory, settings
from . import plan as cpu_plan
from .tiers import Tier, take

MIN_BYTES = 1 << 20


class _Saved:
    """One saved tensor's way through the tier."""
    __slots__ = ("index", "stored", "fetched", "shape", "dtype", "held", "nbytes")

    def __init__(self, index: int, shape, dtype, held: torch.Tensor, nbytes: int):
        self.index, self.shape, self.dtype, self.nbytes = index, shape, dtype, nbytes
        self.held: torch.Tensor | None = held   # the tensor itself until the tier has it
        self.stored: Future | None = None       # tier handle, once written
        self.fetched: Future | None = None      # the tensor, once read back


class AutoMem:
    def __init__(self, tier: Tier, model: torch.nn.Module | None = None, *, min_bytes: int | None = None):
        if min_bytes is None:
            min_bytes = min_bytes_setting()
        self.tier, self.min_bytes = tier, min_bytes
        # bytes handed to the offload thread and not yet written: the forward pass waits above
        # this, or tensors pile up in the queue faster than the tier takes them (the peak
        # would be theirs)
        self.max_pending = settings.non_negative_int(
            "AUTOHC_AUTOMEM_PENDING_MB", 1024, "MiB waiting to be offloaded") << 20
        self._pending = 0
        self._drained = threading.Condition()
        prefault = settings.non_negative_int("AUTOHC_AUTOMEM_PREFAULT", 1, "0 (off) or 1 (on)")
        fixed_mmap_threshold(self.min_bytes)
        # The result pool (runtime/memory.py) keeps freed kernel results for reuse, up to
        # AUTOHC_POOL_MB (2 GB and up): the offloaded activations' blocks would wait there, in RSS.
        # Measured, DiT-B/2 batch 16, file tier: peak 3.95 GB with that cap, 3.18 with 256 MB,
        # 2.96 with none, the step time the same within noise. Restored by close().
        self._pool_cap = memory.pool.set_cap(min(memory.pool.cap_bytes, settings.non_negative_int(
            "AUTOHC_AUTOMEM_POOL_MB", 256, "MiB of free result blocks kept while AutoMem runs") << 20))
        self.param_storages: set[int] = set()
        if model is not None:
            self.protect(model)
        core = _memory_core()
        # with the pool capped that low, its misses are fresh pages that the compute threads
        # would zero in their first write: a helper readies the next step's blocks instead
        # (runtime/memory.py: Prefaulter)
        self._prefaulter = None
        if prefault and memory.pool.cap_bytes and memory.pool.listener is None:
            self._prefaulter = memory.Prefaulter(memory.pool, core)
        self._offload = ThreadPoolExecutor(1, thread_name_prefix="autohc-automem-out",
                                           initializer=cpu_plan.pin_this_thread, initargs=(core,))
        self._prefetch = ThreadPoolExecutor(1, thread_name_prefix="autohc-automem-in",
                                            initializer=cpu_plan.pin_this_thread, initargs=(core,))
        self.order: list[int] | None = None     # recorded unpack order (pack indices)
        self._unpacked: list[int] = []
        self._saved: dict[int, _Saved] = {}
        self._lock = threading.Lock()
        self._hooks = None
        # unqueued: used from memory at unpack, its write cancelled or its copy dropped
        # *_wait_s: the compute thread's time waiting, for room in the offload queue (pack) and
        # for a read not yet done (unpack)
        self.stats = {"offloaded": 0, "offloaded_bytes": 0, "kept": 0, "prefetched": 0, "waited": 0,
                      "unqueued": 0, "pack_wait_s": 0.0, "unpack_wait_s": 0.0}

    def protect(self, model: torch.nn.Module) -> None:
        """Parameters of `model` are never offloaded (nor any view of their storage)."""
        for p in model.parameters():
            self.param_storages.add(p.untyped_storage().data_ptr())

    # ------------------------------------------------------------------ hooks
    def _pack(self, t: torch.Tensor):
        if (isinstance(t, torch.nn.Parameter) or t.device.type != "cpu" or t.layout != torch.strided
                or t.untyped_storage().data_ptr() in self.param_storages
                or t.numel() * t.element_size() < self.min_bytes):
            self.stats["kept"] += 1
            return t
        nbytes = t.numel() * t.element_size()
        with self._lock:
            s = _Saved(len(self._saved), t.shape, t.dtype, t, nbytes)
            self._saved[s.index] = s
        with self._drained:
            t0 = time.perf_counter()
            while self.max_pending and self._pending and self._pending + nbytes > self.max_pending:
                self._drained.wait()
            self.stats["pack_wait_s"] += time.perf_counter() - t0
            self._pending += nbytes
        s.stored = self._offload.submit(self._put, s)
        self.stats["offloaded"] += 1
        self.stats["offloaded_bytes"] += nbytes
        return s

    def _put(self, s: _Saved):
        try:
            t = s.held
            return None if t is None else self.tier.put(t)   # None: unpack took it meanwhile
        finally:
            s.held = None           # the tier has it: the memory goes once autograd lets go
            self._release(s.nbytes)

    def _release(self, nbytes: int) -> None:
        with self._drained:
            self._pending -= nbytes
            self._drained.notify_all()

    def _fetch(self, s: _Saved) -> torch.Tensor:
        return take(self.tier, s.stored.result(), s.shape, s.dtype)

    def _drop_written(self, stored: Future) -> None:
        """A tensor used from memory after all: its copy in the tier is not needed."""
        if not stored.cancelled() and stored.exception() is None and stored.result() is not None:
            self.tier.free(stored.result())

    def _unpack(self, s):
        if not isinstance(s, _Saved):
            return s
        self._unpacked.append(s.index)
        t = s.held
        if t is not None:
            # Not yet in the tier (the tail of the forward pass, which backward needs first):
            # use it as it is, instead of waiting behind the offload queue to read it back.
            if s.stored.cancel():
                self._release(s.nbytes)
            else:
                s.stored.add_done_callback(self._drop_written)
            s.held = None
            self.stats["unqueued"] += 1
        else:
            if s.fetched is None:
                self.stats["waited"] += 1
                s.fetched = self._prefetch.submit(self._fetch, s)
            t0 = time.perf_counter()
            t = s.fetched.result()
            self.stats["unpack_wait_s"] += time.perf_counter() - t0
        with self._lock:
            self._saved.pop(s.index, None)
        self._prefetch_after(s.index)
        return t

    def _prefetch_after(self, index: int) -> None:
        """Start reading the tensor that backward needs after this one (recorded order); past
        those still in memory (not yet written), which need no read."""
        if not self.order:
            return
        try:
            at = self.order.index(index) + 1
        except ValueError:
            return
        for nxt in self.order[at:]:
            s = self._saved.get(nxt)
            if s is None or s.held is not None:
                continue
            if s.fetched is None:
                s.fetched = self._prefetch.submit(self._fetch, s)
                self.stats["prefetched"] += 1
            return

    # --------------------------------------------------------------- context
    def __enter__(self) -> "AutoMem":
        if self._prefaulter is not None:
            self._prefaulter.step()
        self._saved.clear()
        self._unpacked = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
        if self._prefaulter is not None:            # result blocks readied, and let go for room
            self.stats["prefaulted"] = self._prefaulter.stats["stocked"]
            self.stats["prefault_evicted"] = self._prefaulter.stats["evicted"]
        if self.order is None and self._unpacked:
            self.order = list(self._unpacked)         # the warm-up step's backward order
        for s in list(self._saved.values()):          # saved but never used: drop from the tier
            if s.stored is not None:
                try:
                    self.tier.free(s.stored.result())
                except Exception:                      # a failed write has nothing to free
                    pass
        self._saved.clear()

    def close(self) -> None:
        self._offload.shutdown(wait=True)
        self._prefetch.shutdown(wait=True)
        self.tier.close()
        if self._prefaulter is not None:
            self._prefaulter.close()
            self._prefaulter = None
        if self._pool_cap is not None:
            memory.pool.set_cap(self._pool_cap)
            self._pool_cap = None


class StateOffload:
    """The optimizer's state (AdamW's two moments: twice the parameters' bytes) in a tier
    between steps: written out after opt.step(), fetched back on a helper thread from the
    middle of backward on, put back before the next opt.step(). The forward and backward passes, where
    a step's memory peaks, run without it.

        so = StateOffload(opt, tier)
        loss = model(x); loss.backward(); so.restore(); opt.step(); so.offload()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, tier: Tier, *, min_bytes: int | None = None,
                 at_fraction: float = 0.5):
        self.opt, self.tier = optimizer, tier
        # the prefetch starts once this fraction of the parameters have their gradient: at the
        # start of backward the activations are all still there (the step's peak), so the
        # moments come back only once backward has freed part of them
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self._trigger_at = max(1, int(len(params) * at_fraction))
        self._grads_seen = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]
        self.min_bytes = min_bytes_setting() if min_bytes is None else min_bytes
        self._away: list = []               # (state dict, key, handle, shape, dtype)
        self._back: Future | None = None
        core = _memory_core()
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="autohc-automem-state",
                                          initializer=cpu_plan.pin_this_thread, initargs=(core,))
        self.stats = {"offloaded_bytes": 0, "steps": 0}

    def offload(self) -> None:
        """After opt.step(): every state tensor of min_bytes and more to the tier (in place of
        it, an empty tensor until restore())."""
        if self._away:
            raise RuntimeError("StateOffload.offload: the state is already in the tier")
        moved = 0
        for state in self.opt.state.values():
            for k, v in state.items():
                if torch.is_tensor(v) and v.device.type == "cpu" and v.numel() * v.element_size() >= self.min_bytes:
                    self._away.append((state, k, self.tier.put(v), v.shape, v.dtype))
                    state[k] = v.new_empty(0)
                    moved += v.numel() * v.element_size()
        self.stats["offloaded_bytes"], self.stats["steps"] = moved, self.stats["steps"] + 1
        self._grads_seen = 0                    # the next backward's count starts here

    def _grad_ready(self, _param) -> None:
        self._grads_seen += 1
        if self._grads_seen == self._trigger_at:
            self.prefetch()

    def prefetch(self) -> None:
        """Start reading the state back (done by itself part-way through backward, see
        at_fraction; restore() waits for it or reads it)."""
        if self._away and self._back is None:
            away = list(self._away)
            self._back = self._helper.submit(lambda: [self.tier.get(h, shape, dtype)
                                                      for _, _, h, shape, dtype in away])

    def restore(self) -> None:
        """Before opt.step(): the state back in place (waits for the prefetch)."""
        if not self._away:
            return
        self.prefetch()
        tensors = self._back.result()
        for (state, k, h, _, _), t in zip(self._away, tensors):
            state[k] = t
            self.tier.free(h)
        self._away, self._back, self._grads_seen = [], None, 0

    def close(self) -> None:
        """The state back in memory (what follows may save a checkpoint), the helper thread and
        the tier (this object's own) closed."""
        self.restore()
        for h in self._hooks:
            h.remove()
        self._helper.shutdown(wait=True)
        self.tier.close()


def min_bytes_setting() -> int:
    """AUTOHC_AUTOMEM_MIN_KB (default 1024): saved tensors below it stay in memory."""
    return settings.non_negative_int("AUTOHC_AUTOMEM_MIN_KB", MIN_BYTES >> 10,
                                     "KiB (saved tensors below it stay in memory)") << 10


def fixed_mmap_threshold(nbytes: int) -> bool:
    """glibc: blocks of `nbytes` and more always mmapped, so that a freed activation goes back
    to the system. By default glibc raises its mmap threshold to the largest block freed (up to
    32 MB) and keeps later blocks of that size in its heap after free: the offloaded
    activations then stay in the process's RSS (measured: DiT-S/2 batch 16 peak 1.96 GB with
    AutoMem under the default, 1.2-1.6 GB with the threshold fixed at process start, 2.2 GB
    when it is fixed only once torch has run; 2.6-2.8 GB without AutoMem). So `autohc train
    --automem` sets it first thing; AutoMem() sets it too, for callers that did not."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, ctypes.c_int(max(nbytes, 128 << 10))))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False                    # not glibc: nothing to fix


def _memory_core() -> int | None:
    p = cpu_plan.current()
    return p.memory[0] if p.memory else None

