"""GEMM benchmark: autohc vs torch.matmul (MKL) vs numpy (OpenBLAS), measured in one run.

The machine is shared and noisy, so the three are timed round-robin (interleaved), each
after a warm-up, and the median of the repeats is reported; ratios measured side by side
are the figures to trust, not absolute numbers from another day.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from . import cpu
from .codegen import GemmParams
from .gemm import default_kernel_params, get_kernel, matmul

# DiT sizes (facebookresearch/DiT): hidden size; tokens per image at 256 px with patch 2
HIDDEN = {"dit-s": 384, "dit-b": 768, "dit-l": 1024, "dit-xl": 1152}
TOKENS = 256


@dataclass(frozen=True)
class GemmProblem:
    """One training GEMM of a Linear(K -> N) on M rows, in one layout.

    NT: forward  Y[M,N]  = X[M,K] @ W[N,K]^T
    NN: backward dX[M,K] = dY[M,N] @ W[N,K]
    TN: backward dW[N,K] = dY[M,N]^T @ X[M,K]
    """
    name: str
    layout: str
    M: int
    K: int
    N: int

    @property
    def flops(self) -> int:
        return 2 * self.M * self.K * self.N

    def operands(self, seed: int = 0):
        """(a, b) float32 torch views for the GEMM of this layout (transposes as strides)."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(self.M, self.K, generator=g)
        w = torch.randn(self.N, self.K, generator=g) * 0.03
        dy = torch.randn(self.M, self.N, generator=g)
        return {"NT": (x, w.t()), "NN": (dy, w), "TN": (dy.t(), x)}[self.layout]


def dit_problems(model: str = "dit-xl", images: int = 8) -> list[GemmProblem]:
    """The training GEMMs of one DiT block: 4 token Linears x 3 layouts at M = images*256,
    and the skinny adaLN Linear (M = images) x 3 layouts."""
    if model not in HIDDEN:
        raise ValueError(f"unknown model {model!r}; one of {sorted(HIDDEN)}")
    d = HIDDEN[model]
    m = images * TOKENS
    linears = [("qkv", d, 3 * d), ("proj", d, d), ("fc1", d, 4 * d), ("fc2", 4 * d, d)]
    out = [GemmProblem(n, lay, m, k, nn) for lay in ("NT", "NN", "TN") for n, k, nn in linears]
    out += [GemmProblem("adaLN", lay, images, d, 6 * d) for lay in ("NT", "NN", "TN")]
    return out


def _median_time(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _set_blas_threads(threads: int):
    """numpy's OpenBLAS and torch's MKL/OpenMP to `threads`; returns an undo callable."""
    from threadpoolctl import threadpool_limits
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    limiter = threadpool_limits(limits=threads, user_api="blas")

    def undo():
        torch.set_num_threads(old)
        limiter.restore_original_limits()
    return undo


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


def bench_problem(p: GemmProblem, threads: int, *, repeats: int = 7, params: GemmParams | None = None,
                  peak_per_core: float | None = None, target_seconds: float = 0.25) -> GemmRow:
    """Time one problem for autohc, torch and numpy, interleaved round-robin."""
    a, b = p.operands()
    # the layout of the operands in the GEMM sense: result is (a.rows, b.cols)
    M, K = a.shape
    N = b.shape[1]
    out = torch.empty(M, N)
    an, bn, on = a.numpy(), b.numpy(), np.empty((M, N), np.float32)
    params = params or default_kernel_params(threads)
    kernel = get_kernel(params)
    fns = {
        "autohc": lambda: matmul(a, b, out=out, params=params),
        "torch": lambda: torch.matmul(a, b, out=out),
        "numpy": lambda: np.matmul(an, bn, out=on),
    }
    undo = _set_blas_threads(threads)
    try:
        for f in fns.values():          # warm-up: page faults, thread pools, packing buffers
            f()
            f()
        # several calls per sample for the small ones, so each sample lasts a few ms
        one = min(_median_time(f, 3) for f in fns.values())
        inner = max(1, min(200, int(0.005 / max(one, 1e-7))))
        samples = {k: [] for k in fns}
        deadline = time.perf_counter() + 20 * target_seconds
        for r in range(repeats):
            for k, f in fns.items():    # round-robin: the same noise hits all three
                t0 = time.perf_counter()
                for _ in range(inner):
                    f()
                samples[k].append((time.perf_counter() - t0) / inner)
            if r >= 2 and time.perf_counter() > deadline:
                break
    finally:
        undo()
    t = {k: statistics.median(v) for k, v in samples.items()}
    g = {k: p.flops / v / 1e9 for k, v in t.items()}
    peak = (peak_per_core or 0.0) * threads
    del kernel
    return GemmRow(p.name, p.layout, p.M, p.K, p.N, threads, round(g["autohc"], 1),
                   round(g["torch"], 1), round(g["numpy"], 1),
                   round(100 * g["autohc"] / peak, 1) if peak else float("nan"),
                   round(g["autohc"] / g["torch"], 3), round(g["autohc"] / g["numpy"], 3))


def geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def bench_gemm(model: str = "dit-xl", threads: int = 1, *, repeats: int = 7, progress=None,
               images: int = 8) -> dict:
    """All DiT training GEMMs of `model` at `threads`; the JSON object of `autohc bench gemm`."""
    from .peak import fma_peak_gflops
    isa = cpu.best_isa()
    peak = fma_peak_gflops(isa)
    rows = []
    for p in dit_problems(model, images):
        rows.append(bench_problem(p, threads, repeats=repeats, peak_per_core=peak))
        if progress:
            progress(rows[-1])
    return {
        "model": model, "threads": threads, "isa": isa, "cpu": cpu.detect().model,
        "fingerprint": cpu.detect().fingerprint, "peak_gflops_per_core": round(peak, 1),
        "torch_version": torch.__version__, "numpy_version": np.__version__,
        "rows": [asdict(r) for r in rows],
        "geomean_speedup_vs_torch": round(geomean(r.speedup_vs_torch for r in rows), 3),
        "geomean_speedup_vs_numpy": round(geomean(r.speedup_vs_numpy for r in rows), 3),
    }
