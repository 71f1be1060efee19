"""autohc.memory: the result pool (reuse, no sharing between live tensors, cap, huge-page
alignment and advice, fork safety, threads) and its settings."""
import os
import threading

import pytest
import torch

from autohc.runtime import memory
from autohc.torch import ops


@pytest.fixture
def pool(monkeypatch):
    """A fresh pool of 256 MB for the test, so hits and misses are the test's own."""
    p = memory.BufferPool(256 << 20)
    monkeypatch.setattr(memory, "pool", p)
    return p


def test_freed_result_is_reused_and_live_ones_never_share(pool):
    a = memory.fresh_empty(512, 1024)                        # 2 MB
    ptr = a.data_ptr()
    b = memory.fresh_empty(512, 1024)
    assert b.data_ptr() != ptr and pool.misses == 2 and pool.hits == 0
    del a
    assert pool.free_bytes == 2 << 20
    c = memory.fresh_empty(1024, 512)                        # same size class, other shape
    assert c.data_ptr() == ptr and c.shape == (1024, 512) and pool.hits == 1
    c.fill_(1.0)
    b.fill_(2.0)
    assert c.sum().item() == c.numel() and b.sum().item() == 2 * b.numel()
    view = c[3:5]                                           # a view keeps the block in use
    del c
    assert pool.free_bytes == 0
    d = memory.fresh_empty(512, 1024)
    assert d.data_ptr() != ptr and view.sum().item() == view.numel()
    del view
    assert pool.free_bytes == 2 << 20


def test_small_results_bypass_the_pool_and_cap_is_kept(pool, monkeypatch):
    small = memory.fresh_like(torch.randn(10, 10).t())
    assert small.shape == (10, 10) and small.is_contiguous() and pool.misses == 0
    monkeypatch.setattr(pool, "cap_bytes", 3 << 20)
    a, b = memory.fresh_empty(1 << 19), memory.fresh_empty(1 << 19)     # 2 MB each
    del a, b
    assert pool.free_bytes == 2 << 20                      # the second would pass the cap
    pool.clear()
    assert pool.free_bytes == 0
    monkeypatch.setattr(pool, "cap_bytes", 0)               # AUTOHC_POOL_MB=0: pool off
    assert isinstance(memory.fresh_empty(1 << 20).untyped_storage(), torch.UntypedStorage)
    assert pool.misses == 2


def test_large_blocks_start_on_a_huge_page_and_ask_for_huge_pages(pool, monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "_madvise", lambda: (lambda a, n, adv: calls.append((a, n, adv)) or 0))
    big = memory.fresh_empty(1024, 4096)                     # 16 MB
    (a, n, adv), = calls
    assert adv == memory.MADV_HUGEPAGE and a == big.data_ptr() and a % memory.HUGE == 0
    assert n == big.nbytes
    del big
    again = memory.fresh_empty(1024, 4096)                   # warm block: no second advice
    assert len(calls) == 1 and again.data_ptr() == a
    x = torch.randn(1024, 4096)                             # and a kernel result through it is right
    torch.testing.assert_close(ops.gelu_tanh(x), torch.nn.functional.gelu(x, approximate="tanh"),
                               rtol=1e-5, atol=2e-6)


