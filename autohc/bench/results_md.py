"""`autohc report --results`: the per-CPU results tables of docs/results.md and the README,
rendered from the files `--save` wrote (autohc/bench/results.py). Deterministic: the same
files give the same text, so a test re-renders them and compares with what is committed.

Every figure stands beside its CPU, the code version it was measured on, the date and the
command that reproduces it.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

from .results import load

BEGIN, END = "<!-- results:{name}:begin -->", "<!-- results:{name}:end -->"
NOTE = "<!-- rendered by `autohc report --results` from results/; edit the files, not this -->"
README_BLOCKS = ("table", "digits", "fidelity")


def cpu_title(c: dict) -> str:
    fam = f"family {c['family']} model {c['model_number']}" if c.get("family") is not None else c["arch"]
    return f"{c['model']} ({c['vendor']}, {fam}, `{c['microarch']}`), {c['cores']} cores"


def ran_under(r: dict) -> str:
    """Where a result ran under another kernel entry than its CPU's heading names."""
    return f"run under the `{r['cpu']['microarch']}` entry"


def cpu_features(c: dict) -> str:
    return (f"fp32 back-end {c['isa']}, bf16 back-end {c['bf16_isa']}; ISA flags "
            f"{', '.join(c['flags'])}; fingerprint `{c['fingerprint']}`")


def _f(x, digits: int = 2) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _range(xs, digits: int = 1, unit: str = "") -> str:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return "—"
    lo, hi = min(xs), max(xs)
    return f"{lo:.{digits}f}{unit}" if f"{lo:.{digits}f}" == f"{hi:.{digits}f}" else \
        f"{lo:.{digits}f}-{hi:.{digits}f}{unit}"


def _token(rows):
    return [w for w in rows if w["name"] != "adaLN"]


_AUTOCAST_NAMES = {"stock": "stock fp32", "stock-bf16": "stock autocast",
                   "compiled-bf16": "compiled autocast"}


def caches_words(g: dict, lead: str = ", caches ") -> str:
    """how a `bench gemm` run timed: cold caches, operands in huge pages (warm runs with torch's
    pages and older results: nothing)"""
    c = g.get("caches", "")
    return (lead + c if c.startswith("cold") else "") + (", operands in huge pages" if g.get("pages") == "huge" else "")


