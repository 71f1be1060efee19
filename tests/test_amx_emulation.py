"""The AMX emulation the bf16 tests run the AMX back-end on where the CPU has no AMX
(templates/gemm/amx_emulated.h.j2): its tile instructions against a numpy reference, the
faults an AMX CPU raises (#GP, #UD) reported instead of executed, and emulated kernels that
hold no tile instruction while the real ones do. The kernels themselves are fuzzed under
emulation by test_gemm_bf16.py."""
import shutil
import subprocess

import numpy as np
import pytest
import torch

from autohc.build import build
from autohc.hw import cpu
from autohc.kernels.family import exported_declarations
from autohc.kernels.gemm.codegen import render_gemm
from autohc.kernels.gemm.kernel import KernelError, get_kernel, tile_emulation
from autohc.kernels.gemm.params import default_params
from autohc.kernels.render import environment

# Drives the emulator: configures tile t with rows[t] x colsb[t] (palette `palette`), then
# dst += a b on registers d, a, b loaded from A (lda bytes), B (ldb), C (ldc), C stored back.
DRIVER = """
#include <stdint.h>
#include <string.h>
#include <stdatomic.h>
#define AUTOHC_API
{% include "gemm/amx_emulated.h.j2" %}
AUTOHC_API void emu_permit(void) { atomic_store(&emu_permitted, 1); }
AUTOHC_API const char *emu_fault_seen(void) { return atomic_load(&emu_faulted) ? emu_fault_text : NULL; }
AUTOHC_API void emu_clear(void) { atomic_store(&emu_faulted, 0); emu_tile_release(); }
AUTOHC_API void emu_dot(int palette, const uint8_t *rows, const uint16_t *colsb, int d, int a, int b,
                        const void *A, long lda, const void *B, long ldb, float *C, long ldc)
{
    struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = (uint8_t)palette;
    for (int t = 0; t < 16; ++t) { cfg.rows[t] = rows[t]; cfg.colsb[t] = colsb[t]; }
    _tile_loadconfig(&cfg);
    _tile_loadd(d, C, ldc);
    _tile_loadd(a, A, lda);
    _tile_loadd(b, B, ldb);
    _tile_dpbf16ps(d, a, b);
    _tile_stored(d, C, ldc);
    _tile_release();
}
AUTOHC_API void emu_zero_unconfigured(void) { _tile_zero(0); }
"""


def _driver(tag: str):
    """A library of the driver, its own emulator state (`tag` makes it another build)."""
    src = environment().from_string(DRIVER).render() + f"/* {tag} */\n"
    lib = build(src, exported_declarations(src), meta={"op": "test-amx-emulation"})
    return lib.ffi, lib.lib


@pytest.fixture(scope="module")
def emu():
    return _driver("shared")


def test_a_tile_instruction_before_the_permission_faults():
    ffi, lib = _driver("before the permission")
    lib.emu_zero_unconfigured()
    assert "before ARCH_REQ_XCOMP_PERM" in _fault(ffi, lib)


def _fault(ffi, lib):
    f = lib.emu_fault_seen()
    return None if f == ffi.NULL else ffi.string(f).decode()


def _dot(ffi, lib, M, K2, N, rows=None, colsb=None, regs=(0, 1, 2), palette=1):
    """C (M x N fp32) += A (M x 2 K2 bf16) B (K2 x 2N bf16 as VNNI pairs) through the emulator;
    (result, float64 reference, the bound on their difference)."""
    rng = np.random.default_rng(M * 1000 + K2 * 10 + N)
    a = torch.randn(M, 2 * K2).bfloat16()
    b = torch.randn(K2, 2 * N).bfloat16()               # row k: pairs (b[2k, n], b[2k+1, n])
    c = rng.standard_normal((M, N)).astype(np.float32)
    d, ta, tb = regs
    r = [0] * 16
    cb = [0] * 16
    r[d], cb[d] = M, 4 * N
    r[ta], cb[ta] = M, 4 * K2
    r[tb], cb[tb] = K2, 4 * N
    r = rows or r
    cb = colsb or cb
    an = a.view(torch.int16).numpy().copy()
    bn = b.view(torch.int16).numpy().copy()
    out = c.copy()
    lib.emu_dot(palette, ffi.new("uint8_t[16]", r), ffi.new("uint16_t[16]", cb), d, ta, tb,
                ffi.cast("void *", an.ctypes.data), 4 * K2, ffi.cast("void *", bn.ctypes.data), 4 * N,
                ffi.cast("float *", out.ctypes.data), 4 * N)
    # the same sum in float64: pair products (exact in fp32) of K2 pairs
    a64 = a.double().numpy().reshape(M, K2, 2)
    b64 = b.double().numpy().reshape(K2, N, 2)
    ref = c.astype(np.float64) + np.einsum("mkp,knp->mn", a64, b64)
    # fp32 sums of 2 K2 exact products onto C: each addition rounds once
    bound = 2 * (2 * K2 + 1) * 2.0 ** -24 * (np.abs(c) + np.einsum("mkp,knp->mn", np.abs(a64), np.abs(b64)))
    return out, ref, bound


