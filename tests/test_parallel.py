"""CFTP at model level (runtime/cftp.py) and `autohc bench parallel` (DP vs DP+TP vs CFTP)."""
from __future__ import annotations

import json

import pytest
import torch

import autohc
from autohc.cli import main
from autohc.dit.diffusion import GaussianDiffusion
from autohc.dit.train import autohc_ops, build_model
from autohc.kernels.gemm.kernel import default_kernel_params
from autohc.runtime import cftp


@pytest.fixture(autouse=True)
def _off():
    yield
    cftp.disable()


def test_clusters_split_every_gemm_by_n():
    p = default_kernel_params(2)
    one = cftp.geometry(p)
    assert one == p                                     # off: as chosen
    cftp.enable(2, 2)
    g = cftp.geometry(p.__class__(**{**p.to_dict(), "jc_ways": 1, "ic_ways": 2, "jr_ways": 1}))
    assert (g.jc_ways, g.ic_ways, g.jr_ways) == (2, 1, 1)
    cftp.enable(1, 2)
    g = cftp.geometry(p)
    assert (g.jc_ways, g.ic_ways) == (1, 2)
    # the B panel ring follows the new geometry where it was the rule's for the old one:
    # own ways (one buffer each) made into one cluster of 2 threads share panels, two buffers
    own = p.__class__(**{**p.to_dict(), "jc_ways": 2, "ic_ways": 1, "jr_ways": 1, "depth": 1})
    assert cftp.geometry(own).depth == 2
    cftp.enable(2, 2)
    shared = p.__class__(**{**p.to_dict(), "jc_ways": 1, "ic_ways": 2, "jr_ways": 1, "depth": 2})
    assert cftp.geometry(shared).depth == 1         # clusters of one thread: one buffer
    named = p.__class__(**{**p.to_dict(), "jc_ways": 1, "ic_ways": 2, "jr_ways": 1, "depth": 3})
    assert cftp.geometry(named).depth == 3          # not the rule's: kept
    with pytest.raises(ValueError, match="do not split into 3 equal clusters"):
        cftp.enable(3, 2)
    with pytest.raises(ValueError, match="positive number of clusters"):
        cftp.enable(0, 2)


def test_first_touch_keeps_every_value_and_training_goes_on():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(300, 500), torch.nn.GELU(), torch.nn.Linear(500, 7))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 300)).sum().backward()
    opt.step()
    before = [p.detach().clone() for p in m.parameters()] + \
             [v.clone() for s in opt.state.values() for v in s.values() if v.dim()]
    moved = cftp.first_touch(m, opt, 2)
    after = [p.detach() for p in m.parameters()] + [v for s in opt.state.values() for v in s.values() if v.dim()]
    assert moved == len(before) + 4                     # + the 4 gradients
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(before, after))
    m(torch.randn(4, 300)).sum().backward()
    opt.step()


def _losses(clusters: int | None, steps: int = 3):
    torch.manual_seed(0)
    model = build_model({"model": "DiT-S/8", "input_size": 16, "in_channels": 4, "num_classes": 10,
                         "class_dropout": 0.0, "learn_sigma": True}, autohc_ops(True)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    out = []
    with autohc.installed(threads=2, first_use_tuning=False):
        if clusters:
            cftp.enable(clusters, 2)
            cftp.first_touch(model, None, clusters)
        for _ in range(steps):
            x = torch.randn(4, 4, 16, 16, generator=gen)
            t = torch.randint(0, 1000, (4,), generator=gen)
            y = torch.randint(0, 10, (4,), generator=gen)
            loss = GaussianDiffusion().training_loss(model, x, t, y, torch.randn(x.shape, generator=gen))
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.item())
        cftp.disable()
    return out


def test_cftp_losses_equal_single_cluster_losses():
    two, one = _losses(2), _losses(1)
    for a, b in zip(two, one):
        assert abs(a - b) <= 1e-5 * abs(b)


