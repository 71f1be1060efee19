"""Tuning on first use (as Triton's autotune and cudnn.benchmark do): the first time `matmul`
(or the torch override) meets a GEMM problem (layout, K, N, M bucket, threads) that the registry
has no entry for, it races a handful of candidates from this CPU's entry in the
per-microarchitecture table (configs/<arch>.yaml) and records the winner. bf16 problems
(bfloat16 operands, or compute="bf16") race the candidates of this CPU's bf16 back-end, on
bf16 operands, and are recorded under their own (dtype) key.

    1st call of a problem: the default kernel runs; the candidates start compiling on a
                           background thread (gcc runs beside the caller's work).
    (under install(), ATen's own kernel is a contender too: where it wins, the entry says
                           `aten_faster` and install() leaves that problem to ATen; problems too
                           small or too skinny for candidates race the default against it alone,
                           and so do all problems of a job that says it is too short to pay for
                           the candidates' race: expect_calls)
    a later call, once they are built: each candidate is verified (GemmVerifier: a wrong one can
                           never win), then the default and the candidates are raced by the one
                           timing protocol within the budget; the default is kept unless beaten by
                           more than the spread, twice: a winner races the default again on fresh
                           samples (pipeline.pick_confirmed). The entry is recorded with
                           "source": "first-use" and that call already runs the winner.
The race runs on the problem's own shapes with operands of its own (never the caller's
tensors), so a result is never changed, only which verified kernel computes it.

Off by default for `autohc.matmul` alone (`autohc.tune.first_use.enable()` turns it on);
`install()` and `autohc train` turn it on (`first_use_tuning=False` / `--no-first-use-tuning`
turn it off), and AUTOHC_FIRST_USE=0 turns it off everywhere. AUTOHC_FIRST_USE_BUDGET is the race's
budget in seconds per problem (default 3; compiles run before it, in the background).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from typing import Callable
from dataclasses import dataclass, field

import torch

from ..bench import timing
from ..build import BuildError
from ..kernels import archs
from ..kernels.gemm import matmul as gemm_matmul
from ..kernels.gemm.family import GEMM
from ..kernels.gemm.kernel import KernelError, default_kernel_params, get_kernel, team_nodes
from ..kernels.gemm.params import GemmParams, ParamError, panel_ring_depth, thread_geometry
from ..kernels.gemm.problem import GemmProblem
from ..kernels.isa import BF16_ISAS
from ..runtime.settings import non_negative_int
from . import pipeline, registry
from .verify import GemmVerifier, WrongResult

MIN_FLOPS = 2e8         # smaller problems: a race would cost more than it could ever win back
MIN_SKINNY_FLOPS = 1e7  # the skinny race holds one candidate, built in a second (DiT-S/2 adaLN: 1.4e7)
SAMPLES = 5
# A race of the candidates costs about a thousand calls of its problem (seven candidates, each
# timed twice): a job that calls the problem fewer times than this races the default against
# ATen only, so that the candidates' race is never more than a few per cent of its time there.
CANDIDATE_MIN_CALLS = 20_000


def env_off() -> bool:
    """AUTOHC_FIRST_USE=0 turns first-use tuning off everywhere (1 or unset: callers decide)."""
    v = os.environ.get("AUTOHC_FIRST_USE", "").strip().lower()
    if v in ("", "1", "on", "true", "yes"):
        return False
    if v in ("0", "off", "false", "no"):
        return True
    raise ValueError(f"AUTOHC_FIRST_USE={v!r}: use 0 (off) or 1 (on)")


def budget_s() -> float:
    return float(non_negative_int("AUTOHC_FIRST_USE_BUDGET", 3, "seconds of racing per GEMM problem"))


@dataclass
class Tuning:
    """One problem's first-use tuning."""
    problem: GemmProblem
    threads: int
    default: GemmParams                 # (its dtype is the problem's)
    candidates: list[GemmParams]
    state: str = "building"             # building -> ready -> done | skipped | failed
    thread: threading.Thread | None = None
    built: list[GemmParams] = field(default_factory=list)
    chosen: GemmParams | None = None
    aten: bool = False                  # ATen's own kernel won the race (install() leaves it ATen's)
    c_fp32: bool = False                # bf16 products into an fp32 C (autocast's weight gradients)
    w_fp32: bool = False                # a float32 B, a Linear's weight (autocast's forward and dX)
    calls_ahead: int | None = None      # the candidates left out: a job of this many calls
    build_s: float = 0.0
    race_s: float = 0.0
    note: str = ""


