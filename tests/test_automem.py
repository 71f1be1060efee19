"""AutoMem: tiers round-trip bit-exactly, the activation hook never offloads a parameter,
prefetch follows the recorded order, and training with it gives the same losses."""
import json

import pytest
import torch

from autohc.runtime.automem import AutoMem
from autohc.runtime.tiers import Bf16Tier, FileTier, LinuxNuma, NumaTier, SimulatedNuma, make_tier


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bfloat16, torch.bool])
def test_file_tier_round_trip_is_bit_exact(tmp_path, dtype):
    tier = FileTier(tmp_path)
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(37, 129, generator=g) * 1e3).to(dtype)
    strided = t.t()                                     # non-contiguous input
    for x in (t, strided):
        h = tier.put(x)
        back = tier.get(h, x.shape, x.dtype)
        assert back.dtype == x.dtype and torch.equal(back, x)
        tier.free(h)
    h2 = tier.put(t)                                    # a freed file of the same size is reused
    assert torch.equal(tier.get(h2, t.shape, t.dtype), t)
    tier.close()
    assert not list(tmp_path.iterdir())                 # nothing left behind


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_file_tier_take_maps_the_file_until_the_tensor_dies(tmp_path, dtype):
    """take(): the file's pages mapped copy-on-write (bit-exact, no copy); its file is not
    reused while the tensor lives, a write to the tensor never reaches the file, and once
    the tensor (and every view of it) is gone the file serves the next tensor of its size."""
    import gc
    import os
    from autohc.runtime.tiers import take
    tier = FileTier(tmp_path)
    t = (torch.randn(300, 1031, generator=torch.Generator().manual_seed(1)) * 100).to(dtype)
    h = tier.put(t)
    back = take(tier, h, t.shape, t.dtype)
    assert back.dtype == dtype and torch.equal(back, t)
    assert tier._free.take(h[1]) is None                # still mapped: not free to reuse
    view = back[5:, 3:]
    del back
    gc.collect()
    assert tier._free.take(h[1]) is None                # a view keeps it
    view.zero_()                                        # copy-on-write: the file keeps t
    file = torch.frombuffer(bytearray(os.pread(h[0], h[1], 0)), dtype=torch.uint8)
    assert torch.equal(file.view(dtype).reshape(t.shape), t)
    del view
    gc.collect()
    assert tier._free.take(h[1]) == h[0]                # the tensor died: its file is free
    tier.free(h)
    empty = torch.empty(0, 4)
    assert take(tier, tier.put(empty), empty.shape, empty.dtype).shape == (0, 4)
    h3 = tier.put(t)
    alive = take(tier, h3, t.shape, t.dtype)
    tier.close()                                        # closing leaves a live tensor intact
    assert torch.equal(alive, t)
    del alive
    gc.collect()
    import errno
    with pytest.raises(OSError) as e:
        os.fstat(h3[0])                                 # and closes its file when it dies
    assert e.value.errno == errno.EBADF


def test_bf16_tier_is_close_and_says_so():
    t = torch.randn(1000)
    back = Bf16Tier().get(Bf16Tier().put(t), t.shape, t.dtype)
    assert back.dtype == torch.float32 and torch.allclose(back, t, rtol=1e-2, atol=1e-2)
    assert not torch.equal(back, t)
    with pytest.raises(ValueError, match="one of file, file:DIR, bf16, numa"):
        make_tier("ssd")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bfloat16])
def test_numa_tier_round_trip_on_a_simulated_two_node_topology(dtype):
    """The machine has one node: a simulated topology of two records where each mapping was
    bound; the data path (mapping, copy in, copy out) is the real one."""
    numa = SimulatedNuma(2)
    tier = NumaTier(1, numa)
    t = (torch.randn(37, 129, generator=torch.Generator().manual_seed(1)) * 1e3).to(dtype)
    for x in (t, t.t(), t[:0]):
        h = tier.put(x)
        assert numa.node_of(tier.address(h)) == 1
        back = tier.get(h, x.shape, x.dtype)
        assert back.dtype == x.dtype and torch.equal(back, x)
        tier.free(h)
    h2 = tier.put(t)                                    # a freed mapping of the same size is reused
    assert tier.address(h2) in numa.bound and torch.equal(tier.get(h2, t.shape, t.dtype), t)
    tier.free(h2)
    tier.close()
    with pytest.raises(ValueError, match="node 5 is not a memory node"):
        NumaTier(5, numa)


