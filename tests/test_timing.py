"""The one timing protocol (autohc/bench/timing.py): its cold-cache form."""
import time

from autohc.bench import timing


def test_before_runs_untimed_before_every_timed_call():
    """`before` (bench gemm --cold's cache eviction) runs right before each timed call, and
    its time is not counted: a 1 ms call with 6 ms before it still reads about 1 ms."""
    log = []

    def before():
        log.append("before")
        time.sleep(0.006)

    def call():
        log.append("call")
        time.sleep(0.001)

    t = timing.interleaved({"call": call}, samples=3, warmup=1, before=before)["call"]
    assert 1 <= t.calls_per_sample <= timing.COLD_CALLS
    assert log.count("before") == 3 * t.calls_per_sample
    assert all(log[i + 1] == "call" for i, e in enumerate(log) if e == "before")
    assert 0.0009 <= t.median < 0.004


def test_bench_problem_cold_times_every_library_after_the_eviction(monkeypatch):
    from autohc.bench import gemm
    from autohc.kernels.gemm.problem import GemmProblem
    ran = []
    real = gemm.cache_evictor

    def counting(mb=gemm.COLD_MB):
        op = real(1)
        return lambda: (ran.append(1), op())
    monkeypatch.setattr(gemm, "cache_evictor", counting)
    row = gemm.bench_problem(GemmProblem("t", "NT", 64, 48, 80), 1, repeats=2, cold=True)
    assert len(ran) >= 3 * 2                # (autohc, torch, numpy: a call or more per sample)
    assert row.gflops > 0 and row.torch_gflops > 0 and row.numpy_gflops > 0
    # the row's rates are rounded to 0.1 GFLOP/s and its ratio to 0.001 from the unrounded rates,
    # so a slow (cold, tiny) sample bounds the ratio by the rounding, not by a relative tolerance
    lo = max(row.gflops - 0.05, 0) / (row.torch_gflops + 0.05) - 5e-4
    hi = (row.gflops + 0.05) / max(row.torch_gflops - 0.05, 1e-9) + 5e-4
    assert lo <= row.speedup_vs_torch <= hi
    ran.clear()
    gemm.bench_problem(GemmProblem("t", "NT", 64, 48, 80), 1, repeats=2)
    assert not ran


def test_bench_gemm_cold_reaches_every_problem_and_says_so(monkeypatch):
    """`autohc bench gemm --cold`: every problem timed cold, and the result says how it was timed
    (the rows' figures come from bench_problem, tested above)."""
    from autohc.bench import gemm
    from autohc.cli import build_parser
    seen = []

    def fake(p, threads, **kw):
        seen.append(kw["cold"])
        return gemm.GemmRow(p.name, p.layout, p.M, p.K, p.N, threads, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    monkeypatch.setattr(gemm, "bench_problem", fake)
    args = build_parser().parse_args(["bench", "gemm", "--model", "dit-s", "--cold"])
    r = gemm.bench_gemm(args.model, 1, first_use_tuning=False, cold=args.cold)
    assert seen == [True] * 15 and r["caches"].startswith("cold")
    seen.clear()
    assert gemm.bench_gemm("dit-s", 1, first_use_tuning=False)["caches"].startswith("warm")
    assert seen == [False] * 15


def test_bench_gemm_operands_in_huge_pages(monkeypatch):
    """`autohc bench gemm --pages`: huge (the default) gives every library operands laid out as
    before (a transposed view stays one) in huge-page blocks; 4k keeps torch's allocations."""
    import torch
    from autohc.bench import gemm
    from autohc.cli import build_parser
    from autohc.kernels.gemm.problem import GemmProblem
    from autohc.runtime import memory
    w = torch.randn(40, 48)
    for t in (w, w.t()):
        h = gemm.in_huge_pages(t)
        assert torch.equal(h, t) and h.stride() == t.stride() and h.data_ptr() != t.data_ptr()
        assert h.data_ptr() % memory.HUGE == 0 or h.nbytes < memory.HUGE_MIN_BYTES
    placed = []                     # copies (the operands) and empties (the results) in huge pages
    real_copy, real_empty = gemm.huge_page_copy, gemm.huge_page_empty
    monkeypatch.setattr(gemm, "huge_page_copy", lambda t: placed.append(t.shape) or real_copy(t))
    monkeypatch.setattr(gemm, "huge_page_empty", lambda *s, **kw: placed.append(s) or real_empty(*s, **kw))
    row = gemm.bench_problem(GemmProblem("t", "TN", 64, 48, 80), 1, repeats=1, dtype="bf16", huge_pages=True)
    assert row.gflops > 0 and row.torch_gflops > 0 and len(placed) == 8   # a, b, C, numpy's C, a16, b16, 2 bf16 C
    placed.clear()
    gemm.bench_problem(GemmProblem("t", "TN", 64, 48, 80), 1, repeats=1)
    assert not placed
    seen = []
    monkeypatch.setattr(gemm, "bench_problem", lambda p, threads, **kw: seen.append(kw["huge_pages"]) or
                        gemm.GemmRow(p.name, p.layout, p.M, p.K, p.N, threads, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0))
    for argv, pages in (([], "huge"), (["--pages", "4k"], "4k")):
        args = build_parser().parse_args(["bench", "gemm", "--model", "dit-s", *argv])
        assert args.pages == pages
        r = gemm.bench_gemm(args.model, 1, first_use_tuning=False, huge_pages=args.pages == "huge")
        assert r["pages"] == pages and set(seen) == {pages == "huge"}
        seen.clear()
