"""`autohc bench memory`: the training step without and with AutoMem, each in a process of its
own (peak RSS is per process), on synthetic 256 px latents: peak RSS, median step time and the
losses of the same steps compared."""
from __future__ import annotations

import os
import statistics
import tempfile
import time


def _run(job: dict, results) -> None:
    import torch
    import autohc
    from ..dit.train import TrainConfig, Trainer, peak_rss_gb
    if job["threads"]:
        torch.set_num_threads(job["threads"])
    with tempfile.TemporaryDirectory() as tmp, autohc.installed(first_use_tuning=False):
        cfg = TrainConfig(model=job["model"], data="synthetic", steps=10**9, batch=job["batch"],
                          out=os.path.join(tmp, "run"), ckpt_every=10**9, image_size=32, channels=4,
                          seed=0, automem=job["tier"])
        tr = Trainer(cfg)
        times = []
        for _ in range(job["steps"]):
            t0 = time.perf_counter()
            tr.train_step()
            times.append(time.perf_counter() - t0)
        out = {"step_s": statistics.median(times[job["warmup"]:]), "times": times,
               "losses": list(tr.losses), "peak_gb": peak_rss_gb(),
               "stats": dict(tr.automem.stats) if tr.automem else None}
        if tr.automem:
            tr.automem.close()
    results.put(out)


def _spawn(job: dict) -> dict:
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_run, args=(job, q))
    p.start()
    try:
        out = q.get(timeout=3600)
    finally:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    if p.exitcode:
        raise RuntimeError(f"the {job['tier'] or 'baseline'} run exited with status {p.exitcode}")
    return out


def bench_memory(model: str = "DiT-B/2", batch: int = 16, tier: str = "file", *, steps: int = 5,
                 warmup: int = 2, threads: int | None = None, progress=None) -> dict:
    from ..runtime.tiers import make_tier
    make_tier(tier).close()                     # a bad tier name fails here, in one line
    if warmup >= steps:
        raise ValueError(f"warmup {warmup} must be below steps {steps}")
    say = progress or (lambda m: None)
    job = {"model": model, "batch": batch, "steps": steps, "warmup": warmup, "threads": threads}
    say(f"{model} batch {batch}: baseline")
    base = _spawn({**job, "tier": None})
    say(f"{model} batch {batch}: AutoMem, tier {tier}")
    am = _spawn({**job, "tier": tier})
    diff = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(base["losses"], am["losses"]))
    return {"model": model, "batch": batch, "tier": tier, "steps": steps,
            "baseline_peak_gb": round(base["peak_gb"], 3), "automem_peak_gb": round(am["peak_gb"], 3),
            "peak_reduction": round(1 - am["peak_gb"] / base["peak_gb"], 4),
            "baseline_step_s": base["step_s"], "automem_step_s": am["step_s"],
            "step_overhead": round(am["step_s"] / base["step_s"] - 1, 4),
            "loss_rel_diff": diff, "automem_stats": am["stats"],
            "baseline_losses": base["losses"], "automem_losses": am["losses"]}
