"""The kernel-family interface: what every generated kernel family (GEMM, element-wise)
provides, so that one pipeline (render -> build -> verify -> time -> record) serves them all.

    family.params_type                typed, validated parameters (ints and enums only)
    family.kernels()                  the kernels of the family (one rendered source each)
    family.render(params, kernel)     C source from the family's template
    family.declaration(params, kernel)  the cffi declaration, read from that same source
    family.default(isa, threads)      parameters that work before any tuning
    family.knobs(kernel)              the parameters a kernel's template really uses
    family.problem_key(...)           the registry key of a problem
The correctness gate (verify) is the tuner's: tune/verify.py checks a candidate against torch.

A public C function of a template is marked `AUTOHC_API`; `exported_declarations` reads the
declarations from the rendered source, so the C signature and the Python one cannot drift.
"""
from __future__ import annotations

import re
from typing import Any, Protocol, runtime_checkable

class ParamError(ValueError):
    """A parameter set that cannot be rendered."""


_API = re.compile(r"^AUTOHC_API\s+(?:(typedef[^;]*;)|([^;{]*?)\s*(?=\{))", re.M | re.S)


def exported_declarations(source: str) -> str:
    """Every `AUTOHC_API` declaration of a rendered source, one per line, as cffi's cdef."""
    out = []
    for m in _API.finditer(source):
        decl = " ".join((m.group(1) or m.group(2)).split())
        out.append(decl if decl.endswith(";") else decl + ";")
    if not out:
        raise ValueError("no AUTOHC_API declaration in the rendered source")
    return "\n".join(out) + "\n"


@runtime_checkable
class KernelFamily(Protocol):
    """Implemented by kernels/gemm/family.py (GEMM) and kernels/eltwise/family.py (ELTWISE);
    verification is the tuner's (tune/verify.py), against torch."""
    name: str
    params_type: type

    def kernels(self) -> tuple[str, ...]: ...
    def render(self, params: Any, kernel: str) -> str: ...
    def declaration(self, params: Any, kernel: str) -> str: ...
    def default(self, isa: str, threads: int = 1) -> Any: ...
    def knobs(self, kernel: str) -> tuple[str, ...]: ...
    def problem_key(self, *problem: Any) -> str: ...
