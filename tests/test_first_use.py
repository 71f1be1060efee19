"""Tuning on first use: a GEMM problem with no registry entry gets its candidates from the
per-microarchitecture table raced and the winner recorded; no result ever changes."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import autohc
from autohc.kernels.gemm.family import GEMM
from autohc.kernels.gemm.matmul import matmul
from autohc.tune import first_use, registry
from autohc.tune.verify import U32


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOHC_REGISTRY", str(tmp_path / "registry.json"))
    monkeypatch.setenv("AUTOHC_FIRST_USE", "1")
    monkeypatch.setenv("AUTOHC_FIRST_USE_BUDGET", "1")
    registry.forget()
    first_use.forget()
    yield
    first_use.enable(False)
    first_use.forget()
    registry.forget()


def _close(out, a, b):
    ref = a.double() @ b.double()
    bound = 2.0 * (a.shape[1] + 4) * U32 * (a.double().abs() @ b.double().abs()) + 1e-30
    return bool(((out.double() - ref).abs() <= bound).all())


def test_first_use_records_an_entry_and_never_changes_a_result(fresh):
    first_use.enable()
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(512, 384, generator=g), torch.randn(1152, 384, generator=g)
    x0, w0 = x.clone(), w.clone()
    threads = 2
    key = GEMM.problem_key("NT", 384, 1152, 512, threads)
    first = matmul(x, w.t(), threads=threads)            # starts the tuning: default kernel
    assert _close(first, x, w.t())
    assert first_use.tunings()[key].state in ("building", "ready")
    first_use.wait()
    second = matmul(x, w.t(), threads=threads)           # races, records, runs the winner
    t = first_use.tunings()[key]
    assert t.state == "done", t.note
    assert _close(second, x, w.t())
    assert torch.equal(x, x0) and torch.equal(w, w0)     # the race never used the caller's data
    hit = registry.lookup("gemm", "NT", 384, 1152, 512, threads, exact=True)
    assert hit is not None and hit[1]["source"] == "first-use"
    assert hit[0] == t.chosen and hit[1]["candidates"] >= 1
    third = matmul(x, w.t(), threads=threads)             # now a registry hit
    assert _close(third, x, w.t())
    if t.chosen == t.default:
        assert torch.equal(third, first)


def test_install_tunes_on_first_use_and_the_switch_turns_it_off(fresh, monkeypatch):
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(640, 384, generator=g), torch.randn(768, 384, generator=g)
    want = F.linear(x, w)
    with autohc.installed(first_use_tuning=False):
        F.linear(x, w)
        assert not first_use.tunings()
    with autohc.installed():
        assert first_use.enabled()
        y1 = F.linear(x, w)
        first_use.wait()
        y2 = F.linear(x, w)
    assert not first_use.enabled()                       # uninstall turned it off again
    torch.testing.assert_close(y1, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y2, want, rtol=1e-4, atol=1e-4)
    done = [t for t in first_use.tunings().values() if t.state == "done"]
    assert done and all(t.problem.layout == "NT" for t in done)
    monkeypatch.setenv("AUTOHC_FIRST_USE", "0")
    first_use.forget()
    with autohc.installed():
        assert not first_use.enabled()
        F.linear(torch.randn(700, 384), w)
    assert not first_use.tunings()


def test_small_and_skinny_problems_are_not_tuned(fresh):
    first_use.enable()
    matmul(torch.randn(8, 384), torch.randn(384, 1152))      # skinny (adaLN-like)
    matmul(torch.randn(64, 64), torch.randn(64, 64))         # tiny
    first_use.wait()
    assert {t.state for t in first_use.tunings().values()} == {"skipped"}
    assert not registry.entries_for_this_cpu("gemm")


def test_a_choice_is_remembered_only_once_settled(fresh):
    """Every GEMM call asks which kernel to run; the answer is remembered once it is settled
    (a registry entry, the default with no first-use tuning, a tuning ended or skipped), and
    asked again while a tuning is under way, after the registry file changes or the hook does."""
    from autohc.kernels.gemm import matmul as gm
    from autohc.kernels.gemm.kernel import default_kernel_params
    asked = []
    settled = {"now": False}

    def hook(layout, M, K, N, threads, dtype, c_fp32, w_fp32):
        asked.append((layout, M, K, N))
        return None, settled["now"]
    at = lambda: gm.tuned_params(512, 384, 1152, (384, 1), (1, 384), 1)   # noqa: E731
    try:
        gm.set_registry_miss_hook(hook)
        assert at() == default_kernel_params(1) and at() == default_kernel_params(1)
        assert len(asked) == 2                      # under way: asked on every call
        settled["now"] = True
        at(), at(), at()
        assert len(asked) == 3                      # settled: remembered
        gm.forget_choices()
        at()
        assert len(asked) == 4
        other = dataclasses.replace(default_kernel_params(1), kc=default_kernel_params(1).kc // 2).validate()
        registry.record("gemm", "NT", 384, 1152, 512, 1, other, 120.0, 100.0, trials=5)
        assert at() == other and at() == other      # the file changed: its entry, not the default
        assert len(asked) == 4
        gm.set_registry_miss_hook(None)
        assert at() == other
    finally:
        gm.set_registry_miss_hook(None)
    first_use.enable()
    assert gm._registry_miss_hook is first_use.on_miss and gm._choices["registry"] is None


def test_on_miss_says_when_its_answer_is_settled(fresh):
    first_use.enable()
    assert first_use.on_miss("NT", 64, 64, 64, 1) == (None, True)            # too small: skipped
    chosen, settled = first_use.on_miss("NT", 512, 384, 1152, 2)             # tuning started
    assert chosen is None and not settled
    first_use.wait()
    chosen, settled = first_use.on_miss("NT", 512, 384, 1152, 2)             # raced here: ended
    assert settled and chosen == first_use.tunings()[GEMM.problem_key("NT", 384, 1152, 512, 2)].chosen


def test_bad_switch_value_is_one_clear_error(fresh, monkeypatch):
    monkeypatch.setenv("AUTOHC_FIRST_USE", "maybe")
    with pytest.raises(ValueError, match="AUTOHC_FIRST_USE"):
        first_use.enable()


def test_an_entry_that_kept_an_earlier_default_is_tuned_again(fresh):
    """A first-use entry records whether it kept the default; where today's default is another
    configuration (a new release), the problem is tuned again, not pinned to the old one, and
    `autohc info` says so of the entry."""
    import dataclasses
    from autohc.kernels.gemm import matmul as gm
    from autohc.kernels.gemm.kernel import default_kernel_params
    threads = 2
    today = default_kernel_params(threads)
    old = dataclasses.replace(today, depth=3 if today.depth != 3 else 2)
    assert old != today
    args = ("gemm", "NT", 384, 1152, 512, threads)
    from autohc.cli.kernels import _first_use_entries

    def info():                     # autohc info's line of this problem
        return [line for line in _first_use_entries(registry) if "NT/K384/N1152/M512/t2" in line]
    registry.record(*args, old, 100.0, 100.0, source="first-use", default_gflops=100.0, default_kept=True)
    assert gm.tuned_params(512, 384, 1152, (384, 1), (1, 384), threads) == today       # not `old`
    assert "an earlier default kept: tuned again on its next use" in info()[0]
    registry.record(*args, old, 100.0, 100.0, source="first-use", default_gflops=100.0)  # older entry
    assert gm.tuned_params(512, 384, 1152, (384, 1), (1, 384), threads) == today
    registry.record(*args, old, 120.0, 100.0, source="first-use", default_gflops=100.0)  # a winner
    assert gm.tuned_params(512, 384, 1152, (384, 1), (1, 384), threads) == old
    assert "(candidate won;" in info()[0]
    registry.record(*args, today, 100.0, 100.0, source="first-use", default_gflops=100.0, default_kept=True)
    assert "(default kept;" in info()[0]                                                # today's default
    registry.record(*args, old, 100.0, 100.0, trials=5)                                  # autohc tune
    assert gm.tuned_params(512, 384, 1152, (384, 1), (1, 384), threads) == old


def test_info_line_says_where_a_comes_from_its_rows(fresh):
    """`autohc info`'s line of a first-use entry names a_direct and its N bound, so that two
    entries that differ only by it do not read the same."""
    from autohc.cli.kernels import _first_use_entries
    from autohc.kernels.gemm.params import GemmParams
    base = dict(isa="avx512bf16", vl=16, mr=12, nr=32, kc=1152, mc=6144, nc=384, dtype="bf16", a_outer=True)
    lines = {}
    for n, (name, more) in enumerate((("packed", {}), ("direct", {"a_direct": True}),
                                      ("bounded", {"a_direct": True, "a_direct_n": 2048})), start=384):
        p = GemmParams(**base, **more).validate()
        registry.record("gemm", "NN", 1152, n, 2048, 1, p, 100.0, 90.0, source="first-use", default_gflops=100.0)
        lines[name] = next(line for line in _first_use_entries(registry) if f"/N{n}/" in line)
    assert "a_direct" not in lines["packed"]
    assert " a_direct ways" in lines["direct"]
    assert " a_direct (N <= 2048) ways" in lines["bounded"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_candidates_leave_out_the_skinny_paths_a_raced_problem_never_takes(dtype):
    """Only problems past skinny_m are raced, so their candidates are built without the skinny
    paths (most of a bf16 kernel's compile); everything else is the table's override."""
    import dataclasses
    from autohc.kernels.gemm.kernel import default_kernel_params
    default = default_kernel_params(2, dtype=dtype)
    got = first_use._candidates(default.isa, default)
    assert got and all(p.skinny_m == 0 for p in got)
    for p in got:
        assert dataclasses.replace(p, skinny_m=default.skinny_m) != default


def test_an_entry_without_the_skinny_paths_is_not_used_for_a_skinny_m(fresh):
    """A problem of a few rows takes the nearest M bucket's entry only where that entry kept
    the skinny paths this M takes in the default kernel; else the default runs."""
    import dataclasses
    from autohc.kernels.gemm import matmul as gm
    from autohc.kernels.gemm.kernel import default_kernel_params
    threads = 1
    default = default_kernel_params(threads)
    assert default.skinny_m >= 8
    without = dataclasses.replace(default, skinny_m=0, depth=3 if default.depth != 3 else 2).validate()
    registry.record("gemm", "NT", 384, 1152, 512, threads, without, 120.0, 100.0, trials=5)
    at = lambda m: gm.tuned_params(m, 384, 1152, (384, 1), (1, 384), threads)   # noqa: E731
    assert at(512) == without and at(100) == without       # its bucket and the nearest past skinny_m
    assert at(8) == default                                  # the nearest entry for 8 rows lacks the paths
    kept = dataclasses.replace(without, skinny_m=default.skinny_m).validate()
    registry.record("gemm", "NT", 384, 1152, 512, threads, kept, 120.0, 100.0, trials=5)
    assert at(8) == kept


def _two_candidates(monkeypatch):
    """The first two of this CPU's candidates: the bf16 race tests need no more (a whole
    list took 33-40 s of gcc on an AMX Xeon)."""
    candidates = first_use._candidates
    monkeypatch.setattr(first_use, "_candidates", lambda isa, default: candidates(isa, default)[:2])


def test_bf16_races_time_a_bf16_c_and_verify_it(fresh, monkeypatch):
    """A bf16 problem's candidates are timed writing a bf16 C (install()'s output under
    autocast, whose last K panel is its own code path) and verified in one too: a candidate
    wrong only there never wins."""
    import dataclasses
    from autohc.kernels.gemm import matmul as gm
    from autohc.kernels.gemm.kernel import default_kernel_params
    from autohc.tune.verify import GemmVerifier, WrongResult
    from autohc.kernels.gemm.problem import GemmProblem
    seen = []
    real = gm.matmul

    def spy(a, b, *args, out=None, params=None, **kw):
        seen.append(None if out is None else out.dtype)
        return real(a, b, *args, out=out, params=params, **kw)
    monkeypatch.setattr(gm, "matmul", spy)                  # the race's calls
    monkeypatch.setattr("autohc.tune.verify.matmul", spy)  # the verifier's
    _two_candidates(monkeypatch)
    first_use.enable()
    threads = 2
    problem = GemmProblem("t", "NT", 512, 384, 1152)
    t = first_use.finish("NT", 512, 384, 1152, threads, "bf16")
    assert t is not None and t.state == "done", t and t.note
    # each candidate verified into a bf16 C, then every finalist (and the default) raced in one
    assert seen.count(torch.bfloat16) >= len(t.built) + 2 * (len(t.built) + 1)

    default = default_kernel_params(threads, dtype="bf16")
    verify = GemmVerifier(problem, dtype="bf16")
    verify(default)

    def wrong_in_bf16(a, b, *args, out=None, params=None, **kw):
        r = real(a, b, *args, out=out, params=params, **kw)
        if r.dtype == torch.bfloat16:
            r[0, 0] += 1.0
        return r
    monkeypatch.setattr("autohc.tune.verify.matmul", wrong_in_bf16)
    with pytest.raises(WrongResult, match="bf16 C"):
        verify(dataclasses.replace(default, kc=default.kc))


def test_bf16_problems_are_tuned_under_their_own_key(fresh, monkeypatch):
    """A bf16 product (bfloat16 operands) races the bf16 back-end's candidates on bf16
    operands and is recorded under the bf16 key, never the fp32 one of the same shape."""
    _two_candidates(monkeypatch)
    first_use.enable()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(512, 384, generator=g).bfloat16()
    w = torch.randn(1152, 384, generator=g).bfloat16()
    threads = 2
    key16 = GEMM.problem_key("NT", 384, 1152, 512, threads, "bf16")
    first = matmul(x, w.t(), out=torch.empty(512, 1152), threads=threads)
    assert _close(first, x, w.t())                       # bf16 products are exact in fp32
    tunings = first_use.tunings()
    assert key16 in tunings and GEMM.problem_key("NT", 384, 1152, 512, threads) not in tunings
    first_use.wait()
    second = matmul(x, w.t(), out=torch.empty(512, 1152), threads=threads)
    t = first_use.tunings()[key16]
    assert t.state == "done", t.note
    assert t.chosen.dtype == "bf16" and t.default.dtype == "bf16"
    assert _close(second, x, w.t())
    hit = registry.lookup("gemm", "NT", 384, 1152, 512, threads, exact=True, dtype="bf16")
    assert hit is not None and hit[1]["source"] == "first-use" and hit[0] == t.chosen
    assert registry.lookup("gemm", "NT", 384, 1152, 512, threads, exact=True) is None


@pytest.mark.parametrize("own", [False, True])
def test_first_use_races_the_other_thread_geometry(monkeypatch, own):
    """On several threads the race holds the geometry the default does not have: every thread
    its own JC way where the default shares B panels, the shared split where it does not."""
    from autohc.kernels import archs
    from autohc.kernels.gemm.params import default_params
    monkeypatch.setattr(archs, "gemm_own_ways_up_to", lambda isa, arch=None: 2 if own else 0)
    default = default_params("avx2", 2, "haswell")
    assert (default.jc_ways, default.ic_ways) == ((2, 1) if own else (1, 2))
    geos = {(p.jc_ways, p.ic_ways, p.jr_ways, p.depth) for p in first_use._candidates("avx2", default)}
    # with the panel ring of that geometry: double where the ways share panels, else single
    assert ((1, 2, 1, 2) if own else (2, 1, 1, 1)) in geos


def _two_races(monkeypatch, wins_again: bool) -> list:
    """first_use's races faked: in the first, candidate 0 clearly ahead of the default; in the
    second (the confirmation), ahead again or not. Returns the list of each race's runs."""
    from autohc.bench.timing import Timing
    races = []

    def fake_interleaved(runs, **kw):
        races.append(sorted(runs))
        if len(races) == 1:
            return {k: Timing(0.5 if k == "candidate 0" else 1.0, 0.01) for k in runs}
        return {k: Timing(1.0 if k == "default" else (0.8 if wins_again else 0.999), 0.01) for k in runs}
    monkeypatch.setattr(first_use.timing, "interleaved", fake_interleaved)
    return races