def test_numa_tier_binds_for_real_on_this_machines_node():
    numa = LinuxNuma()
    node = numa.nodes()[0]
    tier = NumaTier(node, numa)
    t = torch.randn(300, 1000)
    h = tier.put(t)
    assert numa.node_of(tier.address(h)) == node        # move_pages: where the page really is
    assert torch.equal(tier.get(h, t.shape, t.dtype), t)
    tier.free(h)
    tier.close()
    if len(numa.nodes()) == 1:
        with pytest.raises(ValueError, match="one memory node"):
            make_tier("numa")
    with pytest.raises(ValueError, match="not a memory node"):
        make_tier("numa:999")


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(4))

    def forward(self, x):
        for lin in self.layers:
            x = torch.nn.functional.gelu(lin(x))
        return x.square().mean()


def _step(net, x, am=None):
    net.zero_grad()
    if am is None:
        loss = net(x)
        loss.backward()
    else:
        with am:
            loss = net(x)
            loss.backward()
    return loss.item(), [p.grad.clone() for p in net.parameters()]


def test_training_steps_are_bit_identical_and_parameters_stay(tmp_path):
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(1024, 512)           # 2 MiB activations: offloaded
    want = [_step(net, x) for _ in range(3)]
    am = AutoMem(FileTier(tmp_path), net, min_bytes=1 << 10)   # the 1 MiB weights qualify by size
    pack, put = am._pack, am.tier.put
    seen, stored = [], []
    am._pack = lambda t: seen.append(t.untyped_storage().data_ptr()) or pack(t)
    am.tier.put = lambda t: stored.append(t.untyped_storage().data_ptr()) or put(t)
    got = [_step(net, x, am) for _ in range(3)]
    am.close()
    for (lw, gw), (lg, gg) in zip(want, got):
        assert lw == lg and all(torch.equal(a, b) for a, b in zip(gw, gg))
    assert am.stats["offloaded"] > 0 and am.stats["prefetched"] > 0
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    assert params & set(seen), "linear saves its weight: the hook must be offered it"
    assert not params & set(stored), "a parameter went to the tier"


def test_training_with_the_numa_tier_is_bit_identical():
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(1024, 512)
    want = [_step(net, x) for _ in range(2)]
    am = AutoMem(NumaTier(0, SimulatedNuma(2)), net, min_bytes=1 << 10)
    got = [_step(net, x, am) for _ in range(2)]
    am.close()
    assert am.stats["offloaded"] > 0
    for (lw, gw), (lg, gg) in zip(want, got):
        assert lw == lg and all(torch.equal(a, b) for a, b in zip(gw, gg))


def test_prefetch_follows_the_recorded_order(tmp_path):
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(1024, 512)
    am = AutoMem(FileTier(tmp_path), net, min_bytes=1 << 20)
    _step(net, x, am)                                   # warm-up: records the order
    order = list(am.order)
    assert order and len(set(order)) == len(order)
    fetched = []
    fetch = am._fetch
    am._fetch = lambda s: fetched.append(s.index) or fetch(s)
    net.zero_grad()
    with am:
        loss = net(x)
        for s in list(am._saved.values()):              # every write done: all are read back
            s.stored.result()
        loss.backward()
    am.close()
    assert am._unpacked == order                        # backward asked in the recorded order
    assert fetched == order                             # and each was fetched in that order
    assert am.stats["waited"] >= 1 and am.stats["prefetched"] >= len(order) - 1


def test_a_tensor_still_queued_at_backward_is_used_from_memory(tmp_path):
    """Backward needs the forward's last saves first, while they may still wait in the
    offload queue: they are used as they are (write cancelled, or its copy freed once done),
    never waited for and read back, and the tier keeps nothing."""
    import threading

    class Gated:                                        # a tier whose writes wait for a gate
        def __init__(self):
            self.inner, self.gate, self.puts, self.live = FileTier(tmp_path), threading.Event(), 0, 0

        def put(self, t):
            self.gate.wait()
            self.puts += 1
            self.live += 1
            return self.inner.put(t)

        def free(self, handle):
            self.live -= 1
            self.inner.free(handle)

        def get(self, handle, shape, dtype):
            return self.inner.get(handle, shape, dtype)

        def close(self):
            self.inner.close()

    torch.manual_seed(0)
    net, x = _Net(), torch.randn(1024, 512)
    want = _step(net, x)
    tier = Gated()
    am = AutoMem(tier, net, min_bytes=1 << 20)
    got = _step(net, x, am)                             # the gate is shut for the whole step
    assert am.stats["offloaded"] >= 4 and am.stats["unqueued"] == am.stats["offloaded"]
    assert am.stats["waited"] == 0 and tier.puts == 0
    tier.gate.set()                                     # the one write that had started ends
    am.close()
    assert tier.puts <= 1 and tier.live == 0            # the rest were cancelled; nothing kept
    assert want[0] == got[0] and all(torch.equal(a, b) for a, b in zip(want[1], got[1]))


