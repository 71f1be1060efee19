"""`autohc.optim.AdamW`: torch.optim.AdamW with a fused, generated step kernel.

One pass reads each parameter, gradient and both moments once and writes them once
(templates/ops/eltwise.c.j2 `adamw_multi`): one call per thread takes its share of all the
group's tensors, split over the worker pool's team of kernel_threads() threads
(install()'s count while installed, else torch.get_num_threads()). Same
hyper-parameters and state (`step`, `exp_avg`, `exp_avg_sq`) as torch.optim.AdamW, so
state_dicts move between the two. Tensors the kernel does not take (not float32, not
contiguous, not CPU) get torch's own AdamW update, unchanged.

An EMA of the weights (a trainer's `ema = d ema + (1 - d) p` after each step) rides in the
same pass: `attach_ema` names each parameter's EMA tensor and `step(ema_decay=d)` updates
them from the new weights as it writes them, so the EMA reads no weight again and costs no
per-parameter torch calls. An EMA the kernel cannot take, or of a parameter without a
gradient this step, is updated by torch's ops, with the same formula.

bf16 working copies ride in it too: `keep_bf16_copies` gives each 2-D float32 weight a bf16
copy (torch/frozen.py `working_copy`) that the pass writes as it updates the weight (2 bytes a
parameter), and that the bf16 GEMMs of autocast's Linears read instead of rounding the fp32
weight on every call. A copy no GEMM read since the last step (a skinny adaLN weight, an
embedding table) is not written; a later read takes it again from the weight.
"""
from __future__ import annotations

import torch

from . import frozen, ops
from .threads import kernel_threads


class AdamW(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, amsgrad: bool = False, maximize: bool = False):
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid beta parameters: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if amsgrad or maximize:
            raise ValueError("autohc.optim.AdamW: amsgrad and maximize are not supported; "
                             "use torch.optim.AdamW for them")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self._ema: dict[torch.Tensor, torch.Tensor] = {}
        self._bf16: dict[torch.Tensor, "frozen.WorkingCopy"] = {}

    def keep_bf16_copies(self) -> int:
        """Keep a bf16 working copy of every 2-D contiguous float32 CPU parameter, rewritten in
        each step's pass (torch/frozen.py); how many parameters have one."""
        for group in self.param_groups:
            for p in group["params"]:
                if (p not in self._bf16 and p.dim() == 2 and p.dtype == torch.float32
                        and p.device.type == "cpu" and p.is_contiguous()):
                    self._bf16[p] = frozen.working_copy(p)
        return len(self._bf16)

    def attach_ema(self, pairs) -> None:
        """(parameter, its EMA tensor) pairs that step(ema_decay=d) updates in its pass."""
        for p, e in pairs:
            if e.shape != p.shape or e.dtype != p.dtype:
                raise ValueError(f"an EMA of shape {tuple(e.shape)} {e.dtype} for a parameter of "
                                 f"{tuple(p.shape)} {p.dtype}")
            self._ema[p] = e

    @torch.no_grad()
    def step(self, closure=None, *, ema_decay: float | None = None):
        """One AdamW step; with ema_decay, also every attached EMA from the new weights."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ema = self._ema if ema_decay is not None else {}
        ema_done: set[torch.Tensor] = set()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            slow = []
            # tensors with the same step share bias corrections; those with an EMA go together
            by_step: dict[tuple[float, bool], list] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("autohc.optim.AdamW does not support sparse gradients")
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["step"] += 1
                tensors = (p, p.grad, st["exp_avg"], st["exp_avg_sq"])
                if all(x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()
                       for x in tensors) and p.numel() > 0:
                    e = ema.get(p)
                    if e is not None and e.is_contiguous() and e.device.type == "cpu":
                        tensors = (*tensors, e)
                        ema_done.add(p)
                    copy = self._bf16.get(p)
                    if copy is not None and not copy.read:      # no GEMM read it: not written
                        copy.version, copy = None, None         # (stale: a read takes it again)
                    by_step.setdefault((float(st["step"]), len(tensors) == 5), []).append((tensors, copy))
                else:
                    slow.append(p)
            for (t, _), bucket in by_step.items():      # one kernel call per thread for the lot
                _fused_step(bucket, lr, b1, b2, eps, wd, 1 - b1 ** t, 1 - b2 ** t, ema_decay)
                for _, copy in bucket:          # (the kernel wrote them; the version is the weight's)
                    if copy is not None:
                        copy.version, copy.read = copy.weight._version, False
            if slow:                    # torch's own single-tensor AdamW for the rest
                from torch.optim.adamw import adamw as torch_adamw
                torch_adamw([p for p in slow], [p.grad for p in slow],
                            [self.state[p]["exp_avg"] for p in slow],
                            [self.state[p]["exp_avg_sq"] for p in slow], [],
                            [self.state[p]["step"] - 1 for p in slow], foreach=False,
                            amsgrad=False, beta1=b1, beta2=b2, lr=lr, weight_decay=wd, eps=eps,
                            maximize=False)
                for p in slow:
                    if p in self._bf16:
                        self._bf16[p].refresh()
        for p, e in ema.items():        # what the pass did not take: torch's ops, same formula
            if p not in ema_done:
                e.mul_(ema_decay).add_(p.detach(), alpha=1 - ema_decay)
        return loss


def _fused_step(bucket, lr, b1, b2, eps, wd, bc1, bc2, ema_decay=None):
    """One AdamW step over [((param, grad, exp_avg, exp_avg_sq[, ema]), working copy or None),
    ...] (all with an EMA or none): their concatenation is split evenly over the team (whole
    cache lines each), one kernel call for the lot."""
    ffi, fn = ops.kernel_fn("adamw")
    tensors = [ts for ts, _ in bucket]
    with_ema = len(tensors[0]) == 5
    cols = [ffi.new("float *[]", [ffi.cast("float *", ts[i].data_ptr()) for ts in tensors])
            for i in range(5 if with_ema else 4)]
    copies = ffi.NULL
    if any(c is not None for _, c in bucket):
        copies = ffi.new("uint16_t *[]", [ffi.NULL if c is None else ffi.cast("uint16_t *", c.bf16.data_ptr())
                                          for _, c in bucket])
    sizes = [ts[0].numel() for ts in tensors]
    fn(*cols[:4], cols[4] if with_ema else ffi.NULL, copies, ffi.new("int64_t[]", sizes), len(sizes),
       sum(sizes), lr, b1, b2, eps, wd, bc1, bc2, ema_decay if with_ema else 0.0, kernel_threads())
