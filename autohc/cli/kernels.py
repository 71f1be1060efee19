"""`autohc info`, `autohc export`, `autohc report`, `autohc cache`: what this machine runs and
what the cache and the registry hold."""
from __future__ import annotations

import json
from pathlib import Path


def cmd_info(args) -> int:
    from ..bench.peak import bf16_peak_summary, fma_peak_gflops
    from ..build import cache_dir, cache_entries
    from ..hw import cpu
    from ..kernels import archs
    from ..kernels.gemm.kernel import bf16_skinny_unit
    from ..runtime import memory, plan
    from ..torch import attention
    from ..tune import registry
    info = cpu.detect()
    isa = cpu.best_isa(info)
    table = archs.describe(info)
    bf16 = bf16_peak_summary()
    data = {
        "model": info.model, "arch": info.arch, "vendor": info.vendor,
        "family_model": f"{info.family}/{info.model_number}", "fingerprint": info.fingerprint, "isa": isa,
        "microarch": f"{table['arch']} (configs/{table['arch']}.yaml: {table['title']})",
        "gemm_default": table["gemm_default"], "gemm_default_source": table["source"],
        "gemm_threads": _geometry_line(info.cores),
        "runnable_isas": cpu.runnable_isas(info), "cores": info.cores, "cpus": list(info.cpus),
        "caches": [f"L{c.level} {c.kind} {c.size_bytes // 1024} KiB" for c in info.caches],
        "numa_nodes": [list(n) for n in info.numa_nodes],
        "fma_peak_gflops_per_core": round(fma_peak_gflops(isa), 1),
        "bf16_dot_peak_gflops_per_core": _round(bf16["dot_gflops_per_core"]),
        "bf16_tile_peak_gflops_per_core": _round(bf16["tile_gflops_per_core"]),
        "bf16_backend": bf16["backend"], "bf16_backend_why": bf16["why"],
        "bf16_skinny_unit": bf16_skinny_unit(bf16["backend"]),
        "attention_bf16": "{}: {}".format(*attention.bf16_isa()),
        "cpu_plan": plan.current().describe(),
        "kernel_threads": _team_line(),
        "result_pool": memory.pool.describe(),
        "cache_dir": str(cache_dir()), "cached_kernels": len(cache_entries()),
        "registry": str(registry.registry_path()),
        "registry_entries": len(registry.entries_for_this_cpu()),
        "first_use_tuned": _first_use_entries(registry),
    }
    if args.json:
        print(json.dumps(data))
    else:
        for k, v in data.items():
            if k == "bf16_skinny_unit":
                print(f"{'bf16_skinny':>26}: {_skinny_line(v)}")
            elif k.startswith("bf16_"):    # the four bf16 peak keys read as one line
                if k == "bf16_backend":
                    print(f"{'bf16_peak':>26}: {_bf16_line(data)}")
            elif k == "first_use_tuned":      # one problem per line
                print(f"{k:>26}: " + (f"\n{'':>28}".join(v) if v else "none"))
            else:
                print(f"{k:>26}: {v}")
    return 0


def _geometry_line(threads: int) -> str:
    """How the default GEMM splits `threads` team threads (jc x ic x jr ways)."""
    from ..kernels.gemm.kernel import default_kernel_params
    if threads == 1:
        return "1 thread"
    p = default_kernel_params(threads)
    how = ("each thread its own JC way: its own N slice, or rows where N < M (own_ways_up_to)"
           if p.own_ways else
           "JC ways split N by NUMA node; a node's threads share B panels and split M (IC) and B micro-panels (JR)")
    ring = "one B panel buffer" if p.depth == 1 else f"a ring of {p.depth} B panel buffers"
    return f"{threads} threads as {p.jc_ways}x{p.ic_ways}x{p.jr_ways} (JC x IC x JR ways): {how}; {ring}"


def _team_line() -> str:
    """Whose threads the kernels' teams run on (AUTOHC_TEAM; a bad value says so here)."""
    from ..runtime import omp
    try:
        kind = omp.team_kind()
    except ValueError as e:
        return str(e)
    return ("torch's OpenMP threads (AUTOHC_TEAM=omp; autohc's pool where OpenMP cannot give "
            "a whole team)" if kind == "omp" else "autohc's worker pool (AUTOHC_TEAM=pool)")


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def _bf16_line(d: dict) -> str:
    """One core's bf16 peaks and the back-end bf16 GEMMs run on, in a line."""
    dot, tile, backend = (d["bf16_dot_peak_gflops_per_core"], d["bf16_tile_peak_gflops_per_core"],
                          d["bf16_backend"])
    if tile is not None:
        return (f"{tile} GFLOP/s per core (AMX tdpbf16ps tiles); vdpbf16ps dot products: "
                f"{dot if dot is not None else 'none'} -> bf16 GEMMs run on {backend}")
    if dot is not None:
        amx = "refused by the OS" if "refused" in d["bf16_backend_why"] else "none on this CPU"
        return (f"{dot} GFLOP/s per core (vdpbf16ps dot products); AMX tiles: {amx} "
                f"-> bf16 GEMMs run on {backend}")
    return f"none ({d['bf16_backend_why']})"