def test_bench_memory_reports_the_keys(monkeypatch):
    from autohc.bench.memory import bench_memory
    monkeypatch.setenv("AUTOHC_AUTOMEM_MIN_KB", "64")
    r = bench_memory("DiT-Ti/8", 4, "file", steps=3, warmup=1, rounds=1)
    for k in ("baseline_peak_gb", "automem_peak_gb", "baseline_step_s", "automem_step_s", "loss_rel_diff"):
        assert r[k] >= 0, k
    assert r["loss_rel_diff"] == 0.0                    # the file tier is exact
    assert r["baseline_out_of_memory"] is False
    assert r["automem_stats"]["offloaded"] > 0
    with pytest.raises(ValueError, match="AutoMem tier"):
        bench_memory("DiT-Ti/8", 4, "tape")


def test_bench_memory_alternates_the_order_and_takes_the_median_of_the_pairs(monkeypatch):
    """Rounds run baseline and AutoMem in alternating order; the overhead is the median of
    each pair's ratio (not the ratio of two runs made minutes apart)."""
    from autohc.bench import memory
    calls = []
    # a machine that drifts: every process is slower than the one before
    fake = {None: [1.0, 1.5, 2.0], "file": [1.25, 1.5, 2.6]}

    def measure(job):
        mode = job["tier"]
        calls.append(mode)
        step = fake[mode][sum(1 for c in calls if c == mode) - 1]
        return {"step_s": step, "peak_gb": 4.0 if mode is None else 2.0, "losses": [1.0, 0.5],
                "stats": {"offloaded": 1}, "times": [step]}
    monkeypatch.setattr(memory, "_measure", measure)
    r = memory.bench_memory("DiT-Ti/8", 2, "file", steps=2, warmup=1, rounds=3)
    assert calls == [None, "file", "file", None, None, "file"]
    assert r["step_overhead_rounds"] == [0.25, 0.0, 0.3] and r["step_overhead"] == 0.25
    assert r["baseline_step_s"] == 1.5 and r["automem_step_s"] == 1.5
    assert r["peak_reduction"] == 0.5 and r["loss_rel_diff"] == 0.0 and r["rounds"] == 3
    with pytest.raises(ValueError, match="rounds 0"):
        memory.bench_memory("DiT-Ti/8", 2, "file", steps=2, warmup=1, rounds=0)


def test_bench_memory_reports_a_baseline_that_runs_out_of_memory(monkeypatch):
    """The batch the baseline cannot hold (killed by the OOM killer, or an allocation torch
    could not make) is reported as such, and the AutoMem run is still measured."""
    from autohc.bench import memory
    monkeypatch.setenv("AUTOHC_AUTOMEM_MIN_KB", "64")
    # SIGKILL over 2 rounds (round 2 runs AutoMem alone: the baseline did not fit), the other over 1
    for death, rounds in (("os.kill(os.getpid(), signal.SIGKILL)", 2),
                          ("raise RuntimeError('[enforce fail at alloc_cpu.cpp:118] . DefaultCPUAllocator: "
                           "can\\'t allocate memory: you tried to allocate 123 bytes.')", 1)):
        monkeypatch.setattr(memory, "CHILD", "import json, os, signal, sys\n"
                            "from autohc.bench.memory import run_job\n"
                            "job = json.loads(sys.argv[1])\n"
                            f"if job['tier'] is None: {death}\n"
                            "print(json.dumps(run_job(job)))")
        r = memory.bench_memory("DiT-Ti/8", 2, "file", steps=2, warmup=1, rounds=rounds)
        assert r["baseline_out_of_memory"] is True
        assert r["baseline_peak_gb"] is None and r["peak_reduction"] is None
        assert r["automem_peak_gb"] > 0 and len(r["automem_losses"]) == 2


def test_optimizer_state_goes_to_the_tier_between_steps(tmp_path):
    """StateOffload: AdamW's moments leave memory after each step and come back for the next
    one; the training is bit-identical and nothing is left out of a checkpoint."""
    from autohc.runtime.automem import StateOffload

    def run(offload: bool):
        torch.manual_seed(0)
        net = _Net()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        so = StateOffload(opt, FileTier(tmp_path), min_bytes=1 << 10) if offload else None
        x = torch.randn(64, 512, generator=torch.Generator().manual_seed(1))
        for _ in range(3):
            opt.zero_grad()
            loss = net(x)
            loss.backward()
            if so and so._away:         # the prefetch started by itself, mid-backward
                assert so._back is not None
            if so:
                so.restore()
            opt.step()
            if so:
                so.offload()
                moments = [v for st in opt.state.values() for k, v in st.items() if k != "step"]
                assert moments and all(v.numel() == 0 for v in moments)     # out of memory
                assert so.stats["offloaded_bytes"] >= 2 * 4 * 512 * 512 * 4
        if so:
            so.close()                  # back in place: a checkpoint sees the whole state
        return [p.detach().clone() for p in net.parameters()], opt.state_dict()
    (pa, sa), (pb, sb) = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    for i in sb["state"]:
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sa["state"][i][k], sb["state"][i][k])
    assert not list(tmp_path.iterdir())


