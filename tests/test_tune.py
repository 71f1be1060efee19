"""The tuner: search space, registry, resume after kill -9, correctness gate, export."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import optuna
import pytest
import torch

import autohc
from autohc.hw import cpu
from autohc.tune import registry
from autohc.kernels.gemm.params import GemmParams, default_params
from autohc.kernels.gemm.problem import GemmProblem
from autohc.tune import space as space_mod
from autohc.tune import gemm as tuner

ISA = cpu.best_isa()


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOHC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("AUTOHC_REGISTRY", raising=False)
    return tmp_path


def test_space_covers_the_default_and_yaml_drives_it():
    for isa in ("avx2", "avx512", "portable"):
        for threads in (1, 2, 4):
            d = default_params(isa, threads)
            trial = optuna.trial.FixedTrial(space_mod.as_suggestions(d, isa))
            assert space_mod.suggest_params(trial, isa, threads) == d
    assert space_mod.geometries(2) == ["1x1x2", "1x2x1", "2x1x1"]
    assert all(eval(g.replace("x", "*")) == 6 for g in space_mod.geometries(6))


def test_multiple_of_rounds_dependent_parameters():
    vals = space_mod.as_suggestions(default_params("avx2"), "avx2") | {"tile": "5x16", "mc": 48,
                                                                       "nc": 1024}
    p = space_mod.suggest_params(optuna.trial.FixedTrial(vals), "avx2", 1)
    assert (p.mr, p.nr, p.mc, p.nc) == (5, 16, 50, 1024)


def test_m_bucket_and_nearest_lookup(fresh_cache):
    assert registry.m_bucket(2048) == 2048 and registry.m_bucket(1400) == 1024
    assert registry.m_bucket(1) == 1 and registry.m_bucket(3000) == 4096
    p = default_params(ISA, 1)
    registry.record("gemm", "NT", 64, 96, 512, 1, p, 10.0, 5.0)
    hit = registry.lookup("gemm", "NT", 64, 96, 2048, 1)
    assert hit is not None and hit[0] == p                  # nearest bucket
    assert registry.lookup("gemm", "NT", 64, 96, 2048, 1, exact=True) is None
    assert registry.lookup("gemm", "NN", 64, 96, 512, 1) is None
    assert registry.lookup("gemm", "NT", 64, 96, 512, 2) is None


def test_corrupt_registry_is_ignored_then_replaced(fresh_cache):
    path = registry.registry_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{ definitely not json")
    with pytest.warns(RuntimeWarning, match="corrupt registry"):
        assert registry.lookup("gemm", "NT", 64, 96, 512, 1) is None
    # matmul still works (default kernel), with the same result
    a, b = torch.randn(20, 30), torch.randn(30, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.allclose(autohc.matmul(a, b), a @ b, atol=1e-4)
    with pytest.warns(RuntimeWarning, match="saved as"):
        registry.record("gemm", "NT", 64, 96, 512, 1, default_params(ISA, 1), 10.0, 5.0)
    assert list(path.parent.glob("registry.json.corrupt-*"))    # the old bytes are kept
    assert json.loads(path.read_text())["version"] == registry.VERSION


def test_foreign_and_invalid_entries_are_ignored(fresh_cache):
    p = default_params(ISA, 1)
    registry.record("gemm", "NT", 64, 96, 512, 1, p, 10.0, 5.0)
    data = json.loads(registry.registry_path().read_text())
    fp = cpu.detect().fingerprint
    (key, entry), = data["entries"][fp].items()
    entry["fingerprint"] = "someothercpu0000"           # copied from another machine
    data["entries"][fp][key.replace("K64", "K65")] = dict(entry, fingerprint=fp, params={"mr": 99})
    data["entries"][fp][key] = entry
    registry.registry_path().write_text(json.dumps(data))
    registry.forget()               # written behind its back: seen within RECHECK_S, now at once
    with pytest.warns(RuntimeWarning, match="ignored"):
        assert registry.lookup("gemm", "NT", 64, 96, 512, 1) is None
    with pytest.warns(RuntimeWarning, match="invalid registry entry"):
        assert registry.lookup("gemm", "NT", 65, 96, 512, 1) is None


def test_tune_records_best_and_second_call_is_instant(fresh_cache):
    prob = GemmProblem("t", "NT", 96, 64, 80)
    r = tuner.tune_problem(prob, 1, trials=3, timeout=120)
    assert not r.from_registry and r.trials == 3 and r.gflops > 0 and r.torch_gflops > 0
    t0 = time.perf_counter()
    r2 = tuner.tune_problem(prob, 1, trials=3, timeout=120)
    assert r2.from_registry and time.perf_counter() - t0 < 2.0
    assert r2.params == r.params
    # autohc.matmul now runs the tuned configuration for this problem
    x, w = prob.operands()
    assert autohc.kernels.gemm.matmul.tuned_params(96, 64, 80, x.stride(), w.stride(), 1) == r.params


def test_trials_past_skinny_m_are_built_without_the_skinny_paths(fresh_cache):
    """M past every skinny_m the space offers: the skinny paths would never run, so each trial
    is built (and recorded) without them."""
    from autohc.kernels.gemm.kernel import default_kernel_params
    assert default_kernel_params(1).skinny_m > 0          # (trial 0 is the default: it had them)
    r = tuner.tune_problem(GemmProblem("t", "NT", 97, 64, 80), 1, trials=2, timeout=120)
    study = optuna.load_study(study_name=r.study, storage=tuner.open_storage())
    tried = [GemmParams.from_dict(t.user_attrs["params"]) for t in study.trials if "params" in t.user_attrs]
    assert len(tried) == 2 and all(p.skinny_m == 0 for p in tried)


def test_wrong_kernel_can_never_win(fresh_cache, monkeypatch):
    """Candidates other than the default compute garbage but claim a huge speed: every one
    of them must fail the correctness gate, and the default must be what is recorded."""
    import dataclasses
    default = default_params(ISA, 1)
    from autohc.tune import pipeline, verify
    real_matmul = verify.matmul
    # (trial 0 is the default built without the skinny paths: M 64 never takes them)
    is_default = lambda p: dataclasses.replace(p, skinny_m=0) == dataclasses.replace(default, skinny_m=0)  # noqa: E731

    def buggy_matmul(a, b, *, out=None, params=None, **kw):
        res = real_matmul(a, b, out=out, params=params, **kw)
        if not is_default(params):
            res[0, 0] += 1.0                              # a wrong element
        return res
    monkeypatch.setattr(verify, "matmul", buggy_matmul)
    problem = GemmProblem("w", "NT", 64, 48, 40)
    one_gflops = problem.flops / 1e9                      # seconds for 1 GFLOP/s
    monkeypatch.setattr(tuner, "measure", lambda p, params, t: pipeline.Measured(
        params, one_gflops * (1e-9 if not is_default(params) else 1.0), one_gflops, 0.0))
    r = tuner.tune_problem(problem, 1, trials=5, timeout=300)
    # the recorded figure is the final race's (the default alone there), not the stub's
    assert r.params == default and r.gflops > 0 and r.default_gflops == r.gflops
    study = optuna.load_study(study_name=r.study, storage=tuner.open_storage())
    states = [t.state for t in study.trials]
    assert states[0] == optuna.trial.TrialState.COMPLETE
    assert all(s != optuna.trial.TrialState.COMPLETE for s in states[1:])
    assert registry.lookup("gemm", "NT", 48, 40, 64, 1)[0] == default


RUN_TUNE = textwrap.dedent("""
    from autohc.kernels.gemm.problem import GemmProblem
    from autohc.tune import gemm as tuner
    r = tuner.tune_problem(GemmProblem("k", "NT", 128, 96, 112), 1, trials=int(__import__("sys").argv[1]),
                           timeout=600)
    print(r.trials)
