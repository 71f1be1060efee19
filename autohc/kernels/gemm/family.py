"""The GEMM family behind the kernel-family interface (kernels/family.py)."""
from __future__ import annotations

import math

from .codegen import gemm_cdef, render_gemm
from .params import GemmParams

# the fields of GemmParams the template renders (isa and vl pick the back-end and are fixed
# by it, except on the portable one, where vl is searched too)
KNOBS = ("vl", "mr", "nr", "kc", "mc", "nc", "k_unroll", "jc_ways", "ic_ways", "jr_ways", "depth",
         "prefetch_a", "prefetch_b", "prefetch_c", "skinny_m", "a_outer",
         "own_rows", "c_tiles", "skinny_unit")


def m_bucket(m: int) -> int:
    """Power-of-two bucket of M (rounded in log space): 2048 -> 2048, 1400 -> 1024, 1500 -> 2048."""
    return 1 << max(0, round(math.log2(max(1, m))))


class GemmFamily:
    name = "gemm"
    params_type = GemmParams

    def kernels(self) -> tuple[str, ...]:
        return ("gemm",)

    def render(self, params: GemmParams, kernel: str = "gemm") -> str:
        return render_gemm(params)

    def declaration(self, params: GemmParams, kernel: str = "gemm") -> str:
        return gemm_cdef(params)

    def default(self, isa: str, threads: int = 1) -> GemmParams:
        from .kernel import default_kernel_params      # this CPU's plan: its NUMA clusters
        return default_kernel_params(threads, isa)

    def knobs(self, kernel: str = "gemm") -> tuple[str, ...]:
        return KNOBS

    def problem_key(self, layout: str, K: int, N: int, M: int, threads: int,
                    dtype: str = "fp32") -> str:
        """The registry key: one entry per layout, K, N, power-of-two M bucket, threads and
        dtype (bf16 keys end in /bf16; fp32 keys are those of releases before bf16)."""
        return f"gemm/{layout}/K{K}/N{N}/M{m_bucket(M)}/t{threads}" + ("/bf16" if dtype == "bf16" else "")


GEMM = GemmFamily()