def test_pool_results_behave_as_torch_tensors(pool, tmp_path):
    x = torch.randn(300, 1000, requires_grad=True)           # 1.2 MB results
    y = ops.gelu_tanh(x)
    assert y.data_ptr() % 64 == 0 and pool.misses >= 1
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ops.aten.gelu_backward(torch.ones_like(x), x.detach(),
                                                                    approximate="tanh"))
    torch.save({"y": y.detach()}, tmp_path / "y.pt")
    torch.testing.assert_close(torch.load(tmp_path / "y.pt")["y"], y.detach())
    assert y.detach().numpy().shape == (300, 1000)
    z = y.detach().clone()
    z += 1
    torch.testing.assert_close(z - 1, y.detach())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_writes_do_not_reach_the_parent(pool):
    t = memory.fresh_empty(1 << 19)
    t.fill_(1.0)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:        # child: write (numpy: torch's OpenMP pool is not fork-safe), report, leave
        a = t.numpy()
        a[:] = 7.0
        os.write(w, b"1" if a[0] == 7.0 else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1"
    assert t.min().item() == 1.0 and t.max().item() == 1.0


def test_threads_never_get_the_same_live_block(pool):
    errors = []

    def worker(k):
        for i in range(40):
            t = memory.fresh_empty(1 << 18)                  # 1 MB
            t.fill_(float(k))
            if t.min().item() != k or t.max().item() != k:
                errors.append((k, i))

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == [] and pool.hits > 0


def test_pool_size_from_environment(monkeypatch):
    monkeypatch.setenv("AUTOHC_POOL_MB", "64")
    assert memory._pool_mb_from_env() == 64
    for bad in ("lots", "-1", "1.5"):
        monkeypatch.setenv("AUTOHC_POOL_MB", bad)
        with pytest.raises(ValueError, match="AUTOHC_POOL_MB"):
            memory._pool_mb_from_env()


def test_refused_mapping_lets_free_blocks_go_then_says_so(pool, monkeypatch):
    a = memory.fresh_empty(1 << 18)
    del a
    assert pool.free_bytes == 1 << 20
    real, calls = memory.mmap.mmap, []

    def refuse_once(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(12, "Cannot allocate memory")
        return real(*args, **kw)
    monkeypatch.setattr(memory.mmap, "mmap", refuse_once)
    t = memory.fresh_empty(1 << 19)                          # another size class: a new mapping
    assert t.numel() == 1 << 19 and pool.free_bytes == 0 and len(calls) == 2
    monkeypatch.setattr(memory.mmap, "mmap", lambda *a, **k: (_ for _ in ()).throw(OSError(12, "no")))
    with pytest.raises(MemoryError, match=r"cannot map \d+ MB for a kernel result"):
        memory.fresh_empty(1 << 20)


def test_huge_pages_switch(tmp_path):
    """AUTOHC_HUGE_PAGES=0 turns transparent huge pages off for the process (the A/B switch of
    the huge-page measurements); a bad value is one line."""
    import os
    import subprocess
    import sys
    from autohc.cli import main
    from autohc.runtime import hugepages
    code = ("from autohc.runtime import hugepages, memory\n"
            "hugepages.apply_env()\n"
            "t = memory.fresh_empty(4096, 4096); t.fill_(1)\n"
            "print(hugepages.anon_huge_kb())\n")
    kb = {}
    for v in ("1", "0"):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "AUTOHC_HUGE_PAGES": v},
                             capture_output=True, text=True, check=True).stdout
        kb[v] = int(out.split()[-1])
    assert kb["0"] == 0
    if hugepages.mode() in ("madvise", "always"):
        assert kb["1"] > 0                              # the 64 MB block got huge pages
    os.environ["AUTOHC_HUGE_PAGES"] = "2"
    try:
        assert main(["info"]) == 1
    finally:
        del os.environ["AUTOHC_HUGE_PAGES"]


def test_automatic_cap_keeps_what_a_step_had_in_use_up_to_its_ceiling(monkeypatch):
    """By default the cap follows the most bytes in use at once (a step whose results pass the
    floor gets them all back the next step), never past the ceiling; a fixed cap does not grow."""
    p = memory.BufferPool(memory.CapSetting(floor=4 << 20, ceiling=24 << 20))
    monkeypatch.setattr(memory, "pool", p)
    live = [memory.fresh_empty(1 << 19) for _ in range(10)]          # 10 x 2 MB in use
    assert p.high_water == 20 << 20 and p.cap_bytes == 20 << 20
    ptrs = {t.data_ptr() for t in live}
    del live
    assert p.free_bytes == 20 << 20                                  # all kept, not just the floor
    again = [memory.fresh_empty(1 << 19) for _ in range(10)]
    assert {t.data_ptr() for t in again} == ptrs and p.hits == 10    # the next "step": no new mapping
    more = [memory.fresh_empty(1 << 19) for _ in range(6)]           # 32 MB in use: past the ceiling
    assert p.cap_bytes == 24 << 20
    del again, more
    assert p.free_bytes == 24 << 20
    old = p.set_cap(4 << 20)                                         # fixed (AutoMem does this)
    assert p.free_bytes == 4 << 20 and p.cap_bytes == 4 << 20
    p.set_cap(old)
    assert p.cap_bytes == 24 << 20


