"""`autohc bench gemm|ops|gate`: measurements against torch and numpy (`bench step` is in
cli/dit.py with the trainer's commands)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..bench.results_md import caches_words
from .argtypes import output_file, recheck


def cmd_bench_scale(args) -> int:
    from ..bench.scale import bench_scale
    rates = () if args.netns is None else (tuple(args.netns) or ("",))
    r = bench_scale(args.model, args.batch_per_rank, steps=args.steps, warmup=args.warmup,
                    netns_rates=rates, progress=lambda m: print(f"bench scale: {m}", file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    ring = r["ring"]
    print(f"{r['model']}, {r['batch_per_rank']} images per rank, 1 thread per rank")
    print(f"  all-reduce ring model: alpha {ring['alpha'] * 1e6:.0f} us, link {1 / ring['beta'] / 1e9:.2f} GB/s, "
          f"reduce {1 / ring['gamma'] / 1e9:.1f} GB/s; buckets {[round(b / 2**20, 1) for b in r['buckets_bytes']]} MiB")
    print(f"  step: 1 rank {r['step_1_s']:.3f} s, 2 ranks {r['step_2_thread_s']:.3f} s (communication thread), "
          f"{r['step_2_gloo_s']:.3f} s (gloo's threads)")
    c = r["model_check_2"]
    print(f"  efficiency at 2 ranks: measured {c['measured']:.2f} (gloo's threads "
          f"{r['measured_efficiency_2_gloo']:.2f}), the model {c['predicted']:.2f}; overlap {r['overlap']:.2f}")
    print("  predicted: " + ", ".join(f"p={p} {e:.2f}" for p, e in r["predicted_efficiency"].items()))
    for rate, h in r["netns"].items():
        line = ", ".join(f"{int(n) >> 10} KiB {t * 1e3:.2f} ms" for n, t in h["allreduce_s"].items())
        model = (", model " + ", ".join(f"{t * 1e3:.2f}" for t in h["model_s"].values()) + " ms") if h["model_s"] else ""
        print(f"  two namespaces, link {rate}: {line}{model}; fitted link {h['fitted_link_gbytes_s']} GB/s")
    pp = r["paper"]
    print(f"  the paper's setting ({pp['model']}, {pp['step_s']} s step, {pp['link_gbytes_s']} GB/s): "
          + ", ".join(f"p={p} {e:.2f}" for p, e in pp["predicted_efficiency"].items())
          + f" (paper: {pp['reported_efficiency_256']} at 256)")
    return 0


def _save(rec, result, threads: int | None) -> None:
    """The result under --save's folder, when given (rec: the Recorder started before the
    bench ran, or None)."""
    if rec is not None:
        print(f"autohc: result saved to {rec.save(result, threads=threads)}", file=sys.stderr)


def cmd_bench_memory(args) -> int:
    from ..bench.memory import bench_memory
    from ..bench.results import recorder
    rec = recorder("memory", args)
    r = bench_memory(args.model, args.batch, args.tier, steps=args.steps, warmup=args.warmup,
                     state=args.state, rounds=args.rounds,
                     progress=lambda m: print(f"bench memory: {m}", file=sys.stderr, flush=True))
    _save(rec, r, None)
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    print(f"{r['model']} batch {r['batch']}, AutoMem tier {r['tier']}:")
    if r["baseline_out_of_memory"]:
        print(f"  without AutoMem: out of memory; with it: peak RSS {r['automem_peak_gb']:.2f} GB, "
              f"step {r['automem_step_s']:.3f} s, losses {', '.join(f'{x:.4f}' for x in r['automem_losses'])}")
        return 0
    print(f"  peak RSS {r['baseline_peak_gb']:.2f} GB -> {r['automem_peak_gb']:.2f} GB "
          f"({100 * r['peak_reduction']:.0f} % less)")
    print(f"  step {r['baseline_step_s']:.3f} s -> {r['automem_step_s']:.3f} s "
          f"({100 * r['step_overhead']:+.0f} %"
          + (f", median of {', '.join(f'{100 * x:+.0f}' for x in r['step_overhead_rounds'])}"
             if r["rounds"] > 1 else "")
          + f"); max loss difference {r['loss_rel_diff']:.2e}")
    return 0


def cmd_bench_parallel(args) -> int:
    from ..bench.parallel import bench_parallel
    from ..bench.results import recorder
    rec = recorder("parallel", args)
    r = bench_parallel(args.model, args.batch, steps=args.steps, warmup=args.warmup,
                       strategies=args.strategies,
                       progress=lambda m: print(m, file=sys.stderr, flush=True))
    _save(rec, r, None)
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    print(f"{r['model']} batch {r['batch']}, median of {r['timed_steps']} steps:")
    print(f"  {'strategy':9s} {'processes x threads':>20s} {'step s':>8s} {'peak GB':>8s} {'loss':>9s} {'vs cftp':>9s}")
    for w in r["rows"]:
        print(f"  {w['strategy']:9s} {w['processes']:>10d} x {w['threads_per_process']:<7d} {w['step_s']:8.3f} "
              f"{w['peak_mem_gb']:8.2f} {w['loss']:9.5f} {w['loss_rel_diff']:9.1e}")
    return 0


def _gate_baseline(args, default: Path) -> Path:
    """The baseline file, checked before anything is measured: one given by --baseline must
    exist unless --update writes it, what exists must be a JSON object (what --update adds
    this CPU to), and --update must be able to write it. The default file missing (an
    installed package): no baseline, the floor is checked."""
    import os
    from ..dit.data import InputError
    path = Path(args.baseline) if args.baseline else default
    if args.update:
        recheck("bench gate", "--baseline", path, output_file)
        if path.is_file() and not os.access(path, os.W_OK):
            raise InputError(f"{path}: not writable, so --update could not rewrite it")
    elif args.baseline is not None and not path.exists():
        raise InputError(f"{path}: no such baseline file (--update measures this CPU and writes one)")
    if path.is_dir():
        raise InputError(f"{path}: a folder, not a baseline file")
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise InputError(f"{path}: not a baseline (a JSON object of CPU fingerprints): {e}") from None
        if not isinstance(data, dict):
            raise InputError(f"{path}: not a baseline (a JSON object of CPU fingerprints)")
    return path


def cmd_gate(args) -> int:
    from ..bench import gate
    path = _gate_baseline(args, gate.DEFAULT_BASELINE)
    show = lambda key, ratio: print(f"  measured {key}: {ratio:.2f}x torch", file=sys.stderr, flush=True)  # noqa: E731
    if args.update:
        entry = gate.update(path, progress=show)
        print(f"autohc: baseline for {entry['cpu']} written to {path} ({len(entry['ratios'])} ratios)")
        return 0
    margin = gate.MARGIN if args.margin is None else args.margin
    ok, lines = gate.check(path, margin, progress=show)
    for line in lines:
        print(line)
    print("autohc perf gate: " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


def cmd_bench_gemm(args) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from ..bench.gemm import bench_gemm
    from ..bench.results import recorder
    from ..kernels.gemm.problem import dit_problems
    rec = recorder("gemm", args)
    console = Console(stderr=True)
    results = []
    n = len(dit_problems(args.model, args.images))
    with Progress(console=console, transient=True) as progress:
        for threads in args.threads:
            task = progress.add_task(f"{args.model} GEMMs, {threads} thread(s)", total=n)
            r = bench_gemm(args.model, threads, repeats=args.repeats, images=args.images,
                           first_use_tuning=not args.no_first_use_tuning,
                           progress=lambda _row, t=task: progress.advance(t), dtype=args.dtype,
                           cold=args.cold, huge_pages=args.pages == "huge")
            r["wait_policy"] = "contended" if args.contended else "passive"
            results.append(r)
    _save(rec, results, max(args.threads))
    if args.json:
        for r in results:
            print(json.dumps(r))
        return 0
    if args.markdown:
        for r in results:
            print(markdown_table(r))
        return 0
    out = Console(width=max(Console().width, 130))
    if args.dtype == "bf16":
        for r in results:
            out.print(_bf16_table(r))
        return 0
    for r in results:
        t = Table(title=f"{r['model']} training GEMMs, {r['threads']} thread(s), {r['isa']} "
                        f"(peak {r['peak_gflops_per_core']} GFLOP/s per core)" + caches_words(r, "; caches "))
        for col in ("GEMM", "layout", "M", "K", "N", "config", "autohc GFLOP/s", "% peak", "torch",
                    "numpy", "x torch", "x numpy"):
            t.add_column(col, justify="left" if col in ("GEMM", "layout", "config") else "right")
        for row in r["rows"]:
            t.add_row(row["name"], row["layout"], str(row["M"]), str(row["K"]), str(row["N"]),
                      row.get("config", ""),
                      f"{row['gflops']:.1f}", f"{row['pct_peak']:.0f}%",
                      f"{row['torch_gflops']:.1f}", f"{row['numpy_gflops']:.1f}",
                      f"{row['speedup_vs_torch']:.2f}", f"{row['speedup_vs_numpy']:.2f}")
        t.caption = (f"geomean: {r['geomean_speedup_vs_torch']:.2f}x torch, "
                     f"{r['geomean_speedup_vs_numpy']:.2f}x numpy"
                     + (f"; first-use tuning {r['first_use_tuning_s']:.1f} s before timing"
                        if r.get("first_use_tuning_s") else ""))
        out.print(t)
    return 0


def _skinny_words(unit) -> str:
    from ..kernels.gemm.kernel import SKINNY_UNIT_WORDS
    return SKINNY_UNIT_WORDS.get(unit, "the packed path")


def _bf16_table(r: dict):
    from rich.table import Table
    t = Table(title=f"{r['model']} training GEMMs in bf16, {r['threads']} thread(s), {r['bf16_isa']} "
                    f"({r['bf16_why']}; {r['peak_kind']} peak {r['peak_gflops_per_core']} GFLOP/s "
                    f"per core; adaLN rows M <= 16 on {_skinny_words(r.get('bf16_skinny_unit'))})"
                    + caches_words(r, "; caches "))
    for col in ("GEMM", "layout", "M", "K", "N", "config", "autohc bf16", "% peak", "torch bf16",
                "torch fp32", "numpy fp32", "x torch bf16", "x best fp32"):
        t.add_column(col, justify="left" if col in ("GEMM", "layout", "config") else "right")
    for w in r["rows"]:
        t.add_row(w["name"], w["layout"], str(w["M"]), str(w["K"]), str(w["N"]), w.get("config", ""),
                  f"{w['gflops']:.1f}", f"{w['pct_peak']:.1f}%", f"{w['torch_gflops']:.1f}",
                  f"{w['torch_fp32_gflops']:.1f}", f"{w['numpy_gflops']:.1f}",
                  f"{w['speedup_vs_torch']:.2f}", f"{w['speedup_vs_fp32']:.2f}")
    t.caption = (f"GFLOP/s; both write bf16 C. geomean {r['geomean_speedup_vs_torch']:.2f}x "
                 f"torch bf16 (oneDNN), {r['geomean_speedup_vs_fp32']:.2f}x the faster fp32 library; "
                 f"token GEMMs at >= {r['token_gemms_min_pct_peak']:.1f}% of the bf16 peak")
    return t


def cmd_bench_ops(args) -> int:
    import torch
    from ..bench.ops import bench_ops
    from ..bench.results import recorder
    rec = recorder("ops", args)
    if args.threads:
        torch.set_num_threads(args.threads)
    r = bench_ops(args.images, args.repeats, args.adamw_params, args.ops,
                  progress=None if args.json else lambda m: print(m, file=sys.stderr, flush=True),
                  dtype=args.dtype)
    _save(rec, r, r["threads"])
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(f"{r['threads']} threads, {r['dtype']}, copy bandwidth {r['bandwidth_gbps']:.1f} GB/s")
    print(f"{'op':28s} {'shape':18s} {'ms':>8s} {'torch ms':>9s} {'speedup':>8s} {'GB/s':>6s} {'% bw':>5s}"
          f" {'GFLOP/s':>8s} {'torch':>6s}")
    for w in r["rows"]:
        rate = f" {w['gflops']:8.1f} {w['torch_gflops']:6.1f}" if w.get("gflops") else ""
        print(f"{w['name']:28s} {w['shape']:18s} {w['ms']:8.2f} {w['torch_ms']:9.2f} "
              f"{w['speedup']:7.2f}x {w['gbps']:6.1f} {w['pct_bandwidth']:4.0f}%{rate}")
    a = r["adamw_ms"] or {}
    if "autohc" in a:
        print(f"adamw: autohc {a['autohc']:.1f} ms, torch fused {a['torch_fused']:.1f} ms, "
              f"torch foreach {a['torch_foreach']:.1f} ms")
    if "autohc+ema" in a:
        print(f"adamw+ema: autohc (the EMA in AdamW's pass) {a['autohc+ema']:.1f} ms, torch fused "
              f"AdamW + foreach lerp EMA {a['torch_fused+ema']:.1f} ms")
    return 0


def markdown_table(r: dict) -> str:
    lines = [f"**{r['model']}, {r['threads']} thread(s)**, {r['isa']}, measured peak "
             f"{r['peak_gflops_per_core']} GFLOP/s per core; geomean "
             f"**{r['geomean_speedup_vs_torch']:.2f}x torch, {r['geomean_speedup_vs_numpy']:.2f}x numpy**"
             + (f"; first-use tuning {r['first_use_tuning_s']:.0f} s before timing"
                if r.get("first_use_tuning_s") else "") + caches_words(r, "; caches "),
             "", "| GEMM | layout | M | K | N | config | autohc GFLOP/s | % peak | torch | numpy | x torch | x numpy |",
             "|---|---|--:|--:|--:|---|--:|--:|--:|--:|--:|--:|"]
    for w in r["rows"]:
        lines.append(f"| {w['name']} | {w['layout']} | {w['M']} | {w['K']} | {w['N']} | {w.get('config', '')} "
                     f"| {w['gflops']:.1f} "
                     f"| {w['pct_peak']:.0f}% | {w['torch_gflops']:.1f} | {w['numpy_gflops']:.1f} "
                     f"| {w['speedup_vs_torch']:.2f} | {w['speedup_vs_numpy']:.2f} |")
    return "\n".join(lines) + "\n"
