"""`autohc tune --op NAME`: the element-wise kernels' parameters (search_spaces/eltwise.yaml)
and the fused attention's (search_spaces/attention.yaml) searched by measurement, as for GEMMs. The space is small, so Optuna walks all of it (a grid);
each candidate must first compute what torch computes on the op's DiT-XL/2-sized tensors
(`autohc bench ops` cases), then it is timed interleaved with torch. The best goes to the
registry under (CPU, kernel, threads), where autohc.ops picks it up on its next call.
`--dtype bf16` tunes the bf16 forms (the kernels torch.autocast's tensors meet) the same way,
against torch under autocast, each its own registry entry (`<kernel>_bf16`)."""
from __future__ import annotations

import time

import optuna
import torch

from ..bench.ops import adamw_params, bf16_op_cases, op_cases
from ..hw import cpu
from ..kernels.eltwise import KERNELS, EltwiseParams, default_eltwise
from ..kernels.eltwise.params import BF16_ARRAYS
from ..kernels.eltwise.codegen import library
from ..kernels.family import ParamError
from ..torch import ops
from . import pipeline, registry
from .space import isa_entries, load_space
from .verify import WrongResult, check_same

# the `autohc bench ops` name of an op -> the kernel it times
OP_KERNELS = {"gelu_tanh": "gelu_tanh_fwd", "gelu_tanh_backward": "gelu_tanh_bwd",
              "silu": "silu_fwd", "silu_backward": "silu_bwd",
              "layernorm_modulate": "ln_mod_fwd", "layernorm_modulate_backward": "ln_mod_bwd",
              "softmax": "softmax_fwd", "softmax_backward": "softmax_bwd",
              "gated_residual": "gated_residual", "adamw": "adamw"}
# the ops with a bf16 form (`--dtype bf16`): those whose kernel has one, and attention
BF16_OPS = tuple(n for n, k in OP_KERNELS.items() if f"{k}_bf16" in BF16_ARRAYS) + ("attention",)
ADAMW_PARAMS_PER_IMAGE = 1 << 23    # `tune --op adamw`: 67M parameters at --images 8


def _adamw_case(images: int):
    """(shape, bytes, step, torch step, check, torch check) for AdamW over 8M parameters per
    image: the timed callables step one persistent optimizer each; the checks take one step
    from the same start on fresh copies, so every candidate is compared from the same state."""
    from ..torch.optim import AdamW
    n = images * ADAMW_PARAMS_PER_IMAGE
    start = adamw_params(n)
    hyper = dict(lr=1e-3, weight_decay=0.01)

    def fresh():
        ps = [p.clone() for p in start]
        for p, q in zip(ps, start):
            p.grad = q.grad.clone()
        return ps

    def first_step(make):
        ps = fresh()
        make(ps).step()
        return tuple(ps)

    mine_opt, theirs_opt = AdamW(fresh(), **hyper), torch.optim.AdamW(fresh(), fused=True, **hyper)
    return (f"{n / 1e6:.1f}M params", 28 * n, mine_opt.step, theirs_opt.step,
            lambda: first_step(lambda ps: AdamW(ps, **hyper)),
            lambda: first_step(lambda ps: torch.optim.AdamW(ps, fused=True, **hyper)))


def _attention_case(images: int, dtype: torch.dtype = torch.float32):
    """(shape, bytes, forward + backward by autohc, the same by torch's CPU flash attention):
    DiT-XL/2's attention (16 heads of 72, 256 tokens), q, k, v views of one qkv tensor."""
    from ..torch import attention
    T, heads, hd = 256, 16, 72
    qkv = torch.randn(images, T, 3, heads, hd, generator=torch.Generator().manual_seed(2))
    qkv = qkv.to(dtype).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    grad = torch.randn(images, heads, T, hd, generator=torch.Generator().manual_seed(3)).to(dtype)
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

    def mine():
        o, lse = attention.forward_kernel(q, k, v, None)
        return (o, *attention.backward_kernel(grad, q, k, v, o, lse, None))

    def theirs():
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
        return (o, *flash_backward(grad, q, k, v, o, lse, 0.0, False))
    return f"{images}x{heads}x{T}x{hd}", 12 * q.numel() * q.element_size(), mine, theirs