def summaries(r: dict) -> list[tuple[str, str]]:
    """(what, figure) lines of one saved result: the short form for the tables."""
    res, bench = r["result"], r["bench"]
    if bench == "gemm":
        out = []
        for g in res:
            tok = _token(g["rows"])
            if g.get("dtype") == "bf16":
                out.append((f"{g['model']} GEMMs bf16 ({g['bf16_isa']}), {g['threads']} thread(s)" + caches_words(g),
                            f"geomean **{_f(g['geomean_speedup_vs_torch'])}x torch bf16 (oneDNN), "
                            f"{_f(g['geomean_speedup_vs_fp32'])}x the faster fp32 library**; token GEMMs "
                            f"{_range([w['gflops'] for w in tok])} GFLOP/s, "
                            f"{_range([w['pct_peak'] for w in tok])} % of the bf16 peak "
                            f"({g['peak_gflops_per_core']} GFLOP/s per core)"))
            else:
                out.append((f"{g['model']} GEMMs fp32 ({g['isa']}), {g['threads']} thread(s)" + caches_words(g),
                            f"geomean **{_f(g['geomean_speedup_vs_torch'])}x torch (MKL), "
                            f"{_f(g['geomean_speedup_vs_numpy'])}x numpy (OpenBLAS)**; token GEMMs "
                            f"{_range([w['gflops'] for w in tok])} GFLOP/s, "
                            f"{_range([w['pct_peak'] for w in tok])} % of the FMA peak "
                            f"({g['peak_gflops_per_core']} GFLOP/s per core)"))
        return out
    if bench == "step" and res.get("bf16_speedups"):
        t, pk = res["step_s"], res.get("pct_bf16_peak", {})
        ratios: dict[str, list[str]] = {}       # "autohc-bf16 vs stock-bf16": 1.19 -> per mode
        for key, v in res["bf16_speedups"].items():
            mode, base = key.split(" vs ", 1)
            ratios.setdefault(mode, []).append(f"{_f(v)}x {_AUTOCAST_NAMES.get(base, base)}")
        figure = "; ".join(f"{m} **{', '.join(ratios[m])}** ({t[m]:.3f} s per step, "
                           f"{_f(pk.get(m), 1)} % of the bf16 peak)" for m in _step_order(t) if m in ratios)
        figure += " (" + ", ".join(f"{m} {t[m]:.3f} s" for m in _step_order(t) if m not in ratios) + ")"
        return [(f"{res['model']} training step bf16 (torch.autocast), batch {res['batch']}, "
                 f"{res['threads']} threads", figure)]
    if bench == "step":
        t, pct = res["step_s"], res["pct_peak"]
        modes = _step_order(t)
        base = ", ".join(f"{m} {t[m]:.3f}" for m in ("stock", "compiled") if m in t)
        if "autohc" in t:
            figure = (f"autohc **{_f(res.get('speedup_vs_stock'))}x stock, "
                      f"{_f(res.get('speedup_vs_compiled'))}x torch.compile** ({t['autohc']:.3f} s per "
                      f"step vs {base or '—'}; {pct['autohc']:.1f} % of the FMA peak)")
        else:
            figure = ", ".join(f"{m} {t[m]:.3f} s per step ({pct[m]:.1f} % of the FMA peak)" for m in modes)
        if "autohc+compile" in t:
            figure += (f"; autohc+compile {_f(res.get('autohc_compile_speedup_vs_stock'))}x / "
                       f"{_f(res.get('autohc_compile_speedup_vs_compiled'))}x "
                       f"({t['autohc+compile']:.3f} s)")
        return [(f"{res['model']} training step fp32, batch {res['batch']}, {res['threads']} threads", figure)]
    if bench == "ops":
        rows = res["rows"]
        line = ", ".join(f"{w['name']} {w['speedup']:.2f}x" for w in rows)
        what = ("bf16 attention vs torch's bf16 flash attention" if res.get("dtype") == "bf16"
                else "fused operators vs torch eager")
        out = [(f"{what}, {res['threads']} threads",
                f"{line} (copy bandwidth {res['bandwidth_gbps']:.1f} GB/s)")]
        if res.get("adamw_ms"):
            a = res["adamw_ms"]
            out.append((f"AdamW, {res['adamw_params']} parameters" if "adamw_params" in res else "AdamW",
                        f"autohc {a['autohc']:.1f} ms, torch fused {a['torch_fused']:.1f} ms, "
                        f"foreach {a['torch_foreach']:.1f} ms"))
        return out
    if bench == "train":
        return [(f"`autohc train`: {res['model']}, {res['steps']} steps of batch {res['batch']}, "
                 f"{res['threads']} threads",
                 f"**{res['seconds']:.0f} s** of training: {res['steps_per_s']:.2f} steps/s, "
                 f"{res['images_per_s']:.0f} images/s; final loss {res['final_loss']:.4f}, "
                 f"peak RSS {res['peak_rss_gb']:.2f} GB")]
    if bench == "compare":
        rs = res["runs"]
        return [(f"fidelity: {' vs '.join(str(w['precision']) for w in rs)}, {rs[0]['model']}, "
                 f"{rs[0]['steps']} steps, seed {rs[0]['seed']}",
                 "; ".join(f"{w['precision']}: final loss {w['final_loss']:.4f}, class match "
                           f"**{100 * w['class_match']:.1f} %**, Fréchet distance **{w['frechet']:.3f}**"
                           for w in rs))]
    if bench == "memory":
        what = f"AutoMem ({res['tier']} tier), {res['model']} batch {res['batch']}"
        if res["baseline_out_of_memory"]:
            return [(what, f"without AutoMem out of memory; with it peak RSS {res['automem_peak_gb']:.2f} GB, "
                           f"step {res['automem_step_s']:.3f} s")]
        return [(what, f"peak RSS {res['baseline_peak_gb']:.2f} -> {res['automem_peak_gb']:.2f} GB "
                       f"(**{-100 * res['peak_reduction']:.1f} %**), step {res['baseline_step_s']:.3f} -> "
                       f"{res['automem_step_s']:.3f} s (**{100 * res['step_overhead']:+.1f} %**, median of "
                       f"{res['rounds']} pairs); losses within {res['loss_rel_diff']:.1e}")]
    if bench == "parallel":
        return [(f"DP vs DP+TP vs CFTP, {res['model']} batch {res['batch']}",
                 ", ".join(f"{w['strategy']} {w['step_s']:.3f} s/step, {w['peak_mem_gb']:.2f} GB"
                           for w in res["rows"]))]
    if bench == "sample" and res.get("speedups"):
        t = res["step_s"]
        ratios: dict[str, list[str]] = {}
        for key, v in res["speedups"].items():
            mode, base = key.split(" vs ", 1)
            ratios.setdefault(mode, []).append(f"{_f(v)}x {_SAMPLE_NAMES.get(base, base)}")
        figure = "; ".join(f"{m} **{', '.join(ratios[m])}** ({res['images_per_s'][m]:.3f} images/s, "
                           f"{t[m]:.3f} s per sampler step)" for m in sorted(ratios))
        figure += " (" + ", ".join(f"{m} {t[m]:.3f} s" for m in sorted(t) if m not in ratios) + ")"
        return [(f"{res['model']} sampling, batch {res['batch']} (x2 for guidance), "
                 f"{res['threads']} threads, bf16 on {res.get('bf16_unit')}", figure)]
    return [(bench, "(no summary for this bench)")]


