"""The fused attention family behind the kernel-family interface (kernels/family.py)."""
from __future__ import annotations

from .codegen import render_attention
from .params import KERNEL, AttentionParams, default_attention
from ..family import exported_declarations

KNOBS = ("vl", "block_q", "block_k", "mr", "dc", "qv", "fk", "fd", "prefetch", "threads")


class AttentionFamily:
    name = "attention"
    params_type = AttentionParams

    def kernels(self) -> tuple[str, ...]:
        return (KERNEL,)

    def render(self, params: AttentionParams, kernel: str = KERNEL) -> str:
        return render_attention(params)

    def declaration(self, params: AttentionParams, kernel: str = KERNEL) -> str:
        return exported_declarations(render_attention(params))

    def default(self, isa: str, threads: int = 1) -> AttentionParams:
        return default_attention(isa)

    def knobs(self, kernel: str = KERNEL) -> tuple[str, ...]:
        return KNOBS

    def problem_key(self, kernel: str, threads: int) -> str:
        """The registry key: one entry per thread count (every head dim shares it)."""
        return f"attention/{kernel}/t{threads}"


ATTENTION = AttentionFamily()
