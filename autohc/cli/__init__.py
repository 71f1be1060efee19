"""The `autohc` command line: the parser and the dispatch here, one module per command group
(tune, kernels: info/export/report/cache, bench, dit: train/sample/eval/bench step).

    autohc info                              what this CPU is and which back-end runs
    autohc bench gemm --model dit-xl         autohc vs torch vs numpy on DiT training GEMMs
"""
from __future__ import annotations

import argparse
import os
import sys

from . import bench, kernels, tune
from ..bench.results import add_save_argument
from .argtypes import (non_negative_int, open_fraction, output_dir, output_file, positive_float,
                       positive_int, thread_count)

# torch's libgomp threads spin for milliseconds after each parallel region and OpenBLAS's for
# ~2^28 cycles; interleaved with another library's threads they steal the cores. A fair
# side-by-side benchmark makes every pool wait passively (read by the libraries at load).
PASSIVE_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_THREAD_TIMEOUT": "4"}
# variables that make a library the GEMM benches compare against slower than this CPU allows,
# not passed on to them: OPENBLAS_CORETYPE forces OpenBLAS's kernels for another CPU (Haswell's
# AVX2 on an AVX-512 Zen 5 ran numpy's fp32 GEMMs at 250 GFLOP/s on 2 threads against 485 with
# OpenBLAS's own choice); the fp32 baseline must be the best BLAS this CPU runs. What was
# dropped is kept with a saved result (AUTOHC_BENCH_DROPPED_ENV).
BASELINE_DROPPED_ENV = ("OPENBLAS_CORETYPE",)


def oversubscription_note(threads, usable: int) -> str | None:
    """The note for --threads beyond the CPUs this process may use (`threads`: an int, a list
    of them or None): the threads then take turns on the cores, and a time or a tuning
    decision measured so says little about either count."""
    asked = [t for t in (threads if isinstance(threads, list) else [threads]) if isinstance(t, int)]
    over = [t for t in asked if t > usable]
    if not over:
        return None
    return (f"autohc: note: {max(over)} threads on {usable} usable CPU{'s' if usable > 1 else ''}: "
            "they take turns on the cores, so what is timed here says little about either count")


def bench_environment(environ: dict, what: str, contended: bool) -> tuple[dict | None, list[str]]:
    """The environment `autohc bench <what>` re-executes itself in (None: run as it is), and
    what it dropped, as NAME=value: every thread pool passive (gemm, gate: unless contended)
    and, for the GEMM benches, no variable that slows their baseline libraries."""
    missing = {} if contended else {k: v for k, v in PASSIVE_ENV.items() if environ.get(k) != v}
    dropped = ([f"{k}={environ[k]}" for k in BASELINE_DROPPED_ENV if k in environ]
               if what in ("gemm", "gate") else [])
    if not missing and not dropped:
        return None, []
    env = {k: v for k, v in environ.items() if not (dropped and k in BASELINE_DROPPED_ENV)}
    if dropped:
        env["AUTOHC_BENCH_DROPPED_ENV"] = ",".join(dropped)
    return {**env, **missing}, dropped

EPILOG = """examples:
  autohc tune --shape 1152x4608 --layout NT --threads 1
  autohc tune --model dit-xl --threads 2 --timeout 30
  autohc export --out generated/
  autohc report --out report/
  autohc info
  autohc bench gemm --model dit-xl --threads 1 2
  autohc bench gemm --model dit-s --threads 2 --json > gemm.json
  autohc bench gemm --model dit-xl --threads 1 2 --save   # also kept in results/<cpu>/
  autohc report --results                                # results/ -> docs/results.md, README.md
  autohc train --data digits --out runs/digits
  autohc sample --ckpt runs/digits --classes 3 5 7 --out grid.png
  autohc eval --ckpt runs/digits
  autohc encode --data folder:imgs/ --vae stabilityai/sd-vae-ft-ema --image-size 256 --out latents/
  autohc convert runs/xl pipeline/ --to diffusers
  autohc bench step --model DiT-S/2 --batch 8
  autohc bench ops --json
"""