# the sample bench's baselines in words
_SAMPLE_NAMES = {"diffusers": "diffusers fp32", "diffusers-bf16": "diffusers under autocast",
                 "diffusers-bf16+compile": "diffusers compiled (max-autotune, frozen) under autocast"}


def _step_order(times: dict) -> list[str]:
    """The modes of a step result in bench/step.py's order (the saved JSON's keys are sorted)."""
    from .step import MODES
    return [m for m in MODES if m in times] + sorted(set(times) - set(MODES))


def _code(r: dict) -> str:
    return f"`{r['code_version']}`, {r['date']}"


def _cmd(r: dict) -> str:
    return "`" + r["command"].replace("|", "\\|") + "`"


def _by_cpu(results):
    out: dict[str, list[dict]] = {}
    for r in results:
        out.setdefault(r["cpu"]["fingerprint"], []).append(r)
    return out


def newest_cpu(rs) -> dict:
    """The CPU record of the newest of one CPU's results: it names the kernel entry
    (configs/<arch>.yaml) the current code picks for it; older results say theirs."""
    return max(rs, key=lambda r: (r["date"], r["file"]))["cpu"]


def latest(results) -> list[dict]:
    """The newest result of each (CPU, command): what the current code gives."""
    keep: dict[tuple, dict] = {}
    for r in results:       # load() sorts by date, so the last one of a key wins
        keep[(r["cpu"]["fingerprint"], r["command"])] = r
    return sorted(keep.values(), key=lambda r: (r["cpu"]["fingerprint"], r["bench"] != "gemm",
                                                r["bench"], r["command"]))


def readme_table(results) -> str:
    """Per CPU, the newest GEMM, training-step and sampling results: one line naming the CPU,
    then a table of figures with their code version, date and command."""
    rows = [r for r in latest(results) if r["bench"] in ("gemm", "step", "sample")]
    if not rows:
        return "(no saved results yet)"
    out = []
    for fp, rs in _by_cpu(rows).items():
        out += [f"**{cpu_title(newest_cpu(rs))}** (fingerprint `{fp}`):", "",
                "| what | result | code, date | command |", "|---|---|---|---|"]
        out += [f"| {what} | {figure} | {_code(r)} | {_cmd(r)} |" for r in rs for what, figure in summaries(r)]
        out.append("")
    return "\n".join(out).rstrip()


def readme_digits(results) -> str:
    rows = [r for r in latest(results) if r["bench"] == "train" and "--data digits" in r["command"]]
    if not rows:
        return "- (no saved digits run yet: `autohc train --data digits --steps 2000 --save`)"
    out = []
    for r in rows:
        res = r["result"]
        out.append(f"- {cpu_title(r['cpu'])}: **{res['seconds']:.0f} s** of training "
                   f"({res['steps_per_s']:.2f} steps/s), code {_code(r)}: {_cmd(r)}")
    return "\n".join(out)


