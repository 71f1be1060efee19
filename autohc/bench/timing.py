"""The one timing protocol of autohc: the tuner, `autohc bench gemm|ops|step` and the CI gate
all measure with it.

- Candidates are interleaved: every round takes one sample of each, in an order that rotates
  from round to round, so that the shared machine's noise (and any order effect) falls on all
  of them alike.
- Each callable is warmed up first (page faults, packing buffers, thread pools).
- A sample is long enough to average out the scheduler's noise: as many back-to-back calls as
  fill `min_sample_s` (a 2048x384x1152 GEMM is one call of about 1 ms: a sample of a few
  milliseconds is mostly noise here). Before each sample one call runs untimed, so another
  library's thread pool still spinning from its last call does not fall on the timed ones.
- The figure is the median over samples of the seconds per call, with the spread beside it:
  the interquartile range over the median (0.05 = 5 %).
- Cold caches (`before`, `autohc bench gemm --cold`): a callable runs untimed before every
  timed call (an element-wise op over more memory than the caches hold, as a training step
  runs between its GEMMs), so each call is timed on its own and the samples hold at most
  COLD_CALLS calls.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

MIN_SAMPLE_S = 0.02         # seconds of back-to-back calls per sample
MAX_CALLS = 1000
COLD_CALLS = 8              # calls per sample at most where each has an untimed `before`


@dataclass
class Timing:
    median: float               # seconds per call
    spread: float               # (q3 - q1) / median over the samples
    samples: list[float] = field(default_factory=list)
    calls_per_sample: int = 1

    @property
    def spread_pct(self) -> float:
        return round(100 * self.spread, 1)


def summarize(samples: list[float], calls_per_sample: int = 1) -> Timing:
    """Median and spread of seconds-per-call samples."""
    if not samples:
        raise ValueError("no samples to summarize")
    med = statistics.median(samples)
    if len(samples) >= 4:
        q1, _, q3 = statistics.quantiles(samples, n=4)
    else:
        q1, q3 = min(samples), max(samples)
    return Timing(med, (q3 - q1) / med if med > 0 else 0.0, list(samples), calls_per_sample)


def _calls_for(fn: Callable[[], object], min_sample_s: float) -> int:
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    return max(1, min(MAX_CALLS, round(min_sample_s / one)))


def interleaved(fns: dict[str, Callable[[], object]], *, samples: int = 7, warmup: int = 2,
                min_sample_s: float = MIN_SAMPLE_S, max_seconds: float | None = None,
                min_samples: int = 3, before: Callable[[], object] | None = None) -> dict[str, Timing]:
    """Time each callable by the protocol above; returns {name: Timing} (seconds per call).
    `max_seconds` stops after `min_samples` rounds once that much time has gone by.
    `before`: run untimed before every timed call (cold caches: see above)."""
    if not fns:
        return {}
    for _ in range(warmup):
        for f in fns.values():
            f()
    calls = {k: _calls_for(f, min_sample_s) for k, f in fns.items()}
    if before is not None:
        calls = {k: min(n, COLD_CALLS) for k, n in calls.items()}
    names = list(fns)
    taken: dict[str, list[float]] = {k: [] for k in names}
    deadline = None if max_seconds is None else time.perf_counter() + max_seconds
    for r in range(samples):
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order:
            f, n = fns[k], calls[k]
            f()                                     # untimed: the switch from another callable
            if before is None:
                t0 = time.perf_counter()
                for _ in range(n):
                    f()
                taken[k].append((time.perf_counter() - t0) / n)
                continue
            spent = 0.0
            for _ in range(n):
                before()
                t0 = time.perf_counter()
                f()
                spent += time.perf_counter() - t0
            taken[k].append(spent / n)
        if deadline is not None and r + 1 >= min_samples and time.perf_counter() > deadline:
            break
    return {k: summarize(v, calls[k]) for k, v in taken.items()}
