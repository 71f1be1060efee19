"""`autohc bench sample --parallel cfg patch`: the time of one guided sampler step of a batch
on a team of ranks (dit/sample_parallel.py: CFG parallel, patch parallel) against one process
with the same total threads, on the same random weights and inputs.

Each layout runs in its own processes (a team: `ranks` processes on gloo over a file store,
`threads / ranks` threads each; one process: all `threads`), autohc's DiT with its fused ops
under install(), weights frozen, the forward in --precision. A process times `warmup +
samples` steps (guided eps, then the fp32 DDIM update; a team's steps end in its gather, so the
members are in step; rank 0's clock). The layouts take turns for `rounds` rounds (one, cfg,
patch, one, cfg, ...), so the host's load falls on all of them; the figure is the median of
every timed step with its spread. Each layout's eps of the first step is compared with one
process's (max abs difference over the largest |eps|).
"""
from __future__ import annotations

import os
import tempfile
import time

import torch

from . import timing

LAYOUTS = ("one", "cfg", "patch")


def _worker(rank: int, layout: str, ranks: int, spec: dict, store: str, out: str) -> None:
    import torch.distributed as tdist

    from ..dit import sample_parallel as sp
    from ..dit.diffusion import GaussianDiffusion
    from ..dit.sample import guided_eps
    from ..dit.train import autohc_ops
    from ..runtime.dist import join_gloo
    from ..torch import dispatch as override
    from ..torch.frozen import frozen
    from .sample import random_weights
    from .step import synthetic_model
    world = 1 if layout == "one" else ranks
    torch.set_num_threads(spec["threads"] // world)
    if world > 1:
        join_gloo(init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        dit = random_weights(synthetic_model(spec["model"], spec["image_size"], autohc_ops(True))).eval()
        arch = {"in_channels": 4, "class_dropout": 0.1, "num_classes": 1000}
        team = sp.form("data" if layout == "one" else layout, world, world, rank)
        g = torch.Generator().manual_seed(1)
        B, S = spec["batch"], spec["image_size"]
        x = torch.randn((B, 4, S, S), generator=g)
        y = torch.randint(0, 1000, (B,), generator=g)
        diffusion = GaussianDiffusion()
        times, first = [], None
        steps = spec["warmup"] + spec["samples"]
        ts = torch.linspace(999, 0, steps).round().long()
        with torch.no_grad(), override.installed(first_use_tuning=False), frozen(dit), sp.token_split(dit, team):
            eps_fn = (sp.cfg_eps(dit, arch, y, spec["cfg"], spec["precision"], team) if layout == "cfg"
                      else guided_eps(dit, arch, y, spec["cfg"], spec["precision"]))
            for i in range(steps):
                t = torch.full((B,), int(ts[i]), dtype=torch.long)
                if world > 1:
                    tdist.barrier()
                t0 = time.perf_counter()
                eps = eps_fn(x, t)          # (guided_eps and cfg_eps run autocast themselves)
                x0 = diffusion._x0_from_eps(x, t, eps).clamp(-1, 1)
                ac_prev = diffusion._at(diffusion.alphas_cumprod, (t - 20).clamp(min=0), x)
                x_next = ac_prev.sqrt() * x0 + (1 - ac_prev).sqrt() * eps
                dt = time.perf_counter() - t0
                if first is None:
                    first = eps
                if i >= spec["warmup"]:
                    times.append(dt)
                x = x_next
        if rank == 0:
            torch.save({"times": times, "eps": first}, out)
    finally:
        if world > 1:
            tdist.destroy_process_group()


def _run_layout(layout: str, ranks: int, spec: dict, where: str, k: int) -> dict:
    import torch.multiprocessing as tmp_mp
    store, out = os.path.join(where, f"store-{layout}-{k}"), os.path.join(where, f"{layout}-{k}.pt")
    tmp_mp.spawn(_worker, args=(layout, ranks, spec, store, out), nprocs=1 if layout == "one" else ranks,
                 join=True)
    return torch.load(out)


def bench_sample_parallel(model: str = "DiT-S/2", batch: int = 8, *, image_size: int = 32, samples: int = 3,
                          warmup: int = 1, rounds: int = 2, cfg: float = 4.0, layouts=("cfg", "patch"),
                          ranks: int = 2, threads: int | None = None, precision: str = "fp32",
                          progress=None) -> dict:
    """Seconds per guided sampler step of each layout and its ratio to one process (module doc)."""
    from ..dit import precision as prec
    bad = [m for m in layouts if m not in LAYOUTS[1:]]
    if bad:
        raise ValueError(f"--parallel {' '.join(bad)}: expected cfg and/or patch")
    threads = threads or len(os.sched_getaffinity(0))
    if ranks < 2 or threads % ranks:
        raise ValueError(f"{threads} threads do not split over {ranks} ranks (a team needs >= 2 ranks, "
                         "each the same number of threads)")
    if "cfg" in layouts and ranks != 2:
        raise ValueError(f"CFG parallel runs on 2 ranks, not {ranks}")
    tokens = (image_size // int(model.rsplit("/", 1)[1])) ** 2
    if "patch" in layouts and tokens % ranks:
        raise ValueError(f"patch parallel: {tokens} tokens do not split over {ranks} ranks")
    if samples < 1 or warmup < 0 or rounds < 1:
        raise ValueError("--samples and rounds must be >= 1 and --warmup >= 0")
    say = progress or (lambda m: None)
    spec = {"model": model, "batch": batch, "image_size": image_size, "samples": samples, "warmup": warmup,
            "cfg": cfg, "threads": threads, "precision": prec.resolve(precision)[0]}
    order = ["one", *layouts]
    say(f"bench sample --parallel: {model}, batch {batch} (x2 for guidance), {threads} threads in all "
        f"(a team: {ranks} ranks x {threads // ranks}), {spec['precision']}, layouts {order} in turn, "
        f"{rounds} rounds of {samples} timed steps")
    times = {m: [] for m in order}
    first = {}
    with tempfile.TemporaryDirectory(prefix="autohc-bench-") as where:
        for k in range(rounds):
            for m in order:
                r = _run_layout(m, ranks, spec, where, k)
                times[m] += r["times"]
                first.setdefault(m, r["eps"])
                say(f"  round {k + 1}/{rounds}, {m}: " + ", ".join(f"{t:.3f}" for t in r["times"]) + " s/step")
    summary = {m: timing.summarize(v) for m, v in times.items()}
    step_s = {m: s.median for m, s in summary.items()}
    ref = first["one"]
    scale = max(float(ref.abs().max()), 1e-12)
    return {"model": model, "batch": batch, "image_size": image_size, "cfg": cfg, "threads": threads,
            "ranks": ranks, "precision": spec["precision"], "timed": samples * rounds, "rounds": rounds,
            "step_s": step_s, "spread_pct": {m: s.spread_pct for m, s in summary.items()},
            "speedups": {f"{m} vs one": step_s["one"] / step_s[m] for m in layouts},
            "max_rel_eps_diff": {m: float((first[m] - ref).abs().max()) / scale for m in layouts},
            "step_times": times}
