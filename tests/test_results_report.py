"""Results as data (issue 30): `--save` writes a bench's result with what it was measured on,
`autohc report --results` renders the docs' tables from those files, the committed pages are
what the committed files render to, no speed figure stands in README.md or docs/ outside the
rendered blocks (docs/history.md, the marked history, excepted), and every relative link of
the docs resolves."""
from __future__ import annotations

import json
import re
import shutil
import urllib.parse
from pathlib import Path

import pytest

from autohc.bench import results as res
from autohc.bench import results_md

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
# the measured history, kept verbatim and marked as such; results.md is rendered as a whole
NOT_CHECKED_FOR_FIGURES = {"history.md", "results.md"}


def test_committed_pages_are_what_the_results_render(tmp_path):
    """docs/results.md and the README's blocks, re-rendered from results/, equal the committed
    ones: a figure edited by hand, or a result file added without `autohc report --results`,
    fails here."""
    assert list(RESULTS.glob("*/*.json")), "no saved results in results/"
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    results_md.render(RESULTS, tmp_path / "results.md", readme)
    assert (tmp_path / "results.md").read_text() == (ROOT / "docs" / "results.md").read_text(), \
        "docs/results.md differs from `autohc report --results`: run it and commit"
    assert readme.read_text() == (ROOT / "README.md").read_text(), \
        "README.md's results blocks differ from `autohc report --results`: run it and commit"


def test_every_saved_result_is_shown_with_its_cpu_code_and_command():
    page = (ROOT / "docs" / "results.md").read_text()
    readme = (ROOT / "README.md").read_text()
    results = res.load(RESULTS)
    for r in results:
        assert r["command"].startswith("autohc ") and "--save" not in r["command"]
        assert re.fullmatch(r"[0-9a-f]{16}", r["cpu"]["fingerprint"])
        assert f"results/{r['file']}" in page
        # the CPU under the kernel entry its newest result ran (an entry of its own can come
        # later: the model 167 guest went from spr to gnr); an older one says its own
        newest = results_md.newest_cpu([q for q in results if q["cpu"]["fingerprint"] == r["cpu"]["fingerprint"]])
        assert f"## {results_md.cpu_title(newest)}" in page
        if r["bench"] in ("gemm", "step", "sample"):
            assert f"**{results_md.cpu_title(newest)}** (fingerprint" in readme
        if r["cpu"]["microarch"] != newest["microarch"]:
            assert f"{results_md.ran_under(r)}; file [`results/{r['file']}`]" in page
        for what, figure in results_md.summaries(r):
            assert f"| {what} | {figure} | {results_md._code(r)} | {results_md._cmd(r)} |" in page


# a speed figure: a decimal ratio (1.05x), a rate, a time per step or job, a share of a peak
# (protocol settings such as "samples of at least 20 ms" are not figures)
_NUM = r"(?<![\w.])\d+(?:\.\d+)?"
FIGURE = re.compile(
    r"(?<![\w.])\d+\.\d+ ?[x×](?!\w)"                        # a decimal ratio: 1.05x
    rf"|{_NUM} ?(?:[GTM]FLOP/s|[GM]B/s|(?:steps|images|it)/s|s/step)"   # a rate, a time per step
    rf"|(?<!at least ){_NUM} ?ms\b"                           # a time (not a sample's minimum)
    rf"|{_NUM} ?s (?:per step|of training)"
    rf"|{_NUM} ?%\s+of\s+(?:the\s+)?(?:\w+\s+)?peak"          # a share of a peak
    rf"|{_NUM} ?min(?:utes?)?\b")


def _prose(text: str) -> str:
    """text without the rendered blocks, fenced code and inline code spans."""
    text = re.sub(r"<!-- results:(\w+):begin -->.*?<!-- results:\1:end -->", "", text, flags=re.S)
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`]*`", "", text)


def test_figure_pattern_catches_the_old_readme_figures():
    """The check below would have failed on the README before the split."""
    for old in ("about 8 minutes here", "0.90-0.97x MKL", "240-252 GFLOP/s", "2.9 steps/s",
                "1.632 s/step", "89-94 % of peak", "688 s of training", "42.4 GB/s"):
        assert FIGURE.search(old), old
    for fine in ("2000 steps", "8×8 digits", "1152x4608", "batch 64", "DiT-XL/2", "12x32 tile",
                 "1 x 2 x 1", "4 MB chunks", "sd-vae-ft-ema", "samples of at least 20 ms"):
        assert not FIGURE.search(fine), fine