_lock = threading.Lock()
_tunings: dict[str, Tuning] = {}
_spent = {"race_s": 0.0, "build_s": 0.0}   # totals of this process (bench step reports deltas)
_busy = threading.local()               # the race's own GEMMs must not start tunings
_enabled = False
_aten_runner = None                     # fn(a, b, out): out := a @ b by ATen's own kernel
_calls_ahead: list[int | None] = [None]  # expect_calls' stack: None, a job of unknown length


def set_aten_runner(fn) -> None:
    """ATen's own GEMM, `fn(a, b, out)` (install() sets it, uninstall() clears it): with it a
    race has ATen for a contender, and a problem too small or too skinny for candidates races
    the default against it, so that install() never keeps a kernel slower than what it replaced."""
    global _aten_runner
    _aten_runner = fn


def enable(on: bool = True) -> None:
    """Turn first-use tuning on or off for this process (AUTOHC_FIRST_USE=0 wins over on)."""
    global _enabled
    _enabled = bool(on) and not env_off()
    gemm_matmul.set_registry_miss_hook(on_miss if _enabled else None)


def enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def expect_calls(calls: int | None):
    """Inside the block, the job ahead calls each GEMM problem it meets about `calls` times (a
    command that knows its length says so: its forwards or steps times the model's depth;
    outside, and with None: unknown). A problem met where that is under CANDIDATE_MIN_CALLS
    races the default against ATen only, its candidates left out (its entry says `calls_ahead`);
    a longer job that meets such an entry races the problem again, candidates included."""
    if calls is not None and (isinstance(calls, bool) or not isinstance(calls, int) or calls < 0):
        raise ValueError(f"expect_calls: a count of calls or None, not {calls!r}")
    _calls_ahead.append(calls)
    gemm_matmul.forget_choices()        # (choices made for a job of another length)
    try:
        yield
    finally:
        _calls_ahead.pop()
        gemm_matmul.forget_choices()


def races_candidates() -> bool:
    """Whether a problem met now would race its candidates (the job ahead is long enough, or of
    unknown length)."""
    calls = _calls_ahead[-1]
    return calls is None or calls >= CANDIDATE_MIN_CALLS


def tunings() -> dict[str, Tuning]:
    with _lock:
        return dict(_tunings)


def forget() -> None:
    """Drop this process's memory of tunings (the registry keeps what was recorded)."""
    wait()
    with _lock:
        _tunings.clear()
    gemm_matmul.forget_choices()        # a skipped problem's default was remembered as settled


def _candidates(isa: str, default: GemmParams) -> list[GemmParams]:
    """This CPU's candidates for a problem past the skinny paths (M > skinny_m, the only ones
    raced): built without those paths, which are three quarters of a bf16 kernel's compile
    (4.5 s against 1.0 on an AMX Xeon) and which the problem never takes."""
    overrides = archs.gemm_candidates(isa)
    if default.threads > 1:             # the other thread geometry than the default's: every
        # thread its own JC way (CFTP's split per thread), or a cluster's threads sharing B
        jc, ic, jr = (thread_geometry(default.threads, team_nodes(default.threads)) if default.own_ways
                      else (default.threads, 1, 1))
        overrides.append(dict(jc_ways=jc, ic_ways=ic, jr_ways=jr, depth=panel_ring_depth(jc, ic, jr)))
    out = []
    for c in overrides:
        try:
            p = dataclasses.replace(default, **c).validate()
        except (ParamError, TypeError):
            continue                    # a candidate this thread count cannot run
        if p != default and p not in out:
            out.append(p)
    return [p.without_skinny_paths() for p in out]


def _build(t: Tuning) -> None:
    t0 = time.perf_counter()
    for p in t.candidates:
        try:
            if get_kernel(p).runnable:
                t.built.append(p)
        except (BuildError, KernelError) as e:
            t.note += f"{p.symbol}: {e}; "
    t.build_s = time.perf_counter() - t0
    _spent["build_s"] += t.build_s
    t.state = "ready"


def on_miss(layout: str, M: int, K: int, N: int, threads: int, dtype: str = "fp32",
            c_fp32: bool = False, w_fp32: bool = False) -> tuple[GemmParams | None, bool]:
    """The registry had nothing for this problem: None (run the default) while its tuning is
    under way, the winner from the call that finishes it on; and whether that answer is
    settled (the tuning ended or was skipped: the matmul remembers it). c_fp32: the call
    that met it writes bf16 products into an fp32 C, which its race then times; w_fp32: its B
    is a float32 weight, which the race's contenders then read as the call's ways do."""
    if getattr(_busy, "on", False):
        return None, False
    key = GEMM.problem_key(layout, K, N, M, threads, dtype)
    with _lock:
        t = _tunings.get(key)
        if t is None:
            t = _tunings[key] = _start(layout, M, K, N, threads, dtype, c_fp32, w_fp32)
            return None, t.state == "skipped"
    _race_if_ready(t)
    return t.chosen, t.state in ("done", "skipped", "failed")


