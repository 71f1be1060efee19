"""Render C from templates/ with validated parameters (Jinja2, StrictUndefined)."""
from __future__ import annotations

import functools
import os
from pathlib import Path

import jinja2

from .params import GemmParams


def templates_dir() -> Path:
    """$AUTOHC_TEMPLATES_DIR (template development), else templates/ of a source checkout,
    else the copy installed inside the package."""
    if os.environ.get("AUTOHC_TEMPLATES_DIR"):
        return Path(os.environ["AUTOHC_TEMPLATES_DIR"])
    here = Path(__file__).resolve().parent
    for candidate in (here.parents[1] / "templates", here.parent / "_templates"):
        if (candidate / "gemm" / "gemm.c.j2").is_file():
            return candidate
    raise FileNotFoundError("autohc templates not found (broken install?)")


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,       # a missing parameter is an error, not ""
        keep_trailing_newline=True,
        autoescape=False,
    )


def render_gemm(params: GemmParams) -> str:
    """C source of one GEMM kernel; its public functions are prefixed with params.symbol."""
    p = params.validate()
    ctx = p.to_dict()
    ctx["fn"] = p.symbol
    ctx["params_comment"] = ", ".join(f"{k}={v}" for k, v in sorted(p.to_dict().items()))
    return environment().get_template("gemm/gemm.c.j2").render(**ctx)


def gemm_cdef(params: GemmParams) -> str:
    """The C declarations of a rendered kernel (cffi cdef and the exported header)."""
    fn = params.validate().symbol
    return (
        f"int {fn}_isa_supported(void);\n"
        f"int {fn}_threads(void);\n"
        f"int {fn}_set_cpus(const int *cpus, int n);\n"
        f"int {fn}_gemm(int64_t M, int64_t N, int64_t K, float alpha,\n"
        f"    const float *A, int64_t rsa, int64_t csa,\n"
        f"    const float *B, int64_t rsb, int64_t csb,\n"
        f"    float beta, float *C, int64_t ldc);\n"
        f"int {fn}_gemm_batched(int64_t batch, int64_t sa, int64_t sb, int64_t sc,\n"
        f"    int64_t M, int64_t N, int64_t K, float alpha,\n"
        f"    const float *A, int64_t rsa, int64_t csa,\n"
        f"    const float *B, int64_t rsb, int64_t csb,\n"
        f"    float beta, float *C, int64_t ldc);\n"
    )
