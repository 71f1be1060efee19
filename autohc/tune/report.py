"""`autohc report`: PNG plots of tuning convergence and a roofline of the tuned kernels."""
from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")                   # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import optuna  # noqa: E402

from ..bench.peak import fma_peak_gflops, memory_bandwidth_gbps  # noqa: E402
from ..hw import cpu  # noqa: E402
from . import registry  # noqa: E402
from .gemm import open_storage  # noqa: E402


def convergence(storage_url: str | None, out: Path) -> list[Path]:
    """One PNG per study: GFLOP/s of each trial and the best so far, torch as a line."""
    storage = open_storage(storage_url)
    written = []
    for summary in optuna.get_all_study_summaries(storage):
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        if not done:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = [t.number for t in done]
        ys = [t.value for t in done]
        best, run = [], float("-inf")
        for y in ys:
            run = max(run, y)
            best.append(run)
        ax.scatter(xs, ys, s=12, alpha=0.6, label="trial")
        ax.step(xs, best, where="post", color="C1", label="best so far")
        torch_g = [t.user_attrs.get("torch_gflops") for t in done if t.user_attrs.get("torch_gflops")]
        if torch_g:
            ax.axhline(sum(torch_g) / len(torch_g), color="C3", ls="--", label="torch.matmul")
        failed = sum(t.state == optuna.trial.TrialState.FAIL for t in study.trials)
        ax.set(xlabel="trial", ylabel="GFLOP/s",
               title=f"{summary.study_name}\n{len(done)} complete, {failed} failed")
        ax.legend(loc="lower right")
        fig.tight_layout()
        path = out / f"convergence-{summary.study_name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def roofline(out: Path) -> Path:
    """Tuned kernels (and torch beside them) against this machine's peak and bandwidth."""
    entries = registry.entries_for_this_cpu("gemm")
    isa = cpu.best_isa()
    peak1 = fma_peak_gflops(isa)
    bw = memory_bandwidth_gbps()
    fig, ax = plt.subplots(figsize=(7, 5))
    threads_seen = sorted({e["threads"] for e in entries.values()}) or [1]
    xs = [10 ** (e / 20) for e in range(-30, 71)]     # 0.03 .. 3000 FLOP/byte, ridge included
    for t in threads_seen:
        ax.plot(xs, [min(peak1 * t, bw * x) for x in xs], ls="-", lw=1,
                label=f"roof: {peak1 * t:.0f} GFLOP/s ({t} thr), {bw:.0f} GB/s")
    for e in entries.values():
        m, k, n = e["M"], e["K"], e["N"]
        intensity = 2 * m * k * n / (4 * (m * k + k * n + m * n))
        ax.scatter(intensity, e["gflops"], color="C1", marker="o", s=18)
        if e.get("torch_gflops"):
            ax.scatter(intensity, e["torch_gflops"], color="C3", marker="x", s=18)
    ax.scatter([], [], color="C1", marker="o", label="autohc (tuned)")
    ax.scatter([], [], color="C3", marker="x", label="torch.matmul")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)",
           ylabel="GFLOP/s", title=f"roofline, {cpu.detect().model} ({isa})")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = out / "roofline.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report(out: str | os.PathLike, storage_url: str | None = None) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return convergence(storage_url, out) + [roofline(out)]