def test_bench_parallel_three_strategies_same_losses(capsys):
    assert main(["bench", "parallel", "--model", "DiT-S/8", "--batch", "4", "--steps", "2",
                 "--warmup", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    rows = {w["strategy"]: w for w in r["rows"]}
    assert set(rows) == {"dp", "dp+tp", "cftp"}
    for w in rows.values():
        assert w["step_s"] > 0 and w["peak_mem_gb"] > 0 and len(w["losses"]) == 2
        assert w["loss_rel_diff"] < 1e-4
    assert rows["cftp"]["processes"] == 1 and rows["dp"]["processes"] == rows["cftp"]["threads_per_process"]
    # one copy of the model and one interpreter: the least memory
    assert rows["cftp"]["peak_mem_gb"] < min(rows["dp"]["peak_mem_gb"], rows["dp+tp"]["peak_mem_gb"])


def test_bench_parallel_bad_inputs_are_one_line(capsys):
    assert main(["bench", "parallel", "--model", "DiT-Ti/8", "--strategies", "dp+tp"]) == 1
    assert "heads do not split" in capsys.readouterr().err
    assert main(["bench", "parallel", "--model", "DiT-S/8", "--batch", "3", "--strategies", "dp"]) == 1
    assert "does not split" in capsys.readouterr().err


def _train(tmp_path, name, *extra):
    out = tmp_path / name
    assert main(["train", "--model", "DiT-S/8", "--data", "digits", "--steps", "3", "--batch", "8",
                 "--threads", "2", "--out", str(out), "--no-progress", "--samples-per-class", "1",
                 "--sample-steps", "1", "--json", *extra]) == 0
    from autohc.dit import checkpoint
    return checkpoint.load(checkpoint.latest(out)[0])["losses"]


def test_train_cftp_gives_the_losses_of_a_plain_run(tmp_path, capsys):
    plain = _train(tmp_path, "plain")
    capsys.readouterr()
    clustered = _train(tmp_path, "cftp", "--cftp", "2")
    assert cftp.clusters() is None                      # the CLI turns it off at the end
    for a, b in zip(clustered, plain):
        assert abs(a - b) <= 1e-5 * abs(b)
    capsys.readouterr()
    assert main(["train", "--model", "DiT-Ti/8", "--data", "digits", "--steps", "1", "--threads", "2",
                 "--out", str(tmp_path / "bad"), "--no-progress", "--cftp", "3"]) == 1
    assert "do not split into 3 equal clusters" in capsys.readouterr().err


def test_a_rank_that_dies_without_a_word_fails_the_strategy_at_once():
    """bench parallel's wait for its ranks (collect): a process gone without a result (killed,
    a crash in native code) fails the strategy on the next poll, not after the whole timeout."""
    import queue
    import time
    from types import SimpleNamespace

    from autohc.bench.parallel import collect
    q = queue.Queue()
    q.put({"rank": 1, "times": [0.1]})
    procs = [SimpleNamespace(exitcode=-9), SimpleNamespace(exitcode=0)]
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="dp rank 0: its process exited with code -9 without a result"):
        collect(q, procs, "dp", timeout_s=60, poll_s=0.05)
    assert time.monotonic() - t0 < 5
    q.put({"rank": 0, "error": "boom"})
    with pytest.raises(RuntimeError, match="dp rank 0: boom"):
        collect(q, [SimpleNamespace(exitcode=None)], "dp", timeout_s=60, poll_s=0.05)
    with pytest.raises(RuntimeError, match="no result within 0.2 s"):
        collect(queue.Queue(), [SimpleNamespace(exitcode=None)], "dp", timeout_s=0.2, poll_s=0.05)
    q.put({"rank": 1, "times": [1]})
    q.put({"rank": 0, "times": [2]})
    assert [g["rank"] for g in collect(q, [SimpleNamespace(exitcode=0)] * 2, "dp", poll_s=0.05)] == [1, 0]
