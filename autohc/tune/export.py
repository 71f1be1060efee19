"""`autohc export`: tuned kernels as plain C that a C/C++ build compiles without Python.

DIR/
  kernels/<symbol>.c   one rendered kernel each (C11 + pthreads)
  kernels/autohc_sk_*.c  the skinny paths (M <= skinny_m), compiled with the kernels that list them
                       in the manifest's `objects` (one file for all the kernels that share it)
  kernels/autohc_pool.c  the worker pool the kernels run their threads on: call
                       <symbol>_bind((void *)autohc_pool_run) once before a kernel's first GEMM
  autohc_kernels.h     the declarations of all of them
  manifest.json        per kernel: problem, params, cflags, sha256 of the source, GFLOP/s, CPU
Files are written to temporary names and renamed into place: an interrupted export never
leaves a half-written file.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from ..build import atomic_write_text
from ..hw import cpu
from ..kernels.family import exported_declarations
from ..kernels.gemm.codegen import gemm_cdef, render_gemm, render_gemm_objects
from ..kernels.gemm.kernel import default_kernel_params
from ..kernels.gemm.params import GemmParams
from ..kernels.isa import GEMM_ISAS
from ..kernels.render import environment
from ..runtime.pool import SPIN_US
from . import registry

HEADER_GUARD = "AUTOHC_KERNELS_H"


def export(out: str | os.PathLike, include_defaults: bool = True) -> dict:
    """Write every tuned kernel of this CPU (and the default ones) to `out`; the manifest."""
    out = Path(out)
    (out / "kernels").mkdir(parents=True, exist_ok=True)
    info = cpu.detect()
    items: list[tuple[GemmParams, dict]] = []
    for key, entry in sorted(registry.entries_for_this_cpu("gemm").items()):
        try:
            items.append((GemmParams.from_dict(entry["params"]), {"registry_key": key, **{
                k: entry.get(k) for k in ("op", "dtype", "layout", "K", "N", "M", "threads", "gflops",
                                          "torch_gflops", "speedup_vs_torch")}}))
        except Exception:  # noqa: BLE001 - an invalid entry is skipped, as lookups do
            continue
    if include_defaults:        # fp32, and bf16 on this CPU's bf16 back-end
        for dtype in ("fp32", "bf16"):
            for threads in sorted({1, info.cores}):
                items.append((registry_default(threads, dtype), {"registry_key": None, "default": True,
                                                                 "dtype": dtype, "threads": threads}))
    kernels, seen, objects_written = [], set(), set()
    decls = []
    for params, meta in items:
        if params.symbol in seen:
            continue
        seen.add(params.symbol)
        src = render_gemm(params, fixed=True)
        rel = f"kernels/{params.symbol}.c"
        atomic_write_text(out / rel, src)
        objects = []
        for name, obj_src in render_gemm_objects(params).items():
            obj_rel = f"kernels/{name}.c"
            if obj_rel not in objects_written:
                atomic_write_text(out / obj_rel, obj_src)
                objects_written.add(obj_rel)
            objects.append({"source": obj_rel, "sha256": hashlib.sha256(obj_src.encode()).hexdigest()})
        decls.append(f"/* {meta.get('layout') or 'default'} {params.dtype} {params.isa} "
                     f"{params.mr}x{params.nr} threads={params.threads} */\n" + gemm_cdef(params, src))
        kernels.append({"symbol": params.symbol, "source": rel, "objects": objects,
                        "sha256": hashlib.sha256(src.encode()).hexdigest(),
                        "cflags": ["-O3", "-std=gnu11", *GEMM_ISAS[params.isa].cflags],
                        "ldflags": ["-lpthread"], "params": params.to_dict(), **meta})
    pool_src = environment().get_template("runtime/pool.c.j2").render(spin_us=SPIN_US)
    atomic_write_text(out / "kernels" / "autohc_pool.c", pool_src)
    decls.insert(0, "/* the worker pool (kernels/autohc_pool.c) */\n" + exported_declarations(pool_src))
    header = (f"/* autohc exported kernels ({info.model}, fingerprint {info.fingerprint}).\n"
              " * Each <symbol>_gemm computes C := alpha*op(A)*op(B) + beta*C, with\n"
              " * op(A)(i,k) = A[i*rsa + k*csa], op(B)(k,j) = B[k*rsb + j*csb], C row-major (ldc).\n"
              " * Bind each kernel to the pool once: <symbol>_bind((void *)autohc_pool_run).\n"
              " * bf16 kernels take A and B as void * of bf16 elements, or fp32 ones where a last\n"
              " * argument in_f32 has bit 0 (A) or bit 1 (B) set; they multiply in bf16, sum in fp32.\n"
              " * Returns 0, or -1 (out of memory) / -2 (cannot start threads) / -3 (not bound).\n"
              " * The full contract: the comment at the top of each kernel's source. */\n"
              f"#ifndef {HEADER_GUARD}\n#define {HEADER_GUARD}\n#include <stdint.h>\n"
              "#ifdef __cplusplus\nextern \"C\" {\n#endif\n\n" + "\n".join(decls) +
              "\n#ifdef __cplusplus\n}\n#endif\n#endif\n")
    atomic_write_text(out / "autohc_kernels.h", header)
    manifest = {"autohc_export": 1, "created_at": time.time(), "cpu": info.model,
                "fingerprint": info.fingerprint, "header": "autohc_kernels.h",
                "pool": {"source": "kernels/autohc_pool.c",
                         "sha256": hashlib.sha256(pool_src.encode()).hexdigest()},
                "kernels": kernels}
    atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=1))
    return manifest


def registry_default(threads: int, dtype: str = "fp32") -> GemmParams:
    return default_kernel_params(threads, dtype=dtype)
