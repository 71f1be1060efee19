"""The `autohc` command line: help, bad input (exit 2, one line), info, bench gemm --json."""
import json
import os
import subprocess
import sys

import pytest


def autohc(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "autohc.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "COLUMNS": "120"})


def test_help_teaches():
    r = autohc("--help")
    assert r.returncode == 0 and "bench" in r.stdout and "examples:" in r.stdout
    r = autohc("bench", "gemm", "--help")
    assert r.returncode == 0 and "--threads" in r.stdout and "interleaved" in r.stdout


@pytest.mark.parametrize("args", [
    ["bench", "gemm", "--threads", "0"],
    ["bench", "gemm", "--threads", "two"],
    ["bench", "gemm", "--model", "dit-xxl"],
    ["bench", "gemm", "--images", "-1"],
    ["frobnicate"],
    [],
])
def test_bad_arguments_exit_2_with_a_message(args):
    r = autohc(*args)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("autohc")
    assert r.stdout == ""


def test_info_json():
    r = autohc("info", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["isa"] in ("avx512", "avx2", "portable")
    assert info["cores"] >= 1 and len(info["fingerprint"]) == 16
    assert info["fma_peak_gflops_per_core"] > 0


def test_bench_gemm_json_small():
    r = autohc("bench", "gemm", "--model", "dit-s", "--images", "1", "--repeats", "3", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["wait_policy"] == "passive" and res["threads"] == 1
    assert len(res["rows"]) == 15
    for row in res["rows"]:
        for key in ("gflops", "torch_gflops", "numpy_gflops", "speedup_vs_torch", "speedup_vs_numpy"):
            assert row[key] > 0
        assert row["speedup_vs_torch"] == pytest.approx(row["gflops"] / row["torch_gflops"], rel=0.02)
    assert res["geomean_speedup_vs_torch"] > 0 and res["geomean_speedup_vs_numpy"] > 0
