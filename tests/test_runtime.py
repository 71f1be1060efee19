"""The runtime: the CPU plan (compute / communication / memory cores, ordered by NUMA node)
and the one native worker pool that every kernel of the process runs its threads on."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from autohc.hw.cpu import Cache, CpuInfo
from autohc.runtime import plan, pool


def _info(nodes):
    cpus = tuple(sorted(c for n in nodes for c in n))
    return CpuInfo("x86_64", "v", "m", frozenset(), cpus, (Cache(1, "Data", 1, 1),), tuple(nodes))


def test_plan_orders_compute_by_node_and_keeps_cores_from_the_end():
    info = _info([(4, 5, 6, 7), (0, 1, 2, 3)])
    p = plan.make_plan(info, comm_cores=1, memory_cores=2)
    assert p.compute == (4, 5, 6, 7, 0) and p.comm == (1,) and p.memory == (2, 3)
    assert not p.shared
    assert plan.make_plan(info, 0, 0).compute == (4, 5, 6, 7, 0, 1, 2, 3)


def test_plan_shares_a_core_when_there_are_too_few():
    p = plan.make_plan(_info([(0, 1)]), comm_cores=2, memory_cores=0)
    assert p.compute == (0, 1) and p.comm == (1,) and p.shared
    assert "shared" in p.describe()


def test_plan_settings_are_checked(monkeypatch):
    monkeypatch.setenv("AUTOHC_COMM_CORES", "two")
    with pytest.raises(ValueError, match="AUTOHC_COMM_CORES"):
        plan.make_plan(_info([(0, 1)]))
    monkeypatch.setenv("AUTOHC_COMM_CORES", "-1")
    with pytest.raises(ValueError, match=">= 0"):
        plan.make_plan(_info([(0, 1)]))


_SHARED_TEAM = textwrap.dedent("""
    import json, os, torch, autohc
    from autohc.kernels.gemm.params import default_params
    from autohc.hw import cpu
    from autohc.runtime import omp, pool
    torch.set_num_threads(2)
    torch.mm(torch.randn(256, 256), torch.randn(256, 256))   # torch's OpenMP team is up
    before = len(os.listdir("/proc/self/task"))
    isa = cpu.best_isa()
    a, b = torch.randn(200, 96), torch.randn(96, 130)
    for threads, kc in ((2, 64), (2, 128), (1, 96), (2, 256)):
        p = default_params(isa, threads).__class__(**{**default_params(isa, threads).to_dict(), "kc": kc})
        torch.testing.assert_close(autohc.matmul(a, b, params=p), a @ b, rtol=1e-4, atol=1e-4)
    autohc.ops.gelu_tanh(torch.randn(512, 512))
    print(json.dumps({"pool_workers": pool.workers(), "fallbacks": omp.team_fallbacks(),
                      "new_threads": len(os.listdir("/proc/self/task")) - before}))
""")


@pytest.mark.parametrize("team", ["omp", "pool"])
def test_every_kernel_runs_on_one_team(team, tmp_path):
    """GEMMs of several configurations and the operators share one set of threads: with
    AUTOHC_TEAM=omp (the default) torch's own OpenMP threads (no pool worker, no new thread,
    nothing handed to the fallback); with AUTOHC_TEAM=pool autohc's pool, no more workers
    than the largest team minus the caller."""
    env = {**os.environ, "AUTOHC_CACHE_DIR": str(tmp_path), "AUTOHC_TEAM": team}
    out = subprocess.run([sys.executable, "-c", _SHARED_TEAM], env=env, capture_output=True,
                         text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if team == "omp":
        assert r == {"pool_workers": 0, "fallbacks": 0, "new_threads": 0}, r
    else:
        assert r["pool_workers"] == 1 and r["new_threads"] == 1, r   # teams of 2: the caller + 1


def test_team_kind_setting_is_checked(monkeypatch):
    from autohc.runtime import omp
    monkeypatch.setenv("AUTOHC_TEAM", "tbb")
    with pytest.raises(ValueError, match="AUTOHC_TEAM='tbb': expected one of omp, pool"):
        omp.team_kind()
    monkeypatch.setenv("AUTOHC_TEAM", " POOL ")
    assert omp.team_kind() == "pool"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_runs_kernels_on_the_fallback_pool(tmp_path):
    """libgomp does not survive a fork of a process that used it (torch's own ops hang in such
    a child): a forked child's teams go to autohc's pool and give the right result."""
    script = textwrap.dedent("""
        import os, sys, numpy as np, torch, autohc
        from autohc.runtime import omp
        torch.set_num_threads(2)
        a, b = torch.randn(300, 200), torch.randn(200, 170)
        ref = (a @ b).numpy()
        autohc.matmul(a, b, threads=2)                      # the parent used OpenMP teams
        assert omp.team_fallbacks() == 0
        pid = os.fork()
        if pid == 0:    # (no torch op here: torch's own would hang, libgomp's limit)
            ok = np.allclose(autohc.matmul(a.numpy(), b.numpy(), threads=2), ref, rtol=1e-4, atol=1e-4)
            os._exit(0 if ok and omp.team_fallbacks() > 0 else 3)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    env = {**os.environ, "AUTOHC_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def test_process_holds_one_pool_under_install(tmp_path):
    """15 DiT-S/2 GEMMs under install(), tuned to 6 distinct configurations in the registry:
    the process holds at most torch's threads plus a handful (before the shared pool every
    configuration started its own threads; 6 such pools would add 6 or more)."""
    script = textwrap.dedent("""
        import json, os, torch, autohc
        from autohc.hw import cpu
        from autohc.kernels.gemm.params import default_params
        from autohc.kernels.gemm.problem import dit_problems
        from autohc.tune import registry
        isa, threads = cpu.best_isa(), 2
        base = default_params(isa, threads).to_dict()
        geos = [(2, 1, 1), (1, 2, 1), (1, 1, 2)]
        probs = dit_problems("dit-s", images=1)
        tuned = []
        for i, p in enumerate(probs):       # 6 distinct tuned configurations (fewer builds)
            jc, ic, jr = geos[i % 3]
            params = default_params(isa, threads).__class__(**{**base, "kc": 64 + 16 * (i % 6),
                                                               "jc_ways": jc, "ic_ways": ic, "jr_ways": jr})
            registry.record("gemm", p.layout, p.K, p.N, p.M, threads, params, 1.0, 1.0)
            tuned.append(params)
        torch.set_num_threads(threads)
        before = len(os.listdir("/proc/self/task"))
        # (compiled side by side first, gcc on every core; counted from before the builds,
        # so that a pool started at load would count too)
        from concurrent.futures import ThreadPoolExecutor
        from autohc.kernels.gemm.kernel import get_kernel
        with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
            list(pool.map(get_kernel, tuned))
        with autohc.installed(threads=threads):
            for p in probs:
                a, b = p.operands()
                torch.testing.assert_close(torch.mm(a, b), (a.double() @ b.double()).float(),
                                           rtol=1e-3, atol=1e-3)
            during = len(os.listdir("/proc/self/task"))
        print(json.dumps({"before": before, "during": during, "torch": torch.get_num_threads()}))
    """)
    env = {**os.environ, "AUTOHC_CACHE_DIR": str(tmp_path), "AUTOHC_REGISTRY": str(tmp_path / "r.json")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["during"] <= r["before"] + 2, r      # the pool's one worker (+1 slack), not 6 pools
