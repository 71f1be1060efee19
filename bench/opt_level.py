"""The kernels at -O3 (autohc.build.cache.OPT_FLAGS, what users run) against another optimisation
level, on this CPU: the default GEMM kernels' rate on a DiT's training GEMMs, and with --step the
training step of `autohc bench step`. Each level runs in its own processes, the levels
alternating round by round, in one kernel cache (the flags are part of a build's key); the
first round of each level builds, and is not counted.

A lower level compiles in about half the time (a user's first run, tuning trials, the suite);
it is worth having where the kernels run as fast (docs/history.md, stops 91 and 92).

    python bench/opt_level.py [--level O2] [--rounds 3] [--model dit-s] [--dtype bf16 fp32]
                              [--step DiT-S/2 --batch 8] [--json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

LEVELS = ("O1", "O2", "Os")          # (set against O3; without the dash, which argparse would read as an option)


def child(level: str, what: str, args) -> None:
    """One process at `level` (O2: -O2): every kernel it builds gets it in place of -O3."""
    from autohc.build import cache
    cache.OPT_FLAGS = tuple(f"-{level}" if f == "-O3" else f for f in cache.OPT_FLAGS)
    if what == "step":
        from autohc.cli import main
        sys.exit(main(["bench", "step", "--model", args.step, "--batch", str(args.batch), "--precision", "bf16",
                       "--modes", "autohc-bf16", "--steps", "8", "--no-first-use-tuning", "--short-spin", "--json"]))
    import torch
    from autohc.bench.gemm import bench_problem
    from autohc.kernels.gemm.kernel import default_kernel_params
    from autohc.kernels.gemm.problem import dit_problems
    threads = torch.get_num_threads()
    rows = {}
    for dtype in args.dtype:
        for p in dit_problems(args.model, args.images):
            if p.M < 64:                    # (the adaLN Linears: skinny paths, not the blocked loops)
                continue
            r = bench_problem(p, threads, params=default_kernel_params(threads, dtype=dtype), with_numpy=False,
                              dtype=dtype)
            rows[f"{dtype} {p.name} {p.layout} {p.M}x{p.K}x{p.N}"] = [r.gflops, r.torch_gflops]
    print(json.dumps(rows))


def run(level: str, what: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", level, "--what", what, "--model", args.model,
           "--images", str(args.images), "--dtype", *args.dtype, "--step", args.step, "--batch", str(args.batch)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"opt_level: the {level} process failed:\n{proc.stderr[-2000:]}")
    lines = proc.stdout.splitlines()      # (the JSON object ends the output, maybe over many lines)
    start = max(i for i, line in enumerate(lines) if line.startswith("{"))
    return json.loads("\n".join(lines[start:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--level", default="O2", choices=LEVELS, help="the level set against O3 (default O2)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per level (default 3)")
    ap.add_argument("--model", default="dit-s", choices=("dit-s", "dit-b", "dit-l", "dit-xl"),
                    help="whose training GEMMs (default dit-s)")
    ap.add_argument("--images", type=int, default=8, help="M = images x 256 tokens (default 8)")
    ap.add_argument("--dtype", nargs="+", default=["bf16", "fp32"], choices=("bf16", "fp32"))
    ap.add_argument("--step", default="", metavar="MODEL",
                    help="also time `autohc bench step --model MODEL --precision bf16` (e.g. DiT-S/2)")
    ap.add_argument("--batch", type=int, default=8, help="the step's batch (default 8)")
    ap.add_argument("--json", action="store_true", help="one JSON object")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--what", default="gemm", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.what, args)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    from autohc.hw import cpu
    levels = ("O3", args.level)
    whats = ["gemm"] + (["step"] if args.step else [])
    for what in whats:                      # (builds, not counted)
        for level in levels:
            print(f"opt_level: building and warming {what} at {level}", file=sys.stderr, flush=True)
            run(level, what, args)
    gemm = {level: [] for level in levels}
    step = {level: [] for level in levels}
    for r in range(args.rounds):
        for level in (levels if r % 2 == 0 else levels[::-1]):
            print(f"opt_level: round {r + 1}/{args.rounds} at {level}", file=sys.stderr, flush=True)
            gemm[level].append(run(level, "gemm", args))
            if args.step:
                step[level].append(run(level, "step", args)["step_s"]["autohc-bf16"])
    names = list(gemm["O3"][0])
    out = {"cpu": cpu.detect().model, "fingerprint": cpu.detect().fingerprint, "level": args.level,
           "rounds": args.rounds, "gemm": {}, "step_s": {}}
    for n in names:
        med = {lv: statistics.median(g[n][0] for g in gemm[lv]) for lv in levels}
        vs_torch = {lv: statistics.median(g[n][0] / g[n][1] for g in gemm[lv]) for lv in levels}
        out["gemm"][n] = {"gflops": med, "vs_torch": vs_torch, "ratio": med[args.level] / med["O3"]}
    if args.step:
        out["step_s"] = {lv: statistics.median(step[lv]) for lv in levels}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['cpu']} (fingerprint {out['fingerprint']}), {args.rounds} rounds, medians:")
    print(f"  {'GEMM':44s} {'O3':>8s} {args.level:>8s}  ratio   (x torch: O3 / {args.level})")
    for n, g in out["gemm"].items():
        print(f"  {n:44s} {g['gflops']['O3']:8.1f} {g['gflops'][args.level]:8.1f}  {g['ratio']:.3f}   "
              f"({g['vs_torch']['O3']:.3f} / {g['vs_torch'][args.level]:.3f})")
    if args.step:
        s = out["step_s"]
        print(f"  step {args.step} batch {args.batch}: O3 {s['O3']:.3f} s, {args.level} {s[args.level]:.3f} s "
              f"(rounds: {', '.join(f'{v:.3f}' for v in step['O3'])} / {', '.join(f'{v:.3f}' for v in step[args.level])})")


if __name__ == "__main__":
    main()
