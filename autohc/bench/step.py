"""`autohc bench step`: one DiT training step (forward, backward, AdamW, EMA) with stock torch
eager, torch.compile (inductor), autohc, and autohc+compile (torch.compile under install():
inductor's GEMMs and attention on autohc's kernels, its fused element-wise code for the rest),
measured in one run. The model is the reference
DiT as written (attention through F.scaled_dot_product_attention: torch's CPU flash kernel
when stock); GFLOP/s and % of the machine's FMA peak come from the step's operation count
(torch's FlopCounterMode: GEMMs and attention). The peak is one core's FMA probe times the
threads, probed just before and just after each mode's steps (all modes' when interleaved),
since a shared machine's clock moves with its host's load.

The EMA update is part of the step, as in every DiT training script: the stock modes run the
reference's update_ema (a mul_ and an add_ per parameter), autohc's AdamW updates the EMA in
its own pass over the weights (torch/optim.py). --profile counts the EMA as "optimizer".

Every mode starts from the same seed (weights, data, timesteps, noise, label dropout), so
their losses step by step differ only by floating-point rounding; they are compared against
stock. Steps of the modes are interleaved (stock, compiled, autohc, stock, ...) so that the
machine's noise falls on all alike, unless the model is too big for three copies in memory
(then one mode after the other). Time: median of the steps after warm-up, with the spread
(bench/timing.py's summary; a step is one sample: it lasts long enough alone).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import os
import statistics
import time

import psutil
import torch

from ..dit import precision
from ..dit.diffusion import GaussianDiffusion
from ..hw import cpu
from ..runtime import memory, omp
from ..dit.model import config
from ..dit.train import (autohc_ops, build_model, ema_decay, ema_pairs, ema_update, make_optimizer,
                         peak_rss_gb)
from ..torch import dispatch as override
from ..tune import first_use
from . import timing
from .peak import fma_peak_gflops, memory_bandwidth_gbps


MODES = ("stock", "compiled", "autohc", "autohc+compile",
         # the same four with the forward under torch.autocast bf16 (fp32 master weights)
         "stock-bf16", "compiled-bf16", "autohc-bf16", "autohc-bf16+compile")


def mode_parts(name: str) -> tuple[str, str]:
    """'autohc-bf16+compile' -> ('autohc+compile', 'bf16'); 'stock' -> ('stock', 'fp32')."""
    return (name.replace("-bf16", ""), "bf16") if "-bf16" in name else (name, "fp32")


def synthetic_model(model: str, image_size: int, fused_ops=None, class_dropout: float = 0.1):
    """The benchmarks' DiT: 4-channel latents, 1000 classes, learned sigma, in train mode."""
    return build_model({"model": model, "input_size": image_size, "in_channels": 4, "num_classes": 1000,
                        "class_dropout": class_dropout, "learn_sigma": True}, fused_ops).train()


def synthetic_batch(gen: torch.Generator, batch: int, size: int):
    """(latents, timesteps, labels, noise) of one step on 4-channel `size` x `size` latents and
    1000 classes, drawn from `gen` (latents, labels, timesteps, noise, in that order)."""
    x = torch.randn((batch, 4, size, size), generator=gen)
    y = torch.randint(0, 1000, (batch,), generator=gen)
    t = torch.randint(0, 1000, (batch,), generator=gen)
    return x, t, y, torch.randn(x.shape, generator=gen)


EMA_DECAY = 0.9999               # the reference's
EMA_EVENT = "ema_update"        # the stock EMA's profiler range (counted as optimizer)


