"""The tuner's one pipeline, for every kernel family:

    params -> render -> build -> verify -> time -> (the search keeps the best) -> record

`evaluate` runs one candidate through build, verification and timing against its baseline
(torch) by the one timing protocol (bench/timing.py); what fails on the way (BuildError,
KernelError, WrongResult) fails the trial, so a wrong or broken kernel can never be recorded.
The operator tuner calls it; the GEMM tuner takes the same three steps in its objective
(get_kernel, GemmVerifier, then `race` at the tuned thread count). After the search, `race` times the finalists (the best few and the default) again, longer and
side by side, and `pick` keeps the default unless a finalist beats it by more than the spread;
`pick_confirmed` races such a finalist against the default once more before it is kept;
`faster_twice` says whether ATen's kernel beat the one kept, twice (install()'s first-use races).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..bench import timing


@dataclass
class Candidate:
    params: Any
    build: Callable[[], object]     # render + compile + load (raises BuildError, KernelError)
    verify: Callable[[], None]      # raises verify.WrongResult
    run: Callable[[], object]       # the timed call


@dataclass
class Measured:
    params: Any
    seconds: float                  # median per call
    baseline_seconds: float
    spread: float                   # of the candidate's samples (IQR / median)

    @property
    def speedup(self) -> float:
        return self.baseline_seconds / self.seconds


FINALISTS = 3                   # best trials raced again against the default at the end
RACE_SAMPLES = 9
RACE_SAMPLE_S = 0.05            # longer samples than a trial's: the race decides what is kept


def race(runs: dict[str, Callable[[], object]], baseline: Callable[[], object], *,
         samples: int = RACE_SAMPLES, min_sample_s: float = RACE_SAMPLE_S) -> dict[str, timing.Timing]:
    """The finalists and the baseline (key "baseline") timed again, side by side, by the one
    protocol with longer samples: a search's best trial is a maximum over noisy measurements."""
    return timing.interleaved({**runs, "baseline": baseline}, samples=samples,
                              min_sample_s=min_sample_s)


def pick(times: dict[str, timing.Timing], default: str) -> str:
    """The fastest finalist, unless it beats the default by no more than the measured spread
    (the larger of the two): then the default is kept."""
    best = min((k for k in times if k != "baseline"), key=lambda k: times[k].median)
    if best == default or default not in times:
        return best
    d, b = times[default], times[best]
    return best if b.median < d.median * (1 - max(d.spread, b.spread)) else default


def pick_confirmed(times: dict[str, timing.Timing], default: str,
                   retime: Callable[[list[str]], dict[str, timing.Timing]]) -> tuple[str, dict[str, timing.Timing]]:
    """`pick`, then a finalist that beat the default races it once more on fresh samples
    (`retime(names)`: those runs timed again) and is kept only if it wins again. Returns the
    name kept and the timings whose figures to report: the second race's where there was one.
    Why: of several noisy contenders the fastest is biased fast (the winner's curse). On a Zen
    5 a first-use race kept the old bf16 blocks for a TN GEMM (4608x2048x1152, 1 thread) by
    1.1 %, where timed apart they ran 5 % slower than the default (458.7 vs 481.8 GFLOP/s); a
    second, independent race of the two does not share the first one's luck."""
    kept = pick(times, default)
    if kept == default or default not in times:
        return kept, times
    again = retime([default, kept])
    return (kept if pick(again, default) == kept else default), again


def faster_twice(times: dict[str, timing.Timing], ours: str, other: str,
                 retime: Callable[[list[str]], dict[str, timing.Timing]]) -> tuple[bool, dict[str, timing.Timing]]:
    """Whether `other` (ATen's kernel) ran faster than `ours` in `times` and again in a second
    race of the two (`retime([ours, other])`), by medians with no margin: at a tie either is as
    good, and install() must never keep the slower. Returns it and the second race's timings
    ({} where there was none)."""
    if other not in times or times[other].median >= times[ours].median:
        return False, {}
    again = retime([ours, other])
    return again[other].median < again[ours].median, again


def evaluate(c: Candidate, baseline: Callable[[], object], *, samples: int = 5,
             min_sample_s: float = timing.MIN_SAMPLE_S) -> Measured:
    c.build()
    c.verify()
    t = timing.interleaved({"candidate": c.run, "baseline": baseline}, samples=samples,
                           min_sample_s=min_sample_s)
    return Measured(c.params, t["candidate"].median, t["baseline"].median, t["candidate"].spread)
