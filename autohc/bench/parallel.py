"""`autohc bench parallel`: the DiT-HC paper's Table 2 at this machine's scale. One DiT
training step under three ways of using the cores, each in fresh processes:

    dp      one process per core, the model replicated, DDP over gloo; each rank takes its
            share of the batch
    dp+tp   one process per core, torch.distributed.tensor.parallel: ColwiseParallel on qkv
            and fc1, RowwiseParallel on proj and fc2 (each rank holds its heads' q, k, v rows);
            every rank takes the whole batch (TP = the ranks, DP = 1)
    cftp    one process, thread clusters splitting N of every GEMM (runtime/cftp.py), one copy
            of weights, gradients and optimizer state, first-touched by the owning cluster

All three run autohc's kernels (install()) and torch's AdamW on the same model, seed and data
(label dropout off, so the steps are the same computation); per step the time of the slowest
rank, the median after warm-up; peak memory is the sum of the processes' peak RSS.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import resource
import time

STRATEGIES = ("dp", "dp+tp", "cftp")
RESULT_TIMEOUT_S = 1800


def check_split(strategy: str, model: str, batch: int, ranks: int) -> None:
    """What a strategy needs of the model and batch over `ranks` ranks (one line if not)."""
    from ..dit.model import config
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(STRATEGIES)}")
    if strategy == "dp+tp" and config(model).heads % ranks:
        raise ValueError(f"dp+tp: {model}'s {config(model).heads} heads do not split over {ranks} ranks")
    if strategy == "dp" and batch % ranks:
        raise ValueError(f"dp: batch {batch} does not split over {ranks} ranks")


def _tensor_parallel(model, mesh) -> None:
    """ColwiseParallel on qkv and fc1, RowwiseParallel on proj and fc2, per block. qkv's rows
    are first put in rank order of heads ([q, k, v] of rank 0's heads, then rank 1's), so a
    column shard holds whole heads; each rank's attention then runs its own heads."""
    import torch
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    ranks = mesh.size()                 # the heads split over them (check_split)
    for block in model.blocks:
        attn = block.attn
        D = attn.proj.in_features
        hd, local = D // attn.heads, attn.heads // ranks
        rows = torch.arange(3 * D).reshape(3, ranks, local * hd).transpose(0, 1).reshape(-1)
        with torch.no_grad():
            attn.qkv.weight.copy_(attn.qkv.weight[rows].clone())
            attn.qkv.bias.copy_(attn.qkv.bias[rows].clone())
        attn.heads = local
        parallelize_module(block, mesh, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                         "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()})


def _worker(strategy: str, model_name: str, batch: int, image_size: int, steps: int,
            threads: int, rank: int, world: int, port: int, results) -> None:
    """One process of a strategy: trains `steps` steps and puts its times, losses and peak
    RSS on `results`."""
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        if world > 1 and hasattr(os, "sched_setaffinity"):
            cpus = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {cpus[rank % len(cpus)]})      # one core per rank
        import torch
        import torch.distributed as dist
        from ..dit.diffusion import GaussianDiffusion
        from ..dit.train import autohc_ops
        from ..runtime import cftp
        from ..runtime.dist import join_gloo
        from ..torch import dispatch
        from .step import synthetic_batch, synthetic_model
        torch.set_num_threads(threads)
        dispatch.install(threads=threads, first_use_tuning=False)
        if world > 1:
            join_gloo()
        torch.manual_seed(0)
        model = synthetic_model(model_name, image_size, autohc_ops(True), class_dropout=0.0)
        forward = model
        if strategy == "dp":
            forward = torch.nn.parallel.DistributedDataParallel(model)
        elif strategy == "dp+tp":
            from torch.distributed.device_mesh import init_device_mesh
            _tensor_parallel(model, init_device_mesh("cpu", (world,)))
        else:
            cftp.enable(threads, threads)
            cftp.first_touch(model, None, threads)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        diffusion = GaussianDiffusion()
        gen = torch.Generator().manual_seed(1)
        times, losses = [], []
        for i in range(steps):
            x, t, y, noise = synthetic_batch(gen, batch, image_size)
            if strategy == "dp":                # this rank's share of the batch
                part = slice(batch * rank // world, batch * (rank + 1) // world)
                x, t, y, noise = x[part], t[part], y[part], noise[part]
            t0 = time.perf_counter()
            loss = diffusion.training_loss(forward, x, t, y, noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            value = loss.detach().clone()
            if strategy == "dp":
                dist.all_reduce(value)
                value /= world
            losses.append(float(value))
            if strategy == "cftp" and i == 0:   # the AdamW moments exist from the first step
                cftp.first_touch(model, opt, threads)
        if world > 1:
            dist.barrier()
            if strategy == "dp":
                del forward
            dist.destroy_process_group()
        rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20     # KiB on Linux
        results.put({"rank": rank, "times": times, "losses": losses, "rss_gb": rss_gb})
    except BaseException as e:          # one line to the parent, never a hang
        results.put({"rank": rank, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})


def collect(results, procs, strategy: str, timeout_s: float = RESULT_TIMEOUT_S, poll_s: float = 1.0) -> list:
    """Every rank's result from `results`, one per process of `procs` (rank = its index). A rank
    that reports an error, or whose process dies without a word (a signal, a crash in native
    code), fails the strategy at once; the whole wait is bounded by timeout_s."""
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < len(procs):
        try:
            got.append(results.get(timeout=poll_s))
        except queue_mod.Empty:
            reported = {g["rank"] for g in got}
            for rank, p in enumerate(procs):
                if rank not in reported and p.exitcode not in (None, 0):
                    raise RuntimeError(f"{strategy} rank {rank}: its process exited with code {p.exitcode} "
                                       "without a result") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"{strategy}: no result within {timeout_s:g} s") from None
            continue
        if "error" in got[-1]:
            raise RuntimeError(f"{strategy} rank {got[-1]['rank']}: {got[-1]['error']}")
    return got


def run_strategy(strategy: str, model: str, batch: int, *, image_size: int = 32, steps: int = 6,
                 warmup: int = 2, cores: int | None = None) -> dict:
    """One strategy in fresh processes over `cores` cores (default: this process's CPUs)."""
    from ..runtime.dist import free_port
    from . import timing
    cores = cores or len(os.sched_getaffinity(0))
    check_split(strategy, model, batch, cores)
    world, threads = (1, cores) if strategy == "cftp" else (cores, 1)
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")     # inherited: torch's workers wait briefly
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(strategy, model, batch, image_size, steps, threads,
                                               r, world, port, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = collect(results, procs, strategy)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    got.sort(key=lambda r: r["rank"])
    slowest = [max(r["times"][i] for r in got) for i in range(steps)]
    summary = timing.summarize(slowest[warmup:])
    return {"strategy": strategy, "processes": world, "threads_per_process": threads,
            "step_s": summary.median, "spread_pct": summary.spread_pct,
            "peak_mem_gb": sum(r["rss_gb"] for r in got), "loss": got[0]["losses"][-1],
            "losses": got[0]["losses"], "step_times": slowest}


def bench_parallel(model: str, batch: int, *, image_size: int = 32, steps: int = 6, warmup: int = 2,
                   strategies=STRATEGIES, progress=None) -> dict:
    if warmup >= steps:
        raise ValueError(f"--warmup {warmup} must be below --steps {steps}")
    say = progress or (lambda m: None)
    for s in strategies:                # before the first strategy runs, not after
        check_split(s, model, batch, len(os.sched_getaffinity(0)))
    rows = []
    for s in strategies:
        say(f"bench parallel: {s}, {model} batch {batch} ...")
        rows.append(run_strategy(s, model, batch, image_size=image_size, steps=steps, warmup=warmup))
        r = rows[-1]
        say(f"  {s}: {r['step_s']:.3f} s/step, peak memory {r['peak_mem_gb']:.2f} GB, loss {r['loss']:.5f}")
    ref = next((r["losses"] for r in rows if r["strategy"] == "cftp"), rows[0]["losses"])
    for r in rows:
        r["loss_rel_diff"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], ref))
    return {"model": model, "batch": batch, "image_size": image_size, "timed_steps": steps - warmup,
            "rows": rows}
