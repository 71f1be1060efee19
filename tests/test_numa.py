"""autohc.numa: node discovery from sysfs, and each slice of an operator computed (so first
written) on its node's CPUs. This machine has one node: the tests give it a fake second one."""
import os

import pytest
import torch

from autohc import numa, ops


def test_parse_cpulist():
    assert numa.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert numa.parse_cpulist("5") == {5}


def test_nodes_from_sysfs_limited_to_allowed_cpus(tmp_path, monkeypatch):
    allowed = sorted(os.sched_getaffinity(0))
    for i, cpus in enumerate([f"{allowed[0]}", ",".join(map(str, allowed[1:])) or "", "4000-4003"]):
        (tmp_path / f"node{i}").mkdir()
        (tmp_path / f"node{i}" / "cpulist").write_text(cpus + "\n")
    monkeypatch.setattr(numa, "SYSFS", tmp_path)
    numa.nodes.cache_clear()
    try:
        got = numa.nodes()
        want = [frozenset(allowed[:1])] + ([frozenset(allowed[1:])] if allowed[1:] else [])
        assert list(got) == want                           # node2's CPUs are not ours: dropped
    finally:
        numa.nodes.cache_clear()


def test_one_node_pins_nothing(monkeypatch):
    monkeypatch.setattr(numa, "nodes", lambda: (frozenset(os.sched_getaffinity(0)),))
    before = os.sched_getaffinity(0)
    numa.pin(1, 2)
    assert os.sched_getaffinity(0) == before


def test_each_slice_runs_on_its_nodes_cpus(monkeypatch):
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    fake = (frozenset({allowed[0]}), frozenset({allowed[1]}))
    monkeypatch.setattr(numa, "nodes", lambda: fake)
    assert [numa.node_of(i, 4) for i in range(4)] == [0, 0, 1, 1]
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(max_workers=2)                   # its own threads, dropped after
    monkeypatch.setattr(ops, "_pool", lambda n: pool)
    seen = {}
    try:
        ops._in_threads(lambda a, b: seen.__setitem__(a, os.sched_getaffinity(0)), [(0, 5), (5, 9)])
        assert seen == {0: set(fake[0]), 5: set(fake[1])}
        monkeypatch.setattr(ops, "kernel_threads", lambda: 2)
        x = torch.randn(1000, 300)                             # an operator on the pinned path
        torch.testing.assert_close(ops.gelu_tanh(x), torch.nn.functional.gelu(x, approximate="tanh"),
                                   rtol=1e-5, atol=2e-6)
    finally:
        pool.shutdown()
