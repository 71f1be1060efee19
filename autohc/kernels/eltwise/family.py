"""The element-wise family behind the kernel-family interface (kernels/family.py)."""
from __future__ import annotations

from .codegen import render_eltwise
from .params import KERNELS, EltwiseParams, default_eltwise
from ..family import exported_declarations


class EltwiseFamily:
    name = "eltwise"
    params_type = EltwiseParams

    def kernels(self) -> tuple[str, ...]:
        return tuple(KERNELS)

    def render(self, params: EltwiseParams, kernel: str) -> str:
        return render_eltwise(kernel, params)

    def declaration(self, params: EltwiseParams, kernel: str) -> str:
        return exported_declarations(render_eltwise(kernel, params))

    def default(self, isa: str, threads: int = 1) -> EltwiseParams:
        return default_eltwise(isa)

    def knobs(self, kernel: str) -> tuple[str, ...]:
        return KERNELS[kernel]

    def problem_key(self, kernel: str, threads: int) -> str:
        """The registry key: one entry per kernel and thread count."""
        return f"eltwise/{kernel}/t{threads}"


ELTWISE = EltwiseFamily()
