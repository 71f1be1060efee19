"""What is being computed: a GEMM problem of a Linear layer in one training layout."""
from __future__ import annotations

import re
from dataclasses import dataclass

LAYOUTS = ("NT", "NN", "TN")

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

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        for dim in ("M", "K", "N"):
            v = getattr(self, dim)
            if type(v) is not int or v < 1:
                raise ValueError(f"{dim} must be a positive int, got {v!r}")

    @property
    def gemm_mkn(self) -> tuple[int, int, int]:
        """(m, k, n) of the GEMM this layout runs: C[m, n] = op(A)[m, k] op(B)[k, n]."""
        return {"NT": (self.M, self.K, self.N), "NN": (self.M, self.N, self.K),
                "TN": (self.N, self.M, self.K)}[self.layout]

    @property
    def flops(self) -> int:
        return 2 * self.M * self.K * self.N

    def c_fp32(self, dtype: str) -> bool:
        """Whether training writes this problem's C in fp32 though its products are bf16: the
        weight gradient (TN) under autocast goes into the fp32 dW (torch/autocast.py), while
        the forward and dX write bf16. Tuning races a problem in this form."""
        return dtype == "bf16" and self.layout == "TN"

    def operands(self, seed: int = 0, dtype=None):
        """(a, b) float32 (or `dtype`) torch views for the GEMM of this layout (transposes as
        strides)."""
        import torch
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(self.M, self.K, generator=g)
        w = torch.randn(self.N, self.K, generator=g) * 0.03
        dy = torch.randn(self.M, self.N, generator=g)
        if dtype is not None:               # (.to keeps a transposed view's strides)
            x, w, dy = x.to(dtype), w.to(dtype), dy.to(dtype)
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




def parse_shape(text: str) -> tuple[int, int]:
    """'1152x4608' -> (1152, 4608): K x N of a Linear(K -> N); both positive."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*(\d+)\s*", text or "")
    if not m:
        raise ValueError(f"shape {text!r} is not KxN (two positive integers, e.g. 1152x4608)")
    k, n = int(m.group(1)), int(m.group(2))
    if k < 1 or n < 1:
        raise ValueError(f"shape {text!r}: K and N must be >= 1")
    return k, n
