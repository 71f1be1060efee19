"""Tune one GEMM problem with Optuna on the one pipeline (tune/pipeline.py):
params -> render -> build -> verify -> time -> registry.

One study per (op, layout, M, K, N, threads, ISA, CPU fingerprint), in Optuna RDB storage
(SQLite in the cache by default, any URL Optuna accepts), so an interrupted tune resumes and
several nodes can share a study. The default configuration is the first trial, so tuning
never ends worse than the default. A candidate that fails to build, crashes or computes a
wrong result is a failed trial and can never be recorded as best.
"""
from __future__ import annotations

import logging
import time
import warnings

import torch

from ..bench import timing
from ..bench.gemm import set_blas_threads
from ..build import BuildError, cache_dir
from ..hw import cpu
from ..kernels.gemm.kernel import KernelError, default_kernel_params, get_kernel
from ..kernels.gemm.matmul import matmul
from ..kernels.gemm.params import GemmParams, ParamError
from ..kernels.gemm.problem import GemmProblem
from ..kernels.isa import BF16_ISAS
from . import pipeline, registry
from .result import TuneResult
from .space import starting_points, suggest_params
from .verify import GemmVerifier, WrongResult


class StorageError(ValueError):
    """The --storage URL cannot be opened."""


def default_storage_url() -> str:
    return f"sqlite:///{cache_dir() / 'tune.db'}"


_OPEN_ATTEMPTS = 6
_RACE_MARKS = ("UNIQUE constraint failed", "database is locked", "already exists")


def open_storage(url: str | None = None):
    """Optuna RDBStorage for `url` (default: SQLite in the cache); StorageError if unusable."""
    import optuna
    if url is None:
        url = default_storage_url()
        cache_dir().mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    for attempt in range(_OPEN_ATTEMPTS):
        try:
            # heartbeats let a resumed (or another node's) tune fail trials of a killed process
            return optuna.storages.RDBStorage(url, heartbeat_interval=2, grace_period=6)
        except Exception as e:  # noqa: BLE001 - sqlalchemy raises many kinds
            first = str(e).splitlines()[0]
            # processes opening a new database at once race to create its schema; the loser
            # sees the winner's rows (UNIQUE constraint) or its lock and only has to retry
            if attempt + 1 < _OPEN_ATTEMPTS and any(m in first for m in _RACE_MARKS):
                time.sleep(0.05 * 2 ** attempt)
                continue
            raise StorageError(f"cannot open tuning storage {url!r}: {first}") from None


def study_name(p: GemmProblem, threads: int, isa: str) -> str:
    """(a bf16 back-end's name says the dtype)"""
    return (f"gemm-{p.layout}-M{p.M}-K{p.K}-N{p.N}-t{threads}-{isa}-"
            f"{cpu.detect().fingerprint}")


def _against_torch(problem: GemmProblem, candidates: dict[str, GemmParams], threads: int,
                   **race_kw) -> dict:
    """Each candidate's matmul and torch.matmul ("baseline") on the problem's operands, timed
    side by side by the one protocol (pipeline.race) at `threads` for every library. bf16: C
    in the form training writes it (GemmProblem.c_fp32): a bf16 C for the forward and dX, as
    install() writes under autocast, and torch's is oneDNN's; an fp32 C for a weight
    gradient, where torch's is oneDNN's bf16 product and then the cast into the fp32 dW, as
    stock autocast runs it."""
    dtype = next(iter(candidates.values())).dtype
    a, b = problem.operands(0, torch.bfloat16 if dtype == "bf16" else None)
    out = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32 if problem.c_fp32(dtype) else a.dtype)
    base_out = torch.empty(out.shape, dtype=a.dtype)

    def baseline():
        torch.matmul(a, b, out=base_out)
        if out.dtype != base_out.dtype:
            out.copy_(base_out)
    for p in candidates.values():
        get_kernel(p)
    undo = set_blas_threads(threads)
    try:
        return pipeline.race({k: (lambda p=p: matmul(a, b, out=out, params=p))
                              for k, p in candidates.items()}, baseline, **race_kw)
    finally:
        undo()


def measure(problem: GemmProblem, params: GemmParams, threads: int,
            samples: int = 5) -> pipeline.Measured:
    """One trial's timing: autohc vs torch.matmul, interleaved, samples of the usual length."""
    t = _against_torch(problem, {"candidate": params}, threads, samples=samples,
                       min_sample_s=timing.MIN_SAMPLE_S)
    return pipeline.Measured(params, t["candidate"].median, t["baseline"].median,
                             t["candidate"].spread)