on_miss.races_candidates = races_candidates    # (matmul asks it of a short job's entries)


def _race_if_ready(t: Tuning) -> None:
    """Race `t` here if its compiles are done and no other thread has claimed it."""
    with _lock:
        if t.state != "ready":
            return
        t.state = "racing"
    try:
        _race(t)
    except Exception as e:              # tuning must never break the caller's GEMM
        t.state, t.note = "failed", f"{t.note}{type(e).__name__}: {e}"


def _skinny_candidates(problem: GemmProblem, default: GemmParams) -> list[GemmParams]:
    """A bf16 problem on the skinny paths (NT and NN with M <= skinny_m: adaLN, M = batch) has
    one choice, the unit they run on: vdpbf16ps or fp32 FMAs on bf16 widened. The kernel's
    probe picks by the two instructions' throughput ("auto"); the race times the other unit on
    the problem itself, since the paths also stream all of W (an Intel Xeon model 207, where
    the probe picked vdpbf16ps, ran adaLN NT at 0.71x oneDNN). On AMX, where auto takes the
    tiles, the race times the FMA form (that Xeon's vdpbf16ps ran at half its FMA rate). Else []."""
    if (default.dtype != "bf16" or default.isa not in BF16_ISAS or default.skinny_unit != "auto"
            or problem.layout not in ("NT", "NN") or not 0 < problem.M <= default.skinny_m
            or problem.flops < MIN_SKINNY_FLOPS):
        return []
    try:
        picked = get_kernel(default).skinny_unit()
    except (BuildError, KernelError):
        return []
    other = {"dot": "fma", "fma": "dot", "tile": "fma"}.get(picked)
    return [dataclasses.replace(default, skinny_unit=other).validate()] if other else []


def _start(layout: str, M: int, K: int, N: int, threads: int, dtype: str,
           c_fp32: bool = False, w_fp32: bool = False) -> Tuning:
    default = default_kernel_params(threads, dtype=dtype)
    problem = GemmProblem("first-use", layout, M, K, N)
    skinny = _skinny_candidates(problem, default)
    t = Tuning(problem, threads, default, skinny or _candidates(default.isa, default),
               c_fp32=c_fp32 and dtype == "bf16", w_fp32=w_fp32 and dtype == "bf16")
    small = problem.flops < MIN_FLOPS or min(M, N) <= default.skinny_m
    short = not (skinny or small) and bool(t.candidates) and not races_candidates()
    if short:
        t.calls_ahead = _calls_ahead[-1]
    if not skinny and (small or not t.candidates or short):
        if _aten_runner is None or problem.flops <= 0:
            t.state, t.note = "skipped", "too small to gain from tuning" if t.candidates else "no candidates"
        else:                           # nothing to build: the default against ATen, next call
            t.candidates, t.state, t.note = [], "ready", "the default raced against ATen only; "
            if short:
                t.note += f"a job of {t.calls_ahead} calls leaves the candidates out; "
        return t
    t.thread = threading.Thread(target=_build, args=(t,), name="autohc-first-use-build", daemon=True)
    t.thread.start()
    return t


def racer(runs: dict) -> Callable[[list[str]], dict]:
    """A first-use race over `runs` (name -> callable): times the named ones side by side by
    the one timing protocol, within the race budget (pipeline.pick_confirmed's and
    faster_twice's `retime`)."""
    return lambda names: timing.interleaved({k: runs[k] for k in names}, samples=SAMPLES, warmup=1,
                                            max_seconds=budget_s())