def test_tdpbf16ps_matches_the_sums_in_float64(emu):
    ffi, lib = emu
    lib.emu_permit()
    for M, K2, N in [(16, 16, 16), (1, 1, 1), (7, 3, 5), (16, 16, 4), (3, 16, 16)]:
        lib.emu_clear()
        out, ref, bound = _dot(ffi, lib, M, K2, N)
        assert _fault(ffi, lib) is None
        assert np.all(np.abs(out - ref) <= bound), (M, K2, N)


def test_what_an_amx_cpu_faults_on_is_reported_not_run(emu):
    ffi, lib = emu
    lib.emu_permit()
    lib.emu_clear()
    lib.emu_zero_unconfigured()
    assert "tilezero tmm0: tiles not configured" in _fault(ffi, lib)
    cases = [
        (dict(palette=2), "palette"),
        (dict(regs=(0, 0, 2)), "used twice"),
        (dict(rows=[16, 16, 8] + [0] * 13, colsb=[64] * 3 + [0] * 13), "operand shapes do not fit"),
        (dict(rows=[17, 16, 16] + [0] * 13, colsb=[64] * 3 + [0] * 13), "over 16 rows"),
        (dict(rows=[16] * 3 + [0] * 5 + [1] + [0] * 7, colsb=[64] * 3 + [0] * 5 + [4] + [0] * 7), "8 tiles"),
        (dict(rows=[16, 16, 0] + [0] * 13, colsb=[64] * 3 + [0] * 13), "rows xor colsb"),
    ]
    for kw, text in cases:
        lib.emu_clear()
        _dot(ffi, lib, 16, 16, 16, **kw)
        assert text in (_fault(ffi, lib) or ""), kw
    lib.emu_clear()


def test_emulated_kernels_hold_no_tile_instruction_and_real_ones_do():
    """objdump of the two builds of one parameter set: the emulation replaced every tile
    instruction (so a CPU without AMX runs it), the real kernel has them."""
    if "avx512bf16" not in cpu.runnable_bf16_isas():
        pytest.skip("emulated AMX kernels need AVX512_BF16 for the vector code around the tiles")
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("needs objdump (binutils)")
    p = default_params("amx", 2, arch="generic", dtype="bf16")
    with tile_emulation():
        emulated = get_kernel(p)
    real = get_kernel(p)
    assert emulated is not real and emulated.runnable
    assert real.runnable == ("amx" in cpu.runnable_bf16_isas())

    def tile_insns(k):
        text = subprocess.run([objdump, "-d", str(k.library.path)], capture_output=True, text=True,
                              check=True).stdout
        return sum(text.count(i) for i in ("tdpbf16ps", "tileloadd", "ldtilecfg", "tilestored"))
    assert tile_insns(emulated) == 0 and tile_insns(real) > 0
    if not real.runnable:
        with pytest.raises(KernelError, match="cannot run the amx back-end"):
            real.run(1, 1, 1, 1.0, 0, 1, 1, 0, 1, 1, 0.0, 0, 1)


def test_only_the_amx_back_end_is_emulated():
    """(test_gemm_bf16.py builds the emulated AMX kernel standalone with every warning an error)"""
    with pytest.raises(ValueError, match="only the amx back-end"):
        render_gemm(default_params("avx512bf16", 1, arch="generic", dtype="bf16"), emulate_tiles=True)


@pytest.mark.parametrize("name", ["amx_tile_store", "amx_feed_ceiling"])
def test_the_stand_alone_amx_benchmarks_build_anywhere(name, tmp_path):
    """bench/<name>.c builds by the line in its header (gcc 12 has the AMX intrinsics on any
    x86), warning-free; running it needs AMX."""
    import pathlib
    import platform
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("AMX intrinsics are x86's")
    src = pathlib.Path(__file__).parent.parent / "bench" / f"{name}.c"
    assert f"bench/{name}.c -o /tmp/{name} -lm" in src.read_text()     # the header's build line
    cc = shutil.which("gcc") or "gcc"
    r = subprocess.run([cc, "-O2", "-Wall", "-Wextra", "-Werror", "-mamx-tile", "-mamx-bf16", "-mavx512f",
                        str(src), "-o", str(tmp_path / name), "-lm"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
