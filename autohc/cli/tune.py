"""`autohc tune`: GEMM problems (--shape, --model) and operator kernels (--op)."""
from __future__ import annotations

import json
import sys

from .argtypes import command_error


def cmd_tune(args, parser) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from ..bench.peak import fma_peak_gflops
    from ..hw import cpu
    from ..kernels.gemm.problem import GemmProblem, dit_problems
    from ..tune import registry
    from ..tune.result import TuneResult
    # (--timeout, --threads: checked by the parser) every value checked before anything is
    # tuned, written or said
    if args.storage is not None:
        from ..tune import StorageError, open_storage
        try:
            open_storage(args.storage)          # a bad URL: exit 2 before anything is written
        except StorageError as e:
            command_error("tune", str(e))
    problems = []
    if args.op:
        _check_ops(args)
    elif args.model:
        problems = dit_problems(args.model, max(1, args.m // 256))
    else:
        k, n = args.shape
        layouts = ["NT", "NN", "TN"] if args.layout == "all" else [args.layout]
        problems = [GemmProblem(f"{k}x{n}", lay, args.m, k, n) for lay in layouts]
    if args.layout != "all" and args.model:
        problems = [p for p in problems if p.layout == args.layout]
    _check_fits(problems)
    threads = args.threads or cpu.detect().cores
    auto = args.dtype == "auto"
    if auto:            # the precision `autohc train --precision auto` would run here
        from ..dit.precision import resolve
        args.dtype, why = resolve("auto")
        print(f"autohc tune: {args.dtype} ({why}; --dtype fp32 or bf16 to choose)", file=sys.stderr)
    if args.op:
        return _tune_ops(args, threads, auto)
    if args.dtype == "bf16":
        from ..bench.peak import bf16_peak_gflops
        from ..kernels.isa import BF16_ISAS
        isa, why = cpu.bf16_isa()
        if isa not in BF16_ISAS:
            raise ValueError(f"nothing to tune in bf16 here: {why}")
        peak_per_core = bf16_peak_gflops("tile" if isa == "amx" else "dot") or float("nan")
    else:
        isa = cpu.best_isa()
        peak_per_core = fma_peak_gflops(isa)
    console = Console(stderr=True)
    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[best]}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        for p in problems:
            hit = None if args.force else registry.lookup("gemm", p.layout, p.K, p.N, p.M, threads,
                                                          exact=True, dtype=args.dtype)
            if hit and hit[1].get("M") == p.M and hit[0].isa == isa:
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
                             progress=on_trial, dtype=args.dtype)
            progress.update(task, completed=args.trials)
            results.append(r)
            if args.json:
                print(json.dumps(r.to_json()), flush=True)
    if args.json:
        return 0
    peak = peak_per_core * threads
    t = Table(title=f"tuned {args.dtype} GEMMs, {threads} thread(s), {isa}"
                    + (" (torch: its bf16 matmul, oneDNN; TN into an fp32 dW, torch's product"
                       " cast into it)" if args.dtype == "bf16" else ""))
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


def _check_ops(args) -> None:
    """--op names this dtype has (before auto resolves it: every op), or exit 2 naming them."""
    from ..tune.ops import BF16_OPS, OP_KERNELS
    known = list(BF16_OPS) if args.dtype == "bf16" else [*OP_KERNELS, "attention"]
    unknown = [] if args.op == ["all"] else [n for n in args.op if n not in known]
    if unknown:
        command_error("tune", f"argument --op: unknown op{'s' if len(unknown) > 1 else ''} "
                              f"{', '.join(unknown)}; one of {', '.join(known)} or all"
                              + (" (in bf16)" if args.dtype == "bf16" else ""))


def _check_fits(problems) -> None:
    """Exit 2 on a problem whose matrices this machine cannot hold, before any allocation:
    a tune keeps the three fp32 operands and about as much again in results and copies."""
    import psutil
    have = psutil.virtual_memory().available
    for p in problems:
        need = 8 * (p.M * p.K + p.K * p.N + p.M * p.N)
        if need > have:
            command_error("tune", f"{p.name} at M = {p.M}: about {need / 2**30:.3g} GiB of matrices, "
                                  f"{have / 2**30:.1f} GiB available; a smaller --shape or --m")


def _tune_ops(args, threads: int, auto: bool = False) -> int:
    """auto (resolved to args.dtype): every op, in bf16 where it has a bf16 form and args.dtype
    is bf16, else in fp32; otherwise only the ops of args.dtype."""
    from ..tune.ops import BF16_OPS, OP_KERNELS, tune_op
    known = list(BF16_OPS) if args.dtype == "bf16" and not auto else [*OP_KERNELS, "attention"]
    dtype_of = {n: "bf16" if args.dtype == "bf16" and n in BF16_OPS else "fp32" for n in known}
    names = known if args.op == ["all"] else args.op     # (known ones: _check_ops)
    say = None if args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    for name in names:
        dtype = dtype_of[name]
        r = tune_op(name, threads, images=args.images, timeout=args.timeout, seed=args.seed, progress=say,
                    dtype=dtype)
        if args.json:
            print(json.dumps(r))
        else:
            knobs = " ".join(f"{k} {v}" for k, v in r["params"].items() if k != "isa")
            print(f"{name}{' bf16' if dtype == 'bf16' else ''}: {knobs} ({r['params']['isa']}), {r['ms']:.2f} ms, "
                  f"torch {r['torch_ms']:.2f} ms, {r['speedup_vs_torch']:.2f}x, {r['trials']} trials "
                  f"-> registry")
    return 0
