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


def test_pool_is_shared_by_every_kernel():
    """GEMMs of several configurations and the operators: one pool, no more workers than the
    largest team asked for minus the caller."""
    import autohc
    from autohc.kernels.gemm.params import default_params
    from autohc.hw import cpu
    isa = cpu.best_isa()
    before = pool.workers()                 # earlier tests may have asked for bigger teams
    a, b = torch.randn(200, 96), torch.randn(96, 130)
    for threads, kc in ((2, 64), (2, 128), (1, 96), (2, 256)):
        p = default_params(isa, threads).__class__(**{**default_params(isa, threads).to_dict(), "kc": kc})
        torch.testing.assert_close(autohc.matmul(a, b, params=p), a @ b, rtol=1e-4, atol=1e-4)
    autohc.ops.gelu_tanh(torch.randn(512, 512))
    assert pool.workers() == max(before, 1)     # teams of 2: the caller and one shared worker


def test_process_holds_one_pool_under_install(tmp_path):
    """15 DiT-S/2 GEMMs under install(), each with its own tuned configuration from the
    registry: the process holds at most torch's threads plus a handful (before the shared pool
    every configuration started its own threads)."""
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
        for i, p in enumerate(probs):       # 15 distinct tuned configurations
            jc, ic, jr = geos[i % 3]
            params = default_params(isa, threads).__class__(**{**base, "kc": 64 + 16 * i,
                                                               "jc_ways": jc, "ic_ways": ic, "jr_ways": jr})
            registry.record("gemm", p.layout, p.K, p.N, p.M, threads, params, 1.0, 1.0)
        torch.set_num_threads(threads)
        before = len(os.listdir("/proc/self/task"))
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
    assert r["during"] <= r["before"] + 2, r      # the pool's one worker (+1 slack), not 15 pools
