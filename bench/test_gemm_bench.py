"""pytest-benchmark suite of the DiT training GEMMs: autohc vs torch.matmul vs numpy.

    pytest bench/test_gemm_bench.py --benchmark-json=bench/results/gemm.json
    AUTOHC_BENCH_MODEL=dit-s AUTOHC_BENCH_THREADS=2 pytest bench/test_gemm_bench.py

Speed goals live here and in `autohc bench gemm`, never in the unit tests.
"""
import os

import numpy as np
import pytest
import torch

import autohc
from autohc.bench.gemm import set_blas_threads
from autohc.kernels.gemm.problem import dit_problems
from autohc.kernels.gemm.kernel import default_kernel_params

MODEL = os.environ.get("AUTOHC_BENCH_MODEL", "dit-xl")
THREADS = int(os.environ.get("AUTOHC_BENCH_THREADS", "1"))
PROBLEMS = dit_problems(MODEL)


@pytest.fixture(scope="module", autouse=True)
def blas_threads():
    undo = set_blas_threads(THREADS)
    yield
    undo()


@pytest.mark.parametrize("impl", ["autohc", "torch", "numpy"])
@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: f"{p.name}-{p.layout}-{p.M}x{p.K}x{p.N}")
def test_gemm(benchmark, problem, impl):
    a, b = problem.operands()
    out = torch.empty(a.shape[0], b.shape[1])
    if impl == "autohc":
        params = default_kernel_params(THREADS)
        fn = lambda: autohc.matmul(a, b, out=out, params=params)  # noqa: E731
    elif impl == "torch":
        fn = lambda: torch.matmul(a, b, out=out)  # noqa: E731
    else:
        an, bn, on = a.numpy(), b.numpy(), out.numpy()
        fn = lambda: np.matmul(an, bn, out=on)  # noqa: E731
    fn()
    benchmark.extra_info.update(model=MODEL, threads=THREADS, layout=problem.layout,
                                gflop=problem.flops / 1e9)
    benchmark.pedantic(fn, rounds=7, iterations=1, warmup_rounds=1)
    # the result is right, not just fast
    ref = a.double() @ b.double()
    assert torch.allclose(out.double(), ref, rtol=1e-3, atol=1e-3 * problem.K ** 0.5)