@pytest.mark.parametrize("wins_again", [False, True])
def test_a_candidate_that_wins_the_race_must_win_a_second_one(fresh, monkeypatch, wins_again):
    """The race's winner over the default runs a second race of the two: it is recorded only if
    it wins that one too, with that race's figures (the first race's would be biased fast)."""
    races = _two_races(monkeypatch, wins_again)
    first_use.enable()
    threads = 1
    key = GEMM.problem_key("NT", 384, 1152, 512, threads)
    t = first_use.finish("NT", 512, 384, 1152, threads)
    assert t is first_use.tunings()[key] and t.state == "done", t.note
    assert len(races) == 2 and races[1] == ["candidate 0", "default"]
    hit = registry.lookup("gemm", "NT", 384, 1152, 512, threads, exact=True)[1]
    flops = 2 * 512 * 384 * 1152
    assert hit["default_kept"] is (not wins_again)
    assert hit["default_gflops"] == round(flops / 1.0 / 1e9, 2)          # the second race's
    assert (t.chosen == t.default) is (not wins_again)


@pytest.mark.parametrize("wins_again", [False, True])
def test_bf16_skinny_problems_race_the_other_unit(fresh, monkeypatch, wins_again):
    """A bf16 adaLN-like problem (NT, M = 8 <= skinny_m) races the skinny paths' other unit
    (fp32 FMAs where the probe picked vdpbf16ps, and the reverse; FMAs beside AMX's tiles)
    against the default, and keeps it only after two wins; where this CPU has no bf16
    back-end (the widened fallback has no skinny paths) it is not tuned."""
    import dataclasses
    from autohc.kernels.gemm.kernel import default_kernel_params, get_kernel
    from autohc.kernels.isa import BF16_ISAS
    threads = 1
    default = default_kernel_params(threads, dtype="bf16")
    first_use.enable()
    races = _two_races(monkeypatch, wins_again)
    t = first_use.finish("NT", 8, 1152, 2304, threads, "bf16")
    if default.isa not in BF16_ISAS or not default.skinny_m:
        assert t.state == "skipped" and not races
        return
    picked = get_kernel(default).skinny_unit()
    other = {"dot": "fma", "fma": "dot", "tile": "fma"}[picked]
    assert t.state == "done", t.note
    assert t.candidates == [dataclasses.replace(default, skinny_unit=other)]
    assert len(races) == 2 and races[0] == ["candidate 0", "default"]
    assert t.chosen.skinny_unit == (other if wins_again else "auto")
    hit = registry.lookup("gemm", "NT", 1152, 2304, 8, threads, exact=True, dtype="bf16")
    assert hit is not None and hit[0] == t.chosen and hit[1]["default_kept"] is (not wins_again)
    # the product is right on the unit recorded (a registry hit from here on)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(8, 1152, generator=g).bfloat16()
    w = torch.randn(2304, 1152, generator=g).bfloat16()
    assert _close(matmul(x, w.t(), out=torch.empty(8, 2304), threads=threads), x, w.t())
    # fp32 and TN (K = batch: no skinny path) are still not tuned
    assert first_use.finish("TN", 8, 1152, 2304, threads, "bf16").state == "skipped"


