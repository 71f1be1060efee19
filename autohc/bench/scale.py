"""`autohc bench scale`: what data parallelism costs here, and what that predicts for p ranks.

Measured on this machine, 1 and 2 ranks (processes on localhost, gloo, 1 thread each):
- the all-reduce of n bytes over a sweep of sizes, fitted to the ring model
      T(n, p) = 2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma
  (alpha latency per message, beta seconds per byte on the link, gamma per byte reduced);
  at p = 2 the sweep gives alpha and beta + gamma/2, and gamma comes from timing the local
  reduction (an in-place add) alone;
- the training step at 1 rank and at 2 ranks with the same per-rank batch (weak scaling), with
  the all-reduce on autohc's communication thread and on gloo's own threads;
- the gradient buckets DDP all-reduced in a step (their sizes: the bucket schedule).
From these: the all-reduce time of one step by the model, how much of it the step hid
(overlap = 1 - exposed / modelled, exposed = t(2 ranks) - t(1 rank)), and the weak-scaling
efficiency t1 / (t1 + exposed(p)) predicted for p up to 1024, with exposed(p) the modelled
time of the step's buckets at p times the share not hidden at 2 ranks. The prediction assumes
the link (beta) and the overlap measured here; `paper` repeats it with the DiT-HC paper's
setting (stated in the output).
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24)      # bytes of float32 per all-reduce
PAPER = {"model": "DiT-XL/2", "params": 675_129_632, "step_s": 13.18, "link_gbytes_s": 48.0,
         "alpha_s": 5e-6, "batch_per_node": 112, "reported_efficiency_256": 0.906}


@dataclass
class RingModel:
    alpha: float        # s per message step
    beta: float         # s per byte on the link
    gamma: float        # s per byte reduced

    def time(self, nbytes: float, p: int) -> float:
        if p <= 1:
            return 0.0
        return 2 * (p - 1) * self.alpha + 2 * (p - 1) / p * nbytes * self.beta + (p - 1) / p * nbytes * self.gamma


def fit(sizes: list[int], seconds: list[float], gamma: float) -> RingModel:
    """alpha and beta from p = 2 measurements (least squares of t = 2 alpha + n (beta + gamma/2)).
    beta is 0 where the slope is within gamma/2: a link no slower than the local reduction (as
    loopback, a memory copy, can be) cannot be told apart from it."""
    if len(sizes) < 2:
        raise ValueError("the fit needs at least two message sizes")
    mx, my = statistics.fmean(sizes), statistics.fmean(seconds)
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds)) / sxx
    intercept = my - slope * mx
    return RingModel(alpha=max(intercept / 2, 0.0), beta=max(slope - gamma / 2, 0.0), gamma=gamma)


def predict(model: RingModel, buckets: list[int], step_s: float, hidden: float,
            ps=(2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)) -> dict[int, float]:
    """Weak-scaling efficiency per p: step / (step + exposed), exposed = the buckets' modelled
    all-reduce time at p x the share not hidden."""
    out = {}
    for p in ps:
        comm = sum(model.time(b, p) for b in buckets)
        out[p] = round(step_s / (step_s + comm * (1.0 - hidden)), 4)
    return out


def measure_gamma(nbytes: int = 1 << 24, repeats: int = 20) -> float:
    """Seconds per byte of the local reduction (acc += incoming), as a ring step does it."""
    import torch
    a, b = torch.ones(nbytes // 4), torch.ones(nbytes // 4)
    a.add_(b)
    t = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.add_(b)
        t.append(time.perf_counter() - t0)
    return statistics.median(t) / nbytes


def _rank_main(rank: int, world: int, port: int, job: dict, results) -> None:
    """One rank of a measurement (a spawned process)."""
    import torch
    torch.set_num_threads(1)
    from ..runtime import dist
    dist.init(dist.Launch(rank, world, rank, "spawn", "127.0.0.1", port))
    try:
        if job["what"] == "allreduce":
            out = allreduce_sweep(job["sizes"], job["repeats"])
        else:
            out = _steps(job, rank, world)
        if rank == 0:
            results.put(out)
    finally:
        dist.shutdown()


def allreduce_sweep(sizes, repeats) -> dict:
    """{bytes: median seconds} of all_reduce on the default group, ranks lined up by a barrier."""
    import torch
    import torch.distributed as tdist
    out = {}
    for n in sizes:
        buf = torch.ones(n // 4)
        tdist.all_reduce(buf)                       # warm-up: connections, pages
        t = []
        for _ in range(repeats):
            tdist.barrier()
            t0 = time.perf_counter()
            tdist.all_reduce(buf)
            t.append(time.perf_counter() - t0)
        out[n] = statistics.median(t)
    return out


def _steps(job: dict, rank: int, world: int) -> dict:
    import autohc
    from ..dit.train import TrainConfig, Trainer
    with tempfile.TemporaryDirectory() as tmp, autohc.installed(threads=1, first_use_tuning=False):
        cfg = TrainConfig(model=job["model"], data="synthetic", steps=10**9, batch=job["batch"] * world,
                          out=os.path.join(tmp, "run"), ckpt_every=10**9, image_size=job["image_size"],
                          channels=4, rank=rank, world=world, comm=job["comm"], seed=0,
                          autohc=job["autohc"])
        tr = Trainer(cfg)
        times, before = [], 0
        for _ in range(job["steps"]):
            if tr.comm_hook is not None:
                before = len(tr.comm_hook.bucket_bytes)
            t0 = time.perf_counter()
            tr.train_step()
            times.append(time.perf_counter() - t0)
        # the last step's buckets (DDP all-reduces one bucket in its first step, then rebuilds
        # them in the order gradients became ready)
        buckets = list(tr.comm_hook.bucket_bytes[before:]) if tr.comm_hook is not None else []
        tr.end_data_parallel()          # every rank done; the hook's thread, DDP, then the group
        return {"step_s": statistics.median(times[job["warmup"]:]), "times": times, "buckets": buckets}


def _spawn(world: int, job: dict) -> dict:
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    from ..runtime.dist import free_port
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, job, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        out = results.get(timeout=job.get("timeout", 1200))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    bad = [p.exitcode for p in procs if p.exitcode]
    if bad:
        raise RuntimeError(f"a measuring rank exited with status {bad[0]}")
    return out


@dataclass
class ScaleResult:
    model: str
    batch_per_rank: int
    allreduce_s: dict
    gamma_s_per_byte: float
    ring: dict
    step_1_s: float
    step_2_thread_s: float
    step_2_gloo_s: float
    buckets_bytes: list
    modelled_comm_2_s: float
    overlap: float
    measured_efficiency_2: float
    measured_efficiency_2_gloo: float
    predicted_efficiency: dict
    model_check_2: dict
    netns: dict
    paper: dict


def bench_scale(model: str = "DiT-S/2", batch_per_rank: int = 8, *, steps: int = 6, warmup: int = 2,
                image_size: int = 32, sizes=SIZES, repeats: int = 10, autohc: bool = True,
                netns_rates: tuple[str, ...] = (), progress=None) -> dict:
    """netns_rates: also time the all-reduce between two network namespaces of this machine,
    once per link rate ("1gbit", ...; "" unshaped), against the ring model at that rate."""
    say = progress or (lambda m: None)
    if warmup >= steps:
        raise ValueError(f"warmup {warmup} must be below steps {steps}")
    say("all-reduce sweep at 2 ranks")
    ar = _spawn(2, {"what": "allreduce", "sizes": list(sizes), "repeats": repeats})
    gamma = measure_gamma()
    ring = fit(list(ar), list(ar.values()), gamma)
    job = {"what": "steps", "model": model, "batch": batch_per_rank, "image_size": image_size,
           "steps": steps, "warmup": warmup, "autohc": autohc}
    say(f"{model} steps, 1 rank")
    one = _spawn(1, {**job, "comm": "thread"})
    say(f"{model} steps, 2 ranks, all-reduce on the communication thread")
    two = _spawn(2, {**job, "comm": "thread"})
    say(f"{model} steps, 2 ranks, all-reduce on gloo's threads")
    two_gloo = _spawn(2, {**job, "comm": "gloo"})
    step_buckets = two["buckets"]
    comm2 = sum(ring.time(b, 2) for b in step_buckets)
    exposed = max(two["step_s"] - one["step_s"], 0.0)
    hidden = min(max(1.0 - exposed / comm2, 0.0), 1.0) if comm2 > 0 else 0.0
    paper_ring = RingModel(PAPER["alpha_s"], 1.0 / (PAPER["link_gbytes_s"] * 1e9), ring.gamma)
    predicted = predict(ring, step_buckets, one["step_s"], hidden)
    paper_buckets = _scaled_buckets(step_buckets, PAPER["params"] * 4)
    hosts = {}
    for rate in netns_rates:
        from . import netns
        bits = netns.parse_rate(rate) if rate else None
        say(f"all-reduce between two network namespaces, link {rate or 'unshaped'}")
        got = netns.allreduce_between_hosts(sizes, repeats, bits)
        at_rate = RingModel(ring.alpha, 8.0 / bits, ring.gamma) if bits else None
        hosts[rate or "unshaped"] = {
            "allreduce_s": {str(k): v for k, v in got.items()},
            "fitted_link_gbytes_s": round(1e-9 / max(fit(list(got), list(got.values()), gamma).beta, 1e-15), 3),
            "model_s": {str(n): at_rate.time(n, 2) for n in got} if at_rate else None}
    r = ScaleResult(
        model=model, batch_per_rank=batch_per_rank,
        allreduce_s={str(k): v for k, v in ar.items()}, gamma_s_per_byte=gamma, ring=asdict(ring),
        step_1_s=one["step_s"], step_2_thread_s=two["step_s"], step_2_gloo_s=two_gloo["step_s"],
        buckets_bytes=step_buckets, modelled_comm_2_s=comm2, overlap=round(hidden, 4),
        measured_efficiency_2=round(one["step_s"] / two["step_s"], 4),
        measured_efficiency_2_gloo=round(one["step_s"] / two_gloo["step_s"], 4),
        predicted_efficiency=predicted,
        netns=hosts,
        model_check_2={"predicted": predicted[2], "measured": round(one["step_s"] / two["step_s"], 4),
                       "exposed_s": round(exposed, 4), "modelled_comm_s": round(comm2, 4)},
        paper={**PAPER, "assumptions": (
            "ring all-reduce over the paper's 48 GB/s links (beta) with a 5 us message latency "
            "(alpha, an HPC interconnect's), this machine's gamma, DDP's bucket schedule scaled "
            "to 675M fp32 gradients, the overlap measured here"),
            "predicted_efficiency": predict(paper_ring, paper_buckets, PAPER["step_s"], hidden,
                                            ps=(2, 16, 64, 256, 1024))})
    return asdict(r)


def _scaled_buckets(buckets: list[int], total: int) -> list[int]:
    """The same bucket schedule (DDP's 25 MB cap, the first one 1 MB) for `total` bytes."""
    if not buckets:
        return [total]
    cap = max(buckets)
    out, left = [], total
    first = min(buckets[-1], cap) if len(buckets) > 1 else cap
    for size in [first] + [cap] * (total // cap + 1):
        if left <= 0:
            break
        out.append(min(size, left))
        left -= out[-1]
    return out
