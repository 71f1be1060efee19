"""`autohc compare RUN RUN ...`: training runs side by side: their loss curves in one plot and
their samples' digits quality (class match, Fréchet distance) in one table. The fidelity
check of bf16 training: the digits job in fp32 and in bf16 from the same seed.

A run is an `autohc train --out` folder: its newest checkpoint gives the losses, the setup
(model, precision, seed) and the EMA weights the samples come from.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from . import checkpoint
from .data import InputError

SMOOTH_STEPS = 100          # "final loss": the mean over the last this many steps (one is noise)


def run_summary(folder: str | Path) -> dict:
    """What one run's newest checkpoint says: its path, setup and losses."""
    path, state = checkpoint.resolve(folder)
    cfg, losses = state.get("config", {}), [float(v) for v in state.get("losses", [])]
    if not losses:
        raise InputError(f"{folder}: its checkpoint {path.name} has no losses to compare")
    return {"run": str(folder), "ckpt": str(path), "arch": state.get("arch", {}), "model": cfg.get("model"),
            "precision": state.get("precision", cfg.get("precision")), "seed": cfg.get("seed"),
            "steps": int(state["step"]), "losses": losses,
            "final_loss": float(np.mean(losses[-SMOOTH_STEPS:]))}


def summarize(runs: list[dict]) -> dict:
    """The comparison of runs (each a run_summary with its digits evaluation merged in):
    per run its figures, and each later run's relative differences to the first."""
    first = runs[0]
    rows = [{k: r.get(k) for k in ("run", "ckpt", "model", "precision", "seed", "steps", "final_loss",
                                   "class_match", "frechet", "frechet_real_halves", "samples")}
            for r in runs]
    for r in rows[1:]:
        r["final_loss_rel_diff"] = (r["final_loss"] - first["final_loss"]) / first["final_loss"]
        if r.get("frechet") is not None and first.get("frechet"):
            r["frechet_rel_diff"] = (r["frechet"] - first["frechet"]) / first["frechet"]
    n = min(len(r["losses"]) for r in runs)
    curve = [_smooth(np.asarray(r["losses"][:n])) for r in runs]
    gap = max((float(np.max(np.abs(c - curve[0]) / curve[0])) for c in curve[1:]), default=0.0)
    return {"runs": rows, "common_steps": n, "smoothed_loss_max_rel_diff": gap,
            "smoothing_steps": _window(n)}


def _window(n: int) -> int:
    return max(1, min(SMOOTH_STEPS, n // 10))


def _smooth(losses: np.ndarray) -> np.ndarray:
    k = _window(len(losses))
    return np.convolve(losses, np.ones(k) / k, mode="valid")


def label(r: dict) -> str:
    return f"{r['run']} ({r.get('precision') or '?'}, seed {r.get('seed')})"


def plot(runs: list[dict], summary: dict, path: str | Path) -> Path:
    """Loss curves (smoothed, log scale) beside the class match and Fréchet distance bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    path = Path(path)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=120, gridspec_kw={"width_ratios": [3, 2]})
    k = summary["smoothing_steps"]
    for r in runs:
        s = _smooth(np.asarray(r["losses"]))
        ax.plot(np.arange(k, k + len(s)), s, lw=1.2, label=label(r))
    ax.set_xlabel("step")
    ax.set_ylabel(f"epsilon MSE (mean of {k} steps)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    names = [f"{r.get('precision') or r['run']}" for r in runs]
    xs = np.arange(len(runs))
    fr = [r.get("frechet") or 0.0 for r in runs]
    bx.bar(xs, fr, color=[f"C{i}" for i in range(len(runs))])
    for i, r in enumerate(runs):
        if r.get("class_match") is not None:
            bx.annotate(f"{100 * r['class_match']:.1f} % match", (i, fr[i]), ha="center",
                        va="bottom", fontsize=8)
    if runs[0].get("frechet_real_halves"):
        bx.axhline(runs[0]["frechet_real_halves"], color="gray", ls="--", lw=0.8,
                   label="two halves of the real digits")
        bx.legend(fontsize=7, loc="lower right")
    bx.set_xticks(xs, names)
    bx.set_ylabel("Fréchet distance to the real digits")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(path)
    return path


def table(summary: dict) -> str:
    """The comparison as a Markdown table (what the command prints)."""
    out = ["| run | precision | seed | steps | final loss (mean of last 100) | class match "
           "| Fréchet distance |",
           "|---|---|--:|--:|--:|--:|--:|"]
    for r in summary["runs"]:
        d = f" ({100 * r['final_loss_rel_diff']:+.1f} %)" if "final_loss_rel_diff" in r else ""
        f = f" ({100 * r['frechet_rel_diff']:+.1f} %)" if "frechet_rel_diff" in r else ""
        cm = "—" if r.get("class_match") is None else f"{100 * r['class_match']:.1f} %"
        fd = "—" if r.get("frechet") is None else f"{r['frechet']:.3f}{f}"
        out.append(f"| {r['run']} | {r.get('precision') or '?'} | {r.get('seed')} | {r['steps']} "
                   f"| {r['final_loss']:.4f}{d} | {cm} | {fd} |")
    return "\n".join(out)