class _Mode:
    def __init__(self, name: str, model_name: str, batch: int, image_size: int, seed: int = 0,
                 install_kw: dict | None = None):
        self.install_kw = install_kw or {}
        torch.manual_seed(seed)
        self.name = name
        base, self.precision = mode_parts(name)
        self.on_autohc = base in ("autohc", "autohc+compile")
        # autohc's DiT takes the fused operators in both precisions (under autocast their bf16
        # forms: LayerNorm + modulate writes the bf16 GEMM input, the gated residual adds bf16)
        self.model = synthetic_model(model_name, image_size, autohc_ops(base == "autohc"))
        if self.on_autohc:          # the weights in huge pages, as `autohc train` places them
            memory.parameters_to_huge_pages(self.model)
        self.opt = make_optimizer([p for p in self.model.parameters() if p.requires_grad], lr=1e-4,
                                  weight_decay=0.0, use_autohc=self.on_autohc, bf16=self.precision == "bf16")
        self.ema = copy.deepcopy(self.model).requires_grad_(False)
        self.fused_ema = hasattr(self.opt, "attach_ema")
        if self.fused_ema:
            self.opt.attach_ema(ema_pairs(self.ema, self.model))
        # autohc+compile: inductor compiles the stock model and fuses its element-wise work;
        # its GEMMs (mm.out / addmm.out) and attention (the flash op) reach autohc's kernels
        # at run time, through install()
        compiled = base in ("compiled", "autohc+compile")
        self.forward = torch.compile(self.model) if compiled else self.model
        self.diffusion = GaussianDiffusion()
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.rng = torch.get_rng_state()        # the label-dropout stream, kept per mode
        self.batch, self.size = batch, image_size
        self.params = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.times, self.losses = [], []
        self.teams = []         # autohc's modes: (team jobs, seconds in them) of each step

    def step(self, finish_tuning: bool = True) -> None:
        torch.set_rng_state(self.rng)
        g = self.gen
        x, t, y, noise = synthetic_batch(g, self.batch, self.size)
        ctx = override.installed(**self.install_kw) if self.on_autohc else contextlib.nullcontext()
        with ctx:
            jobs0, team0 = omp.team_time()
            t0 = time.perf_counter()
            with precision.autocast(self.precision):
                loss = self.diffusion.training_loss(self.forward, x, t, y, noise)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            d = ema_decay(EMA_DECAY, len(self.losses))
            if self.fused_ema:
                self.opt.step(ema_decay=d)
            else:
                self.opt.step()
                with torch.profiler.record_function(EMA_EVENT):
                    ema_update(self.ema, self.model, EMA_DECAY, len(self.losses))
            self.times.append(time.perf_counter() - t0)
            if self.on_autohc:
                jobs1, team1 = omp.team_time()
                self.teams.append((jobs1 - jobs0, team1 - team0))
            if finish_tuning:
                self.finish_tuning()
        self.losses.append(loss.item())
        self.rng = torch.get_rng_state()

    def finish_tuning(self) -> None:
        """Untimed: what first-use tuning has left is raced between steps (installed, so that
        ATen's kernel races too; inside step() it already is)."""
        if self.on_autohc:
            with override.installed(**self.install_kw):
                if first_use.enabled():
                    first_use.finish_pending()


# `bench step --profile`: op classes by the profiler's event names (self time, so a kernel's
# time counts once, in the op that ran it)
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
            # a Linear on its fp32 weight under autocast (autohc/torch/autocast.py)
            "autohc::linear_fp32w", "autohc::linear_fp32w_backward",
            "autohc::linear_gelu_fp32w", "autohc::linear_gelu_fp32w_train",    # (fc1, GELU in its store)
            # (fc1 + GELU and fc2; fc2's input gradient with GELU's backward in its store, and dW)
            "autohc::mlp_fp32w_train", "autohc::gelu_linear_fp32w_backward",
            # (every block's adaLN Linear: SiLU once, then one skinny GEMM per block)
            "autohc::modulations_fp32w"}
COPY_OPS = {"aten::copy_", "aten::clone", "aten::cat", "aten::contiguous", "aten::_to_copy",
            "aten::to", "aten::stack", "aten::index_select"}
FREE_OPS = {"aten::view", "aten::reshape", "aten::permute", "aten::transpose", "aten::t",
            "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::chunk", "aten::split",
            "aten::unbind", "aten::select", "aten::slice", "aten::as_strided", "aten::empty",
            "aten::empty_strided", "aten::empty_like", "aten::detach", "aten::alias",
            "aten::_unsafe_view", "aten::flatten", "aten::narrow", "aten::lift_fresh",
            "aten::resolve_conj", "aten::resolve_neg", "aten::result_type", "aten::linear",
            "aten::matmul"}
PROFILE_CLASSES = ("gemm", "attention", "elementwise", "optimizer", "copies", "other")
AUTOGRAD_FN = "GeneratedBackwardFor_"


def op_class(name: str) -> str | None:
    """The class of a profiler event, or None for events that only hold others (autograd
    nodes, compiled regions: their self time counts as "other" through the remainder)."""
    if name.startswith(AUTOGRAD_FN) and name.endswith("_default"):
        # a custom op called with autograd runs its forward inside this node (torch's
        # register_autograd), so the node's self time is the op's own kernel
        ns, _, op = name[len(AUTOGRAD_FN):-len("_default")].partition("_")
        return op_class(f"{ns}::{op}")
    if name in GEMM_OPS:
        return "gemm"
    if "scaled_dot_product" in name or name.startswith("autohc::attention"):
        return "attention"
    if name.startswith("Optimizer.") or "_foreach_" in name or "adam" in name.lower():
        return "optimizer"
    if name in COPY_OPS:
        return "copies"
    if name in FREE_OPS:
        return "other"
    if name.startswith(("aten::", "autohc::", "cpp_fused", "graph_")):
        return "elementwise"
    return None