# what the attention kernel's amx back-end reads of the search space (the products are tiles)
AMX_ATTENTION_KNOBS = ("block_q", "block_k", "prefetch", "threads")


class _Target:
    """What the search needs of one kernel: its space, how to make, force and build
    parameters, its default, and where the result is recorded."""

    def __init__(self, name: str, isa: str, threads: int, bf16: bool = False):
        from ..kernels.attention import AttentionParams, default_attention
        from ..kernels.attention.codegen import library as attention_library
        from ..kernels.attention.params import bf16_attention
        from ..torch import attention
        if name == "attention":
            self.op, self.space = "attention", grid(isa, threads, space="attention")
            self.kernel = attention.KERNEL + ("_bf16" if bf16 else "")
            if bf16:        # the fp32 space's blocks and tiles, on the bf16 back-end
                bisa = attention.bf16_isa()[0]
                self.make = lambda knobs: bf16_attention(AttentionParams(isa=isa, **knobs), bisa)
                self.default = bf16_attention(default_attention(isa), bisa)
                if self.default.amx:    # no vector micro-tiles there: theirs held at the default
                    self.space = {k: v if k in AMX_ATTENTION_KNOBS else [getattr(self.default, k)]
                                  for k, v in self.space.items()}
            else:
                self.make = lambda knobs: AttentionParams(isa=isa, **knobs)
                self.default = default_attention(isa)
            self.force = attention.forced_params
            self.build = attention_library
        else:
            kernel = OP_KERNELS[name] + ("_bf16" if bf16 else "")
            self.op, self.kernel, self.space = "eltwise", kernel, grid(isa, threads, kernel)
            self.make = lambda knobs: EltwiseParams(isa=isa, **knobs)
            self.force = lambda p: ops.forced_params(kernel, p)
            self.build = lambda p: library(kernel, p)
            self.default = default_eltwise(isa)


def grid(isa: str, threads: int, kernel: str | None = None, space: str = "eltwise") -> dict[str, list]:
    """{parameter: values} of this back-end from search_spaces/<space>.yaml, limited to the
    knobs `kernel`'s template uses (kernels/eltwise/params.py KERNELS); a split over more
    threads than `threads`, or the same as all of them (0), is left out."""
    out = {name: list(e["values"]) for name, e in isa_entries(load_space(space), isa).items()}
    if "threads" in out:
        out["threads"] = [t for t in out["threads"] if t == 0 or t < threads]
    if kernel is not None:
        out = {k: v for k, v in out.items() if k in KERNELS[kernel]}
    return out


def same_bf16(a, b) -> bool:
    """bf16 results: within a few bf16 roundings of torch's under autocast (which rounds some
    intermediates that the kernels keep in fp32), sums to their size."""
    a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
    return len(a) == len(b) and all(
        u.dtype == v.dtype and torch.allclose(u.float(), v.float().reshape(u.shape), rtol=2e-2,
                                              atol=2e-2 * max(1.0, v.float().abs().max().item()),
                                              equal_nan=True)
        for u, v in zip(a, b))