def readme_fidelity(results) -> str:
    rows = [r for r in latest(results) if r["bench"] == "compare"]
    if not rows:
        return "(no saved comparison yet: `autohc compare runs/digits runs/digits-bf16 --save`)"
    out = []
    for r in rows:
        res = r["result"]
        out += [f"{cpu_title(r['cpu'])}, code {_code(r)}: {_cmd(r)} ({res['per_class'] * 10} samples "
                f"each, {res['sampler']} {res['sample_steps']} steps, cfg {res['cfg']}; smoothed loss "
                f"curves within {100 * res['smoothed_loss_max_rel_diff']:.1f} % of each other):", "",
                "| run | precision | final loss (mean of last 100 steps) | class match | Fréchet distance |",
                "|---|---|--:|--:|--:|"]
        out += [f"| `{w['run']}` | {w['precision']} | {w['final_loss']:.4f} | {100 * w['class_match']:.1f} % "
                f"| {w['frechet']:.3f}"
                + (f" ({100 * w['frechet_rel_diff']:+.1f} %)" if "frechet_rel_diff" in w else "") + " |"
                for w in res["runs"]]
        out.append("")
    return "\n".join(out).rstrip()


def _details(r: dict) -> list[str]:
    """The full table of one result, as the bench prints it."""
    res, bench = r["result"], r["bench"]
    out: list[str] = []
    if bench == "gemm":
        for g in res:
            bf16 = g.get("dtype") == "bf16"
            out += ["", f"{g['model']}, {g['threads']} thread(s), "
                        + (f"bf16 on {g['bf16_isa']}" if bf16 else f"fp32 on {g['isa']}")
                        + f", peak {g['peak_gflops_per_core']} GFLOP/s per core" + caches_words(g, "; caches ")
                        + (f"; first-use tuning {g['first_use_tuning_s']:.1f} s before timing"
                           if g.get("first_use_tuning_s") else "") + ":", ""]
            if bf16:
                out += ["| GEMM | layout | M | K | N | config | autohc bf16 GFLOP/s | % peak | torch bf16 "
                        "| torch fp32 | numpy fp32 | x torch bf16 | x best fp32 |",
                        "|---|---|--:|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|"]
                out += [f"| {w['name']} | {w['layout']} | {w['M']} | {w['K']} | {w['N']} | {w['config']} "
                        f"| {_f(w['gflops'], 1)} | {_f(w['pct_peak'], 1)} | {_f(w['torch_gflops'], 1)} "
                        f"| {_f(w['torch_fp32_gflops'], 1)} | {_f(w['numpy_gflops'], 1)} "
                        f"| {_f(w['speedup_vs_torch'])} | {_f(w['speedup_vs_fp32'])} |" for w in g["rows"]]
            else:
                out += ["| GEMM | layout | M | K | N | config | autohc GFLOP/s | % peak | torch | numpy "
                        "| x torch | x numpy |", "|---|---|--:|--:|--:|---|--:|--:|--:|--:|--:|--:|"]
                out += [f"| {w['name']} | {w['layout']} | {w['M']} | {w['K']} | {w['N']} | {w['config']} "
                        f"| {_f(w['gflops'], 1)} | {_f(w['pct_peak'], 1)} | {_f(w['torch_gflops'], 1)} "
                        f"| {_f(w['numpy_gflops'], 1)} | {_f(w['speedup_vs_torch'])} "
                        f"| {_f(w['speedup_vs_numpy'])} |" for w in g["rows"]]
    elif bench == "step":
        peaks = sorted((res.get("peak_gflops_by_mode") or {}).values())
        peak = (f"{res['peak_gflops']} GFLOP/s" if not peaks or peaks[-1] - peaks[0] < 1 else
                f"{peaks[0]}-{peaks[-1]} GFLOP/s probed around each mode's steps (autohc's "
                f"{res['peak_gflops']})")
        out += ["", f"{res['step_gflop']} GFLOP per step in GEMMs and attention, FMA peak "
                    f"{peak}, median of {res['timed_steps']} steps; losses within "
                    f"{res['max_loss_rel_diff']:.1e} relative of stock; peak RSS {res['peak_rss_gb']:.2f} GB"
                + (f"; first-use tuning {res['first_use_race_s']:.1f} s of races" if res.get("first_use_race_s")
                   else "")
                + (f"; one thread's copy bandwidth {res['copy_gbps']['before']:.1f} GB/s before the steps, "
                   f"{res['copy_gbps']['after']:.1f} after" if res.get("copy_gbps") else "") + ":", "",
                "| mode | s/step | GFLOP/s | % of peak | spread |", "|---|--:|--:|--:|--:|"]
        out += [f"| {m} | {t:.3f} | {res['gflops'][m]:.1f} | {res['pct_peak'][m]:.1f} "
                f"| {_f(res['spread_pct'].get(m), 1)} % |" for m, t in
                ((m, res["step_s"][m]) for m in _step_order(res["step_s"]))]
    elif bench == "sample" and res.get("step_s"):
        out += ["", f"{res['model']}, batch {res['batch']} (x2 for guidance {res.get('cfg')}), "
                    f"{res['threads']} threads, bf16 on {res.get('bf16_unit')}; median of {res['timed']} "
                    f"sampler steps, an image = {res['sample_steps']} steps"
                + (f"; first-use tuning {res['first_use_race_s']:.1f} s of races, untimed"
                   if res.get("first_use_race_s") else "") + ":", "",
                "| mode | s/step | s/image | images/s | spread |", "|---|--:|--:|--:|--:|"]
        out += [f"| {m} | {res['step_s'][m]:.3f} | {res['s_per_image'][m]:.2f} | {res['images_per_s'][m]:.3f} "
                f"| {_f(res['spread_pct'].get(m), 1)} % |" for m in sorted(res["step_s"])]
    elif bench == "ops":
        out += ["", f"copy bandwidth {res['bandwidth_gbps']:.1f} GB/s in the same run:", "",
                "| op | shape | ms | torch ms | speedup | GB/s | % of copy bandwidth |",
                "|---|---|--:|--:|--:|--:|--:|"]
        out += [f"| {w['name']} | {w['shape']} | {w['ms']:.2f} | {w['torch_ms']:.2f} | {w['speedup']:.2f}x "
                f"| {w['gbps']:.1f} | {w['pct_bandwidth']:.0f} |" for w in res["rows"]]
    return out