def _skinny_line(unit: str | None) -> str:
    from ..kernels.gemm.kernel import SKINNY_UNIT_WORDS
    why = {"dot": "a probe found it at least 2/3 of the fp32 FMA rate here",
           "fma": "a probe found vdpbf16ps under 2/3 of the FMA rate here",
           "tile": "the AMX back-end's, for a bf16 W"}
    if unit not in why:
        return "none (no bf16 back-end)"
    return f"M <= 16 (adaLN) on {SKINNY_UNIT_WORDS[unit]} ({why[unit]})"


def _first_use_entries(registry) -> list[str]:
    """Registry entries that first-use tuning recorded: problem, tile and blocks, GFLOP/s; an
    entry that kept an earlier release's default is said to be tuned again on its next use
    (as matmul does, kernels/gemm/matmul.py's outdated_default)."""
    from ..kernels.gemm.matmul import outdated_default
    from ..kernels.gemm.params import GemmParams, ParamError
    out = []
    for key, e in sorted(registry.entries_for_this_cpu("gemm").items()):
        if e.get("source") != "first-use":
            continue
        p = e.get("params", {})
        kept = e.get("default_kept", e.get("gflops") == e.get("default_gflops"))
        try:
            earlier = outdated_default((GemmParams.from_dict(p), e), e.get("threads", 1))
        except (ParamError, KeyError, TypeError):
            earlier = False             # (an invalid entry: lookups ignore it too)
        how = ("an earlier default kept: tuned again on its next use" if earlier
               else f"ATen faster ({e.get('torch_gflops')} GFLOP/s): install() leaves it to ATen"
               if e.get("aten_faster") else "default kept" if kept else "candidate won")
        if e.get("c_fp32"):             # (raced into an fp32 C, ATen's product cast into it)
            how += "; raced into an fp32 C"
        if e.get("w_fp32"):             # (raced on an fp32 weight, ATen's contender casting it)
            how += "; raced on an fp32 weight"
        if e.get("calls_ahead") is not None:    # (first_use.expect_calls: raced again by a longer job)
            how += f"; candidates left out for a job of {e['calls_ahead']} calls"
        ways = f"{p.get('jc_ways', 1)}x{p.get('ic_ways', 1)}x{p.get('jr_ways', 1)}"
        # (A from its rows: entries that differ only by it would read the same otherwise)
        bound = f" (N <= {p['a_direct_n']})" if p.get("a_direct_n") else ""
        direct = f" a_direct{bound}" if p.get("a_direct") else ""
        out.append(f"{key}: {p.get('mr')}x{p.get('nr')} kc {p.get('kc')} mc {p.get('mc')} "
                   f"nc {p.get('nc')}{' a_outer' if p.get('a_outer') else ''}{direct} ways {ways}, "
                   f"{e.get('gflops')} GFLOP/s ({how}; default {e.get('default_gflops')})")
    return out


def cmd_export(args) -> int:
    from ..tune.export import export
    m = export(args.out, include_defaults=not args.no_defaults)
    print(f"autohc: exported {len(m['kernels'])} kernel(s) to {args.out}/ "
          f"(autohc_kernels.h, manifest.json, kernels/)")
    return 0


def _check_results_args(args) -> Path | None:
    """--results' folder, --page and --readme, checked before anything is written; returns
    the README (None: --readme none)."""
    import os
    from ..dit.data import InputError
    from .argtypes import command_error
    if not Path(args.results).is_dir():
        command_error("report", f"argument --results: no folder {args.results}")
    if Path(args.page).exists() and not os.access(args.page, os.W_OK):
        command_error("report", f"argument --page: {args.page!r} is not writable")
    if args.readme == "none":
        return None
    readme = Path(args.readme)
    if not readme.is_file():
        raise InputError(f"{readme}: {'a folder' if readme.is_dir() else 'no such file'}, not a README "
                         "with results blocks (--readme PATH, or none to leave the README)")
    if not os.access(readme, os.R_OK | os.W_OK):
        raise InputError(f"{readme}: cannot read and rewrite it (--readme none leaves the README)")
    return readme


def cmd_report(args, parser) -> int:
    from ..dit.data import InputError
    from .argtypes import command_error
    if args.results is not None:
        from ..bench.results_md import render
        readme = _check_results_args(args)
        try:
            wrote = render(args.results, args.page, readme)
        except ValueError as e:         # a README without the blocks, a file not a result: nothing written
            raise InputError(str(e)) from None
        print(f"autohc: rendered {', '.join(map(str, wrote))} from {args.results}/")
        return 0
    from ..tune import StorageError, open_storage
    from ..tune.report import report
    if args.storage is not None:        # a bad URL: exit 2 before --out is made
        try:
            open_storage(args.storage)
        except StorageError as e:
            command_error("report", str(e))
    paths = report(args.out, args.storage)
    print(f"autohc: wrote {len(paths)} plot(s) to {args.out}/")
    return 0


def cmd_cache(args) -> int:
    import hashlib
    import shutil

    from ..build import cache_dir, cache_entries
    entries = cache_entries()
    if args.action == "clear":
        shutil.rmtree(cache_dir() / "kernels", ignore_errors=True)
        shutil.rmtree(cache_dir() / "objects", ignore_errors=True)     # (the code they link)
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