def test_pool_cap_setting_from_environment(monkeypatch):
    monkeypatch.delenv("AUTOHC_POOL_MB", raising=False)
    auto = memory._setting_from_env()
    assert auto.floor == memory.AUTO_CAP_MIN_BYTES and auto.ceiling >= auto.floor
    monkeypatch.setenv("AUTOHC_POOL_MB", "512")
    assert memory._setting_from_env() == memory.CapSetting(512 << 20)
    monkeypatch.setenv("AUTOHC_POOL_MB", "0")
    assert memory.BufferPool(memory._setting_from_env()).cap_bytes == 0
    assert memory.BufferPool(0).describe().startswith("off")
    assert memory.BufferPool(512 << 20).describe().startswith("512 MB")
    assert "2048-8192 MB" in memory.BufferPool(memory.CapSetting(2 << 30, 8 << 30)).describe()


def _resident(t: torch.Tensor) -> bool:
    """Every page of t's memory is resident (mincore), i.e. already faulted in."""
    import ctypes
    import mmap as _mmap
    page = _mmap.PAGESIZE
    lo = t.data_ptr() // page * page
    n = -(-(t.data_ptr() + t.nbytes - lo) // page)
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(lo, n * page, vec) == 0
    return all(v & 1 for v in vec)


def _one_step(p, pf, sizes_mb, refill=True):
    """A step's requests in order (each result freed before the next, as a chain of ops
    does), the prefaulter refilled before each as its thread would; per request: whether it
    was a hit and whether its pages were resident before the kernel's first write."""
    pf.step()
    out = []
    for mb in sizes_mb:
        if refill:
            pf.refill()
            assert p.free_bytes <= p.cap_bytes
        hits = p.hits
        t = memory.fresh_empty(mb << 18)                     # mb MiB of float32
        out.append((p.hits > hits, _resident(t)))
        del t
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux")
def test_prefaulter_readies_the_next_steps_blocks_within_the_cap(pool, monkeypatch):
    monkeypatch.setattr(pool, "cap_bytes", 24 << 20)
    pf = memory.Prefaulter(pool, thread=False)
    try:
        sizes = [4, 6, 4, 10, 6, 8, 4]                       # MiB, 4 size classes
        first = _one_step(pool, pf, sizes)                   # nothing recorded yet: misses
        assert pf.stats["stocked"] == 0 and not first[0][0]
        pool.clear()                                         # a cold pool: only stocking can hit
        second = _one_step(pool, pf, sizes)
        assert pf.plan == [memory._size_class(mb << 20) for mb in sizes]
        assert all(hit and resident for hit, resident in second), second
        assert pf.stats["stocked"] >= 4
        # a free block of a size the next requests do not ask for makes room for one they do
        pool.clear()
        keep = memory.fresh_empty(12 << 18)                  # 12 MiB: no request is 12 MiB
        del keep
        evicted = pf.stats["evicted"]
        pf.step()
        pf.refill()
        assert memory._size_class(12 << 20) not in pool.free_counts() and pf.stats["evicted"] == evicted + 1
        pf._trace.clear()                                    # the step starts over
        third = _one_step(pool, pf, sizes)
        assert all(hit for hit, _ in third)
        # without a refill the same cold step misses: the hits above were the prefaulter's
        pool.clear()
        cold = _one_step(pool, pf, sizes, refill=False)
        assert not cold[0][0] and sum(hit for hit, _ in cold) < len(sizes)
    finally:
        pf.close()
    assert pool.listener is None


def test_prefaulter_thread_stocks_ahead_and_detaches(pool, monkeypatch):
    import time
    monkeypatch.setattr(pool, "cap_bytes", 16 << 20)
    pf = memory.Prefaulter(pool, core=None)
    try:
        with pytest.raises(RuntimeError, match="already has a prefaulter"):
            memory.Prefaulter(pool, thread=False)
        for _ in range(2):
            pf.step()
            for mb in (4, 8, 4):
                del_me = memory.fresh_empty(mb << 18)
                del del_me
        pool.clear()
        pf.step()                               # the thread stocks the step's first blocks
        deadline = time.monotonic() + 10
        while pool.free_counts().get(memory._size_class(4 << 20), 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        hits = pool.hits
        first = memory.fresh_empty(4 << 18)
        assert pool.hits == hits + 1 and _resident(first)
    finally:
        pf.close()
    assert pool.listener is None and not pf._thread.is_alive()
    misses = pool.misses
    pool.clear()
    memory.fresh_empty(4 << 18)
    assert pool.misses == misses + 1                        # no thread stocks any more


def test_parameters_to_huge_pages_moves_large_weights_in_place(monkeypatch):
    """The large parameters' data move to huge-page-advised mappings (advice on a 2 MB boundary
    before the copy writes them); values, Parameter objects, small parameters and views of a
    larger storage stay as they were; autograd and an optimizer step then update the moved data,
    and a state_dict round-trips through it."""
    calls = []
    monkeypatch.setattr(memory, "_madvise", lambda: (lambda a, n, adv: calls.append((a, n, adv)) or 0))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1152, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 8))
    shared = torch.nn.Parameter(torch.randn(2048, 1024)[:1536])     # a view into a larger storage
    model.register_parameter("view", shared)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = {n: p for n, p in model.named_parameters()}
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}

    moved = memory.parameters_to_huge_pages(model)

    big = model[0].weight
    assert moved == big.nbytes                       # only the 4.5 MiB weight qualifies
    (a, n, adv), = calls
    assert adv == memory.MADV_HUGEPAGE and a == big.data_ptr() and a % memory.HUGE == 0
    assert n == 2 * memory.HUGE                      # whole huge pages; the tail keeps 4 KB ones
    assert big.data_ptr() != ptrs["0.weight"] and big.is_contiguous()
    for name, p in model.named_parameters():
        assert p is params[name] and torch.equal(p.detach(), before[name]), name
        if name != "0.weight":
            assert p.data_ptr() == ptrs[name], name
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 1152)).sum().backward()
    expected = before["0.weight"].add(big.grad, alpha=-0.1)       # (as SGD computes it)
    opt.step()
    assert big.data_ptr() == a and torch.equal(big.detach(), expected)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model[0].weight.data.zero_()
    model.load_state_dict(state)
    assert big.data_ptr() == a and torch.equal(big.detach(), state["0.weight"])


def test_parameters_to_huge_pages_gives_the_old_weights_memory_back():
    """Where glibc served the weights from its heap (its mmap threshold raised by a large block
    that came and went, as earlier work in a process does), the old copies' pages go back to the
    OS: resident memory does not grow by the weights' size (without the trim it grew by 129 MB
    for these 128 MB)."""
    code = """
import torch, psutil
from autohc.runtime import memory
x = torch.empty(31 << 20, dtype=torch.uint8); x.fill_(1); del x
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(8)])
rss = psutil.Process().memory_info().rss
moved = memory.parameters_to_huge_pages(model)
print(moved, psutil.Process().memory_info().rss - rss)
"""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    moved, grown = map(int, out.split())
    assert moved == 8 * 2048 * 2048 * 4
    assert grown < moved // 4, f"resident memory grew by {grown >> 20} MB for {moved >> 20} MB moved"