def test_train_automem_state_same_losses_and_whole_checkpoints(tmp_path, capsys):
    from autohc.cli import main
    from autohc.dit import checkpoint
    runs = {}
    for name, extra in (("plain", ["--samples-per-class", "1"]),
                        ("state", ["--automem", "file", "--automem-state", "--samples-per-class", "0"])):
        out = tmp_path / name
        assert main(["train", "--model", "DiT-Ti/8", "--data", "digits", "--steps", "3", "--batch", "8",
                     "--out", str(out), "--ckpt-every", "2", "--no-progress",
                     "--sample-steps", "1", "--json", *extra]) == 0
        runs[name] = checkpoint.load(checkpoint.latest(out)[0])
        summary = json.loads(capsys.readouterr().out)
        assert (out / "samples.png").exists() == (name == "plain")      # 0: no sample grid
        assert (summary["samples_png"] is None) == (name == "state")
    assert runs["state"]["losses"] == runs["plain"]["losses"]
    moments = [v for st in runs["state"]["opt"]["state"].values() for k, v in st.items() if k != "step"]
    assert moments and all(v.numel() > 0 for v in moments)
    assert main(["train", "--data", "digits", "--steps", "1", "--out", str(tmp_path / "bad"),
                 "--no-progress", "--automem-state"]) == 2
    assert "--automem-state needs --automem" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_automem_caps_the_result_pool_while_it_runs(tmp_path, monkeypatch):
    """Freed kernel results waiting in the result pool would keep offloaded activations in
    RSS: AutoMem lowers the pool's cap (AUTOHC_AUTOMEM_POOL_MB), letting go of free blocks
    past it, and close() puts the cap back."""
    from autohc.runtime import memory
    before = memory.pool.cap_bytes
    kept = [memory.pool.empty((3 << 20,)) for _ in range(3)]     # 12 MiB blocks
    del kept
    assert memory.pool.free_bytes >= 3 * (12 << 20)
    monkeypatch.setenv("AUTOHC_AUTOMEM_POOL_MB", "16")
    am = AutoMem(FileTier(tmp_path))
    assert memory.pool.cap_bytes == min(before, 16 << 20)
    assert memory.pool.free_bytes <= 16 << 20
    am.close()
    assert memory.pool.cap_bytes == before
    monkeypatch.setenv("AUTOHC_AUTOMEM_POOL_MB", "many")
    with pytest.raises(ValueError, match="AUTOHC_AUTOMEM_POOL_MB"):
        AutoMem(FileTier(tmp_path))
    assert memory.pool.cap_bytes == before


def test_automem_runs_a_prefaulter_on_the_pool_until_closed(tmp_path, monkeypatch):
    """The helper that readies the next step's result blocks (memory.Prefaulter) listens to
    the pool while AutoMem runs, sees each step start, and goes with close();
    AUTOHC_AUTOMEM_PREFAULT=0 leaves it out; a bad value is one line, the pool untouched."""
    from autohc.runtime import memory
    before = memory.pool.cap_bytes
    am = AutoMem(FileTier(tmp_path))
    pf = am._prefaulter
    assert pf is not None and memory.pool.listener == pf._asked
    with am:
        memory.fresh_empty(1 << 20)
    with am:                                    # the second step: the first one is its plan
        pass
    assert pf.plan == [memory._size_class(4 << 20)]
    am.close()
    assert memory.pool.listener is None and not pf._thread.is_alive()
    monkeypatch.setenv("AUTOHC_AUTOMEM_PREFAULT", "0")
    am = AutoMem(FileTier(tmp_path))
    assert am._prefaulter is None and memory.pool.listener is None
    am.close()
    monkeypatch.setenv("AUTOHC_AUTOMEM_PREFAULT", "yes")
    with pytest.raises(ValueError, match="AUTOHC_AUTOMEM_PREFAULT"):
        AutoMem(FileTier(tmp_path))
    assert memory.pool.cap_bytes == before and memory.pool.listener is None