def tune_problem(problem: GemmProblem, threads: int = 1, *, trials: int | None = 40,
                 timeout: float | None = 60.0, storage: str | None = None, seed: int = 0,
                 force: bool = False, isa: str | None = None, progress=None,
                 dtype: str = "fp32") -> TuneResult:
    """Tune (or answer from the registry) one problem. `trials` is the study's total.
    dtype bf16: on this CPU's bf16 back-end (AVX512_BF16 or AMX; ValueError where it has
    neither: the widened fallback runs the fp32 kernels, tuned as fp32)."""
    import optuna                       # imported only when a problem is really tuned
    t0 = time.perf_counter()
    if dtype == "bf16":
        isa = isa or cpu.bf16_isa()[0]
        if isa not in BF16_ISAS:
            raise ValueError(f"nothing to tune in bf16 on {isa}: {cpu.bf16_isa()[1]}")
    isa = isa or cpu.best_isa()
    if not force:
        hit = registry.lookup("gemm", problem.layout, problem.K, problem.N, problem.M, threads,
                              exact=True, dtype=dtype)
        if hit and hit[1].get("M") == problem.M and hit[0].isa == isa:
            return TuneResult.from_entry(problem, threads, *hit, time.perf_counter() - t0)
    optuna.logging.set_verbosity(logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    store = open_storage(storage)
    name = study_name(problem, threads, isa)
    study = optuna.create_study(study_name=name, storage=store, direction="maximize",
                                sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=4),
                                load_if_exists=True)
    if not study.trials:            # the default first: tuning never ends worse than it
        for values in starting_points(default_kernel_params(threads, isa, dtype), isa):
            study.enqueue_trial(values)
    verifier = GemmVerifier(problem, seed, dtype)

    def objective(trial) -> float:
        try:
            params = suggest_params(trial, isa, threads)
        except ParamError as e:
            raise optuna.TrialPruned(str(e)) from None
        if problem.M > params.skinny_m:             # paths this problem never takes
            params = params.without_skinny_paths()
        trial.set_user_attr("params", params.to_dict())
        kernel = get_kernel(params)                 # build: BuildError / KernelError fail it
        try:
            verifier(params)                        # verify: WrongResult fails it
            m = measure(problem, params, threads)   # time
        finally:
            kernel.trim()                           # (a study's trials would hold GBs of panels)
        trial.set_user_attr("torch_gflops", problem.flops / m.baseline_seconds / 1e9)
        trial.set_user_attr("spread", round(m.spread, 4))
        return problem.flops / m.seconds / 1e9

    def callback(study, trial) -> None:
        if progress:
            progress(study, trial)

    finished = [t for t in study.trials if t.state.is_finished()]
    remaining = None if trials is None else max(0, trials - len(finished))
    if remaining != 0:
        study.optimize(objective, n_trials=remaining, timeout=timeout, callbacks=[callback],
                       catch=(BuildError, KernelError, WrongResult, RuntimeError))
    trials_done = sum(t.state.is_finished() for t in study.trials)   # not the waiting starts
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if not complete:
        raise RuntimeError(f"tuning {name}: no trial completed (see the study in {store.url})")
    params, gflops, torch_gflops, default_gflops = final_race(
        problem, threads, default_kernel_params(threads, isa, dtype), complete)
    result = TuneResult(problem, threads, params, gflops, torch_gflops, trials_done, False, name,
                        time.perf_counter() - t0, default_gflops=default_gflops)
    registry.record("gemm", problem.layout, problem.K, problem.N, problem.M, threads, params,
                    result.gflops, result.torch_gflops, trials=trials_done, study=name,
                    storage=_redact(store.url), default_gflops=round(default_gflops, 2),
                    **({"c_fp32": problem.c_fp32(dtype)} if dtype == "bf16" else {}))
    return result


def final_race(problem: GemmProblem, threads: int, default: GemmParams, complete: list):
    """(params kept, its GFLOP/s, torch's, the default's): the best FINALISTS trials and the
    default raced again (pipeline.race); the default stays unless beaten by more than the
    spread, in that race and in one more of the two (pipeline.pick_confirmed). Figures are the
    last race's, not the search's."""
    ranked = sorted(complete, key=lambda t: t.value, reverse=True)
    finalists: dict[str, GemmParams] = {"default": default}
    for t in ranked:
        p = GemmParams.from_dict(t.user_attrs["params"])
        if len(finalists) > pipeline.FINALISTS:
            break
        if p not in finalists.values():
            finalists[f"trial {t.number}"] = p
    times = _against_torch(problem, finalists, threads)
    kept, times = pipeline.pick_confirmed(
        times, "default", lambda names: _against_torch(problem, {k: finalists[k] for k in names}, threads))
    gf = {k: problem.flops / t.median / 1e9 for k, t in times.items()}
    return finalists[kept], gf[kept], gf["baseline"], gf["default"]


def _redact(url: str) -> str:
    """A storage URL without its password, for the registry."""
    try:
        from sqlalchemy.engine import make_url
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001
        return url.split("@")[-1]
