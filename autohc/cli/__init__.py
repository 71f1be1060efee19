"""The `autohc` command line.

    autohc info                              what this CPU is and which back-end runs
    autohc bench gemm --model dit-xl         autohc vs torch vs numpy on DiT training GEMMs
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .argtypes import non_negative_int, positive_int

# torch's libgomp threads spin for milliseconds after each parallel region and OpenBLAS's for
# ~2^28 cycles; interleaved with another library's threads they steal the cores. A fair
# side-by-side benchmark makes every pool wait passively (read by the libraries at load).
PASSIVE_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_THREAD_TIMEOUT": "4"}

EPILOG = """examples:
  autohc tune --shape 1152x4608 --layout NT --threads 1
  autohc tune --model dit-xl --threads 2 --timeout 30
  autohc export --out generated/
  autohc report --out report/
  autohc info
  autohc bench gemm --model dit-xl --threads 1 2
  autohc bench gemm --model dit-s --threads 2 --json > gemm.json
  autohc train --data digits --out runs/digits
  autohc sample --ckpt runs/digits --classes 3 5 7 --out grid.png
  autohc eval --ckpt runs/digits
  autohc bench step --model DiT-S/2 --batch 8
  autohc bench ops --json
"""


class OneLineParser(argparse.ArgumentParser):
    """Bad input: one line on stderr (what is wrong), exit code 2; --help teaches the rest."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _shape(text: str) -> tuple[int, int]:
    from ..kernels.gemm.problem import parse_shape
    try:
        return parse_shape(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(
        prog="autohc", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Generated, autotuned CPU kernels for Diffusion Transformer training.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = sub.add_parser("info", help="CPU, ISA, caches, NUMA, measured FMA peak, kernel cache")
    info.add_argument("--json", action="store_true", help="one JSON object instead of text")

    tune = sub.add_parser(
        "tune", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="search kernel parameters for a GEMM by measurement (Optuna) and remember the best",
        description="Tunes the GEMM kernel for the training GEMMs of a Linear(K -> N) on M rows: "
                    "each trial renders, builds, verifies (a wrong kernel can never win) and times "
                    "a configuration against torch. The best goes to the registry, which "
                    "autohc.matmul consults on every call. A problem already tuned is answered "
                    "from the registry (--force to retune); an interrupted tune resumes.",
        epilog="examples:\n  autohc tune --shape 1152x4608                 # NT, NN and TN, M = 2048\n"
               "  autohc tune --shape 1152x4608 --layout NT --threads 1 --json\n"
               "  autohc tune --model dit-xl --threads 2 --timeout 30\n"
               "  autohc tune --shape 1152x1152 --storage postgresql://user@host/db   # a shared study")
    what = tune.add_mutually_exclusive_group(required=True)
    what.add_argument("--shape", type=_shape, metavar="KxN",
                      help="the Linear's in x out features, e.g. 1152x4608")
    what.add_argument("--model", choices=["dit-s", "dit-b", "dit-l", "dit-xl"],
                      help="every training GEMM of this DiT size (15 problems)")
    what.add_argument("--op", nargs="+", metavar="NAME",
                      help="operator kernels instead (names as in `autohc bench ops`, adamw, or "
                           "all): vector width, unroll, streaming stores and thread split from "
                           "search_spaces/eltwise.yaml")
    tune.add_argument("--m", type=positive_int, default=2048, help="rows (tokens), default 2048")
    tune.add_argument("--layout", choices=["NT", "NN", "TN", "all"], default="all",
                      help="NT forward, NN input grad, TN weight grad (default: all)")
    tune.add_argument("--threads", type=positive_int, default=None,
                      help="GEMM threads (default: every usable CPU)")
    tune.add_argument("--trials", type=positive_int, default=40,
                      help="trials per problem, counting earlier runs of its study (default 40)")
    tune.add_argument("--timeout", type=float, default=60.0,
                      help="seconds per problem (default 60); the trial in flight finishes")
    tune.add_argument("--storage", default=None,
                      help="Optuna storage URL (default: sqlite in the autohc cache)")
    tune.add_argument("--seed", type=int, default=0, help="sampler seed (default 0)")
    tune.add_argument("--force", action="store_true", help="retune problems already in the registry")
    tune.add_argument("--json", action="store_true", help="one JSON object per problem")
    tune.add_argument("--images", type=positive_int, default=8,
                      help="with --op: DiT-XL/2 tensors for this many images, and for adamw 8M "
                           "parameters per image (default: 8)")

    exp = sub.add_parser("export", help="write tuned kernels as C + header + manifest.json",
                         description="Writes the C source of every tuned kernel of this CPU (and "
                                     "the default ones), one header and manifest.json (problem, "
                                     "params, cflags, sha256, GFLOP/s, CPU), for a C/C++ build "
                                     "that calls the kernels without Python.")
    exp.add_argument("--out", default="generated", help="output folder (default: generated/)")
    exp.add_argument("--no-defaults", action="store_true", help="only tuned kernels")

    rep = sub.add_parser("report", help="PNG plots: tuning convergence, roofline of tuned kernels")
    rep.add_argument("--out", default="report", help="output folder (default: report/)")
    rep.add_argument("--storage", default=None, help="Optuna storage URL of the studies "
                                                     "(default: sqlite in the autohc cache)")

    cache = sub.add_parser("cache", help="list, verify or clear compiled kernels",
                           description="The kernel cache: $AUTOHC_CACHE_DIR, else "
                                       "$XDG_CACHE_HOME/autohc, else ~/.cache/autohc.")
    cache.add_argument("action", choices=["list", "verify", "clear"],
                       help="list entries / check every library against its sha256 / delete "
                            "compiled kernels (the registry and tuning studies stay)")
    cache.add_argument("--json", action="store_true", help="JSON output (list, verify)")

    bench = sub.add_parser("bench", help="measure autohc against torch and numpy")
    bsub = bench.add_subparsers(dest="what", required=True, metavar="WHAT")
    g = bsub.add_parser(
        "gemm", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="the training GEMMs of a DiT (forward NT, backward NN and TN, adaLN)",
        description="Times autohc.matmul, torch.matmul (MKL) and numpy.matmul (OpenBLAS) on the "
                    "GEMMs of one DiT block at M = images x 256 tokens (adaLN: M = images), "
                    "interleaved, median of repeats, at each thread count asked for.",
        epilog="example:\n  autohc bench gemm --model dit-xl --threads 1 2 --json")
    g.add_argument("--model", default="dit-xl", choices=["dit-s", "dit-b", "dit-l", "dit-xl"],
                   help="DiT size (default: dit-xl, hidden 1152)")
    g.add_argument("--threads", type=positive_int, nargs="+", default=[1],
                   help="thread counts to measure (default: 1)")
    g.add_argument("--images", type=positive_int, default=8,
                   help="images per batch: M = images x 256 (default: 8, i.e. M = 2048)")
    g.add_argument("--repeats", type=positive_int, default=7, help="timed repeats (default: 7)")
    g.add_argument("--json", action="store_true",
                   help="print JSON (one object per thread count) instead of tables")
    g.add_argument("--markdown", action="store_true", help="print Markdown tables (as in the README)")
    g.add_argument("--contended", action="store_true",
                   help="keep the libraries' spinning thread pools (default: all three wait "
                        "passively, via OMP_WAIT_POLICY=PASSIVE and OPENBLAS_THREAD_TIMEOUT=4, "
                        "so no library's idle threads steal the cores of the one being timed)")
    gate = bsub.add_parser(
        "gate", help="CI perf-regression gate on autohc/torch speed ratios",
        description="Measures autohc/torch speed ratios (interleaved, medians) on the DiT-XL/2 "
                    "forward GEMMs at 1 and 2 threads and fails (exit 1) when one falls more than "
                    "--margin below the committed baseline for this CPU (bench/baseline.json).",
        epilog="refresh the baseline after an intended change:  autohc bench gate --update")
    gate.add_argument("--baseline", default=None, help="baseline file (default: bench/baseline.json)")
    gate.add_argument("--margin", type=float, default=None,
                      help="allowed fall of a ratio, as a fraction (default 0.25)")
    gate.add_argument("--update", action="store_true", help="measure and rewrite this CPU's baseline")
    gate.add_argument("--contended", action="store_true", help=argparse.SUPPRESS)
    o = bsub.add_parser(
        "ops", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="the fused operators and AdamW vs torch eager, on DiT-XL/2-sized tensors",
        description="Times each generated operator (GELU-tanh, SiLU, LayerNorm + adaLN modulate, "
                    "softmax, gated residual; forward and backward) against torch eager on\n"
                    "DiT-XL/2-sized tensors, interleaved, median of repeats, with effective GB/s and "
                    "%% of a copy's bandwidth measured in the same run;\nand autohc.optim.AdamW "
                    "against torch.optim.AdamW fused=True and foreach=True over 675M parameters.",
        epilog="examples:\n  autohc bench ops\n  autohc bench ops --ops gelu_tanh softmax --adamw-params 0 --json\n"
               "  autohc bench ops --adamw-params 50000000   # AdamW on less memory (675M needs ~14 GB)")
    o.add_argument("--images", type=positive_int, default=8, help="images: 256 tokens each (default: 8)")
    o.add_argument("--repeats", type=positive_int, default=9, help="timed repeats (default: 9)")
    o.add_argument("--adamw-params", type=non_negative_int, default=675_129_632,
                   help="AdamW parameters (default: DiT-XL/2's 675129632; 0 skips AdamW)")
    o.add_argument("--ops", nargs="+", default=None, metavar="NAME",
                   help="only these rows (names as in the table; 'adamw' included)")
    o.add_argument("--threads", type=positive_int, default=None, help="threads (default: all usable)")
    o.add_argument("--json", action="store_true", help="one JSON object (rows: name, ms, torch_ms, speedup, gbps, ...)")
    o.add_argument("--contended", action="store_true", help=argparse.SUPPRESS)
    from .dit import add_parsers
    add_parsers(sub, bsub)
    return ap


def cmd_gate(args) -> int:
    from ..bench import gate
    path = Path(args.baseline) if args.baseline else gate.DEFAULT_BASELINE
    show = lambda key, ratio: print(f"  measured {key}: {ratio:.2f}x torch", file=sys.stderr, flush=True)  # noqa: E731
    if args.update:
        entry = gate.update(path, progress=show)
        print(f"autohc: baseline for {entry['cpu']} written to {path} ({len(entry['ratios'])} ratios)")
        return 0
    margin = gate.MARGIN if args.margin is None else args.margin
    if not 0 < margin < 1:
        raise SystemExit("autohc: error: --margin must be between 0 and 1")
    ok, lines = gate.check(path, margin, progress=show)
    for line in lines:
        print(line)
    print("autohc perf gate: " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


def cmd_info(args) -> int:
    from ..bench.peak import fma_peak_gflops
    from ..build import cache_dir, cache_entries
    from ..hw import cpu
    from ..runtime import plan
    from ..tune import registry
    info = cpu.detect()
    isa = cpu.best_isa(info)
    data = {
        "model": info.model, "arch": info.arch, "fingerprint": info.fingerprint, "isa": isa,
        "runnable_isas": cpu.runnable_isas(info), "cores": info.cores, "cpus": list(info.cpus),
        "caches": [f"L{c.level} {c.kind} {c.size_bytes // 1024} KiB" for c in info.caches],
        "numa_nodes": [list(n) for n in info.numa_nodes],
        "fma_peak_gflops_per_core": round(fma_peak_gflops(isa), 1),
        "cpu_plan": plan.current().describe(),
        "cache_dir": str(cache_dir()), "cached_kernels": len(cache_entries()),
        "registry": str(registry.registry_path()),
        "registry_entries": len(registry.entries_for_this_cpu()),
    }
    if args.json:
        print(json.dumps(data))
    else:
        for k, v in data.items():
            print(f"{k:>26}: {v}")
    return 0


def cmd_tune(args, parser) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from ..bench.peak import fma_peak_gflops
    from ..hw import cpu
    from ..kernels.gemm.problem import GemmProblem, dit_problems
    from ..tune import registry
    from ..tune.result import TuneResult
    if args.timeout <= 0:
        parser.error("--timeout must be > 0")
    if args.storage is not None:
        from ..tune import StorageError, open_storage
        try:
            open_storage(args.storage)          # a bad URL: exit 2 before anything is written
        except StorageError as e:
            parser.error(str(e))
    threads = args.threads or cpu.detect().cores
    if args.op:
        return _tune_ops(args, threads)
    if args.model:
        problems = dit_problems(args.model, max(1, args.m // 256))
    else:
        k, n = args.shape
        layouts = ["NT", "NN", "TN"] if args.layout == "all" else [args.layout]
        problems = [GemmProblem(f"{k}x{n}", lay, args.m, k, n) for lay in layouts]
    if args.layout != "all" and args.model:
        problems = [p for p in problems if p.layout == args.layout]
    console = Console(stderr=True)
    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[best]}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        for p in problems:
            hit = None if args.force else registry.lookup("gemm", p.layout, p.K, p.N, p.M, threads,
                                                          exact=True)
            if hit and hit[1].get("M") == p.M and hit[0].isa == cpu.best_isa():
                r = TuneResult.from_entry(p, threads, *hit)      # no torch, no optuna
                results.append(r)
                if args.json:
                    print(json.dumps(r.to_json()), flush=True)
                continue
            from ..tune import tune_problem
            task = progress.add_task(f"{p.name} {p.layout} M={p.M}", total=args.trials, best="")

            def on_trial(study, trial, task=task):
                try:
                    best = f"best {study.best_value:.1f} GFLOP/s"
                except ValueError:
                    best = ""
                progress.update(task, completed=len(study.trials), best=best)
            r = tune_problem(p, threads, trials=args.trials, timeout=args.timeout,
                             storage=args.storage, seed=args.seed, force=args.force,
                             progress=on_trial)
            progress.update(task, completed=args.trials)
            results.append(r)
            if args.json:
                print(json.dumps(r.to_json()), flush=True)
    if args.json:
        return 0
    peak = fma_peak_gflops(cpu.best_isa()) * threads
    t = Table(title=f"tuned GEMMs, {threads} thread(s), {cpu.best_isa()}")
    for col in ("GEMM", "layout", "M", "K", "N", "MRxNR", "KC/MC/NC", "JCxICxJR ways", "depth",
                "GFLOP/s", "% peak", "torch", "x torch", "trials", "source"):
        t.add_column(col, justify="left" if col in ("GEMM", "layout", "source") else "right")
    for r in results:
        q, p = r.params, r.problem
        t.add_row(p.name, p.layout, str(p.M), str(p.K), str(p.N), f"{q.mr}x{q.nr}",
                  f"{q.kc}/{q.mc}/{q.nc}", f"{q.jc_ways}x{q.ic_ways}x{q.jr_ways}", str(q.depth),
                  f"{r.gflops:.1f}", f"{100 * r.gflops / peak:.0f}%", f"{r.torch_gflops:.1f}",
                  f"{r.speedup_vs_torch:.2f}", str(r.trials),
                  "registry" if r.from_registry else "tuned")
    Console(width=max(Console().width, 150)).print(t)
    return 0


def _tune_ops(args, threads: int) -> int:
    from ..tune.ops import OP_KERNELS, tune_op
    names = list(OP_KERNELS) if args.op == ["all"] else args.op
    unknown = [n for n in names if n not in OP_KERNELS]
    if unknown:
        raise ValueError(f"unknown op {unknown}; one of {', '.join(OP_KERNELS)} or all")
    say = None if args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    for name in names:
        r = tune_op(name, threads, images=args.images, timeout=args.timeout, seed=args.seed, progress=say)
        if args.json:
            print(json.dumps(r))
        else:
            knobs = " ".join(f"{k} {v}" for k, v in r["params"].items() if k != "isa")
            print(f"{name}: {knobs} ({r['params']['isa']}), {r['ms']:.2f} ms, "
                  f"torch {r['torch_ms']:.2f} ms, {r['speedup_vs_torch']:.2f}x, {r['trials']} trials "
                  f"-> registry")
    return 0


def cmd_export(args) -> int:
    from ..tune.export import export
    m = export(args.out, include_defaults=not args.no_defaults)
    print(f"autohc: exported {len(m['kernels'])} kernel(s) to {args.out}/ "
          f"(autohc_kernels.h, manifest.json, kernels/)")
    return 0


def cmd_report(args, parser) -> int:
    from ..tune import StorageError
    from ..tune.report import report
    try:
        paths = report(args.out, args.storage)
    except StorageError as e:
        parser.error(str(e))
    print(f"autohc: wrote {len(paths)} plot(s) to {args.out}/")
    return 0


def cmd_cache(args) -> int:
    import hashlib
    import shutil

    from ..build import cache_dir, cache_entries
    entries = cache_entries()
    if args.action == "clear":
        shutil.rmtree(cache_dir() / "kernels", ignore_errors=True)
        print(f"autohc: removed {len(entries)} compiled kernel(s) from {cache_dir()}")
        return 0
    bad = 0
    rows = []
    for e in entries:
        row = {"entry": e["entry"], "op": e.get("op"), "file": e.get("file"),
               "built_at": e.get("built_at")}
        if args.action == "verify":
            try:
                lib = Path(e["entry"]) / e["file"]
                row["ok"] = hashlib.sha256(lib.read_bytes()).hexdigest() == e["sha256"]
            except (KeyError, OSError, TypeError):
                row["ok"] = False
            bad += not row["ok"]
        rows.append(row)
    if args.json:
        print(json.dumps({"cache_dir": str(cache_dir()), "entries": rows, "bad": bad}))
    else:
        for r in rows:
            status = "" if args.action == "list" else ("ok   " if r["ok"] else "BAD  ")
            print(f"{status}{r['op'] or '?':6} {r['entry']}")
        print(f"{len(rows)} kernel(s) in {cache_dir()}" +
              (f", {bad} failed verification (they will be rebuilt, never loaded)" if bad else ""))
    return 1 if bad else 0


def cmd_bench_gemm(args) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from ..bench.gemm import bench_gemm
    from ..kernels.gemm.problem import dit_problems
    console = Console(stderr=True)
    results = []
    n = len(dit_problems(args.model, args.images))
    with Progress(console=console, transient=True) as progress:
        for threads in args.threads:
            task = progress.add_task(f"{args.model} GEMMs, {threads} thread(s)", total=n)
            r = bench_gemm(args.model, threads, repeats=args.repeats, images=args.images,
                           progress=lambda _row, t=task: progress.advance(t))
            r["wait_policy"] = "contended" if args.contended else "passive"
            results.append(r)
    if args.json:
        for r in results:
            print(json.dumps(r))
        return 0
    if args.markdown:
        for r in results:
            print(markdown_table(r))
        return 0
    out = Console(width=max(Console().width, 130))
    for r in results:
        t = Table(title=f"{r['model']} training GEMMs, {r['threads']} thread(s), {r['isa']} "
                        f"(peak {r['peak_gflops_per_core']} GFLOP/s per core)")
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
                     f"{r['geomean_speedup_vs_numpy']:.2f}x numpy")
        out.print(t)
    return 0


def cmd_bench_ops(args) -> int:
    import torch
    from ..bench.ops import bench_ops
    if args.threads:
        torch.set_num_threads(args.threads)
    r = bench_ops(args.images, args.repeats, args.adamw_params, args.ops,
                  progress=None if args.json else lambda m: print(m, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(f"{r['threads']} threads, copy bandwidth {r['bandwidth_gbps']:.1f} GB/s")
    print(f"{'op':28s} {'shape':18s} {'ms':>8s} {'torch ms':>9s} {'speedup':>8s} {'GB/s':>6s} {'% bw':>5s}")
    for w in r["rows"]:
        print(f"{w['name']:28s} {w['shape']:18s} {w['ms']:8.2f} {w['torch_ms']:9.2f} "
              f"{w['speedup']:7.2f}x {w['gbps']:6.1f} {w['pct_bandwidth']:4.0f}%")
    if r["adamw_ms"]:
        a = r["adamw_ms"]
        print(f"adamw: autohc {a['autohc']:.1f} ms, torch fused {a['torch_fused']:.1f} ms, "
              f"torch foreach {a['torch_foreach']:.1f} ms")
    return 0


def markdown_table(r: dict) -> str:
    lines = [f"**{r['model']}, {r['threads']} thread(s)**, {r['isa']}, measured peak "
             f"{r['peak_gflops_per_core']} GFLOP/s per core; geomean "
             f"**{r['geomean_speedup_vs_torch']:.2f}x torch, {r['geomean_speedup_vs_numpy']:.2f}x numpy**",
             "", "| GEMM | layout | M | K | N | config | autohc GFLOP/s | % peak | torch | numpy | x torch | x numpy |",
             "|---|---|--:|--:|--:|---|--:|--:|--:|--:|--:|--:|"]
    for w in r["rows"]:
        lines.append(f"| {w['name']} | {w['layout']} | {w['M']} | {w['K']} | {w['N']} | {w.get('config', '')} "
                     f"| {w['gflops']:.1f} "
                     f"| {w['pct_peak']:.0f}% | {w['torch_gflops']:.1f} | {w['numpy_gflops']:.1f} "
                     f"| {w['speedup_vs_torch']:.2f} | {w['speedup_vs_numpy']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    if words[:1] in (["train"], ["sample"], ["eval"]) and "--no-autohc" not in words:
        from ..runtime import omp
        omp.prefer_short_spin()         # before anything imports torch: autohc/runtime/omp.py
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench" and not getattr(args, "contended", True):
        missing = {k: v for k, v in PASSIVE_ENV.items() if os.environ.get(k) != v}
        if missing and argv is None:    # the thread libraries read these at load: re-exec
            os.execve(sys.executable, [sys.executable, "-m", "autohc.cli", *sys.argv[1:]],
                      {**os.environ, **missing})
        elif missing:
            print("autohc: note: run from the command line for passive thread pools",
                  file=sys.stderr)
    try:
        if args.command == "info":
            return cmd_info(args)
        if args.command == "tune":
            return cmd_tune(args, parser)
        if args.command == "export":
            return cmd_export(args)
        if args.command == "cache":
            return cmd_cache(args)
        if args.command == "report":
            return cmd_report(args, parser)
        if args.command == "bench" and args.what == "gemm":
            return cmd_bench_gemm(args)
        if args.command == "bench" and args.what == "gate":
            return cmd_gate(args)
        if args.command == "bench" and args.what == "ops":
            return cmd_bench_ops(args)
        if args.command in ("train", "sample", "eval") or getattr(args, "what", None) == "step":
            from . import dit as commands
            run = {"train": commands.cmd_train, "sample": commands.cmd_sample,
                   "eval": commands.cmd_eval}.get(args.command, commands.cmd_bench_step)
            return run(args)
    except KeyboardInterrupt:
        print("autohc: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one clear line, not a traceback, for known errors
        from ..build import BuildError
        from ..dit.data import DataError
        from ..kernels.family import ParamError
        from ..kernels.gemm.kernel import KernelError
        if isinstance(e, (BuildError, ParamError, KernelError, DataError)) or (
                isinstance(e, ValueError) and args.command in ("train", "sample", "eval", "bench", "tune")):
            print(f"autohc: {e}", file=sys.stderr)
            return 1
        raise
    return 2


