"""Stopping a long job cleanly when the batch system asks (SIGTERM at a time limit, scancel or
preemption; the signal a job asked for with Slurm's `--signal=USR1@120`).

`StopSignals` is a context manager for the main thread of `autohc train`, `autohc sample --num`
and `autohc encode`. The first signal only sets `requested`: the job looks at it at its next
boundary (a training step, a shard of samples, a batch of images), saves what it has and exits
with EXIT_PREEMPTED. A second signal, more than `grace_s` after the first, exits at once with
128 + its number: the files being written are removed first (`writing`), so the last good file
stays the newest one. Signals within `grace_s` of the first count as the same request: Slurm
signals every process of a step and torchrun forwards its own SIGTERM to its workers, so a
worker is often told twice at the same moment.

Exit codes of these jobs (docs/training.md):
    0                finished
    1                an error (a crashed rank, a kernel that failed)
    2                bad input, a configuration that does not match the run in --out, or a
                     checkpoint / shard that could not be written (the previous one stays)
    75 (EX_TEMPFAIL) stopped by a signal after writing its state: the same command continues
    128 + N          a second signal N: exited at once, the last good checkpoint intact
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

EXIT_PREEMPTED = 75             # sysexits.h EX_TEMPFAIL: "try again later"
DEFAULT_GRACE_S = 2.0

_writing: set[Path] = set()     # files half-written now, removed on an immediate exit
_lock = threading.Lock()


def parse_signal(text: str) -> signal.Signals:
    """USR1, SIGUSR1, usr1 or 10 -> signal.SIGUSR1; ValueError naming the choices otherwise."""
    t = text.strip().upper()
    try:
        return signal.Signals(int(t)) if t.isdigit() else signal.Signals[t if t.startswith("SIG") else "SIG" + t]
    except (KeyError, ValueError):
        raise ValueError(f"{text!r} is not a signal name or number (e.g. TERM, USR1, USR2, 10)") from None


def name(sig: int) -> str:
    return signal.Signals(sig).name


@contextmanager
def writing(path: Path) -> Iterator[Path]:
    """Marks `path` as half-written while the block runs: an immediate exit removes it."""
    path = Path(path)
    with _lock:
        _writing.add(path)
    try:
        yield path
    finally:
        with _lock:
            _writing.discard(path)


class StopSignals:
    """Catches `signals` while the block runs (main thread only; elsewhere it does nothing).

    requested: the name of the first signal caught (e.g. "SIGTERM"), or None.
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM,), grace_s: float = DEFAULT_GRACE_S):
        self.signals = list(dict.fromkeys(int(s) for s in signals))
        self.grace_s = grace_s
        self.requested: str | None = None
        self.requested_signal: int | None = None
        self._first_at = 0.0
        self._old: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.requested is None:
            self.requested, self.requested_signal, self._first_at = name(signum), signum, now
            return
        if now - self._first_at <= self.grace_s:        # the same request, told twice
            return
        with _lock:
            for p in list(_writing):
                try:
                    p.unlink()
                except OSError:
                    pass
        try:
            os.write(2, f"autohc: {name(signum)} again: exiting at once; the last checkpoint "
                        "written stays the newest\n".encode())
        finally:
            os._exit(128 + signum)

    def __bool__(self) -> bool:
        return self.requested is not None


def stop_signals(extra: int | None = None) -> list[int]:
    """SIGTERM (what Slurm, PBS and torchrun send first) and the job's own signal, if any."""
    sigs = [signal.SIGTERM]
    if extra is not None and extra != signal.SIGTERM:
        sigs.append(extra)
    return sigs


def requeue(log=None) -> bool:
    """Ask Slurm to requeue this job (`scontrol requeue $SLURM_JOB_ID`, as PyTorch Lightning
    does); True if scontrol said yes. Outside a Slurm job, a note and False."""
    import shutil
    import subprocess
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    env = os.environ
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):     # one task of an array
        job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    else:
        job = env.get("SLURM_JOB_ID")
    if not job:
        log("autohc: --requeue: not in a Slurm job (no SLURM_JOB_ID): nothing requeued")
        return False
    exe = shutil.which("scontrol")
    if exe is None:
        log(f"autohc: --requeue: scontrol is not on PATH: job {job} not requeued")
        return False
    try:
        r = subprocess.run([exe, "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        log(f"autohc: --requeue: scontrol requeue {job} failed ({type(e).__name__}: {e})")
        return False
    if r.returncode != 0:
        why = (r.stderr or r.stdout).strip().splitlines()
        log(f"autohc: --requeue: scontrol requeue {job} exited {r.returncode}" + (f": {why[0]}" if why else ""))
        return False
    log(f"autohc: requeued Slurm job {job} (scontrol requeue {job})")
    return True
