"""GEMM benchmark: autohc vs torch.matmul (MKL) vs numpy (OpenBLAS), measured in one run.
bf16: autohc's bf16 kernels vs torch's bf16 matmul (oneDNN), both bf16 in and bf16 C, and
vs the fp32 libraries on the fp32 operands (what the bf16 kernels must beat to be worth it).

The machine is shared and noisy, so the three are timed by the one protocol (bench/timing.py:
interleaved, warmed up, samples of 20 ms and more, medians with their spread); ratios measured
side by side are the figures to trust, not absolute numbers from another day.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ..hw import cpu
from ..kernels.gemm.kernel import bf16_skinny_unit, default_kernel_params, get_kernel
from ..kernels.gemm.matmul import matmul, tuned_params
from ..kernels.gemm.params import GemmParams
from ..kernels.gemm.problem import GemmProblem, dit_problems
from ..runtime.memory import huge_page_copy, huge_page_empty
from ..tune import first_use, registry
from . import timing


def set_blas_threads(threads: int):
    """numpy's OpenBLAS and torch's MKL/OpenMP to `threads`; returns an undo callable."""
    from threadpoolctl import threadpool_limits
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    limiter = threadpool_limits(limits=threads, user_api="blas")

    def undo():
        torch.set_num_threads(old)
        limiter.restore_original_limits()
    return undo


COLD_MB = 64


def cache_evictor(mb: int = COLD_MB):
    """An element-wise op over `mb` MB (half read, half written) on torch's threads, for
    `--cold`: run before each timed call, it leaves A, B and C out of the cores' L1 and L2 (and
    of an L3 share smaller than that), as the ops between a training step's GEMMs do, where
    back-to-back calls find them in L2 (measured on an AMX Xeon: the step's K = 384 GEMMs ran
    1500-1970 GFLOP/s against 2600-2900 back to back; docs/history.md, stop 58)."""
    src = torch.ones(mb * 2**20 // 8)
    dst = torch.empty_like(src)
    return lambda: torch.mul(src, 1.0001, out=dst)


@dataclass
class GemmRow:
    name: str
    layout: str
    M: int
    K: int
    N: int
    threads: int
    gflops: float
    torch_gflops: float
    numpy_gflops: float
    pct_peak: float
    speedup_vs_torch: float
    speedup_vs_numpy: float
    config: str = "default"         # default | tuned (registry) | first-use (tuned just now) | given
    spread_pct: float = 0.0         # autohc's spread (IQR / median, %)
    torch_spread_pct: float = 0.0
    tuning_s: float = 0.0           # first-use tuning of this problem (compiles + race), not timed
    numpy_spread_pct: float = float("nan")
    # bf16 rows: torch_gflops is torch's bf16 matmul, numpy_gflops numpy's fp32 one, and these
    # the fp32 torch.matmul and autohc over the faster fp32 library
    dtype: str = "fp32"
    torch_fp32_gflops: float = float("nan")
    speedup_vs_fp32: float = float("nan")


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """t's values in transparent huge pages with t's strides (a contiguous matrix or its
    transpose): how a training or sampling step's GEMM operands lie (the result pool, weights
    moved by parameters_to_huge_pages). torch's own allocations get 4 KB pages where THP is in
    madvise mode, and a GEMM then walks the page table for rows a page apart: measured on an
    AMX Xeon, 1 thread, DiT-XL/2's token GEMMs 3-14 % slower for autohc and oneDNN alike."""
    if t.is_contiguous():
        return huge_page_copy(t)
    if t.dim() == 2 and t.t().is_contiguous():
        return huge_page_copy(t.t()).t()
    raise ValueError("in_huge_pages: a contiguous matrix or the transpose of one")


def bench_problem(p: GemmProblem, threads: int, *, repeats: int = 7, params: GemmParams | None = None,
                  peak_per_core: float | None = None, target_seconds: float = 0.25,
                  with_numpy: bool = True, dtype: str = "fp32", cold: bool = False,
                  huge_pages: bool = False) -> GemmRow:
    """Time one problem for autohc, torch and numpy by the timing protocol (bench/timing.py);
    cold: each timed call after cache_evictor's op (untimed); huge_pages: every library's
    operands and results in transparent huge pages (in_huge_pages)."""
    a, b = p.operands()
    empty = huge_page_empty if huge_pages else torch.empty     # (results: where they are written)
    if huge_pages:
        a, b = in_huge_pages(a), in_huge_pages(b)
    # the layout of the operands in the GEMM sense: result is (a.rows, b.cols)
    M, K = a.shape
    N = b.shape[1]
    out = empty(M, N)
    an, bn, on = a.numpy(), b.numpy(), empty(M, N).numpy()
    tuning_s = 0.0
    bf16 = dtype == "bf16"
    a16, b16 = (a.to(torch.bfloat16), b.to(torch.bfloat16)) if bf16 else (a, b)
    if huge_pages and bf16:
        a16, b16 = in_huge_pages(a16), in_huge_pages(b16)
    if params is None:      # what autohc.matmul runs: the registry's config, else the default
        if first_use.enabled() and \
                registry.lookup("gemm", p.layout, p.K, p.N, p.M, threads, dtype=dtype) is None:
            # as a first call in training would (a bf16 weight gradient: into its fp32 dW)
            t = first_use.finish(p.layout, p.M, p.K, p.N, threads, dtype, p.c_fp32(dtype))
            tuning_s = t.build_s + t.race_s if t is not None else 0.0
        run_params = tuned_params(M, K, N, a.stride(), b.stride(), threads, dtype)
        hit = registry.lookup("gemm", p.layout, p.K, p.N, p.M, threads, dtype=dtype)
        config = ("default" if run_params == default_kernel_params(threads, dtype=dtype) else
                  "first-use" if tuning_s and hit and hit[1].get("source") == "first-use" else "tuned")
    else:
        run_params, config = params, "given"
    get_kernel(run_params)
    out16, c16 = (empty(M, N, dtype=torch.bfloat16) for _ in range(2))
    fns = {
        "autohc": (lambda: matmul(a16, b16, out=c16, params=run_params)) if bf16 else
                  (lambda: matmul(a, b, out=out, params=run_params)),
        "torch": (lambda: torch.matmul(a16, b16, out=out16)) if bf16 else (lambda: torch.matmul(a, b, out=out)),
        "numpy": lambda: np.matmul(an, bn, out=on),
    }
    if bf16:
        fns["torch_fp32"] = lambda: torch.matmul(a, b, out=out)
    if not with_numpy:
        del fns["numpy"]
    undo = set_blas_threads(threads)
    try:
        times = timing.interleaved(fns, samples=repeats, max_seconds=20 * target_seconds,
                                   before=cache_evictor() if cold else None)
    finally:
        undo()
    g = {k: p.flops / v.median / 1e9 for k, v in times.items()}
    g.setdefault("numpy", float("nan"))
    g.setdefault("torch_fp32", float("nan"))
    peak = (peak_per_core or 0.0) * threads
    fp32_best = max(g["torch_fp32"], g["numpy"]) if bf16 else float("nan")
    return GemmRow(p.name, p.layout, p.M, p.K, p.N, threads, round(g["autohc"], 1),
                   round(g["torch"], 1), round(g["numpy"], 1),
                   round(100 * g["autohc"] / peak, 1) if peak else float("nan"),
                   round(g["autohc"] / g["torch"], 3), round(g["autohc"] / g["numpy"], 3), config,
                   times["autohc"].spread_pct, times["torch"].spread_pct, round(tuning_s, 2),
                   times["numpy"].spread_pct if "numpy" in times else float("nan"),
                   dtype, round(g["torch_fp32"], 1), round(g["autohc"] / fp32_best, 3))


def geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def numpy_blas() -> str:
    """numpy's BLAS and the kernels it runs, as threadpoolctl reads them ("openblas
    SkylakeX"): a forced core type (OPENBLAS_CORETYPE) shows here."""
    from threadpoolctl import threadpool_info
    for i in threadpool_info():
        if i.get("user_api") == "blas" and "numpy" in (i.get("filepath") or "") + (i.get("prefix") or ""):
            return " ".join(str(x) for x in (i.get("internal_api"), i.get("architecture")) if x)
    return "unknown"


def bench_gemm(model: str = "dit-xl", threads: int = 1, *, repeats: int = 7, progress=None,
               images: int = 8, first_use_tuning: bool = True, dtype: str = "fp32",
               cold: bool = False, huge_pages: bool = True) -> dict:
    """All DiT training GEMMs of `model` at `threads`; the JSON object of `autohc bench gemm`.
    With first-use tuning (as install() has it), a problem the registry lacks is tuned first,
    that time reported apart (`tuning_s`), then what matmul runs after it is timed.
    dtype bf16: the bf16 kernels (tuned with `autohc tune --dtype bf16`, else the default) on
    this CPU's bf16 back-end, % of its bf16 peak (the tile peak on AMX, else the dot one).
    cold: every timed call after an untimed op that evicts the caches (cache_evictor).
    huge_pages: the operands in huge pages, as a step's are (in_huge_pages); False: torch's
    allocation (the figures recorded before stop 85)."""
    from .peak import bf16_backend_peak, fma_peak_gflops
    extra = {}
    if dtype == "bf16":
        isa, why = cpu.bf16_isa()
        peak, kind = bf16_backend_peak(isa)
        if peak is None:        # the widened fallback: its ceiling is the fp32 one
            peak = fma_peak_gflops(isa)
            kind = "fp32 fma"
        extra = {"dtype": "bf16", "bf16_isa": isa, "bf16_why": why, "peak_kind": kind,
                 "bf16_skinny_unit": bf16_skinny_unit(isa, threads)}
    else:
        isa = cpu.best_isa()
        peak = fma_peak_gflops(isa)
    rows = []
    was = first_use.enabled()
    first_use.enable(first_use_tuning)
    try:
        for p in dit_problems(model, images):
            rows.append(bench_problem(p, threads, repeats=repeats, peak_per_core=peak, dtype=dtype, cold=cold,
                                      huge_pages=huge_pages))
            if progress:
                progress(rows[-1])
    finally:
        first_use.enable(was)
    return {
        "model": model, "threads": threads, "isa": isa, "cpu": cpu.detect().model,
        "fingerprint": cpu.detect().fingerprint, "peak_gflops_per_core": round(peak, 1),
        "torch_version": torch.__version__, "numpy_version": np.__version__, "numpy_blas": numpy_blas(),
        "caches": f"cold ({COLD_MB} MB op before each call)" if cold else "warm (calls back to back)",
        "pages": "huge" if huge_pages else "4k",
        "rows": [asdict(r) for r in rows],
        "geomean_speedup_vs_torch": round(geomean(r.speedup_vs_torch for r in rows), 3),
        "geomean_speedup_vs_numpy": round(geomean(r.speedup_vs_numpy for r in rows), 3),
        "first_use_tuning": first_use_tuning and not first_use.env_off(),
        "first_use_tuning_s": round(sum(r.tuning_s for r in rows), 2),
        **extra,
        **({"geomean_speedup_vs_fp32": round(geomean(r.speedup_vs_fp32 for r in rows), 3),
            "token_gemms_min_pct_peak": min(r.pct_peak for r in rows if r.name != "adaLN")}
           if dtype == "bf16" else {}),
    }
