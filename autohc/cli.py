"""The `autohc` command line.

    autohc info                              what this CPU is and which back-end runs
    autohc bench gemm --model dit-xl         autohc vs torch vs numpy on DiT training GEMMs
"""
from __future__ import annotations

import argparse
import json
import os
import sys

# torch's libgomp threads spin for milliseconds after each parallel region and OpenBLAS's for
# ~2^28 cycles; interleaved with another library's threads they steal the cores. A fair
# side-by-side benchmark makes every pool wait passively (read by the libraries at load).
PASSIVE_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_THREAD_TIMEOUT": "4"}

EPILOG = """examples:
  autohc info
  autohc bench gemm --model dit-xl --threads 1 2
  autohc bench gemm --model dit-s --threads 2 --json > gemm.json
"""


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="autohc", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Generated, autotuned CPU kernels for Diffusion Transformer training.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = sub.add_parser("info", help="CPU, ISA, caches, NUMA, measured FMA peak, kernel cache")
    info.add_argument("--json", action="store_true", help="one JSON object instead of text")

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
    g.add_argument("--threads", type=_positive_int, nargs="+", default=[1],
                   help="thread counts to measure (default: 1)")
    g.add_argument("--images", type=_positive_int, default=8,
                   help="images per batch: M = images x 256 (default: 8, i.e. M = 2048)")
    g.add_argument("--repeats", type=_positive_int, default=7, help="timed repeats (default: 7)")
    g.add_argument("--json", action="store_true",
                   help="print JSON (one object per thread count) instead of tables")
    g.add_argument("--markdown", action="store_true", help="print Markdown tables (as in the README)")
    g.add_argument("--contended", action="store_true",
                   help="keep the libraries' spinning thread pools (default: all three wait "
                        "passively, via OMP_WAIT_POLICY=PASSIVE and OPENBLAS_THREAD_TIMEOUT=4, "
                        "so no library's idle threads steal the cores of the one being timed)")
    return ap


def cmd_info(args) -> int:
    from . import cpu
    from .build import cache_dir, cache_entries
    from .peak import fma_peak_gflops
    info = cpu.detect()
    isa = cpu.best_isa(info)
    data = {
        "model": info.model, "arch": info.arch, "fingerprint": info.fingerprint, "isa": isa,
        "runnable_isas": cpu.runnable_isas(info), "cores": info.cores, "cpus": list(info.cpus),
        "caches": [f"L{c.level} {c.kind} {c.size_bytes // 1024} KiB" for c in info.caches],
        "numa_nodes": [list(n) for n in info.numa_nodes],
        "fma_peak_gflops_per_core": round(fma_peak_gflops(isa), 1),
        "cache_dir": str(cache_dir()), "cached_kernels": len(cache_entries()),
    }
    if args.json:
        print(json.dumps(data))
    else:
        for k, v in data.items():
            print(f"{k:>26}: {v}")
    return 0


def cmd_bench_gemm(args) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from .bench import bench_gemm, dit_problems
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
        for col in ("GEMM", "layout", "M", "K", "N", "autohc GFLOP/s", "% peak", "torch",
                    "numpy", "x torch", "x numpy"):
            t.add_column(col, justify="left" if col in ("GEMM", "layout") else "right")
        for row in r["rows"]:
            t.add_row(row["name"], row["layout"], str(row["M"]), str(row["K"]), str(row["N"]),
                      f"{row['gflops']:.1f}", f"{row['pct_peak']:.0f}%",
                      f"{row['torch_gflops']:.1f}", f"{row['numpy_gflops']:.1f}",
                      f"{row['speedup_vs_torch']:.2f}", f"{row['speedup_vs_numpy']:.2f}")
        t.caption = (f"geomean: {r['geomean_speedup_vs_torch']:.2f}x torch, "
                     f"{r['geomean_speedup_vs_numpy']:.2f}x numpy")
        out.print(t)
    return 0


def markdown_table(r: dict) -> str:
    lines = [f"**{r['model']}, {r['threads']} thread(s)**, {r['isa']}, measured peak "
             f"{r['peak_gflops_per_core']} GFLOP/s per core; geomean "
             f"**{r['geomean_speedup_vs_torch']:.2f}x torch, {r['geomean_speedup_vs_numpy']:.2f}x numpy**",
             "", "| GEMM | layout | M | K | N | autohc GFLOP/s | % peak | torch | numpy | x torch | x numpy |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for w in r["rows"]:
        lines.append(f"| {w['name']} | {w['layout']} | {w['M']} | {w['K']} | {w['N']} | {w['gflops']:.1f} "
                     f"| {w['pct_peak']:.0f}% | {w['torch_gflops']:.1f} | {w['numpy_gflops']:.1f} "
                     f"| {w['speedup_vs_torch']:.2f} | {w['speedup_vs_numpy']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
        if args.command == "bench" and args.what == "gemm":
            return cmd_bench_gemm(args)
    except KeyboardInterrupt:
        print("autohc: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one clear line, not a traceback, for known errors
        from .build import BuildError
        from .codegen import ParamError
        from .gemm import KernelError
        if isinstance(e, (BuildError, ParamError, KernelError)):
            print(f"autohc: {e}", file=sys.stderr)
            return 1
        raise
    return 2


if __name__ == "__main__":
    sys.exit(main())
