"""`autohc bench memory`: the training step without and with AutoMem, each in a process of its
own (peak RSS is per process), on synthetic 256 px latents: peak RSS, median step time and the
losses of the same steps compared."""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time


def run_job(job: dict) -> dict:
    """One mode's steps in this process (the child of `_measure`)."""
    import torch
    import autohc
    from ..dit.train import TrainConfig, Trainer, peak_rss_gb
    if job["threads"]:
        torch.set_num_threads(job["threads"])
    with tempfile.TemporaryDirectory() as tmp, autohc.installed(first_use_tuning=False):
        cfg = TrainConfig(model=job["model"], data="synthetic", steps=10**9, batch=job["batch"],
                          out=os.path.join(tmp, "run"), ckpt_every=10**9, image_size=32, channels=4,
                          seed=0, automem=job["tier"], automem_state=bool(job["tier"] and job.get("state")))
        tr = Trainer(cfg)
        times = []
        for _ in range(job["steps"]):
            t0 = time.perf_counter()
            tr.train_step()
            times.append(time.perf_counter() - t0)
        out = {"step_s": statistics.median(times[job["warmup"]:]), "times": times,
               "losses": list(tr.losses), "peak_gb": peak_rss_gb(),
               "stats": dict(tr.automem.stats) if tr.automem else None}
        if tr.state_offload:
            out["state_offloaded_gb"] = tr.state_offload.stats["offloaded_bytes"] / 2 ** 30
            tr.state_offload.close()
        if tr.automem:
            tr.automem.close()
    return out


CHILD = "import json, sys; from autohc.bench.memory import run_job; print(json.dumps(run_job(json.loads(sys.argv[1]))))"


def _measure(job: dict) -> dict:
    """A fresh interpreter per mode: peak RSS is per process, and AutoMem's run starts as
    `autohc train --automem` does, with glibc's mmap threshold fixed before the first
    allocation (runtime/automem.py: fixed_mmap_threshold); the baseline runs with glibc's
    defaults, as users run it."""
    from ..runtime.automem import min_bytes_setting
    env = dict(os.environ)
    if job["tier"]:
        env["MALLOC_MMAP_THRESHOLD_"] = str(max(min_bytes_setting(), 128 << 10))
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(job)], env=env, capture_output=True,
                       text=True, timeout=7200)
    if r.returncode == -signal.SIGKILL or (r.returncode and _allocation_failed(r.stderr)):
        # the kernel's OOM killer (SIGKILL) or an allocation torch could not make: this batch
        # does not fit in this machine's memory in that mode
        return {"out_of_memory": True, "how": "killed (SIGKILL: the OOM killer)"
                if r.returncode == -signal.SIGKILL else _last_line(r.stderr)}
    if r.returncode:
        raise RuntimeError(f"the {job['tier'] or 'baseline'} run failed: "
                           f"{_last_line(r.stderr) or f'status {r.returncode}'}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1] if text.strip() else ""


def _allocation_failed(stderr: str) -> bool:
    last = _last_line(stderr)
    return last.startswith("MemoryError") or "can't allocate memory" in last or "not enough memory" in last


def bench_memory(model: str = "DiT-B/2", batch: int = 16, tier: str = "file", *, steps: int = 5,
                 warmup: int = 2, threads: int | None = None, state: bool = False, rounds: int = 2,
                 progress=None) -> dict:
    """state: the optimizer's moments go to the tier between steps too (--automem-state).
    rounds: pairs of processes, baseline and AutoMem, in alternating order (B A, A B, ...), so
    that a shared machine's drift falls on both; the step overhead is the median of the pairs'
    ratios, and each figure the median over the rounds."""
    from ..runtime.tiers import make_tier
    make_tier(tier).close()                     # a bad tier name fails here, in one line
    if warmup >= steps:
        raise ValueError(f"warmup {warmup} must be below steps {steps}")
    if rounds < 1:
        raise ValueError(f"rounds {rounds} must be 1 or more")
    say = progress or (lambda m: None)
    job = {"model": model, "batch": batch, "steps": steps, "warmup": warmup, "threads": threads,
           "state": state}
    base_runs, am_runs = [], []
    base_oom = None
    for k in range(rounds):
        tag = f"{model} batch {batch}" + (f", round {k + 1}/{rounds}" if rounds > 1 else "")
        for mode in (("baseline", "automem") if k % 2 == 0 else ("automem", "baseline")):
            if mode == "baseline":
                if base_oom:
                    continue                    # it will not fit the next time either
                say(f"{tag}: baseline")
                base = _measure({**job, "tier": None})
                if base.get("out_of_memory"):
                    base_oom = base
                    say(f"{tag}: the baseline ran out of memory ({base['how']})")
                else:
                    base_runs.append(base)
            else:
                say(f"{tag}: AutoMem, tier {tier}" + (", optimizer state too" if state else ""))
                am = _measure({**job, "tier": tier})
                if am.get("out_of_memory"):
                    raise RuntimeError(f"{model} batch {batch} runs out of memory with AutoMem too ({am['how']})")
                am_runs.append(am)
    med = statistics.median
    am = am_runs[0]
    r = {"model": model, "batch": batch, "tier": tier, "steps": steps, "state": state, "rounds": rounds,
         "state_offloaded_gb": am.get("state_offloaded_gb"),
         "baseline_out_of_memory": base_oom is not None,
         "baseline_peak_gb": None, "automem_peak_gb": round(med(a["peak_gb"] for a in am_runs), 3),
         "peak_reduction": None,
         "baseline_step_s": None, "automem_step_s": med(a["step_s"] for a in am_runs),
         "step_overhead": None, "step_overhead_rounds": None,
         "loss_rel_diff": None, "automem_stats": am["stats"],
         "baseline_losses": None, "automem_losses": am["losses"]}
    if base_oom is None:
        ratios = [a["step_s"] / b["step_s"] - 1 for a, b in zip(am_runs, base_runs)]
        base_peak = med(b["peak_gb"] for b in base_runs)
        r.update(baseline_peak_gb=round(base_peak, 3),
                 peak_reduction=round(1 - med(a["peak_gb"] for a in am_runs) / base_peak, 4),
                 baseline_step_s=med(b["step_s"] for b in base_runs),
                 step_overhead=round(med(ratios), 4), step_overhead_rounds=[round(x, 4) for x in ratios],
                 loss_rel_diff=max(abs(x - y) / max(abs(x), 1e-12)
                                   for a, b in zip(am_runs, base_runs)
                                   for x, y in zip(b["losses"], a["losses"])),
                 baseline_losses=base_runs[0]["losses"])
    return r
