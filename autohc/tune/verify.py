"""The correctness gate of the tuner: a candidate must compute what the reference computes,
within a tolerance stated here, before it is timed; a wrong one raises WrongResult and can
never win."""
from __future__ import annotations

import random

import torch

from ..kernels.gemm.matmul import matmul
from ..kernels.gemm.params import GemmParams
from ..kernels.gemm.problem import GemmProblem
from . import registry

U32 = 2.0 ** -24            # unit roundoff of float32


class WrongResult(RuntimeError):
    """A candidate kernel computed a wrong result: it must never win."""


class GemmVerifier:
    """GEMM: the problem's own operands plus ragged shapes in the same layout, against a
    float64 reference (never an fp32 torch.matmul, which install() may route to autohc itself),
    error bound gamma_k |A||B| scaled to K."""

    def __init__(self, problem: GemmProblem, seed: int = 0, dtype: str = "fp32"):
        self.problem = problem
        # bf16: bf16 operands, whose products are exact in fp32: the same bound holds
        self.dtype = torch.bfloat16 if dtype == "bf16" else None
        self.a, self.b = problem.operands(seed, self.dtype)
        a64, b64 = self.a.double(), self.b.double()
        self.ref = a64 @ b64
        k = self.a.shape[1]
        self.bound = 2.0 * (k + 4) * U32 * (a64.abs() @ b64.abs()) + 1e-30
        self.out = torch.empty(self.ref.shape, dtype=torch.float32)
        self.rng = random.Random(seed)

    def __call__(self, params: GemmParams) -> None:
        matmul(self.a, self.b, out=self.out, params=params)
        bad = ~((self.out.double() - self.ref).abs() <= self.bound)
        if bad.any():
            raise WrongResult(f"{int(bad.sum())} wrong elements on the problem's own shape")
        if self.dtype is not None:
            # and into a bf16 C, as install() writes under autocast and the races time it (its
            # own last-panel path): the fp32 sum, within the bound, then rounded once to bf16
            # (unit roundoff 2^-8)
            out = matmul(self.a, self.b, out=torch.empty(self.ref.shape, dtype=self.dtype), params=params)
            u = 2.0 ** -8
            bad = ~((out.double() - self.ref).abs() <= self.bound * (1 + u) + self.ref.abs() * u)
            if bad.any():
                raise WrongResult(f"{int(bad.sum())} wrong elements in a bf16 C on the problem's own shape")
        for _ in range(6):
            m, k, n = (self.rng.choice([1, 2, 3, 7, 13, params.mr + 1, params.nr + 1,
                                        params.kc + 1, 61]) for _ in range(3))
            a, b = GemmProblem("ragged", self.problem.layout,
                               *registry.linear_dims(self.problem.layout, m, k, n)).operands(0, self.dtype)
            out = matmul(a, b, out=torch.empty(m, n), params=params)
            ref = a.double() @ b.double()
            bound = 2.0 * (a.shape[1] + 4) * U32 * (a.double().abs() @ b.double().abs()) + 1e-30
            if not ((out.double() - ref).abs() <= bound).all():
                raise WrongResult(f"wrong result on ragged shape m={m} k={k} n={n}")

    check = __call__


def same(a, b, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    """Element-wise operators: every output within rtol/atol of torch's (NaN where torch has
    NaN). The kernels' own accuracy is tested tighter in tests/test_ops.py."""
    a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
    return len(a) == len(b) and all(torch.allclose(u, v, rtol=rtol, atol=atol, equal_nan=True)
                                    for u, v in zip(a, b))


def check_same(got, reference, what: str, agree=None) -> None:
    """WrongResult unless got agrees with torch's reference (by `same`, or `agree` if given)."""
    if not (agree or same)(got, reference):
        raise WrongResult(f"{what}: result differs from torch's")