def event_class(event) -> str | None:
    """op_class of a profiler event, except that whatever runs inside an optimizer's step is the
    optimizer's: stock AdamW on the CPU runs per-parameter element-wise ops (lerp_, mul_, sqrt,
    addcdiv_), which op_class alone counts as element-wise work."""
    parent = event
    while parent is not None:
        if parent.name.startswith("Optimizer.step") or parent.name == EMA_EVENT:
            return "optimizer"
        parent = parent.cpu_parent
    return op_class(event.name)


def profile_step(mode: "_Mode") -> dict:
    """Shares of one step's wall time per op class (PROFILE_CLASSES), one profiled step."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        mode.step(finish_tuning=False)  # the races first-use tuning has left are not the step's
    mode.finish_tuning()
    wall = mode.times.pop()         # not one of the timed steps
    mode.losses.pop()
    if mode.on_autohc:
        mode.teams.pop()
    seconds = dict.fromkeys(PROFILE_CLASSES, 0.0)
    for e in prof.events():
        cls = event_class(e)
        if cls is not None:
            seconds[cls] += e.self_cpu_time_total / 1e6
    known = sum(v for k, v in seconds.items() if k != "other")
    seconds["other"] = max(0.0, wall - known)
    return {"wall_s": wall, "seconds": seconds, "share": {k: v / wall for k, v in seconds.items()}}


def step_flops(model: str, batch: int, image_size: int) -> float:
    """Floating-point operations of one training step (forward + backward: GEMMs and
    attention, as torch's FlopCounterMode counts them; element-wise work not included),
    counted on a stock model once."""
    return sum(step_flops_by_class(model, batch, image_size).values())


@functools.lru_cache(maxsize=8)
def step_flops_by_class(model: str, batch: int, image_size: int) -> dict:
    """step_flops split into the profile's classes that do them: {"gemm": .., "attention": ..}
    (FlopCounterMode's count per op, attention being the scaled-dot-product ops). torch's
    counter has no formula for the CPU flash-attention op SDPA runs here, so attention is then
    counted as torch counts its other SDPA ops: 4 B S^2 D forward (Q K^T and P V) and twice
    that backward, per block."""
    from torch.utils.flop_counter import FlopCounterMode
    torch.manual_seed(0)
    m = synthetic_model(model, image_size)
    x = torch.randn(batch, 4, image_size, image_size)
    t = torch.randint(0, 1000, (batch,))
    y = torch.randint(0, 1000, (batch,))
    counter = FlopCounterMode(display=False)
    with counter:
        GaussianDiffusion().training_loss(m, x, t, y, torch.randn_like(x)).backward()
    out = {"gemm": 0.0, "attention": 0.0}
    for op, n in counter.get_flop_counts().get("Global", {}).items():
        out["attention" if "scaled_dot_product" in str(op) else "gemm"] += float(n)
    if out["attention"] == 0.0:
        cfg = config(model)
        tokens = (image_size // cfg.patch) ** 2
        out["attention"] = 3 * 4.0 * batch * tokens ** 2 * cfg.hidden * cfg.depth
    return out


def _pct_bf16_peak(flops: float, med: dict) -> dict | None:
    """% of the bf16 peak (times the threads) of the -bf16 modes; None without any, or on a
    CPU without bf16 hardware."""
    from .peak import bf16_backend_peak
    names = [n for n in med if mode_parts(n)[1] == "bf16"]
    peak = bf16_backend_peak(cpu.bf16_isa()[0])[0] if names else None
    if peak is None:
        return None
    return {n: round(100 * flops / med[n] / 1e9 / (peak * torch.get_num_threads()), 1) for n in names}


# bytes per trainable parameter that a step moves whatever its schedule (fp32 master weights):
# AdamW + EMA read p, g, m, v, ema and write p, m, v, ema (36), the forward and the dX GEMMs
# each read the weight (8), the dW GEMM writes its gradient (4); activations not counted
PARAM_BYTES = 48


def floors(flops: float, params: int, peaks: dict, copy_gbps: float) -> dict:
    """The step's two floors beside its time: compute, its flops over each mode's unit peak
    (the fp32 modes the FMA probe times the threads; the -bf16 modes the bf16 unit's peak times
    the threads where the CPU has one, else the FMA peak); memory, PARAM_BYTES per parameter
    over the copy bandwidth at the step's threads."""
    from .peak import bf16_backend_peak
    bf16 = bf16_backend_peak(cpu.bf16_isa()[0])[0]
    threads = torch.get_num_threads()
    compute = {}
    for name, peak in peaks.items():
        unit = bf16 * threads if mode_parts(name)[1] == "bf16" and bf16 else peak
        compute[name] = round(flops / unit / 1e9, 4)
    return {"compute_s": compute, "memory_s": round(params * PARAM_BYTES / copy_gbps / 1e9, 4),
            "params": params, "bytes_per_param": PARAM_BYTES, "copy_gbps": round(copy_gbps, 1)}


def bench_step(model: str, batch: int, *, image_size: int = 32, steps: int = 10, warmup: int = 2,
               modes=MODES, threads: int | None = None,
               torch_threads: int | None = None, first_use_tuning: bool = True, profile: bool = False,
               progress=None) -> dict:
    if warmup >= steps:
        raise ValueError(f"--warmup {warmup} must be below --steps {steps}")
    if threads:
        torch.set_num_threads(threads)
    say = progress or (lambda m: None)
    was_installed = override.is_installed()
    override.uninstall()                # each mode sets its own kernels
    try:
        kw = {"first_use_tuning": first_use_tuning}
        if torch_threads is not None:
            kw["torch_threads"] = torch_threads
        return _bench(model, batch, image_size, steps, warmup, modes, say, kw, profile)
    finally:
        if was_installed:
            override.install()


def _teams_summary(teams: list, times: list) -> dict:
    """Medians over the timed steps: team jobs, seconds inside them and outside them."""
    return {"jobs_per_step": statistics.median(j for j, _ in teams),
            "in_teams_s": statistics.median(s for _, s in teams),
            "outside_s": statistics.median(t - s for (_, s), t in zip(teams, times))}


def _probe_peak() -> float:
    """The FMA peak of the threads now: one core's probe, taken afresh, times the threads. A
    shared machine's clock moves with its host's load (a Zen 5 here probed 231-272 GFLOP/s per
    core within one hour), so each mode's % of peak takes the probes around its own steps."""
    return fma_peak_gflops.__wrapped__(cpu.best_isa()) * torch.get_num_threads()


def _bench(model, batch, image_size, steps, warmup, modes, say, install_kw, profile=False) -> dict:
    if {"compiled", "autohc+compile"} & set(modes):
        import torch._inductor.config as ic
        ic.fallback_random = True       # inductor draws label dropout as eager does
    spent0 = first_use.spent()
    # one thread's copy bandwidth before and after the steps: on a shared machine what a
    # neighbour's memory traffic leaves, which the memory-bound parts of a step follow
    copy_before = memory_bandwidth_gbps()
    D, depth = config(model).hidden, config(model).depth
    est = 20 * 18 * D * D * depth * len(modes)   # weights, grads, two moments, EMA per mode
    interleave = est < 0.4 * psutil.virtual_memory().total
    say(f"bench step: {model} batch {batch}, {torch.get_num_threads()} threads, modes {list(modes)}, "
        f"{'interleaved' if interleave else 'one after the other'}")
    runs = []
    params = 0
    if interleave:
        runs = [_Mode(m, model, batch, image_size, install_kw=install_kw) for m in modes]
        params = runs[0].params
        before = _probe_peak()
        for i in range(steps):
            for r in runs:
                r.step()
            say(f"  step {i + 1}/{steps}: " + ", ".join(f"{r.name} {r.times[-1]:.2f} s" for r in runs))
        after = _probe_peak()
        for r in runs:
            r.peak = (before + after) / 2
        for r in runs if profile else ():
            r.profile = profile_step(r)
    else:
        for m in modes:
            r = _Mode(m, model, batch, image_size, install_kw=install_kw)
            params = r.params
            before = _probe_peak()
            for i in range(steps):
                r.step()
                say(f"  {m} step {i + 1}/{steps}: {r.times[-1]:.2f} s")
            r.peak = (before + _probe_peak()) / 2
            if profile:
                r.profile = profile_step(r)
            runs.append(r)
            r.model = r.forward = r.opt = r.ema = None      # free it before the next mode
    copy_after = memory_bandwidth_gbps()
    from .ops import copy_bandwidth_gbps
    copy_threads = copy_bandwidth_gbps()            # at the step's threads: the memory floor's
    flops = step_flops(model, batch, image_size)
    peaks = {r.name: r.peak for r in runs}
    peak = peaks.get("autohc", statistics.median(peaks.values()))   # the figure shown beside the table
    summary = {r.name: timing.summarize(r.times[warmup:]) for r in runs}
    med = {name: t.median for name, t in summary.items()}
    losses = {r.name: r.losses for r in runs}
    # each mode against stock of its precision (bf16 modes: stock autocast)
    diff = {"fp32": 0.0, "bf16": 0.0}
    for name, ls in losses.items():
        prec = mode_parts(name)[1]
        ref = losses.get("stock-bf16" if prec == "bf16" else "stock")
        diff[prec] = max([diff[prec]] + [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ls, ref or ())])
    out = {"model": model, "batch": batch, "image_size": image_size, "threads": torch.get_num_threads(),
           "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),   # torch's OpenMP wait (cli)
           "timed_steps": steps - warmup, "interleaved": interleave,
           "stock_s": med.get("stock"), "compiled_s": med.get("compiled"), "autohc_s": med.get("autohc"),
           "autohc_compile_s": med.get("autohc+compile"), "step_s": med,
           "autohc_compile_speedup_vs_stock": (med["stock"] / med["autohc+compile"]
                                               if {"stock", "autohc+compile"} <= med.keys() else None),
           "autohc_compile_speedup_vs_compiled": (med["compiled"] / med["autohc+compile"]
                                                  if {"compiled", "autohc+compile"} <= med.keys() else None),
           "speedup_vs_stock": med["stock"] / med["autohc"] if {"stock", "autohc"} <= med.keys() else None,
           "speedup_vs_compiled": med["compiled"] / med["autohc"] if {"compiled", "autohc"} <= med.keys() else None,
           "spread_pct": {name: t.spread_pct for name, t in summary.items()},
           "step_gflop": round(flops / 1e9, 2), "peak_gflops": round(peak, 1),
           "peak_gflops_by_mode": {name: round(v, 1) for name, v in peaks.items()},
           "copy_gbps": {"before": round(copy_before, 1), "after": round(copy_after, 1)},
           "floors": floors(flops, params, peaks, copy_threads),
           "gflops": {name: round(flops / t / 1e9, 1) for name, t in med.items()},
           "pct_peak": {name: round(100 * flops / t / 1e9 / peaks[name], 1) for name, t in med.items()},
           # the -bf16 modes against the CPU's bf16 peak too (dot products; tiles on AMX)
           "pct_bf16_peak": _pct_bf16_peak(flops, med),
           "first_use_race_s": round(first_use.spent()["race_s"] - spent0["race_s"], 2),
           "first_use_build_s": round(first_use.spent()["build_s"] - spent0["build_s"], 2),
           "max_loss_rel_diff": diff["fp32"], "peak_rss_gb": peak_rss_gb(), "losses": losses,
           "max_loss_rel_diff_bf16": (diff["bf16"] if any(mode_parts(n)[1] == "bf16" for n in med)
                                      else None),
           # autohc-bf16 (and +compile) against stock autocast, compiled autocast and stock fp32
           "bf16_speedups": {f"{a} vs {b}": med[b] / med[a]
                             for a in ("autohc-bf16", "autohc-bf16+compile")
                             for b in ("stock-bf16", "compiled-bf16", "stock") if {a, b} <= med.keys()},
           "step_times": {r.name: r.times for r in runs},
           # autohc's modes: the time inside the kernels' teams against the step; the rest is the
           # interpreter, torch's dispatch and autograd, ATen's ops and one-thread calls
           "kernel_teams": {r.name: _teams_summary(r.teams[warmup:], r.times[warmup:])
                            for r in runs if r.teams[warmup:]}}
    if profile:
        # the GEMMs' and attention's own rate inside the profiled step: their flops over the
        # self time of their ops (a regression shows in the class it is in)
        split = step_flops_by_class(model, batch, image_size)
        for r in runs:
            # (3 significant digits: a tiny model's attention runs well under 0.1 GFLOP/s)
            r.profile["gflops"] = {c: float(f"{split[c] / r.profile['seconds'][c] / 1e9:.3g}")
                                   if r.profile["seconds"][c] > 0 else None for c in split}
        out["profile"] = {r.name: r.profile for r in runs}
    return out
