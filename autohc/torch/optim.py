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
                if _fused_takes(tensors):
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


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _fused_takes(tensors) -> bool:
    """Whether the fused pass can update (param, grad, exp_avg, exp_avg_sq): plain, dense,
    contiguous float32 CPU tensors, not empty. (A subclass, DTensor's sharded parameters say,
    has no storage of its own to write through.)"""
    return tensors[0].numel() > 0 and all(
        type(t) in _PLAIN and t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
        and not t.is_sparse for t in tensors)


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
       sum(sizes), lr, 1 - b1, b2, 1 - b2, eps, wd, bc1, bc2, ema_decay if with_ema else 0.0,
       kernel_threads())


# --- torch's own Adam and AdamW under install() ---------------------------------------------
# torch.optim.Adam and AdamW on the CPU run, by default, `_single_tensor_adam`: about ten
# element-wise ATen calls per parameter, each a pass over it (docs/history.md, stop 84, for
# what that costs a DiT's step). install() puts the fused pass above in its place for the
# tensors it takes: float32, contiguous, on the CPU, with AdamW's decoupled weight decay (or
# none), no amsgrad, maximize, capturable or differentiable step, outside torch.compile.
# Anything else goes to torch's own function, unchanged. The fused pass differs from torch's
# by float32 rounding order only (tests/test_optim.py states the bound).
stats = {"autohc": 0, "torch": 0}       # parameters each has updated while served
_torch_single_tensor_adam: list = []    # torch's function while install() serves it


def _scalar(x) -> float | None:
    """x as a Python float where it is one (a number, or a one-element CPU tensor without
    grad), else None."""
    if isinstance(x, torch.Tensor):
        ok = x.numel() == 1 and not x.requires_grad and x.device.type == "cpu"
        return float(x) if ok else None
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _served_single_tensor_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                               *args, **kw):
    """torch.optim.adam._single_tensor_adam's contract: the fused pass for the tensors it takes,
    torch's own function for the others."""
    torch_fn = _torch_single_tensor_adam[0]
    lr, b1, b2 = (_scalar(kw.get(k)) for k in ("lr", "beta1", "beta2"))
    wd, eps = kw.get("weight_decay"), kw.get("eps")
    plain = (not args and set(kw) <= _ADAM_KEYWORDS and None not in (lr, b1, b2)
             and isinstance(wd, (int, float)) and isinstance(eps, (int, float))
             and (wd == 0 or kw.get("decoupled_weight_decay"))
             and not any(kw.get(k) for k in ("amsgrad", "maximize", "capturable", "differentiable",
                                             "has_complex"))
             and kw.get("grad_scale") is None and kw.get("found_inf") is None
             and not torch.compiler.is_compiling())
    take = [plain and _fused_takes((p, g, m, v)) and s.numel() == 1 and s.device.type == "cpu"
            for p, g, m, v, s in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps)]
    rest = [i for i, ok in enumerate(take) if not ok]
    if rest:
        pick = lambda ts: [ts[i] for i in rest] if ts else ts
        torch_fn(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), pick(max_exp_avg_sqs),
                 pick(state_steps), *args, **kw)
        stats["torch"] += len(rest)
    by_step: dict[float, list] = {}
    for i, ok in enumerate(take):
        if ok:
            state_steps[i] += 1                 # (torch's function counts the step first too)
            by_step.setdefault(float(state_steps[i]), []).append(
                ((params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]), None))
    with torch.no_grad():
        for t, bucket in by_step.items():
            _fused_step(bucket, lr, b1, b2, eps, float(wd), 1 - b1 ** t, 1 - b2 ** t)
            stats["autohc"] += len(bucket)


_ADAM_KEYWORDS = {"grad_scale", "found_inf", "amsgrad", "has_complex", "beta1", "beta2", "lr",
                  "weight_decay", "eps", "maximize", "capturable", "differentiable",
                  "decoupled_weight_decay"}


def serve_torch_adam() -> None:
    """Put the fused pass under torch.optim.Adam and AdamW's default CPU path (install())."""
    import torch.optim.adam as adam
    if not _torch_single_tensor_adam:
        _torch_single_tensor_adam.append(adam._single_tensor_adam)
        adam._single_tensor_adam = _served_single_tensor_adam


def restore_torch_adam() -> None:
    """Give torch.optim.Adam and AdamW their own function back (uninstall())."""
    import torch.optim.adam as adam
    if _torch_single_tensor_adam:
        adam._single_tensor_adam = _torch_single_tensor_adam.pop()