def results_page(results) -> str:
    lines = ["# Results on the CPUs met", "", NOTE, "",
             "Every figure here is rendered by `autohc report --results` from a file under",
             "[`results/`](../results) that a bench saved with `--save`: the CPU, the code version",
             "(`git describe`; `+dirty`: uncommitted changes in the code), the date and the command",
             "stand beside it. How they are measured: [benchmarks.md](benchmarks.md). Figures of",
             "earlier code, typed by hand before results were data: [history.md](history.md).", ""]
    if not results:
        lines.append("No saved results yet.")
    for fp, rs in _by_cpu(results).items():
        c = newest_cpu(rs)
        lines += [f"## {cpu_title(c)}", "", cpu_features(c), "",
                  "| what | result | code, date | command |", "|---|---|---|---|"]
        for r in latest(rs):
            lines += [f"| {what} | {figure} | {_code(r)} | {_cmd(r)} |" for what, figure in summaries(r)]
        lines.append("")
        for r in sorted(rs, key=lambda r: (r["date"], r["file"]), reverse=True):
            lines += [f"### {r['bench']}: {_cmd(r)}", "",
                      f"{_code(r)}, torch {r['torch']}, registry entries at the start "
                      f"{r['registry_entries_at_start']}"
                      + (f", environment {', '.join(f'{k}={v}' for k, v in r['env'].items())}" if r["env"] else "")
                      + (f", {ran_under(r)}" if r["cpu"]["microarch"] != c["microarch"] else "")
                      + f"; file [`results/{r['file']}`](../results/{r['file']})"]
            lines += _details(r)
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def replace_block(text: str, name: str, body: str) -> str:
    """text with the block between name's markers replaced by body (the markers must be there)."""
    begin, end = BEGIN.format(name=name), END.format(name=name)
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"no {begin} ... {end} block")
    return pattern.sub(lambda _m: f"{begin}\n{NOTE}\n{body}\n{end}", text, count=1)


def render(folder: Path | str, page: Path | str, readme: Path | str | None) -> list[Path]:
    """Writes page (docs/results.md) and the README's blocks; returns what it wrote. Both
    texts are made first: a README without its blocks (ValueError) leaves both files as they were."""
    results = load(folder)
    page = Path(page)
    texts = {page: results_page(results)}
    if readme is not None:
        readme = Path(readme)
        text = readme.read_text()
        for name, body in (("table", readme_table(results)), ("digits", readme_digits(results)),
                           ("fidelity", readme_fidelity(results))):
            try:
                text = replace_block(text, name, body)
            except ValueError as e:
                raise ValueError(f"{readme}: {e}") from None
        texts[readme] = text
    page.parent.mkdir(parents=True, exist_ok=True)
    for path, text in texts.items():
        path.write_text(text)
    return list(texts)