@pytest.mark.parametrize("page", [p for p in PAGES if p.name not in NOT_CHECKED_FOR_FIGURES],
                         ids=lambda p: p.name)
def test_no_speed_figure_outside_rendered_results(page):
    found = [m.group(0) for m in FIGURE.finditer(_prose(page.read_text()))]
    assert not found, f"{page.name}: speed figures not rendered from results/: {found}"


def _anchors(md: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file."""
    out = set()
    for line in md.read_text().splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue                     # http(s), mailto: not checked here
        path, _, anchor = urllib.parse.unquote(target).partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(target)
    assert not bad, f"{page.name}: links that do not resolve: {bad}"


def test_save_writes_atomically_with_what_it_was_measured_on(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOHC_FIRST_USE", "0")
    monkeypatch.setenv("AUTOHC_CACHE_DIR", str(tmp_path / "cache"))      # not recorded
    rec = res.Recorder("gemm", ["bench", "gemm", "--model", "dit-s", "--save", str(tmp_path / "r"),
                                "--json"], tmp_path / "r", 0)
    import datetime
    path = rec.save([{"model": "dit-s", "threads": 1, "rows": []}], threads=1,
                    when=datetime.date(2026, 1, 2))
    fp = res.cpu_record()["fingerprint"]
    assert path == tmp_path / "r" / fp / "2026-01-02-gemm-model-dit-s.json"
    assert [p.name for p in path.parent.iterdir()] == [path.name]      # no temporary left
    r = json.loads(path.read_text())
    assert r["command"] == "autohc bench gemm --model dit-s --json"
    assert r["date"] == "2026-01-02" and r["bench"] == "gemm" and r["threads"] == 1
    assert r["env"].get("AUTOHC_FIRST_USE") == "0" and "AUTOHC_CACHE_DIR" not in r["env"]
    assert r["cpu"]["fingerprint"] == fp and r["code_version"] and r["torch"]
    assert r["result"] == [{"model": "dit-s", "threads": 1, "rows": []}]
    [loaded] = res.load(tmp_path / "r")
    assert loaded["file"] == f"{fp}/2026-01-02-gemm-model-dit-s.json"


def test_file_names_of_long_commands_differ():
    a = res._slug(["--data", "digits", "--steps", "3", "--batch", "8", "--out", "/tmp/run", "--samples-per-class", "0"])
    b = res._slug(["--data", "digits", "--steps", "3", "--batch", "8", "--out", "/tmp/run", "--samples-per-class", "8"])
    assert a != b and len(a) <= 60 and res._slug(["--json"]) == "default"


def test_bench_save_option_on_the_command_line(tmp_path, monkeypatch, capsys):
    """`autohc bench ops --save DIR` saves what the bench returned (the bench itself faked:
    the wiring is under test, not the timing)."""
    from autohc import cli
    from autohc.bench import ops
    fake = {"threads": 1, "images": 1, "bandwidth_gbps": 10.0, "adamw_ms": None,
            "rows": [{"name": "gelu_tanh", "shape": "256x4608", "ms": 1.0, "torch_ms": 2.0,
                      "speedup": 2.0, "gbps": 5.0, "pct_bandwidth": 50.0, "gflops": None}]}
    monkeypatch.setattr(ops, "bench_ops", lambda *a, **k: fake)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", "4")
    assert cli.main(["bench", "ops", "--ops", "gelu_tanh", "--adamw-params", "0", "--json",
                     "--save", str(tmp_path)]) == 0
    [saved] = res.load(tmp_path)
    assert saved["result"] == fake and saved["bench"] == "ops"
    assert saved["command"] == "autohc bench ops --ops gelu_tanh --adamw-params 0 --json"
    assert "result saved to" in capsys.readouterr().err
    # rendered: the figure beside the CPU, code version and command
    page = results_md.results_page([saved])
    assert "gelu_tanh 2.00x" in page and saved["code_version"] in page
    assert "`autohc bench ops --ops gelu_tanh --adamw-params 0 --json`" in page


def test_render_replaces_only_the_marked_blocks(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("before\n<!-- results:table:begin -->\nold\n<!-- results:table:end -->\nmid\n"
                      "<!-- results:digits:begin -->\n<!-- results:digits:end -->\n"
                      "<!-- results:fidelity:begin -->\n<!-- results:fidelity:end -->\nafter\n")
    shutil.copytree(RESULTS, tmp_path / "results")
    results_md.render(tmp_path / "results", tmp_path / "page.md", readme)
    text = readme.read_text()
    assert text.startswith("before\n") and "\nmid\n" in text and text.endswith("after\n")
    assert "\nold\n" not in text and "| what | result | code, date | command |" in text
    once = (tmp_path / "page.md").read_text()
    results_md.render(tmp_path / "results", tmp_path / "page.md", readme)
    assert (tmp_path / "page.md").read_text() == once and readme.read_text() == text
    (readme).write_text("no markers\n")
    with pytest.raises(ValueError, match="results:table"):
        results_md.render(tmp_path / "results", tmp_path / "page.md", readme)


@pytest.mark.parametrize("bench, result, shown", [
    ("memory", {"model": "DiT-B/2", "batch": 16, "tier": "file", "rounds": 2,
                "baseline_out_of_memory": False, "baseline_peak_gb": 5.8, "automem_peak_gb": 3.2,
                "peak_reduction": 0.45, "baseline_step_s": 10.0, "automem_step_s": 11.0,
                "step_overhead": 0.1, "loss_rel_diff": 0.0}, "(**-45.0 %**)"),
    ("parallel", {"model": "DiT-S/2", "batch": 16, "rows": [
        {"strategy": "dp", "step_s": 1.5, "peak_mem_gb": 3.4},
        {"strategy": "cftp", "step_s": 1.25, "peak_mem_gb": 2.5}]}, "cftp 1.250 s/step, 2.50 GB"),
    ("step", {"model": "DiT-S/2", "batch": 8, "threads": 2,
              "step_s": {"stock": 2.0, "stock-bf16": 1.3, "autohc-bf16": 1.1},
              "bf16_speedups": {"autohc-bf16 vs stock-bf16": 1.3 / 1.1, "autohc-bf16 vs stock": 2.0 / 1.1},
              "pct_bf16_peak": {"stock-bf16": 40.0, "autohc-bf16": 50.0}},
     "autohc-bf16 **1.18x stock autocast, 1.82x stock fp32** (1.100 s per step, 50.0 % of the bf16 peak)"),
    ("sample", {"model": "DiT-XL/2", "batch": 4, "threads": 2, "bf16_unit": "amx",
                "step_s": {"diffusers-bf16": 1.8, "diffusers-bf16+compile": 1.1, "autohc-bf16": 1.0},
                "images_per_s": {"diffusers-bf16": 0.044, "diffusers-bf16+compile": 0.073, "autohc-bf16": 0.08},
                "speedups": {"autohc-bf16 vs diffusers-bf16": 1.8, "autohc-bf16 vs diffusers-bf16+compile": 1.1}},
     "autohc-bf16 **1.80x diffusers under autocast, 1.10x diffusers compiled (max-autotune, frozen) under "
     "autocast** (0.080 images/s, 1.000 s per sampler step) (diffusers-bf16 1.800 s, diffusers-bf16+compile 1.100 s)"),
])
def test_summaries_of_the_other_benches(bench, result, shown):
    r = {"bench": bench, "result": result}
    [(what, figure)] = results_md.summaries(r)
    assert shown in figure and result["model"] in what


def test_a_step_result_shows_the_copy_bandwidth_it_ran_beside():
    """bench step's details name one thread's copy bandwidth before and after the steps (the
    machine's state then); results saved before it was recorded render as they did."""
    res = {"step_gflop": 290.65, "peak_gflops": 550.0, "timed_steps": 8, "max_loss_rel_diff": 0.0,
           "peak_rss_gb": 4.4, "step_s": {"stock": 1.6, "autohc": 0.74},
           "gflops": {"stock": 181.7, "autohc": 392.8}, "pct_peak": {"stock": 33.0, "autohc": 71.4},
           "spread_pct": {"stock": 1.0, "autohc": 2.0}}
    r = {"bench": "step", "result": res, "command": "autohc bench step", "code_version": "abc1234",
         "date": "2026-11-26", "torch": "2.13.0", "registry_entries_at_start": 0, "env": {}, "file": "x.json"}
    assert not any("copy bandwidth" in line for line in results_md._details(r))
    res["copy_gbps"] = {"before": 38.1, "after": 36.0}
    [line] = [ln for ln in results_md._details(r) if "copy bandwidth" in ln]
    assert "one thread's copy bandwidth 38.1 GB/s before the steps, 36.0 after:" in line
    assert "FMA peak 550.0 GFLOP/s," in line        # one peak: as before
    res["peak_gflops_by_mode"] = {"stock": 540.2, "autohc": 550.0}
    [line] = [ln for ln in results_md._details(r) if "copy bandwidth" in ln]
    assert "FMA peak 540.2-550.0 GFLOP/s probed around each mode's steps (autohc's 550.0)," in line