def test_install_races_aten_and_leaves_it_the_problems_it_wins(fresh, monkeypatch):
    """Under install(), ATen's own kernel is a contender of every first-use race; where it wins
    (forced here: the race's pick is patched), the entry says so and install() sends that
    problem, in that M bucket only, to ATen, with ATen's own result."""
    from autohc.bench import timing
    from autohc.cli.kernels import _first_use_entries
    from autohc.torch import served
    raced = []

    def aten_faster(fns, **kw):                         # every contender runs; ATen "is faster"
        raced.append(sorted(fns))
        for f in fns.values():
            f()
        return {k: timing.Timing(0.5e-3 if k == "aten" else 1e-3, 0.01) for k in fns}
    monkeypatch.setattr(first_use.timing, "interleaved", aten_faster)
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(96, 64, generator=g), torch.randn(80, 64, generator=g)
    want = F.linear(x, w)                                # ATen's, before install
    with autohc.installed(threads=1):
        F.linear(x, w)                                   # meets the problem: races the default and ATen
        first_use.wait()
        F.linear(x, w)
        assert raced[0] == ["aten", "default"] and raced[-1] == ["aten", "default"]    # and confirmed
        before = dict(served.stats)
        got = F.linear(x, w)
        assert served.stats["aten"] == before["aten"] + 1 and served.stats["autohc"] == before["autohc"]
        assert torch.equal(got, want)
        other = F.linear(torch.randn(1024, 64, generator=g), w)     # another M bucket: autohc's
        assert served.stats["autohc"] > before["autohc"]
        assert other.shape == (1024, 80)
    (key, entry), = [(k, e) for k, e in registry.entries_for_this_cpu("gemm").items() if "/M128/" in k]
    assert entry["aten_faster"] is True and entry["torch_gflops"] > 0 and entry["source"] == "first-use"
    assert any("ATen faster" in line for line in _first_use_entries(registry))
    assert first_use._aten_runner is None                # uninstall took ATen's contender away