def _contenders(t: Tuning, finalists: dict[str, GemmParams],
                dtype: torch.dtype | None) -> tuple[dict[str, Callable[[], object]], torch.Tensor]:
    """The race's runs, and the one C they all write, on the problem's own operands (bfloat16
    where `dtype` is, else float32): each finalist, and ATen's own kernel where install() gave
    one. The C has the form of the call that met the problem: bf16 products go into a bf16 C,
    as install() writes under autocast (with K past one panel it costs fp32 partial sums that
    an fp32 C does not), or with c_fp32 into an fp32 C (autocast's weight gradients), which
    ATen's contender fills as their way back to ATen does (torch/autocast.py: a bf16 product,
    then the cast). Raced into a bf16 C, ATen could win a problem that the cast then made
    slower (docs/history.md, stop 67). With w_fp32, B is float32, as a Linear's weight under
    autocast: autohc's kernels round it while packing, and ATen's contender takes the bf16 copy
    that its way back takes on every call (torch/autocast.py) inside the timed run."""
    a, b = t.problem.operands(seed=1)
    if dtype is not None:               # (.to keeps a transposed view's strides)
        a, b = a.to(dtype), b if t.w_fp32 else b.to(dtype)
    out = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32 if t.c_fp32 else dtype or torch.float32)
    runs = {k: (lambda p=p: gemm_matmul.matmul(a, b, out=out, params=p)) for k, p in finalists.items()}
    aten = _aten_runner
    if aten is not None and t.w_fp32:
        runs["aten"] = lambda: aten(a, b.to(a.dtype), out)
    elif aten is not None and out.dtype != a.dtype:
        c16 = torch.empty(out.shape, dtype=a.dtype)

        def rounded():
            aten(a, b, c16)
            out.copy_(c16)
        runs["aten"] = rounded
    elif aten is not None:              # ATen's own kernel, into the same C
        runs["aten"] = lambda: aten(a, b, out)
    return runs, out


def _race(t: Tuning) -> None:
    t0 = time.perf_counter()
    _busy.on = True
    try:
        verify = GemmVerifier(t.problem, dtype=t.default.dtype)
        finalists = {"default": t.default}
        for i, p in enumerate(t.built):
            try:
                verify(p)
            except WrongResult as e:
                t.note += f"candidate {p.symbol} failed verification: {e}; "
                continue
            finalists[f"candidate {i}"] = p
        runs, _ = _contenders(t, finalists, verify.dtype)
        race = racer(runs)
        first = race(list(runs))
        # autohc's kernel: the default unless a candidate beats it clearly, twice
        ours, times = pipeline.pick_confirmed({k: v for k, v in first.items() if k != "aten"}, "default", race)
        # then ATen's, where it beats that one twice
        t.aten, again = pipeline.faster_twice(first, ours, "aten", race)
        times = {**times, **again}
    finally:
        _busy.on = False
    gf = {k: t.problem.flops / v.median / 1e9 for k, v in {**first, **times}.items()}
    t.chosen, t.race_s = finalists[ours], time.perf_counter() - t0
    for k, p in finalists.items():      # the candidates that lost hold no packed panels
        if k not in ("default", ours):
            get_kernel(p).trim()
    _spent["race_s"] += t.race_s
    p = t.problem
    registry.record("gemm", p.layout, p.K, p.N, p.M, t.threads, t.chosen, gf[ours], gf.get("aten", 0.0),
                    source="first-use", default_gflops=round(gf["default"], 2),
                    default_kept=ours == "default", aten_faster=t.aten,
                    candidates=len(finalists) - 1, build_s=round(t.build_s, 2),
                    race_s=round(t.race_s, 2),
                    **({"calls_ahead": t.calls_ahead} if t.calls_ahead is not None else {}),
                    **({"c_fp32": t.c_fp32, "w_fp32": t.w_fp32} if t.default.dtype == "bf16" else {}))
    t.state = "done"


def spent() -> dict[str, float]:
    """Seconds this process spent on first-use tuning: `race_s` in the callers' threads
    (verification and races, inside the GEMM call that met the problem again, or in
    finish_pending), `build_s` compiling on background threads (beside the callers' work)."""
    return dict(_spent)


def wait(timeout: float | None = None) -> None:
    """Until every background compile has finished (tests, `autohc bench gemm`)."""
    for t in tunings().values():
        if t.thread is not None:
            t.thread.join(timeout)


def finish_pending() -> float:
    """Run every started tuning to the end now: wait for its compiles, race, record. Seconds
    spent. `autohc bench step` calls it between steps, so that its timed steps run what first
    use settled on, and reports that time apart."""
    t0 = time.perf_counter()
    for t in tunings().values():
        if t.thread is not None:
            t.thread.join()
        _race_if_ready(t)
    return time.perf_counter() - t0


def finish(layout: str, M: int, K: int, N: int, threads: int, dtype: str = "fp32",
           c_fp32: bool = False) -> Tuning | None:
    """This problem's first-use tuning, started if needed and run to the end now (what
    `autohc bench gemm` times apart), raced into an fp32 C where c_fp32 (on_miss). None if
    first-use tuning is off."""
    if not _enabled:
        return None
    key = GEMM.problem_key(layout, K, N, M, threads, dtype)
    if key not in tunings():
        on_miss(layout, M, K, N, threads, dtype, c_fp32)
    finish_pending()
    return tunings()[key]