def tune_op(name: str, threads: int | None = None, *, images: int = 8, repeats: int = 5,
            timeout: float = 60.0, seed: int = 0, progress=None, dtype: str = "fp32") -> dict:
    """Tune one operator's kernel (dtype bf16: its bf16 form); records and returns the best
    (params, ms, torch_ms)."""
    if name not in OP_KERNELS and name != "attention":
        raise ValueError(f"unknown op {name!r}; one of {', '.join(OP_KERNELS)}, attention")
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype {dtype!r}: fp32 or bf16")
    bf16 = dtype == "bf16"
    if bf16 and name not in BF16_OPS:
        raise ValueError(f"tune --op {name} --dtype bf16: {name} has no bf16 form "
                         f"(autocast leaves it fp32); the bf16 ones: {', '.join(BF16_OPS)}")
    threads = threads or torch.get_num_threads()       # what autohc.ops uses, uninstalled
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if name == "adamw":
            shape, nbytes, mine, theirs, check, their_check = _adamw_case(images)
        elif name == "attention":
            shape, nbytes, mine, theirs = _attention_case(images, torch.bfloat16 if bf16 else torch.float32)
            check, their_check = mine, theirs
        else:
            cases = bf16_op_cases(images) if bf16 else op_cases(images)
            _, shape, nbytes, mine, theirs = next(c for c in cases if c[0] == name)
            check, their_check = mine, theirs
        isa = cpu.best_isa()
        target = _Target(name, isa, threads, bf16)
        agree = same_bf16 if bf16 else None
        space, kernel = target.space, target.kernel
        reference = their_check()
        timings: dict[int, tuple[float, float]] = {}

        def objective(trial) -> float:
            knobs = {k: trial.suggest_categorical(k, v) for k, v in space.items()}
            try:            # (the bf16 attention's make validates already)
                params = target.make(knobs).validate()
            except ParamError as e:
                raise optuna.TrialPruned(str(e)) from None
            with target.force(params):
                cand = pipeline.Candidate(params, lambda: target.build(params),
                                          lambda: check_same(check(), reference, name, agree), mine)
                try:
                    m = pipeline.evaluate(cand, theirs, samples=repeats)
                except WrongResult:
                    raise optuna.TrialPruned("wrong result") from None      # can never win
            timings[trial.number] = (1e3 * m.seconds, 1e3 * m.baseline_seconds)
            if progress:
                knobs = " ".join(f"{k}={getattr(params, k)}" for k in space)
                progress(f"  {name} {knobs}: {1e3 * m.seconds:.2f} ms "
                         f"(torch {1e3 * m.baseline_seconds:.2f} ms)")
            return m.seconds

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(direction="minimize", sampler=optuna.samplers.GridSampler(space, seed=seed))
        t0 = time.perf_counter()
        study.optimize(objective, timeout=timeout)
        done = [t for t in study.trials if t.number in timings]
        if not done:
            raise RuntimeError(f"tune --op {name}: no candidate passed the correctness check")
        # the final race: the best few and the default, again, longer and side by side; the
        # default is kept unless beaten by more than the spread, twice (tune/pipeline.py)
        default = target.default
        finalists = {"default": {k: getattr(default, k) for k in space}}
        for t in sorted(done, key=lambda t: t.value):
            if len(finalists) > pipeline.FINALISTS:
                break
            if t.params not in finalists.values():
                finalists[f"trial {t.number}"] = dict(t.params)

        def run_with(knobs):
            p = target.make(knobs)

            def run():
                with target.force(p):
                    return mine()
            return run
        times = pipeline.race({k: run_with(v) for k, v in finalists.items()}, theirs)
        kept, times = pipeline.pick_confirmed(
            times, "default", lambda names: pipeline.race({k: run_with(finalists[k]) for k in names}, theirs))
        ms, torch_ms = 1e3 * times[kept].median, 1e3 * times["baseline"].median
        default_ms = 1e3 * times["default"].median
        params = {"isa": isa, **finalists[kept]}
        entry = registry.record_op(target.op, kernel, threads, params, ms, torch_ms,
                                   name=name, shape=shape, trials=len(done),
                                   default_ms=round(default_ms, 4),
                                   seconds=round(time.perf_counter() - t0, 1))
        return {"op": name, "kernel": kernel, "threads": threads, "params": params,
                "ms": ms, "torch_ms": torch_ms, "speedup_vs_torch": torch_ms / ms,
                "gbps": nbytes / ms / 1e6, "trials": len(done), "default_ms": default_ms,
                "recorded_at": entry["recorded_at"]}
    finally:
        torch.set_num_threads(old)