class OneLineParser(argparse.ArgumentParser):
    """Bad input: one line on stderr (what is wrong), exit code 2; --help teaches the rest."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")



def _step_args(p, model: str, batch: int | None, steps: int, model_note: str = "") -> None:
    """--model, --batch (unless None: the command has its own), --steps, --warmup of the
    training-step benchmarks."""
    from ..dit.sizes import MODELS
    p.add_argument("--model", default=model, choices=list(MODELS), metavar="NAME",
                   help=f"DiT size, one of {', '.join(MODELS)} (default: {model}{model_note})")
    if batch is not None:
        p.add_argument("--batch", type=positive_int, default=batch, help=f"images per step (default: {batch})")
    p.add_argument("--steps", type=positive_int, default=steps, help=f"steps per run (default: {steps})")
    p.add_argument("--warmup", type=positive_int, default=2, help="of which untimed (default: 2)")


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

    info = sub.add_parser("info", help="CPU, ISA, caches, NUMA, measured FMA peak, kernel cache",
                          formatter_class=argparse.RawDescriptionHelpFormatter,
                          description="What this machine runs: the CPU and its ISA, caches and NUMA "
                                      "nodes, the measured FMA and bf16 peaks, the back-end bf16 "
                                      "GEMMs use, the default GEMM configuration and thread split, "
                                      "and what the kernel cache and the tuning registry hold.",
                          epilog="examples:\n  autohc info\n  autohc info --json")
    info.add_argument("--json", action="store_true", help="one JSON object instead of text")

    tune = sub.add_parser(
        "tune", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="search kernel parameters for a GEMM by measurement (Optuna) and remember the best",
        description="Tunes the GEMM kernel for the training GEMMs of a Linear(K -> N) on M rows: "
                    "each trial renders, builds, verifies (a wrong kernel can never win) and times "
                    "a configuration against torch. The best goes to the registry, which "
                    "autohc.matmul consults on every call. A problem already tuned is answered "
                    "from the registry (--force to retune); an interrupted tune resumes.",
        epilog="examples:\n  autohc tune --shape 1152x4608                 # NT, NN and TN, M = 2048, as training runs here\n"
               "  autohc tune --shape 1152x4608 --layout NT --threads 1 --json\n"
               "  autohc tune --model dit-xl --threads 2 --timeout 30\n"
               "  autohc tune --shape 1152x4608 --dtype bf16   # the bf16 kernels vs oneDNN bf16\n"
               "  autohc tune --shape 1152x4608 --dtype fp32   # the fp32 kernels, on any CPU\n"
               "  autohc tune --shape 1152x1152 --storage postgresql://user@host/db   # a shared study")
    what = tune.add_mutually_exclusive_group(required=True)
    what.add_argument("--shape", type=_shape, metavar="KxN",
                      help="the Linear's in x out features, e.g. 1152x4608")
    what.add_argument("--model", choices=["dit-s", "dit-b", "dit-l", "dit-xl"],
                      help="every training GEMM of this DiT size (15 problems)")
    what.add_argument("--op", nargs="+", metavar="NAME",
                      help="operator kernels instead (names as in `autohc bench ops`, adamw, "
                           "attention, or all): vector width, unroll, streaming stores and thread "
                           "split from search_spaces/eltwise.yaml; attention's blocks and "
                           "micro-tiles from search_spaces/attention.yaml")
    tune.add_argument("--m", type=positive_int, default=2048, help="rows (tokens), default 2048")
    tune.add_argument("--layout", choices=["NT", "NN", "TN", "all"], default="all",
                      help="NT forward, NN input grad, TN weight grad (default: all)")
    tune.add_argument("--threads", type=thread_count, default=None,
                      help="GEMM threads (default: every usable CPU)")
    tune.add_argument("--trials", type=positive_int, default=40,
                      help="trials per problem, counting earlier runs of its study (default 40)")
    tune.add_argument("--timeout", type=positive_float, default=60.0,
                      help="seconds per problem (default 60); the trial in flight finishes")
    tune.add_argument("--storage", default=None,
                      help="Optuna storage URL (default: sqlite in the autohc cache)")
    tune.add_argument("--seed", type=int, default=0, help="sampler seed (default 0)")
    tune.add_argument("--force", action="store_true", help="retune problems already in the registry")
    tune.add_argument("--dtype", choices=["fp32", "bf16", "auto"], default="auto",
                      help="bf16: the bf16 kernels (bf16 products, fp32 sums) on this CPU's bf16 "
                           "back-end (AMX tiles, else AVX512_BF16; `autohc info` says which), "
                           "raced against torch's bf16 matmul (oneDNN) in the form training "
                           "runs: NT and NN write a bf16 C, TN (the weight gradient) the fp32 dW, "
                           "where torch's product is cast into it; fp32: the fp32 kernels; auto "
                           "(default): what `autohc train`'s default --precision auto runs here, "
                           "bf16 where the CPU multiplies bf16 in hardware, else fp32 (with --op: "
                           "each op's bf16 form where it has one, the others in fp32); the first "
                           "line says which and why")
    tune.add_argument("--json", action="store_true", help="one JSON object per problem")
    tune.add_argument("--images", type=positive_int, default=8,
                      help="with --op: DiT-XL/2 tensors for this many images, and for adamw 8M "
                           "parameters per image (default: 8)")

    exp = sub.add_parser("export", help="write tuned kernels as C + header + manifest.json",
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         epilog="example:\n  autohc export --out generated/",
                         description="Writes the C source of every tuned kernel of this CPU (and "
                                     "the default ones), one header and manifest.json (problem, "
                                     "params, cflags, sha256, GFLOP/s, CPU), for a C/C++ build "
                                     "that calls the kernels without Python.")
    exp.add_argument("--out", default="generated", type=output_dir, help="output folder (default: generated/)")
    exp.add_argument("--no-defaults", action="store_true", help="only tuned kernels")

    rep = sub.add_parser("report", help="PNG plots: tuning convergence, roofline of tuned kernels; "
                                        "--results: the docs' results tables from saved results",
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         description="Plots of the tuning studies (each problem's convergence) and "
                                     "a roofline of the tuned kernels into --out; with --results, "
                                     "instead, the docs' results tables rendered from the files "
                                     "`--save` wrote.",
                         epilog="examples:\n  autohc report --out report/\n"
                                "  autohc report --results            # results/ -> docs/results.md, README.md")
    rep.add_argument("--out", default="report", type=output_dir, help="output folder (default: report/)")
    rep.add_argument("--results", nargs="?", const="results", default=None, metavar="DIR",
                     help="instead of the plots: render the per-CPU results tables from the files "
                          "`--save` wrote under DIR (default: results/) into --page and the "
                          "README's results blocks")
    rep.add_argument("--page", default="docs/results.md", type=output_file,
                     help="with --results: the page written (default: docs/results.md)")
    rep.add_argument("--readme", default="README.md",
                     help="with --results: the README whose marked blocks are replaced "
                          "(default: README.md; 'none' leaves it)")
    rep.add_argument("--storage", default=None, help="Optuna storage URL of the studies "
                                                     "(default: sqlite in the autohc cache)")

    cache = sub.add_parser("cache", help="list, verify or clear compiled kernels",
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="examples:\n  autohc cache list\n  autohc cache verify --json",
                           description="The kernel cache: $AUTOHC_CACHE_DIR, else "
                                       "$XDG_CACHE_HOME/autohc, else ~/.cache/autohc.")
    cache.add_argument("action", choices=["list", "verify", "clear"],
                       help="list entries / check every library against its sha256 / delete "
                            "compiled kernels (the registry and tuning studies stay)")
    cache.add_argument("--json", action="store_true", help="JSON output (list, verify)")

    bench = sub.add_parser("bench", help="measure autohc against torch and numpy",
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="Benchmarks of autohc against torch and numpy, timed "
                                       "interleaved, medians of repeats: the training GEMMs, the "
                                       "fused operators, training steps, sampling, memory, "
                                       "parallel strategies, scaling, and the CI's perf gate. "
                                       "`autohc bench WHAT --help` says what each measures.",
                           epilog="examples:\n  autohc bench gemm --model dit-xl --threads 1 2\n"
                                  "  autohc bench ops --json")
    bsub = bench.add_subparsers(dest="what", required=True, metavar="WHAT")
    g = bsub.add_parser(
        "gemm", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="the training GEMMs of a DiT (forward NT, backward NN and TN, adaLN)",
        description="Times autohc.matmul, torch.matmul (MKL) and numpy.matmul (OpenBLAS) on the "
                    "GEMMs of one DiT block at M = images x 256 tokens (adaLN: M = images), "
                    "interleaved, median of repeats, at each thread count asked for.",
        epilog="examples:\n  autohc bench gemm --model dit-xl --threads 1 2 --json\n"
               "  autohc bench gemm --model dit-xl --threads 1 2 --dtype bf16\n"
               "  autohc bench gemm --model dit-s --threads 2 --dtype bf16 --cold")
    g.add_argument("--model", default="dit-xl", choices=["dit-s", "dit-b", "dit-l", "dit-xl"],
                   help="DiT size (default: dit-xl, hidden 1152)")
    g.add_argument("--threads", type=positive_int, nargs="+", default=[1],
                   help="thread counts to measure (default: 1)")
    g.add_argument("--images", type=positive_int, default=8,
                   help="images per batch: M = images x 256 (default: 8, i.e. M = 2048)")
    g.add_argument("--repeats", type=positive_int, default=7, help="timed repeats (default: 7)")
    g.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: autohc's bf16 kernels (bf16 inputs and C) against torch's bf16 "
                        "matmul (oneDNN, bf16 C) and the fp32 libraries (MKL, OpenBLAS), with "
                        "%% of the bf16 peak; default fp32")
    g.add_argument("--cold", action="store_true",
                   help="cold caches: before every timed call an untimed element-wise op over 64 MB "
                        "on the same threads evicts A, B and C from L1 and L2, as the ops between a "
                        "training step's GEMMs do (default: calls back to back, operands warm)")
    g.add_argument("--pages", choices=("huge", "4k"), default="huge",
                   help="huge: every library's operands and results in transparent huge pages, as a "
                        "step's are (autohc's result pool, weights moved to huge pages); 4k: torch's "
                        "own allocation, 4 KB pages where THP is in madvise mode, a page-table walk "
                        "for rows a page apart (default: huge)")
    g.add_argument("--json", action="store_true",
                   help="print JSON (one object per thread count) instead of tables")
    add_save_argument(g)
    g.add_argument("--markdown", action="store_true", help="print Markdown tables (as in the README)")
    g.add_argument("--no-first-use-tuning", action="store_true",
                   help="time the default kernel where the registry has no entry (default: tune "
                        "such a problem first, as install() does on first use, and report that "
                        "time apart; config column: first-use)")
    g.add_argument("--contended", action="store_true",
                   help="keep the libraries' spinning thread pools (default: all three wait "
                        "passively, via OMP_WAIT_POLICY=PASSIVE and OPENBLAS_THREAD_TIMEOUT=4, "
                        "so no library's idle threads steal the cores of the one being timed)")
    sc = bsub.add_parser(
        "scale", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="data-parallel cost here (all-reduce, 1 vs 2 ranks) and the predicted weak scaling",
        description="Measures, with 1 and 2 ranks on this machine (gloo on localhost, 1 thread each):\n"
                    "the all-reduce over a sweep of sizes (fitted to the ring model 2(p-1)a +\n"
                    "2(p-1)/p n b + (p-1)/p n g), the training step at the same per-rank batch with the\n"
                    "all-reduce on autohc's communication thread and on gloo's threads, and DDP's\n"
                    "bucket schedule; predicts weak-scaling efficiency up to 1024 ranks, and for the\n"
                    "DiT-HC paper's setting (DiT-XL/2, 13.18 s step, 48 GB/s links).",
        epilog="example:\n  autohc bench scale --model DiT-S/2 --batch-per-rank 8 --json")
    _step_args(sc, "DiT-S/2", None, 6)
    sc.add_argument("--batch-per-rank", type=positive_int, default=8, help="images per rank (default: 8)")
    sc.add_argument("--netns", nargs="*", metavar="RATE", default=None,
                    help="also time the all-reduce between two network namespaces of this machine "
                         "(root): one run per link rate given (e.g. 1gbit 10gbit; none: unshaped)")
    sc.add_argument("--json", action="store_true", help="one JSON object")
    me = bsub.add_parser(
        "memory", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="peak memory and step time without and with AutoMem",
        description="Runs training steps of a DiT on synthetic 256px latents without and with AutoMem\n"
                    "(saved activations moved to a tier after the forward pass, prefetched back for\n"
                    "backward), each in its own process: peak RSS, median step time, losses compared.\n"
                    "The two processes run in alternating order for --rounds pairs (B A, A B, ...);\n"
                    "the step overhead is the median of the pairs' ratios. On a machine too small to\n"
                    "give AutoMem's helper threads a core of their own they share the compute cores;\n"
                    "AUTOHC_MEMORY_CORES=1 keeps one for them (and computes on the rest, both runs).",
        epilog="examples:\n  autohc bench memory --model DiT-B/2 --batch 16 --tier file --json\n"
               "  AUTOHC_MEMORY_CORES=1 autohc bench memory --model DiT-B/2 --batch 16 --rounds 3")
    _step_args(me, "DiT-B/2", 16, 5)
    me.add_argument("--tier", default="file", help="file, file:DIR, numa[:NODE] or bf16 (default: file)")
    me.add_argument("--state", action="store_true",
                    help="the optimizer's moments to the tier between steps too (train --automem-state)")
    me.add_argument("--rounds", type=positive_int, default=2,
                    help="pairs of runs, baseline and AutoMem in alternating order (default: 2)")
    me.add_argument("--json", action="store_true", help="one JSON object")
    add_save_argument(me)
    pa = bsub.add_parser(
        "parallel", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="the paper's Table 2 here: DP vs DP+TP vs CFTP, step time, peak memory, losses",
        description="Trains a DiT on synthetic 256px latents three ways over this process's cores, each\n"
                    "in fresh processes: dp (one process per core, DDP on gloo), dp+tp (one process per\n"
                    "core, torch tensor parallel: ColwiseParallel qkv/fc1, RowwiseParallel proj/fc2) and\n"
                    "cftp (one process, thread clusters splitting N of every GEMM, one copy of the\n"
                    "model). All on autohc's kernels and torch's AdamW, label dropout off: median step\n"
                    "time of the slowest rank, the sum of the processes' peak RSS, the losses compared.",
        epilog="example:\n  autohc bench parallel --model DiT-S/2 --batch 16 --json")
    _step_args(pa, "DiT-S/2", 16, 6, "; dp+tp needs its heads to split over the cores")
    pa.add_argument("--strategies", nargs="+", choices=["dp", "dp+tp", "cftp"], default=["dp", "dp+tp", "cftp"],
                    help="what to run (default: all three)")
    pa.add_argument("--json", action="store_true", help="one JSON object")
    add_save_argument(pa)
    gate = bsub.add_parser(
        "gate", help="CI perf-regression gate on autohc/torch speed ratios",
        description="Measures autohc/torch speed ratios (interleaved, medians) on the DiT-XL/2 "
                    "forward GEMMs at 1 and 2 threads and fails (exit 1) when one falls more than "
                    "--margin below the committed baseline for this CPU (bench/baseline.json). On a "
                    "CPU without a baseline it checks a floor instead: autohc no slower than the "
                    "faster of torch (MKL) and numpy (OpenBLAS) by more than the measured spread.",
        epilog="refresh the baseline after an intended change:  autohc bench gate --update")
    gate.add_argument("--baseline", default=None, help="baseline file (default: bench/baseline.json)")
    gate.add_argument("--margin", type=open_fraction, default=None,
                      help="allowed fall of a ratio, as a fraction (default 0.25)")
    gate.add_argument("--update", action="store_true", help="measure and rewrite this CPU's baseline")
    gate.add_argument("--contended", action="store_true", help=argparse.SUPPRESS)
    o = bsub.add_parser(
        "ops", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="the fused operators and AdamW vs torch eager, on DiT-XL/2-sized tensors",
        description="Times each generated operator (GELU-tanh, SiLU, LayerNorm + adaLN modulate, "
                    "softmax, gated residual; forward and backward) against torch eager on\n"
                    "DiT-XL/2-sized tensors, interleaved, median of repeats, with effective GB/s and "
                    "%% of a copy's bandwidth measured in the same run;\nautohc.optim.AdamW "
                    "against torch.optim.AdamW fused=True and foreach=True over 675M parameters;\n"
                    "and adamw+ema, a trainer's step with its EMA: autohc's AdamW updating the EMA in "
                    "its pass against torch's fused AdamW and a foreach lerp.",
        epilog="examples:\n  autohc bench ops\n  autohc bench ops --ops gelu_tanh softmax --adamw-params 0 --json\n"
               "  autohc bench ops --dtype bf16   # the ops and attention as under torch.autocast, vs torch's\n"
               "  autohc bench ops --adamw-params 50000000   # AdamW on less memory (675M needs ~14 GB)")
    o.add_argument("--images", type=positive_int, default=8, help="images: 256 tokens each (default: 8)")
    o.add_argument("--repeats", type=positive_int, default=9, help="timed repeats (default: 9)")
    o.add_argument("--adamw-params", type=non_negative_int, default=675_129_632,
                   help="AdamW parameters (default: DiT-XL/2's 675129632; 0 skips AdamW)")
    o.add_argument("--ops", nargs="+", default=None, metavar="NAME",
                   help="only these rows (names as in the table; 'adamw' and 'adamw+ema' included)")
    o.add_argument("--threads", type=positive_int, default=None, help="threads (default: all usable)")
    o.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="fp32 (default), or bf16: the operators and attention with the dtypes "
                        "torch.autocast gives them, against torch under autocast")
    o.add_argument("--json", action="store_true", help="one JSON object (rows: name, ms, torch_ms, speedup, gbps, ...)")
    add_save_argument(o)
    o.add_argument("--contended", action="store_true", help=argparse.SUPPRESS)
    from .dit import add_parsers
    add_parsers(sub, bsub)
    from .latents import add_parsers as add_latent_parsers
    add_latent_parsers(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    from ..runtime import hugepages
    try:
        hugepages.apply_env()           # AUTOHC_HUGE_PAGES=0: before anything is allocated
    except (ValueError, OSError) as e:
        print(f"autohc: {e}", file=sys.stderr)
        return 1
    # the commands that train or sample on autohc, and the benches that time only autohc's
    # training: torch's OpenMP workers wait briefly, so install() keeps torch's threads for what
    # autohc does not serve. `bench step` times stock torch too, with libgomp's default wait
    # unless --short-spin
    if (words[:1] in (["train"], ["sample"], ["eval"], ["compare"]) and "--no-autohc" not in words) \
            or words[:2] in (["bench", "parallel"], ["bench", "memory"]) \
            or (words[:2] == ["bench", "step"] and "--short-spin" in words):
        from ..runtime import omp
        omp.prefer_short_spin()         # before anything imports torch: autohc/runtime/omp.py
    if words[:1] == ["train"] and any(w == "--automem" or w.startswith("--automem=") for w in words):
        from ..runtime import automem   # glibc's mmap threshold, before torch's first blocks
        automem.fixed_mmap_threshold(automem.min_bytes_setting())
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(words)             # the command line, kept with a result saved by --save
    if args.command == "bench":
        env, dropped = bench_environment(dict(os.environ), args.what, getattr(args, "contended", True))
        if dropped:
            print(f"autohc: note: {', '.join(dropped)} not passed on to the libraries timed: "
                  "the fp32 baseline is the best BLAS this CPU runs", file=sys.stderr)
        if env is not None and argv is None:    # the libraries read these at load: re-exec
            os.execve(sys.executable, [sys.executable, "-m", "autohc.cli", *sys.argv[1:]], env)
        elif env is not None:
            print("autohc: note: run from the command line for passive thread pools and the "
                  "baseline libraries' own kernels", file=sys.stderr)
    if args.command in ("bench", "tune", "train"):
        from ..hw import cpu
        note = oversubscription_note(getattr(args, "threads", None), cpu.detect().cores)
        if note:
            print(note, file=sys.stderr)
    try:
        if args.command == "info":
            return kernels.cmd_info(args)
        if args.command == "tune":
            return tune.cmd_tune(args, parser)
        if args.command == "export":
            return kernels.cmd_export(args)
        if args.command == "cache":
            return kernels.cmd_cache(args)
        if args.command == "report":
            return kernels.cmd_report(args, parser)
        if args.command == "bench" and args.what == "gemm":
            return bench.cmd_bench_gemm(args)
        if args.command == "bench" and args.what == "gate":
            return bench.cmd_gate(args)
        if args.command == "bench" and args.what == "ops":
            return bench.cmd_bench_ops(args)
        if args.command == "bench" and args.what == "memory":
            return bench.cmd_bench_memory(args)
        if args.command == "bench" and args.what == "parallel":
            return bench.cmd_bench_parallel(args)
        if args.command == "bench" and args.what == "scale":
            return bench.cmd_bench_scale(args)
        if args.command in ("encode", "convert"):
            from . import latents
            return (latents.cmd_encode if args.command == "encode" else latents.cmd_convert)(args)
        if args.command in ("train", "sample", "eval", "compare") or getattr(args, "what", None) in ("step", "sample"):
            from . import dit as commands
            bench_cmd = commands.cmd_bench_sample if getattr(args, "what", None) == "sample" else commands.cmd_bench_step
            run = {"train": commands.cmd_train, "sample": commands.cmd_sample, "eval": commands.cmd_eval,
                   "compare": commands.cmd_compare}.get(args.command, bench_cmd)
            return run(args)
    except KeyboardInterrupt:
        print("autohc: interrupted", file=sys.stderr)
        return 130
    except OSError as e:                # a file or folder the system refused: one line
        where = f"{e.filename}: " if e.filename else ""
        print(f"autohc: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - one clear line, not a traceback, for known errors
        from ..build import BuildError
        from ..build.cache import CacheDirError
        from ..dit.data import InputError
        from ..kernels.family import ParamError
        if isinstance(e, InputError):   # a file or folder that is not what it should be
            print(f"autohc: {e}", file=sys.stderr)
            return 2
        from ..kernels.gemm.kernel import KernelError
        if isinstance(e, (BuildError, ParamError, KernelError, CacheDirError)) or (
                isinstance(e, ValueError) and args.command in ("info", "train", "sample", "eval", "compare", "bench", "tune")):
            print(f"autohc: {e}", file=sys.stderr)
            return 1
        raise
    return 2