def test_a_problem_too_small_for_candidates_races_the_default_against_aten(fresh):
    """Skipped without install() (no candidates worth the race); under it, the default races
    ATen, and whichever wins, the results stay right."""
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)
    first_use.enable()
    matmul(x, w.t(), threads=1)
    assert {t.state for t in first_use.tunings().values()} == {"skipped"}
    first_use.forget()
    with autohc.installed(threads=1):
        y1 = F.linear(x, w)
        first_use.wait()
        y2 = F.linear(x, w)
        t, = first_use.tunings().values()
        assert t.state == "done" and "ATen" in t.note, t.note
    entry, = registry.entries_for_this_cpu("gemm").values()
    assert entry["torch_gflops"] > 0 and entry["aten_faster"] == t.aten
    for y in (y1, y2):
        torch.testing.assert_close(y, x @ w.t(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("aten_ms, want", [((0.5, 0.5), True), ((2.0,), False), ((0.9, 1.1), False)])
def test_aten_is_kept_only_where_it_wins_the_race_and_the_one_after(fresh, monkeypatch, aten_ms, want):
    """ATen against autohc's kept kernel: faster in the race and in a second race of the two
    (no margin either way), else autohc's kernel stays."""
    from autohc.bench import timing
    from autohc.kernels.gemm.problem import GemmProblem
    from autohc.kernels.gemm.kernel import default_kernel_params
    rounds = iter(aten_ms)

    def fake(fns, **kw):
        ms = next(rounds) if "aten" in fns else 1.0
        return {k: timing.Timing((ms if k == "aten" else 1.0) * 1e-3, 0.01) for k in fns}
    monkeypatch.setattr(first_use.timing, "interleaved", fake)
    first_use.set_aten_runner(lambda a, b, out: torch.mm(a, b, out=out))
    try:
        t = first_use.Tuning(GemmProblem("first-use", "NT", 96, 64, 80), 1, default_kernel_params(1), [])
        first_use._race(t)
    finally:
        first_use.set_aten_runner(None)
    assert t.state == "done" and t.aten is want and t.chosen == t.default
    assert next(rounds, None) is None                    # a second race exactly where the first was won
    entry, = registry.entries_for_this_cpu("gemm").values()
    assert entry["aten_faster"] is want


def _record_what_starts_a_tuning(monkeypatch) -> list:
    """(layout, dtype, c_fp32, w_fp32) of each tuning started from here on; none runs (skipped)."""
    from autohc.kernels.gemm.kernel import default_kernel_params
    from autohc.kernels.gemm.problem import GemmProblem
    met = []

    def start(layout, M, K, N, threads, dtype, c_fp32=False, w_fp32=False):
        met.append((layout, dtype, c_fp32, w_fp32))
        return first_use.Tuning(GemmProblem("first-use", layout, M, K, N), threads,
                                default_kernel_params(threads, dtype=dtype), [], state="skipped")
    monkeypatch.setattr(first_use, "_start", start)
    return met


def test_the_call_that_meets_a_bf16_problem_says_whether_its_c_is_fp32(fresh, monkeypatch):
    """autocast's weight gradient (gemm_into, bf16 products into an fp32 dW) starts its
    problem's tuning as c_fp32; a bf16 C (gemm_bf16_into: the forward and dX) and an fp32
    problem do not."""
    from autohc.kernels.gemm.kernel import KernelError, default_kernel_params
    from autohc.kernels.gemm.matmul import gemm_bf16_into, gemm_into
    from autohc.kernels.isa import BF16_ISAS
    met = _record_what_starts_a_tuning(monkeypatch)
    first_use.enable()
    g = torch.Generator().manual_seed(11)
    dy, x = torch.randn(96, 40, generator=g).bfloat16(), torch.randn(96, 24, generator=g).bfloat16()
    dw = torch.empty(40, 24)
    gemm_into(dy.t(), x, dw, 1.0, 0.0, 1, dtype="bf16")
    assert _close(dw, dy.t(), x)
    try:
        gemm_bf16_into(x.t(), dy, torch.empty(24, 40, dtype=torch.bfloat16), 1.0, 1)
    except KernelError:                 # (the widened fallback has no bf16 store; the problem was met)
        assert default_kernel_params(1, dtype="bf16").isa not in BF16_ISAS
    gemm_into(dy.float().t(), x.float(), dw, 1.0, 0.0, 1)
    assert met == [("TN", "bf16", True, False), ("TN", "bf16", False, False), ("TN", "fp32", False, False)]


def test_bench_gemm_races_a_bf16_problem_as_training_meets_it(fresh, monkeypatch):
    """`autohc bench gemm`'s first-use race of a bf16 weight gradient (TN) times the fp32 dW
    that training writes (its entry then serves training as is); the forward, dX and fp32
    problems race their own C."""
    from autohc.bench import gemm as bench
    from autohc.kernels.gemm.problem import GemmProblem
    met = _record_what_starts_a_tuning(monkeypatch)
    first_use.enable()
    for layout, dtype in (("TN", "bf16"), ("NT", "bf16"), ("NN", "bf16"), ("TN", "fp32")):
        row = bench.bench_problem(GemmProblem("t", layout, 64, 48, 40), 1, repeats=1, dtype=dtype,
                                  with_numpy=False, target_seconds=0.01)
        assert row.gflops > 0 and row.torch_gflops > 0
    assert met == [("TN", "bf16", True, False), ("NT", "bf16", False, False), ("NN", "bf16", False, False),
                   ("TN", "fp32", False, False)]


def _contenders_watching_aten(t, watch) -> tuple[dict, torch.Tensor]:
    """first_use._contenders of `t` (the default alone against ATen), ATen's contender calling
    watch(a, b, out) before its product."""
    def aten(a, b, out):
        watch(a, b, out)
        torch.mm(a, b, out=out)
    first_use.set_aten_runner(aten)
    try:
        return first_use._contenders(t, {"default": t.default}, torch.bfloat16)
    finally:
        first_use.set_aten_runner(None)


@pytest.mark.parametrize("c_fp32", [True, False])
def test_a_bf16_race_times_atens_contender_into_the_calls_c(fresh, c_fp32):
    """With c_fp32 every contender writes one fp32 C: autohc's kernel its fp32 sums, ATen's its
    bf16 product cast (the weight gradient's way back to ATen); without, both a bf16 C."""
    from autohc.kernels.gemm.kernel import default_kernel_params
    from autohc.kernels.gemm.problem import GemmProblem
    c_dtypes = []
    t = first_use.Tuning(GemmProblem("first-use", "TN", 40, 96, 24), 1,
                         default_kernel_params(1, dtype="bf16"), [], c_fp32=c_fp32)
    runs, out = _contenders_watching_aten(t, lambda a, b, out: c_dtypes.append(out.dtype))
    assert sorted(runs) == ["aten", "default"] and out.dtype == (torch.float32 if c_fp32 else torch.bfloat16)
    a, b = t.problem.operands(seed=1, dtype=torch.bfloat16)
    runs["default"]()
    ours = out.clone()
    if c_fp32:
        assert _close(ours, a, b)
    assert c_fp32 is not torch.equal(ours, ours.bfloat16().to(out.dtype))   # fp32 sums, not rounded
    runs["aten"]()
    assert c_dtypes == [torch.bfloat16]             # ATen's mm wrote a bf16 C either way
    assert torch.equal(out, torch.mm(a, b).to(out.dtype))


def test_a_race_into_an_fp32_c_is_recorded_and_shown(fresh, monkeypatch):
    """The entry of a race run into an fp32 C says so, and so does `autohc info`'s line, since
    its torch_gflops is then ATen's product with the cast."""
    from autohc.bench import timing
    from autohc.cli.kernels import _first_use_entries
    from autohc.kernels.gemm.kernel import default_kernel_params
    from autohc.kernels.gemm.problem import GemmProblem
    monkeypatch.setattr(first_use.timing, "interleaved",
                        lambda fns, **kw: {k: timing.Timing(1e-3, 0.01) for k in fns})
    first_use.set_aten_runner(lambda a, b, out: torch.mm(a, b, out=out))
    try:
        for c_fp32, n in ((True, 24), (False, 32)):
            t = first_use.Tuning(GemmProblem("first-use", "TN", 40, 96, n), 1,
                                 default_kernel_params(1, dtype="bf16"), [], c_fp32=c_fp32)
            first_use._race(t)
            assert t.state == "done" and not t.aten
    finally:
        first_use.set_aten_runner(None)
    entries = registry.entries_for_this_cpu("gemm")
    assert [e.get("c_fp32", False) for _, e in sorted(entries.items(), key=lambda kv: kv[1]["N"])] == [True, False]
    lines = _first_use_entries(registry)
    assert [("raced into an fp32 C" in line) for line in sorted(lines, key=lambda s: "/N32/" in s)] == [True, False]


def test_an_older_entry_giving_atens_uncast_product_a_weight_gradient_is_raced_again(fresh):
    """An entry raced before races knew the caller's C (no c_fp32 field) that gave a bf16 TN
    problem to ATen is raced again when an fp32-C call (a weight gradient) meets it; a bf16-C
    call keeps it, and so does every call once the entry says which C it timed, or where
    first-use tuning is off."""
    from autohc.kernels.gemm import matmul as gm
    from autohc.kernels.gemm.kernel import default_kernel_params
    asked = []

    def hook(layout, M, K, N, threads, dtype, c_fp32, w_fp32):
        asked.append(c_fp32)
        return None, True
    bf16 = default_kernel_params(1, dtype="bf16")
    old = registry.record("gemm", "TN", 384, 1152, 2048, 1, bf16, 100.0, 110.0, source="first-use",
                          default_gflops=100.0, default_kept=True, aten_faster=True)
    assert "c_fp32" not in old
    sa, sb = (1, 1152), (384, 1)                     # dYᵀ (column-major), X: Linear M 2048, K 384, N 1152
    at = lambda c_fp32: gm._choice(1152, 2048, 384, sa, sb, 1, "bf16", c_fp32)   # noqa: E731
    try:
        gm.set_registry_miss_hook(hook)
        assert at(False) == (bf16, True) and asked == []           # ATen's, as recorded
        assert at(True) == (bf16, False) and asked == [True]       # raced again (the hook)
        for c in (True, False):
            registry.record("gemm", "TN", 384, 1152, 2048, 1, bf16, 100.0, 110.0, source="first-use",
                            default_gflops=100.0, default_kept=True, aten_faster=True, c_fp32=c)
            assert at(True) == (bf16, True) and at(False) == (bf16, True)
        assert asked == [True]
        gm.set_registry_miss_hook(None)                 # first-use tuning off: the entry stands
        registry.record("gemm", "TN", 384, 1152, 2048, 1, bf16, 100.0, 110.0, source="first-use",
                        default_gflops=100.0, default_kept=True, aten_faster=True)
        assert at(True) == (bf16, True)
    finally:
        gm.set_registry_miss_hook(None)


def test_the_call_that_meets_a_bf16_problem_on_an_fp32_weight_says_so(fresh, monkeypatch):
    """autocast's forward and dX read a Linear's fp32 weight as B (gemm_bf16_into rounds it while
    packing; ATen's way back casts it each call): their problem's tuning starts as w_fp32; the same
    product on a bf16 B does not."""
    from autohc.kernels.gemm.kernel import KernelError
    from autohc.kernels.gemm.matmul import gemm_bf16_into
    met = _record_what_starts_a_tuning(monkeypatch)
    first_use.enable()
    g = torch.Generator().manual_seed(12)
    x, w = torch.randn(96, 40, generator=g).bfloat16(), torch.randn(24, 40, generator=g)
    for b in (w.t(), w.bfloat16().t()):
        try:
            gemm_bf16_into(x, b, torch.empty(96, 24, dtype=torch.bfloat16), 1.0, 1)
        except KernelError:             # (the widened fallback has no bf16 store; the problem was met)
            pass
    assert met == [("NT", "bf16", False, True)]     # (one tuning a problem: the first call's form)
    first_use.forget()
    try:
        gemm_bf16_into(x, w.bfloat16().t(), torch.empty(96, 24, dtype=torch.bfloat16), 1.0, 1)
    except KernelError:
        pass
    assert met[1:] == [("NT", "bf16", False, False)]


def test_a_race_on_an_fp32_weight_casts_it_inside_atens_timed_run(fresh):
    """With w_fp32 autohc's contenders read B in float32 (rounded while packing) and ATen's
    contender casts it to bf16 on every run, as its way back does; both give the product of the
    rounded weight. The entry says w_fp32, and so does `autohc info`'s line."""
    from autohc.bench import timing
    from autohc.cli.kernels import _first_use_entries
    from autohc.kernels.gemm.kernel import default_kernel_params
    from autohc.kernels.gemm.problem import GemmProblem
    bs = []
    t = first_use.Tuning(GemmProblem("first-use", "NT", 40, 96, 24), 1,
                         default_kernel_params(1, dtype="bf16"), [], w_fp32=True)
    runs, out = _contenders_watching_aten(t, lambda a, b, out: bs.append(b))
    a, w = t.problem.operands(seed=1, dtype=torch.bfloat16)[0], t.problem.operands(seed=1)[1]
    assert w.dtype == torch.float32 and out.dtype == torch.bfloat16
    runs["aten"](), runs["aten"]()
    assert len(bs) == 2 and bs[0] is not bs[1]                      # a cast in every run
    assert all(b.dtype == torch.bfloat16 and torch.equal(b, w.bfloat16()) for b in bs)
    want = torch.mm(a, w.bfloat16())
    assert torch.equal(out, want)
    out.zero_()
    runs["default"]()
    ref = a.double() @ w.bfloat16().double()                         # (the rounded weight's product)
    bound = 2 ** -8 * ref.abs() + 2.0 * 100 * U32 * (a.double().abs() @ w.bfloat16().double().abs())
    assert bool(((out.double() - ref).abs() <= bound).all())         # (one bf16 rounding of C)
    first_use.set_aten_runner(lambda a, b, out: torch.mm(a, b, out=out))
    try:
        first_use._race(t)
    finally:
        first_use.set_aten_runner(None)
    entry, = registry.entries_for_this_cpu("gemm").values()
    assert entry["w_fp32"] is True and entry["c_fp32"] is False
    assert ["raced on an fp32 weight" in line for line in _first_use_entries(registry)] == [True]


def test_an_entry_giving_atens_product_on_a_bf16_weight_is_raced_again_for_an_fp32_one(fresh):
    """An entry that gave ATen a forward problem raced on a bf16 B (no w_fp32 field, or false) is
    raced again when a call on an fp32 weight meets it (ATen's way back would add the cast); a
    call on a bf16 B keeps it, and so does every call once the entry was raced on an fp32
    weight, or where first-use tuning is off."""
    from autohc.kernels.gemm import matmul as gm
    from autohc.kernels.gemm.kernel import default_kernel_params
    asked = []

    def hook(layout, M, K, N, threads, dtype, c_fp32, w_fp32):
        asked.append(w_fp32)
        return None, True
    bf16 = default_kernel_params(1, dtype="bf16")
    rec = lambda **kw: registry.record("gemm", "NT", 192, 1152, 64, 1, bf16, 100.0, 110.0,   # noqa: E731
                                       source="first-use", default_gflops=100.0, default_kept=True,
                                       aten_faster=True, **kw)
    sa, sb = (192, 1), (1, 192)                      # X, Wᵀ (a transposed view): M 64, K 192, N 1152
    at = lambda w_fp32: gm._choice(64, 192, 1152, sa, sb, 1, "bf16", False, w_fp32)   # noqa: E731
    try:
        gm.set_registry_miss_hook(hook)
        for old in ({}, {"c_fp32": False, "w_fp32": False}):
            gm.forget_choices()
            rec(**old)
            assert at(False) == (bf16, True)                        # ATen's, as recorded
            assert at(True) == (bf16, False) and asked[-1] is True  # raced again (the hook)
        n = len(asked)
        rec(c_fp32=False, w_fp32=True)
        assert at(True) == (bf16, True) and at(False) == (bf16, True) and len(asked) == n
        gm.set_registry_miss_hook(None)                 # first-use tuning off: the entry stands
        rec()
        assert at(True) == (bf16, True)
    finally:
        gm.set_registry_miss_hook(None)


def test_a_short_job_races_the_default_against_aten_only(fresh, monkeypatch):
    """Inside expect_calls(n) with n under CANDIDATE_MIN_CALLS, a problem that would race
    candidates races the default against ATen only (nothing built), and its entry says how many
    calls the job had; a job of unknown length or a long one builds the candidates as before.
    Problems that race no candidates anyway (small ones) are not marked."""
    from autohc.kernels.gemm.kernel import default_kernel_params
    built = []
    monkeypatch.setattr(first_use, "_build", lambda t: built.append(t.problem.N))
    first_use.set_aten_runner(lambda a, b, out: torch.mm(a, b, out=out))
    try:
        with pytest.raises(ValueError):
            with first_use.expect_calls(-1):
                pass
        start = lambda n: first_use._start("NT", 512, 384, n, 1, "bf16")   # noqa: E731
        with first_use.expect_calls(600):
            assert not first_use.races_candidates()
            short, small = start(1152), first_use._start("NT", 16, 16, 16, 1, "bf16")
        assert short.candidates == [] and short.state == "ready" and short.calls_ahead == 600
        assert "leaves the candidates out" in short.note and small.calls_ahead is None
        for calls in (None, first_use.CANDIDATE_MIN_CALLS):
            with first_use.expect_calls(calls):
                t = start(1536 if calls is None else 768)
            assert t.candidates and t.calls_ahead is None
            t.thread.join()
        assert sorted(built) == [768, 1536] and first_use.races_candidates()
        monkeypatch.setattr(first_use.timing, "interleaved",
                            lambda fns, **kw: {k: first_use.timing.Timing(1e-3, 0.01) for k in fns})
        first_use._race(short)
    finally:
        first_use.set_aten_runner(None)
    entry, = registry.entries_for_this_cpu("gemm").values()
    assert entry["calls_ahead"] == 600 and entry["candidates"] == 0
    from autohc.cli.kernels import _first_use_entries
    line, = _first_use_entries(registry)
    assert "candidates left out for a job of 600 calls" in line


def test_a_short_jobs_entry_is_raced_again_by_a_longer_job(fresh):
    """An entry raced without its candidates for a short job (`calls_ahead`) stands for calls
    where first-use tuning would leave them out too, and is raced again where it would race them
    (a longer job); an entry raced with them stands for every job."""
    from autohc.kernels.gemm import matmul as gm
    from autohc.kernels.gemm.kernel import default_kernel_params
    asked = []

    def hook(layout, M, K, N, threads, dtype, c_fp32, w_fp32):
        asked.append(N)
        return None, True
    bf16 = default_kernel_params(1, dtype="bf16")
    sa, sb = (384, 1), (1, 384)
    at = lambda: gm._choice(512, 384, 1152, sa, sb, 1, "bf16")      # noqa: E731
    try:
        gm.set_registry_miss_hook(hook)
        for long_job in (False, True):
            hook.races_candidates = lambda: long_job    # noqa: B023
            for short in (True, False):
                gm.forget_choices()
                registry.record("gemm", "NT", 384, 1152, 512, 1, bf16, 100.0, 90.0, source="first-use",
                                default_gflops=100.0, default_kept=True, aten_faster=False,
                                **({"calls_ahead": 600} if short else {}))
                n = len(asked)
                at()
                assert len(asked) - n == int(long_job and short)
    finally:
        gm.set_registry_miss_hook(None)
