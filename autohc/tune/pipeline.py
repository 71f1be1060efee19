"""The tuner's one pipeline, for every kernel family:

    params -> render -> build -> verify -> time -> (the search keeps the best) -> record

`evaluate` runs one candidate through build, verification and timing against its baseline
(torch) by the one timing protocol (bench/timing.py); what fails on the way (BuildError,
KernelError, WrongResult) fails the trial, so a wrong or broken kernel can never be recorded.
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


def evaluate(c: Candidate, baseline: Callable[[], object], *, samples: int = 5,
             min_sample_s: float = timing.MIN_SAMPLE_S) -> Measured:
    c.build()
    c.verify()
    t = timing.interleaved({"candidate": c.run, "baseline": baseline}, samples=samples,
                           min_sample_s=min_sample_s)
    return Measured(c.params, t["candidate"].median, t["baseline"].median, t["candidate"].spread)