""")


OPEN_STORAGE = "import sys; from autohc.tune import gemm as t; t.open_storage(sys.argv[1])"


def test_processes_opening_a_new_storage_at_once_all_succeed(tmp_path):
    # the schema of a new database is created by whichever process gets there first
    for rep in range(2):
        url = f"sqlite:///{tmp_path / f'race{rep}.db'}"
        procs = [subprocess.Popen([sys.executable, "-c", OPEN_STORAGE, url],
                                  stderr=subprocess.PIPE, text=True) for _ in range(4)]
        errors = [p.communicate(timeout=120)[1] for p in procs]
        assert all(p.returncode == 0 for p in procs), "\n".join(errors)
        assert optuna.get_all_study_names(tuner.open_storage(url)) == []


def test_resume_after_kill_9(fresh_cache):
    env = {**os.environ, "AUTOHC_CACHE_DIR": str(fresh_cache)}
    proc = subprocess.Popen([sys.executable, "-c", RUN_TUNE, "200"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    storage = None
    name = tuner.study_name(GemmProblem("k", "NT", 128, 96, 112), 1, ISA)
    done_before = 0
    deadline = time.time() + 240
    try:
        while time.time() < deadline:
            time.sleep(1.0)
            try:
                storage = storage or tuner.open_storage()
                study = optuna.load_study(study_name=name, storage=storage)
                done_before = sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
            except KeyError:
                continue
            if done_before >= 3:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert done_before >= 3, "the tune made no progress before the kill"
    study = optuna.load_study(study_name=name, storage=storage)
    kept = [t.number for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(kept) >= done_before
    total = len(study.trials) + 2
    out = subprocess.run([sys.executable, "-c", RUN_TUNE, str(total)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    study = optuna.load_study(study_name=name, storage=storage)
    after = [t.number for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert set(kept) <= set(after) and len(after) >= len(kept) + 1   # resumed, nothing lost
    assert registry.lookup("gemm", "NT", 96, 112, 128, 1) is not None


def test_export_compiles_and_runs_without_python(fresh_cache, tmp_path):
    from autohc.tune.export import export
    p = default_params(ISA, 2)
    registry.record("gemm", "NT", 40, 24, 33, 2, p, 10.0, 5.0)
    out = tmp_path / "exp"
    manifest = export(out)
    k = next(k for k in manifest["kernels"] if k.get("registry_key"))
    assert k["symbol"] == p.symbol
    src = (out / k["source"]).read_text()
    import hashlib
    assert hashlib.sha256(src.encode()).hexdigest() == k["sha256"]
    main = tmp_path / "main.c"
    main.write_text(textwrap.dedent(f"""
        #include <stdio.h>
        #include "autohc_kernels.h"
        int main(void) {{
            enum {{ M = 33, K = 40, N = 24 }};
            static float x[M * K], w[N * K], y[M * N];
            for (int i = 0; i < M * K; ++i) x[i] = (float)((i * 7) % 13) - 6.0f;
            for (int i = 0; i < N * K; ++i) w[i] = (float)((i * 5) % 11) - 5.0f;
            {p.symbol}_bind((void *)autohc_pool_run);     /* threads from the exported pool */
            /* Y = X W^T: op(B)(k, j) = W[j*K + k] -> rsb = 1, csb = K */
            if ({p.symbol}_gemm(M, N, K, 1.0f, x, K, 1, w, 1, K, 0.0f, y, N)) return 2;
            for (int i = 0; i < M * N; ++i) printf("%.1f\\n", y[i]);
            return 0;
        }}"""))
    exe = tmp_path / "prog"
    for o in k["objects"]:                              # (the skinny paths: M <= skinny_m)
        assert hashlib.sha256((out / o["source"]).read_bytes()).hexdigest() == o["sha256"]
    assert bool(k["objects"]) == (p.skinny_m > 0)
    cmd = ["gcc", *k["cflags"], f"-I{out}", str(main), str(out / k["source"]),
           *(str(out / o["source"]) for o in k["objects"]),
           str(out / manifest["pool"]["source"]), "-o", str(exe), *k["ldflags"]]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if ISA not in cpu.runnable_isas():
        pytest.skip("compiled; this CPU cannot run it")
    got = np.array(subprocess.run([str(exe)], check=True, capture_output=True, text=True)
                   .stdout.split(), dtype=np.float64).reshape(33, 24)
    x = (np.arange(33 * 40) * 7 % 13 - 6.0).reshape(33, 40)
    w = (np.arange(24 * 40) * 5 % 11 - 5.0).reshape(24, 40)
    assert np.array_equal(got, x @ w.T)                # small integers: exact in fp32


def test_report_writes_pngs(fresh_cache, tmp_path):
    from autohc.tune.report import report
    tuner.tune_problem(GemmProblem("r", "NN", 64, 32, 48), 1, trials=2, timeout=120)
    paths = report(tmp_path / "rep")
    names = sorted(p.name for p in paths)
    assert "roofline.png" in names and any(n.startswith("convergence-gemm-NN") for n in names)
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_final_race_keeps_the_default_unless_beaten_by_more_than_the_spread():
    from autohc.bench.timing import Timing
    from autohc.tune.pipeline import pick
    t = lambda med, spread: Timing(med, spread)  # noqa: E731
    base = t(1.0, 0.0)
    assert pick({"default": t(1.0, 0.10), "a": t(0.95, 0.02), "baseline": base}, "default") == "default"
    assert pick({"default": t(1.0, 0.02), "a": t(0.95, 0.10), "baseline": base}, "default") == "default"
    assert pick({"default": t(1.0, 0.03), "a": t(0.90, 0.02), "baseline": base}, "default") == "a"
    assert pick({"default": t(0.9, 0.03), "a": t(1.0, 0.02), "baseline": base}, "default") == "default"


def test_a_winner_is_kept_only_if_it_wins_a_second_race_and_its_figures_are_that_race_s():
    from autohc.bench.timing import Timing
    from autohc.tune.pipeline import pick_confirmed
    t = lambda med, spread: Timing(med, spread)  # noqa: E731
    first = {"default": t(1.0, 0.01), "a": t(0.95, 0.01), "b": t(0.90, 0.01), "baseline": t(1.0, 0.0)}
    asked = []

    def retime(result):
        def run(names):
            asked.append(list(names))
            return {k: result[k] for k in names} | {"baseline": t(1.0, 0.0)}
        return run
    # the second race of the two agrees: b is kept, with the second race's figures
    again = {"default": t(1.0, 0.01), "b": t(0.93, 0.01)}
    kept, times = pick_confirmed(first, "default", retime(again))
    assert kept == "b" and asked == [["default", "b"]] and times["b"].median == 0.93
    # the second race does not: the default stays (its luck was the first race's)
    asked.clear()
    kept, times = pick_confirmed(first, "default", retime({"default": t(1.0, 0.01), "b": t(0.995, 0.01)}))
    assert kept == "default" and asked == [["default", "b"]] and times["default"].median == 1.0
    # the default won the first race: no second one
    asked.clear()
    kept, times = pick_confirmed({**first, "b": t(0.999, 0.01)} | {"a": t(1.2, 0.01)}, "default", retime(again))
    assert kept == "default" and asked == [] and times["b"].median == 0.999


def test_aten_is_faster_only_if_it_wins_twice_by_medians_alone():
    from autohc.bench.timing import Timing
    from autohc.tune.pipeline import faster_twice
    asked = []

    def retime(ours_ms, aten_ms):
        def run(names):
            asked.append(list(names))
            return {"ours": Timing(ours_ms, 0.2), "aten": Timing(aten_ms, 0.2)}
        return run
    first = {"ours": Timing(1.0, 0.2), "aten": Timing(0.99, 0.2), "b": Timing(0.5, 0.0)}
    assert faster_twice(first, "ours", "aten", retime(1.0, 0.98)) == (True, retime(1.0, 0.98)([]))
    assert asked[0] == ["ours", "aten"]                  # no margin, though within the spread
    assert faster_twice(first, "ours", "aten", retime(1.0, 1.01))[0] is False
    asked.clear()
    assert faster_twice({**first, "aten": Timing(1.0, 0.2)}, "ours", "aten", retime(1.0, 0.5)) == (False, {})
    assert faster_twice({"ours": Timing(1.0, 0.2)}, "ours", "aten", retime(1.0, 0.5)) == (False, {})
    assert asked == []                                   # not faster first (or not raced): no second race


def test_tune_reports_the_default_remeasured_in_the_race(fresh_cache):
    r = tuner.tune_problem(GemmProblem("race", "NN", 96, 64, 80), 1, trials=3, timeout=120)
    j = r.to_json()
    assert j["default_gflops"] > 0 and j["gflops"] > 0
    if r.params != default_params(ISA, 1):      # a finalist kept: it beat the default clearly
        assert j["gflops"] > j["default_gflops"]
    entry = registry.lookup("gemm", "NN", 64, 80, 96, 1)[1]
    assert entry["default_gflops"] == j["default_gflops"]


def test_final_race_keeps_the_default_over_a_deliberately_slow_finalist(fresh_cache):
    """A finalist whose search figure was a fluke (claimed 1e9 GFLOP/s) but is really slow
    (a tiny KC and MC): the race re-measures both and keeps the default."""
    default = default_params(ISA, 1)
    slow = GemmParams(**{**default.to_dict(), "kc": 8, "mc": default.mr, "nc": default.nr,
                         "k_unroll": 1, "skinny_m": 0})

    class Trial:
        number, value, user_attrs = 7, 1e9, {"params": slow.to_dict()}
    problem = GemmProblem("slow", "NT", 256, 256, 256)
    params, gflops, torch_gflops, default_gflops = tuner.final_race(problem, 1, default, [Trial()])
    assert params == default and gflops == default_gflops and torch_gflops > 0
