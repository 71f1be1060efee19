"""bf16 GEMM: bf16 products (bf16 inputs, or fp32 ones rounded to bf16 while packing), fp32
accumulation. Checked against float64 of the bf16-rounded inputs with the fp32 accumulation
bound 2 (K + 4) u32 |A||B| (a product of two bf16 is exact in fp32, so only the sums round),
plus, for a bf16 out, its one final rounding (2^-8 of the value). Every back-end this CPU runs
is fuzzed (AVX512_BF16, AMX where present, and the widened fp32 fallback); on a CPU with
AVX512_BF16 but no AMX the AMX back-end runs too, its tile instructions emulated in C and
checked as the CPU checks them (gemm/amx_emulated.h.j2); what a CPU cannot run is compiled."""
import dataclasses
import contextlib
import os
import random
import shutil
import subprocess

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import autohc
from autohc.build import EMULATED_TILE_FLAGS
from autohc.hw import cpu
from autohc.kernels.gemm.codegen import render_gemm, render_gemm_objects
from autohc.kernels.gemm.kernel import default_kernel_params, get_kernel, tile_emulation
from autohc.kernels.gemm.matmul import _run_bf16c, operand_raw
from autohc.kernels.gemm.params import GemmParams, ParamError, default_params
from autohc.kernels.isa import GEMM_ISAS
from autohc.tune import registry

from gemm_reference import check

# the AMX back-end with its tiles emulated, where this CPU runs the vector code around them
EMULATED_AMX = ("amx-emulated" if "avx512bf16" in cpu.runnable_bf16_isas()
                and "amx" not in cpu.runnable_bf16_isas() else None)
# every bf16 back-end this CPU runs with bf16 products (AMX perhaps emulated) ...
BF16_UNITS = cpu.runnable_bf16_isas() + ([EMULATED_AMX] if EMULATED_AMX else [])
# ... then the widened fallback on the fp32 one
RUNNABLE = BF16_UNITS + [cpu.best_isa()]


@contextlib.contextmanager
def backend(name: str):
    """The isa of a back-end named in RUNNABLE, its tiles emulated inside for amx-emulated."""
    if name == EMULATED_AMX:
        with tile_emulation():
            yield "amx"
    else:
        yield name


@pytest.fixture(params=RUNNABLE)
def isa(request):
    with backend(request.param) as name:
        yield name


@pytest.fixture(params=BF16_UNITS or ["none"])
def unit_isa(request):
    if request.param == "none":
        pytest.skip("no bf16 back-end here: the widened fallback (tested above) is the path")
    with backend(request.param) as name:
        yield name


def bf16_params(isa: str, threads: int = 1, **over) -> GemmParams:
    """The generic entry's bf16 default of `isa` (the fp32 default, widened, on fp32 ISAs)."""
    p = default_params(isa, threads, arch="generic", dtype="bf16")
    return GemmParams(**{**p.to_dict(), **over}).validate() if over else p


# for tests whose every M is past skinny_m: kernels built without the skinny paths, which they
# never take and which are three quarters of a bf16 kernel's compile (first-use candidates too)
PACKED_ONLY = {"skinny_m": 0}


def prebuild(configs):
    """Compile the kernels of `configs` side by side (gcc on every core), as first-use tuning
    builds its candidates, before a test runs them one by one."""
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        list(pool.map(get_kernel, configs))


def rounded(x):
    """x as the kernels multiply it: rounded to bf16 (nearest even), held in float64."""
    return x.to(torch.bfloat16).double()


def operands(layout, m, k, n, rng, strided=False):
    """op(A) (m x k) and op(B) (k x n) as the layout's views; strided: every other column."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    step = 2 if strided else 1
    if layout == "NT":
        a = torch.randn(m, k * step, generator=g)[:, ::step]
        b = torch.randn(n, k * step, generator=g)[:, ::step].t()
    elif layout == "NN":
        a = torch.randn(m, k * step, generator=g)[:, ::step]
        b = torch.randn(k, n * step, generator=g)[:, ::step]
    else:  # TN
        a = torch.randn(k, m * step, generator=g)[:, ::step].t()
        b = torch.randn(k, n * step, generator=g)[:, ::step]
    return a, b


def check_bf16(got, a, b, c0, alpha, beta, what):
    a64, b64 = rounded(a), rounded(b)
    if got.dtype == torch.bfloat16:
        exp = alpha * (a64 @ b64) + (beta * c0.double() if beta else 0.0)
        tol = 2.0 * (a64.shape[1] + 4) * 2.0 ** -24 * (abs(alpha) * (a64.abs() @ b64.abs())
                                                       + abs(beta) * c0.double().abs())
        bad = ~((got.double() - exp).abs() <= tol + 2.0 ** -8 * exp.abs() + 1e-30)
        assert not bad.any(), f"{what}: {int(bad.sum())} wrong elements"
    else:
        check(got, a64, b64, c0, alpha, beta, what)


def products(kernels, a, b, out_dtype):
    """A B by each of `kernels`, each into a zeroed C of out_dtype."""
    outs = []
    for p in kernels:
        out = torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)
        autohc.matmul(a, b, out=out, params=p)
        outs.append(out)
    return outs


def test_fuzz_layouts_shapes_strides_dtypes(isa):
    """Ragged shapes (1, primes, past the tiles and blocks), the three layouts, strided
    views, alpha/beta, bf16/fp32/mixed inputs and fp32/bf16 out, on one and two threads."""
    rng = random.Random(27)
    sizes = [1, 2, 3, 7, 13, 17, 31, 33, 61, 97, 130, 257, 523]
    for threads in (1, 2):
        params = bf16_params(isa, threads)
        for trial in range(40 if threads == 1 else 15):
            layout = rng.choice(["NT", "NN", "TN"])
            m, k, n = (rng.choice(sizes) for _ in range(3))
            a, b = operands(layout, m, k, n, rng, strided=trial % 5 == 4)
            a = a if rng.random() < 0.4 else a.to(torch.bfloat16)
            b = b if rng.random() < 0.4 else b.to(torch.bfloat16)
            alpha = rng.choice([1.0, -0.5])
            beta = rng.choice([0.0, 0.0, 1.0, -2.0])
            out_dtype = rng.choice([torch.float32, torch.bfloat16])
            run_and_check(a, b, torch.randn(m, n).to(out_dtype), alpha, beta, params,
                          f"{isa} t{threads} {layout} m{m} k{k} n{n} {a.dtype}/{b.dtype}->{out_dtype} "
                          f"alpha {alpha} beta {beta}")


def run_and_check(a, b, c0, alpha, beta, params, what):
    """out := alpha a b + beta c0 (out of c0's dtype) by `params` in bf16, against float64"""
    out = c0.clone()
    autohc.matmul(a, b, out=out, alpha=alpha, beta=beta, params=params, compute="bf16")
    check_bf16(out, a, b, c0.float(), alpha, beta, what)


def bf16_out_as_fp32_rounded(a, b, alpha, params, what):
    """C := alpha a b into a bf16 C that is a column slice of a wider tensor (ldc > N), by
    `params`: bit for bit the same kernel's fp32 C rounded, nothing written outside C."""
    m, n = a.shape[0], b.shape[1]
    wide = torch.full((m, n + 9), 7.0, dtype=torch.bfloat16)
    out = wide[:, 3:3 + n]
    autohc.matmul(a, b, out=out, alpha=alpha, params=params, compute="bf16")
    f32 = autohc.matmul(a, b, out=torch.empty(m, n), alpha=alpha, params=params, compute="bf16")
    assert torch.equal(out, f32.to(torch.bfloat16)), what
    assert (wide[:, :3] == 7).all() and (wide[:, 3 + n:] == 7).all(), what + ": wrote outside C"
    return out


def test_bf16_rows_at_any_offset_and_stride(isa):
    """bf16 rows contiguous along K (A in NT/NN, W in NT) are transposed in place as 32-bit
    pairs where their stride is even and they start on a 4-byte boundary; an odd element
    offset, an odd stride or an odd K takes the copying path. Both give the same products."""
    rng = random.Random(11)
    for threads in (1, 2):
        params = bf16_params(isa, threads, kc=64, **PACKED_ONLY)  # K past one panel: panel offsets too
        for off in (0, 1):
            for k in (64, 130, 131, 200):
                for ld in (k + off, k + off + 1):       # even and odd row strides
                    m, n = 29, 45
                    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
                    xa = torch.randn(m, ld + 1, generator=g).to(torch.bfloat16)
                    xw = torch.randn(n, ld + 1, generator=g).to(torch.bfloat16)
                    a = xa[:, off:off + k]
                    for b in (xw[:, off:off + k].t(), torch.randn(k, n, generator=g).to(torch.bfloat16)):
                        out = autohc.matmul(a, b, params=params)
                        check_bf16(out, a, b, torch.zeros(m, n), 1.0, 0.0,
                                   f"{isa} t{threads} off {off} k {k} ld {ld + 1} b {b.stride()}")


def test_every_register_tile_and_loop_order(isa):
    """The search space's tiles and both loop orders (edges of every micro-tile)."""
    rng = random.Random(5)
    if isa == "amx":
        tiles = [(32, 32), (16, 48), (48, 16), (16, 16)]
    elif isa in ("avx512bf16", "avx512"):
        tiles = [(12, 32), (14, 32), (8, 48), (6, 64), (28, 16)]
    else:
        tiles = [(default_params(isa).mr, default_params(isa).nr)]
    configs = [bf16_params(isa, 1, mr=mr, nr=nr, mc=mr * 8, nc=nr * 10, kc=64, a_outer=a_outer, **PACKED_ONLY)
               for mr, nr in tiles for a_outer in (False, True)]
    prebuild(configs)
    for p in configs:
        for layout in ("NT", "NN", "TN"):
            m, k, n = p.mr * 3 + 1, 64 * 2 + 33, p.nr * 2 + 5
            a, b = operands(layout, m, k, n, rng)
            out = autohc.matmul(a, b, params=p, compute="bf16")
            check_bf16(out, a, b, torch.zeros(m, n), 1.0, 0.0, f"{isa} {p.mr}x{p.nr} {layout} {p.a_outer}")


def test_zero_sizes_and_nan(isa):
    p = bf16_params(isa)
    a = torch.randn(5, 0, dtype=torch.bfloat16)
    b = torch.randn(0, 3, dtype=torch.bfloat16)
    out = torch.full((5, 3), 2.0)
    autohc.matmul(a, b, out=out, beta=0.5, params=p)          # K == 0: C := beta C
    assert torch.equal(out, torch.full((5, 3), 1.0))
    assert autohc.matmul(torch.randn(0, 4).bfloat16(), torch.randn(4, 3).bfloat16(), params=p).shape == (0, 3)
    # beta == 0 never reads C; a NaN in A reaches only its own row
    out = torch.full((4, 3), float("nan"))
    a = torch.ones(4, 8, dtype=torch.bfloat16)
    a[1, 2] = float("nan")
    autohc.matmul(a, torch.ones(8, 3, dtype=torch.bfloat16), out=out, params=p)
    assert torch.isnan(out[1]).all() and torch.equal(out[[0, 2, 3]], torch.full((3, 3), 8.0))


def test_short_k_with_wide_n_stays_inside_the_b_panel(isa):
    """A K panel shorter than the K step (K = 1 and 3: AMX packs K in blocks of 32, vdpbf16ps in
    pairs) with N far past the B panel's columns: the packed chunk is sized by the padded K.
    Sized by the unpadded K, K = 1 on AMX took 32x the buffer's budget at N = 100 000 and wrote
    into the packed A beside it (wrong results, 10-16 off); vdpbf16ps's 2x stayed inside."""
    for k, threads in ((1, 1), (3, 2)):
        params = bf16_params(isa, threads, **PACKED_ONLY)
        g = torch.Generator().manual_seed(k)
        a = torch.randn(40, k, generator=g).bfloat16()
        b = torch.randn(k, 100_000, generator=g).bfloat16()
        out = autohc.matmul(a, b, out=torch.empty(40, 100_000), params=params)
        # K <= 3 products of bf16 values are exact in fp32 up to the sums' one rounding
        check(out, a.double(), b.double(), torch.zeros(40, 100_000), 1.0, 0.0, f"{isa} k{k} t{threads}")


def test_fp32_inputs_are_rounded_to_nearest_even_while_packing():
    """compute='bf16' on fp32 inputs gives what bf16 inputs rounded by torch give, bit for bit
    (the same products, summed in the same order)."""
    for name in RUNNABLE:
        with backend(name) as isa:
            p = bf16_params(isa)
            x = torch.randn(37, 301) * 3
            w = torch.randn(45, 301)
            got = autohc.matmul(x, w.t(), params=p, compute="bf16")
            want = autohc.matmul(x.to(torch.bfloat16), w.to(torch.bfloat16).t(), out=torch.empty(37, 45), params=p)
            assert torch.equal(got, want), name
            # NN and TN: operands along the other dimension (B's rows, TN's A), 32 columns at
            # a time rounded in vectors, the rest one by one; ties (low half 0x8000) included
            ties = torch.randn(301, 45).bfloat16().float().view(torch.int32) | 0x8000
            b = torch.where(torch.rand(301, 45) < 0.3, ties.view(torch.float32), torch.randn(301, 45))
            for a in (x, torch.randn(301, 37).t()):
                got = autohc.matmul(a, b, params=p, compute="bf16")
                want = autohc.matmul(a.to(torch.bfloat16), b.to(torch.bfloat16), out=torch.empty(37, 45), params=p)
                assert torch.equal(got, want), name


def test_numpy_with_compute_bf16():
    x = np.random.default_rng(0).standard_normal((20, 70), dtype=np.float32)
    w = np.random.default_rng(1).standard_normal((70, 9), dtype=np.float32)
    got = autohc.matmul(x, w, compute="bf16")
    assert got.dtype == np.float32
    check(torch.from_numpy(got), rounded(torch.from_numpy(x)), rounded(torch.from_numpy(w)),
          torch.zeros(20, 9), 1.0, 0.0, "numpy")


def test_bad_inputs_are_one_clear_error():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="compute='bf16'"):
        autohc.matmul(x, x.t(), compute="fp32")
    with pytest.raises(ValueError, match="compute must be"):
        autohc.matmul(x, x.t(), compute="fp16")
    with pytest.raises(ValueError, match="params compute in fp32"):
        autohc.matmul(x, x.t(), params=default_params(cpu.best_isa()))
    with pytest.raises(TypeError, match="bfloat16 out"):
        autohc.matmul(torch.randn(4, 8), torch.randn(8, 2), out=torch.empty(4, 2, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="float16"):
        autohc.matmul(x.half(), x.t())


def test_params_validation():
    with pytest.raises(ParamError, match="needs dtype='bf16'"):
        GemmParams(isa="avx512bf16", vl=16, mr=12, nr=32).validate()
    with pytest.raises(ParamError, match="no skinny path"):
        GemmParams(isa="avx512", vl=16, mr=12, nr=32, dtype="bf16", skinny_m=16).validate()
    GemmParams(isa="avx512bf16", vl=16, mr=12, nr=32, dtype="bf16", skinny_m=16).validate()
    with pytest.raises(ParamError, match="tiles"):
        GemmParams(isa="amx", vl=16, mr=32, nr=48, dtype="bf16", skinny_m=0, kc=256, nc=4080).validate()
    with pytest.raises(ParamError, match="multiple of 16"):
        GemmParams(isa="amx", vl=16, mr=12, nr=32, dtype="bf16", skinny_m=0).validate()
    with pytest.raises(ParamError, match="blocks of 32"):
        GemmParams(isa="amx", vl=16, mr=32, nr=32, dtype="bf16", skinny_m=0, kc=200).validate()
    with pytest.raises(ParamError, match="pairs"):
        GemmParams(isa="avx512bf16", vl=16, mr=12, nr=32, dtype="bf16", skinny_m=0, kc=255).validate()
    # an fp32 set keeps the key of releases before bf16; a bf16 one is another kernel
    p = default_params("avx2")
    assert "dtype" not in p.to_dict() and GemmParams.from_dict(p.to_dict()) == p
    q = default_params("avx2", dtype="bf16")
    assert q.key != p.key and GemmParams.from_dict(q.to_dict()) == q
    # c_tiles is the AMX back-end's; off, a set keeps the key it had before the field
    with pytest.raises(ParamError, match="c_tiles"):
        GemmParams(isa="avx512bf16", vl=16, mr=12, nr=32, dtype="bf16", c_tiles=True).validate()
    amx = default_params("amx", dtype="bf16").to_dict()
    for bad in ({"kc_inner": 64, "a_outer": False}, {"kc_inner": 100}, {"kc_inner": amx["kc"]}):
        with pytest.raises(ParamError, match="kc_inner"):
            GemmParams(**{**amx, "a_outer": True, **bad}).validate()
    with pytest.raises(ParamError, match="kc_inner"):
        GemmParams(isa="avx512bf16", vl=16, mr=12, nr=32, dtype="bf16", a_outer=True, kc_inner=64).validate()
    for bad in ({"sink_every": 3}, {"sink_every": 128}):
        with pytest.raises(ParamError, match="sink_every"):
            GemmParams(**{**amx, **bad}).validate()
    with pytest.raises(ParamError, match="sink_every"):
        GemmParams(isa="avx512bf16", vl=16, mr=12, nr=32, dtype="bf16", sink_every=8).validate()
    assert "sink_every" not in GemmParams(**{**amx, "sink_every": 0}).validate().to_dict()
    with pytest.raises(ParamError, match="a_direct"):
        GemmParams(**{**amx, "a_outer": False, "a_direct": True}).validate()
    with pytest.raises(ParamError, match="a_direct"):
        GemmParams(isa="avx512bf16", vl=16, mr=12, nr=32, dtype="bf16", a_outer=False, a_direct=True).validate()
    with pytest.raises(ParamError, match="a_direct"):
        GemmParams(isa="avx512", vl=16, mr=12, nr=32, dtype="bf16", skinny_m=0, a_outer=True, a_direct=True).validate()
    assert GemmParams(isa="avx512bf16", vl=16, mr=12, nr=32, dtype="bf16", a_outer=True, a_direct=True).validate().a_direct
    assert "a_direct" not in GemmParams(**{**amx, "a_outer": True, "a_direct": False}).validate().to_dict()
    x = GemmParams(**{**default_params("amx", dtype="bf16").to_dict(), "c_tiles": False, "stream_c": False}).validate()
    y = GemmParams(**{**x.to_dict(), "c_tiles": True}).validate()
    assert "c_tiles" not in x.to_dict() and y.key != x.key and GemmParams.from_dict(y.to_dict()) == y


@pytest.mark.skipif(not ({"amx", EMULATED_AMX} & set(BF16_UNITS)), reason="needs AMX, real or emulated")
def test_amx_c_through_the_tiles():
    """c_tiles: a whole fp32 C tile with alpha 1 and no bias goes straight between C and the
    accumulators (loaded where beta is 1: a later K panel, or C's own values); every other
    tile (edges, alpha != 1, another beta, a bf16 C) takes the vector epilogue. Both loop
    orders, K over several panels, 1 and 2 threads, against float64."""
    with backend("amx" if "amx" in BF16_UNITS else EMULATED_AMX):
        _c_through_the_tiles()


def _c_through_the_tiles():
    rng = random.Random(31)
    for threads, a_outer in ((1, False), (2, True)):
        p = bf16_params("amx", threads, kc=64, mc=64, nc=96, a_outer=a_outer, c_tiles=True, **PACKED_ONLY)
        for layout in ("NT", "NN", "TN"):
            for m, k, n in ((64, 192, 96), (64 + 7, 64 * 2 + 33, 96 + 5), (32, 64, 32)):
                a, b = operands(layout, m, k, n, rng)
                for alpha, beta, out_dtype in ((1.0, 0.0, torch.float32), (1.0, 1.0, torch.float32),
                                               (-0.5, 1.0, torch.float32), (1.0, -2.0, torch.float32),
                                               (1.0, 0.0, torch.bfloat16)):
                    run_and_check(a, b, torch.randn(m, n).to(out_dtype), alpha, beta, p,
                                  f"c_tiles t{threads} a_outer {a_outer} {layout} m{m} k{k} n{n} "
                                  f"alpha {alpha} beta {beta} {out_dtype}")


@pytest.mark.skipif(not ({"amx", EMULATED_AMX} & set(BF16_UNITS)), reason="needs AMX, real or emulated")
def test_amx_k_steps_inside_a_panel():
    """kc_inner: a K panel of 160 taken as 64 + 64 + 32 (first, middle, last step) and one of
    45 whole, over two groups of B micro-panels (15 > PART_NP = 12), ragged M and N, C
    through the tiles or not, fp32 C with beta 0, 1 and 0.5, a bf16 C, a bias; 1 thread and
    2 (own rows) against float64."""
    rng = random.Random(41)
    with backend("amx" if "amx" in BF16_UNITS else EMULATED_AMX):
        for threads, c_tiles in ((1, True), (2, False)):
            p = bf16_params("amx", threads, kc=160, mc=96, nc=480, a_outer=True, own_rows=True, **PACKED_ONLY,
                            c_tiles=c_tiles, kc_inner=64)
            for layout in ("NT", "NN", "TN"):
                m, k, n = 71, 160 * 2 + 45, 32 * 14 + 5
                a, b = operands(layout, m, k, n, rng)
                for alpha, beta, out_dtype in ((1.0, 0.0, torch.float32), (1.0, 1.0, torch.float32),
                                               (-0.5, 0.5, torch.float32), (1.0, 0.0, torch.bfloat16)):
                    run_and_check(a, b, torch.randn(m, n).to(out_dtype), alpha, beta, p,
                                  f"kc_inner t{threads} c_tiles {c_tiles} {layout} alpha {alpha} "
                                  f"beta {beta} {out_dtype}")
            # a Linear's bias, added by the last step of the first K panel (C not read)
            a, b = operands("NT", 71, 365, 453, rng)
            a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
            bias, out = torch.randn(453), torch.full((71, 453), float("nan"))
            get_kernel(p).run(71, 453, 365, 0.5, a16.data_ptr(), a16.stride(0), a16.stride(1), b16.data_ptr(),
                              b16.stride(0), b16.stride(1), -2.0, out.data_ptr(), 453, bias.data_ptr())
            check_bf16(out, a, b, bias.expand(71, 453), 0.5, -2.0, f"kc_inner bias t{threads}")


A_DIRECT_UNITS = [u for u in ("amx" if "amx" in BF16_UNITS else EMULATED_AMX, "avx512bf16") if u in BF16_UNITS]


@pytest.mark.skipif(not A_DIRECT_UNITS, reason="needs AMX (real or emulated) or AVX512_BF16")
@pytest.mark.parametrize("unit", A_DIRECT_UNITS)
def test_a_from_its_own_rows(unit):
    """a_direct: a bf16 A with rows contiguous along K and K in whole blocks of 32 (AMX) or
    pairs (vdpbf16ps) (NT, NN) is read straight from its rows, a ragged last micro-panel
    packed; at any row stride (a view of a wider A, an odd stride), over several K panels,
    with kc_inner steps (amx) and without, own rows and shared A blocks on 2 threads. An A
    that cannot (TN, an odd K, on AMX a K not a multiple of 32, an fp32 A rounded while
    packing) is packed as before. Against float64."""
    rng = random.Random(43)
    with backend(unit) as isa:
        steps = (0, 32, 0, 32) if isa == "amx" else (0, 0, 0, 0)
        configs = [bf16_params(isa, t, kc=64, mc=96, nc=96, a_outer=True, own_rows=own, a_direct=True,
                               kc_inner=ki, **PACKED_ONLY)
                   for (t, own), ki in zip(((1, True), (1, True), (2, True), (2, False)), steps)]
        prebuild(configs)
        cases = (("NT", 71, 160, 101, 0, torch.bfloat16), ("NN", 71, 160, 101, 7, torch.bfloat16),
                 ("NT", 64, 96, 45, 33, torch.bfloat16), ("NN", 71, 161, 45, 0, torch.bfloat16),
                 ("NN", 73, 98, 45, 3, torch.bfloat16),
                 ("TN", 71, 160, 45, 0, torch.bfloat16), ("NT", 71, 160, 45, 0, torch.float32))
        for p in configs:
            for i, (layout, m, k, n, wider, a_dtype) in enumerate(cases):
                g = torch.Generator().manual_seed(rng.randrange(1 << 30))
                a = (torch.randn(k, m, generator=g).to(a_dtype).t() if layout == "TN"
                     else torch.randn(m, k + wider, generator=g).to(a_dtype)[:, :k])
                b = (torch.randn(n, k, generator=g).t() if layout == "NT"
                     else torch.randn(k, n, generator=g)).to(torch.bfloat16)
                if layout != "TN" and wider:
                    assert a.stride() == (k + wider, 1)     # (the view kept A's row stride)
                beta, out_dtype = ((0.0, torch.bfloat16), (0.5, torch.float32))[i % 2]
                c0 = torch.randn(m, n).to(out_dtype)
                out = c0.clone()
                autohc.matmul(a, b, out=out, beta=beta, params=p, compute="bf16")
                check_bf16(out, a.float(), b.float(), c0.float(), 1.0, beta,
                           f"a_direct t{p.threads} own_rows {p.own_rows} kc_inner {p.kc_inner} {layout} "
                           f"m{m} k{k} n{n} lda {a.stride()} {a_dtype}")


@pytest.mark.skipif("avx512bf16" not in BF16_UNITS, reason="needs AVX512_BF16")
def test_a_from_its_rows_bounded_by_n_and_row_stride():
    """vdpbf16ps's a_direct with a_direct_n: A from its rows only where the way's N is at most
    that, and never where A's rows lie a multiple of 4 KiB apart (they would share an L1 set);
    each side of both bounds, 1 and 2 threads (2 JC ways: each way's own N), against float64 and
    bit-identical to the same blocks packing A (the same products summed in the same order)."""
    rng = random.Random(47)
    with backend("avx512bf16") as isa:
        pairs = [(bf16_params(isa, t, kc=64, mc=96, nc=96, a_outer=True, own_rows=own, a_direct=True,
                              a_direct_n=64, jc_ways=jc, ic_ways=t // jc, **PACKED_ONLY),
                  bf16_params(isa, t, kc=64, mc=96, nc=96, a_outer=True, own_rows=own, jc_ways=jc,
                              ic_ways=t // jc, **PACKED_ONLY))
                 for t, own, jc in ((1, True, 1), (2, True, 1), (2, False, 2))]
        with pytest.raises(ParamError, match="a_direct_n"):
            bf16_params(isa, 1, a_outer=True, a_direct=False, a_direct_n=64)
        with pytest.raises(ParamError, match="a_direct_n"):
            bf16_params("amx", 1, a_outer=True, a_direct=True, a_direct_n=64)
        prebuild([p for pair in pairs for p in pair])
        # (M, K, N, A's row stride): N at and past 64 (one way's N past it, the other's not,
        # at 2 ways), rows 4 KiB (2048 bf16) and 8 KiB apart, and 2 KiB (direct)
        cases = ((71, 160, 45, 160), (71, 160, 64, 162), (71, 160, 101, 160), (71, 160, 130, 170),
                 (37, 160, 45, 2048), (37, 98, 45, 4096), (37, 160, 45, 1024), (25, 2048, 33, 2048))
        for direct, packed in pairs:
            for layout in ("NT", "NN"):
                for i, (m, k, n, lda) in enumerate(cases):
                    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
                    a = torch.randn(m, lda, generator=g).to(torch.bfloat16)[:, :k]
                    b = (torch.randn(n, k, generator=g).t() if layout == "NT"
                         else torch.randn(k, n, generator=g)).to(torch.bfloat16)
                    out_dtype = (torch.bfloat16, torch.float32)[i % 2]
                    outs = products((direct, packed), a, b, out_dtype)
                    what = f"a_direct_n t{direct.threads} jc{direct.jc_ways} {layout} m{m} k{k} n{n} lda {lda}"
                    check_bf16(outs[0], a.float(), b.float(), torch.zeros(m, n), 1.0, 0.0, what)
                    assert torch.equal(outs[0], outs[1]), what


@pytest.mark.skipif(not ({"amx", EMULATED_AMX} & set(BF16_UNITS)), reason="needs AMX, real or emulated")
def test_own_rows_by_k_gives_own_rows_results_bit_for_bit():
    """own_rows_by_k (2 threads, 32-row micro-panels: own rows up to K 512, shared A blocks
    for K in one panel past that, own rows again over several panels) changes which thread
    computes which tile, never a tile's sum: C is bit-identical to own rows' and to the shared
    blocks', NT and NN with A from its rows (a_direct) and TN packed, ragged M and N, bf16 and
    fp32 out, and matches float64. The same with own_rows_b_kib 4 (own rows at short K only
    where K x N bf16 is at most 4 KiB: 32 x 40 own rows, the others past it shared)."""
    rng = random.Random(57)
    with backend("amx" if "amx" in BF16_UNITS else EMULATED_AMX):
        common = dict(kc=576, mc=128, nc=96, a_outer=True, a_direct=True, **PACKED_ONLY)
        by_k, own, shared = (bf16_params("amx", 2, own_rows=o, own_rows_by_k=k, **common)
                             for o, k in ((True, True), (True, False), (False, False)))
        by_b = bf16_params("amx", 2, own_rows=True, own_rows_by_k=True, own_rows_b_kib=4, **common)
        assert bf16_params("amx", 2).mr == 32      # (the K bounds below are for 32 rows)
        prebuild([by_k, own, shared, by_b])
        for layout, m, k, n in (("NT", 71, 96, 45), ("NN", 96, 512, 33), ("NT", 71, 576, 45), ("NN", 64 + 5, 544, 101),
                                ("TN", 45, 576, 40), ("NT", 33, 640, 17), ("NN", 71, 1184, 45), ("NT", 71, 32, 40)):
            a, b = operands(layout, m, k, n, rng)
            a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
            for out_dtype in (torch.bfloat16, torch.float32):
                outs = products((by_k, own, shared, by_b), a, b, out_dtype)
                what = f"own_rows_by_k {layout} {m}x{k}x{n} {out_dtype}"
                assert all(torch.equal(outs[0], o) for o in outs[1:]), what
                check_bf16(outs[0], a.float(), b.float(), torch.zeros(m, n), 1.0, 0.0, what)
    with pytest.raises(ParamError, match="own_rows_by_k"):
        bf16_params("amx", 2, own_rows=False, own_rows_by_k=True)
    with pytest.raises(ParamError, match="own_rows_b_kib"):
        bf16_params("amx", 2, own_rows=True, own_rows_by_k=False, own_rows_b_kib=1024)


def check_pairs(name, pairs, shapes, rng, bitwise):
    """Each (new, old) pair of kernels on each shape, bf16 and fp32 out: the new one's C against
    float64, and bit-identical to the old one's where bitwise(m, n, new) holds."""
    prebuild([p for pair in pairs for p in pair])
    for new, old in pairs:
        for layout, m, k, n in shapes:
            a, b = operands(layout, m, k, n, rng)
            a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
            for out_dtype in (torch.bfloat16, torch.float32):
                outs = products((new, old), a, b, out_dtype)
                what = f"{name} t{new.threads} {layout} {m}x{k}x{n} {out_dtype}"
                check_bf16(outs[0], a.float(), b.float(), torch.zeros(m, n), 1.0, 0.0, what)
                if bitwise(m, n, new):
                    assert torch.equal(outs[0], outs[1]), what


@pytest.mark.skipif(not ({"amx", EMULATED_AMX} & set(BF16_UNITS)), reason="needs AMX, real or emulated")
def test_stream_b_k_changes_no_result():
    """stream_b_k: where the whole K is one panel of at most stream_b_k, the tile loop loads B
    by tileloaddt1 and prefetches no A; elsewhere (K past it, several panels) the loop is as
    before. Bit-identical C to the same kernel without it, NT/NN (A from its rows, ragged
    rows packed) and TN, 1 and 2 threads, K one block, several, at the bound and past it,
    bf16 and fp32 out, against float64."""
    rng = random.Random(59)
    with backend("amx" if "amx" in BF16_UNITS else EMULATED_AMX):
        pairs = [tuple(bf16_params("amx", t, kc=256, mc=96, nc=96, a_outer=True, a_direct=True, prefetch_a=2,
                                   stream_b_k=sb, **PACKED_ONLY) for sb in (0, 160))
                 for t in (1, 2)]
        pairs = [(streamed, base) for base, streamed in pairs]
        check_pairs("stream_b_k", pairs, (("NT", 71, 32, 45), ("NN", 96, 160, 33), ("NT", 64 + 5, 150, 101),
                                          ("TN", 45, 96, 40), ("NT", 33, 192, 17), ("NN", 71, 300, 45)),
                    rng, lambda m, n, p: True)
    with pytest.raises(ParamError, match="stream_b_k"):
        GemmParams(isa="avx512bf16", vl=16, mr=12, nr=32, dtype="bf16", stream_b_k=512).validate()


@pytest.mark.skipif(not ({"amx", EMULATED_AMX} & set(BF16_UNITS)), reason="needs AMX, real or emulated")
def test_stream_c_changes_no_result():
    """stream_c: where K is one panel and beta is 0, a whole fp32 C tile goes out by
    non-temporal stores (C's rows 64-byte aligned; else the tile store); several K panels,
    beta 1, ragged edges, a bf16 C and unaligned rows as before. Bit-identical C to the same kernel without it (beta 0 and 1,
    NT/NN/TN, 1 and 2 threads, both loop orders), nothing written outside a C that is a column
    slice of a wider tensor, against float64."""
    rng = random.Random(61)
    with backend("amx" if "amx" in BF16_UNITS else EMULATED_AMX):
        pairs = [tuple(bf16_params("amx", t, kc=128, mc=96, nc=96, a_outer=a_outer, c_tiles=True, stream_c=sc,
                                   **PACKED_ONLY) for sc in (True, False))
                 for t, a_outer in ((1, True), (2, True), (2, False))]
        shapes = (("TN", 64, 128, 96), ("TN", 96, 96, 64 + 5), ("NT", 64 + 7, 64, 96), ("NN", 32, 4, 64),
                  ("TN", 64, 128 * 2 + 32, 96), ("NT", 71, 300, 45))
        check_pairs("stream_c", pairs, shapes, rng, lambda m, n, p: True)
        for new, old in pairs:
            for layout, m, k, n in shapes:
                a, b = operands(layout, m, k, n, rng)
                c0 = torch.randn(m, n)
                outs = []
                for q in (new, old):
                    wide = torch.full((m, n + 16), 7.0)      # rows 64-byte aligned from column 16
                    out = wide[:, 16:]
                    out.copy_(c0)
                    autohc.matmul(a, b, out=out, beta=1.0, params=q, compute="bf16")
                    assert (wide[:, :16] == 7).all(), f"stream_c {layout} {m}x{k}x{n}: wrote outside C"
                    outs.append(out)
                what = f"stream_c t{new.threads} a_outer {new.a_outer} {layout} {m}x{k}x{n} beta 1"
                assert torch.equal(outs[0], outs[1]), what
                check_bf16(outs[0], a, b, c0, 1.0, 1.0, what)
    with pytest.raises(ParamError, match="stream_c"):
        GemmParams(isa="avx512bf16", vl=16, mr=12, nr=32, dtype="bf16", stream_c=True).validate()
    with pytest.raises(ParamError, match="stream_c"):
        bf16_params("amx", 1, c_tiles=False, stream_c=True)
    assert "stream_c" not in bf16_params("amx", 1).to_dict()


@pytest.mark.skipif(not ({"amx", EMULATED_AMX} & set(BF16_UNITS)), reason="needs AMX, real or emulated")
def test_one_panel_k_takes_k_whole_with_the_panels_results():
    """one_panel_k: where A's tiles come from its rows (NT/NN, bf16, K whole blocks of 32) and
    K is at most one_panel_k, K is one panel past kc (buffers sized for it, a ragged last
    micro-panel packed at that K, shared A blocks at 2 threads); elsewhere (K past it, K not
    whole blocks, TN) panels of kc as before. Against float64 everywhere; where every tile is
    whole, the fp32 sums go through the tiles either way, so C is bit-identical to the kernel
    with panels of kc. 1 and 2 threads, bf16 and fp32 out."""
    rng = random.Random(61)
    with backend("amx" if "amx" in BF16_UNITS else EMULATED_AMX):
        pairs = [tuple(bf16_params("amx", t, kc=128, mc=96, nc=96, a_outer=True, a_direct=True, c_tiles=True,
                                   defer_epilogue=True, own_rows=True, own_rows_by_k=True, one_panel_k=opk,
                                   **PACKED_ONLY) for opk in (320, 0))
                 for t in (1, 2)]
        check_pairs("one_panel_k", pairs, (("NT", 64, 256, 64), ("NN", 96, 320, 64), ("NT", 71, 288, 45),
                                           ("NN", 64, 96, 32), ("NT", 64, 352, 64), ("NT", 45, 150, 40),
                                           ("TN", 64, 256, 64)),
                    rng, lambda m, n, p: m % p.mr == 0 and n % p.nr == 0)
    with pytest.raises(ParamError, match="one_panel_k"):
        bf16_params("amx", 1, a_outer=False, a_direct=False, one_panel_k=2304)
    with pytest.raises(ParamError, match="256 MiB"):     # the buffers hold one_panel_k's K
        bf16_params("amx", 1, a_outer=True, a_direct=True, mc=16384, one_panel_k=8192)


@pytest.mark.skipif(not ({"amx", EMULATED_AMX} & set(BF16_UNITS)), reason="needs AMX, real or emulated")
def test_amx_prefetches_and_the_sink_change_no_result():
    """prefetch_a/b (tiles K blocks ahead), prefetch_c (C's lines as the call starts, fp32
    or bf16, read or only written) and sink_every (an A tile stored to the stack every that
    many K blocks, with k_unroll 1 and 2) on and off: the same results against float64, K
    over several panels and ragged edges."""
    rng = random.Random(37)
    with backend("amx" if "amx" in BF16_UNITS else EMULATED_AMX):
        for threads, a_outer, pf in ((1, False, dict(prefetch_a=1, prefetch_b=2, prefetch_c=True, sink_every=2)),
                                     (2, True, dict(prefetch_a=2, prefetch_b=1, prefetch_c=False, sink_every=1,
                                                    k_unroll=2))):
            p = bf16_params("amx", threads, kc=64, mc=64, nc=96, a_outer=a_outer, **pf, **PACKED_ONLY)
            for layout in ("NT", "TN"):
                m, k, n = 64 + 7, 64 * 2 + 33, 96 + 5
                a, b = operands(layout, m, k, n, rng)
                for beta, out_dtype in ((0.0, torch.float32), (1.0, torch.float32), (0.5, torch.bfloat16)):
                    run_and_check(a, b, torch.randn(m, n).to(out_dtype), 1.0, beta, p,
                                  f"{pf} t{threads} {layout} beta {beta} {out_dtype}")


@pytest.mark.skipif(not ({"amx", EMULATED_AMX} & set(BF16_UNITS)), reason="needs AMX, real or emulated")
def test_amx_deferred_epilogue_rounds_every_tile_as_the_fp32_result():
    """defer_epilogue: a whole bf16 micro-tile (beta 0, or a bias) is rounded into C among the
    next micro-tile's K blocks (from its third, 4 rows a block; the rest after its loop where K
    has fewer blocks), the last one of a sweep at its end; ragged tiles and a C read with beta
    are rounded at once; with c_tiles the last K panel takes the earlier panels' fp32 sums into
    the tiles (alpha 1) and is deferred too, and the next micro-tile's fp32 C is prefetched.
    With prefetch_next_a (the next A micro-panel into L2 during a sweep) on two of them.
    Bit for bit the same kernel's fp32 C rounded, and against float64, on K of 2, 10 and more
    blocks per panel, one and several panels, ragged M and N, alpha 1 and not, 1 and 2 threads."""
    rng = random.Random(43)
    with backend("amx" if "amx" in BF16_UNITS else EMULATED_AMX):
        configs = [bf16_params("amx", t, kc=kc, mc=96, nc=96, a_outer=True, own_rows=own, defer_epilogue=True,
                               **more, **PACKED_ONLY)
                   for t, own, kc, more in ((1, True, 320, dict(a_direct=True, prefetch_a=2, sink_every=8, c_tiles=True,
                                                                prefetch_c=False, prefetch_next_a=True)),
                                            (2, True, 64, dict(c_tiles=True, prefetch_next_a=True)),
                                            (2, False, 320, dict(k_unroll=2)))]
        prebuild(configs)
        for p in configs:
            for layout, m, k, n in (("NT", 71, 64, 101), ("NN", 96, 320, 64), ("NT", 64 + 7, 320 * 2 + 64, 96 + 5),
                                    ("TN", 45, 320, 96)):
                a, b = operands(layout, m, k, n, rng)
                a = a.to(torch.bfloat16)
                for alpha in (1.0, -0.75):
                    what = f"defer t{p.threads} own_rows {p.own_rows} kc {p.kc} {layout} {m}x{k}x{n} alpha {alpha}"
                    out = bf16_out_as_fp32_rounded(a, b, alpha, p, what)
                    check_bf16(out, a.float(), b.float(), torch.zeros(m, n), alpha, 0.0, what)
                run_and_check(a, b, torch.randn(m, n).to(torch.bfloat16), 0.5, 0.5, p, f"defer beta 0.5 {layout}")
                # a Linear's bias (beta scales it): deferred as well, the same bits as at once
                bias = torch.randn(n)
                outs = [torch.zeros(m, n, dtype=torch.bfloat16) for _ in range(2)]
                for q, out in zip((p, dataclasses.replace(p, defer_epilogue=False)), outs):
                    assert _run_bf16c("torch", a, b, operand_raw(a), operand_raw(b), operand_raw(out), 0.5,
                                      q.threads, q, bias, -2.0)
                what = f"defer bias t{p.threads} {layout} {m}x{k}x{n}"
                assert torch.equal(outs[0], outs[1]), what
                check_bf16(outs[0], a.float(), b.float(), bias.expand(m, n), 0.5, -2.0, what)
    for amx_only in ("defer_epilogue", "prefetch_next_a"):
        with pytest.raises(ParamError, match=amx_only):
            GemmParams(isa="avx512bf16", vl=16, mr=12, nr=32, dtype="bf16", **{amx_only: True}).validate()


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
@pytest.mark.parametrize("name", ["avx512bf16", "amx", "amx-emulated", "avx2", "portable"])
def test_every_bf16_backend_compiles_standalone(name, tmp_path):
    """The rendered C builds without Python (as `autohc export` ships it) with every warning
    an error: AMX and AVX512_BF16 included on CPUs that cannot run them, and the AMX kernel
    with its tiles emulated (the tests' build of it). Every option's variant compiles on the
    real tiles; the emulated build swaps only the tile instructions, so it compiles the two
    loop orders."""
    isa, emulated = name.removesuffix("-emulated"), name.endswith("-emulated")
    variants = [(1, False, {}), (2, True, {})] + ([(2, True, {"c_tiles": True, "kc_inner": 128, "sink_every": 8,
                                                              "a_direct": True, "defer_epilogue": True,
                                                              "prefetch_a": 2, "prefetch_next_a": True,
                                                              "own_rows_by_k": True, "stream_b_k": 1024,
                                                              "one_panel_k": 2304, "stream_c": True}),
                                                  (1, False, {"prefetch_a": 1, "prefetch_b": 2, "sink_every": 4,
                                                              "k_unroll": 2})]
                                                 if isa == "amx" and not emulated else [])
    flags = ["-O3", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-fPIC", *GEMM_ISAS[isa].cflags,
             *(EMULATED_TILE_FLAGS if emulated else ())]
    renders = [(render_gemm(p, emulate_tiles=emulated), tuple(render_gemm_objects(p, emulate_tiles=emulated).values()))
               for p in (bf16_params(isa, threads, a_outer=a_outer, **more) for threads, a_outer, more in variants)]
    # the linked objects (the skinny paths: the same source for every variant) compile once
    objects = {src: tmp_path / f"{isa}_object{j}" for j, src in enumerate(dict.fromkeys(o for _, objs in renders for o in objs))}

    def compile_to(src, path):
        path.with_suffix(".c").write_text(src)
        return subprocess.run(["gcc", *flags, "-c", str(path.with_suffix(".c")), "-o", str(path.with_suffix(".o"))],
                              capture_output=True, text=True)

    def link(i, objs):
        # every symbol resolved inside the library: the skinny paths' object linked in
        # (with the flags autohc builds it with: emulated tiles also EMULATED_TILE_FLAGS)
        return subprocess.run(["gcc", *flags, "-shared", "-Wl,--no-undefined", str(tmp_path / f"{isa}{i}.o"),
                               *(str(objects[o].with_suffix(".o")) for o in objs), "-o", str(tmp_path / f"{isa}{i}.so"),
                               "-lpthread"], capture_output=True, text=True)
    jobs = [*objects.items(), *((src, tmp_path / f"{isa}{i}") for i, (src, _) in enumerate(renders))]
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:      # (gcc runs side by side)
        for proc in pool.map(lambda job: compile_to(*job), jobs):
            assert proc.returncode == 0, proc.stderr
        for proc in pool.map(lambda i: link(i, renders[i][1]), range(len(renders))):
            assert proc.returncode == 0, proc.stderr
    src = render_gemm(bf16_params(isa), emulate_tiles=emulated)
    if emulated:
        assert "emu_tile_dpbf16ps" in src and "amx_configure" in src
    elif isa == "amx":
        assert "_tile_dpbf16ps" in src and "amx_configure" in src
    elif isa == "avx512bf16":
        assert "_mm512_dpbf16_ps" in src
    else:
        assert "_mm512_dpbf16_ps" not in src and "_tile_" not in src


def test_unrunnable_backend_says_so():
    for isa in ("amx", "avx512bf16"):
        if isa in cpu.runnable_bf16_isas():
            continue
        k = get_kernel(bf16_params(isa))
        assert not k.runnable
        with pytest.raises(RuntimeError, match="cannot run"):
            k.run(1, 1, 1, 1.0, 0, 1, 1, 0, 1, 1, 0.0, 0, 1)


def test_bf16_choice_and_reason(monkeypatch):
    from autohc.hw.cpu import CpuInfo
    base = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}

    def fake(flags):
        return CpuInfo(arch="x86_64", vendor="v", model="m", flags=frozenset(flags), cpus=(0,))
    monkeypatch.delenv(cpu.BF16_ISA_ENV, raising=False)
    assert cpu.bf16_isa(fake(base | {"avx512_bf16", "amx_tile", "amx_bf16"}))[0] == "amx"
    assert cpu.bf16_isa(fake(base | {"avx512_bf16"}))[0] == "avx512bf16"
    isa, why = cpu.bf16_isa(fake({"avx2", "fma"}))
    assert isa == "avx2" and "widened" in why
    monkeypatch.setenv(cpu.BF16_ISA_ENV, "avx512bf16")
    assert cpu.bf16_isa(fake(base | {"avx512_bf16", "amx_tile", "amx_bf16"}))[0] == "avx512bf16"
    with pytest.raises(ValueError, match="AUTOHC_BF16_ISA"):
        cpu.bf16_isa(fake({"avx2", "fma"}))


def test_registry_keeps_bf16_and_fp32_apart(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOHC_REGISTRY", str(tmp_path / "registry.json"))
    registry.forget()
    p16 = default_params(cpu.bf16_isa()[0], 1, dtype="bf16")
    registry.record("gemm", "NT", 1152, 4608, 2048, 1, p16, 200.0, 190.0)
    assert registry.lookup("gemm", "NT", 1152, 4608, 2048, 1) is None
    hit = registry.lookup("gemm", "NT", 1152, 4608, 2048, 1, dtype="bf16")
    assert hit is not None and hit[0] == p16 and hit[1]["dtype"] == "bf16"
    p32 = default_params(cpu.best_isa(), 1)
    registry.record("gemm", "NT", 1152, 4608, 2048, 1, p32, 100.0, 90.0)
    assert registry.lookup("gemm", "NT", 1152, 4608, 2048, 1)[0] == p32
    assert registry.lookup("gemm", "NT", 1152, 4608, 2048, 1, dtype="bf16")[0] == p16
    keys = registry.entries_for_this_cpu("gemm")
    assert "gemm/NT/K1152/N4608/M2048/t1/bf16" in keys and "gemm/NT/K1152/N4608/M2048/t1" in keys
    registry.forget()


needs_bf16_unit = pytest.mark.skipif(not cpu.runnable_bf16_isas(),
                                     reason="tuning bf16 needs AVX512_BF16 or AMX (elsewhere it "
                                            "is the widened fp32 kernel, tested above)")


@needs_bf16_unit
def test_tune_bf16_records_a_bf16_entry_that_matmul_runs(tmp_path, monkeypatch):
    from autohc.kernels.gemm.matmul import tuned_params
    from autohc.kernels.gemm.problem import GemmProblem
    from autohc.tune import gemm as tuner
    monkeypatch.setenv("AUTOHC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("AUTOHC_REGISTRY", raising=False)
    registry.forget()
    prob = GemmProblem("t", "NT", 96, 64, 80)
    r = tuner.tune_problem(prob, 1, trials=3, timeout=120, dtype="bf16")
    assert r.params.dtype == "bf16" and r.params.isa == cpu.bf16_isa()[0]
    assert r.gflops > 0 and r.torch_gflops > 0 and not r.from_registry
    assert tuner.tune_problem(prob, 1, trials=3, dtype="bf16").from_registry
    x, w = prob.operands(0, torch.bfloat16)
    assert tuned_params(96, 64, 80, x.stride(), w.stride(), 1, "bf16") == r.params
    assert tuned_params(96, 64, 80, x.stride(), w.stride(), 1).dtype == "fp32"
    entry = registry.lookup("gemm", "NT", 64, 80, 96, 1, exact=True, dtype="bf16")[1]
    assert entry["c_fp32"] is False                 # the forward writes a bf16 C
    registry.forget()


@needs_bf16_unit
def test_tune_bf16_races_a_weight_gradient_into_its_fp32_dw(tmp_path, monkeypatch):
    """A bf16 TN problem (the weight gradient) is tuned in the form training runs it: every
    candidate writes the fp32 dW (fp32 sums of bf16 products), and torch's contender is its
    bf16 product cast into that dW, as stock autocast runs it; the entry says so."""
    from autohc.kernels.gemm.problem import GemmProblem
    from autohc.tune import gemm as tuner
    monkeypatch.setenv("AUTOHC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("AUTOHC_REGISTRY", raising=False)
    registry.forget()
    prob = GemmProblem("t", "TN", 96, 64, 80)
    assert prob.c_fp32("bf16") and not prob.c_fp32("fp32")
    assert not any(GemmProblem("t", lay, 96, 64, 80).c_fp32("bf16") for lay in ("NT", "NN"))
    outs, real = [], tuner.matmul
    monkeypatch.setattr(tuner, "matmul", lambda a, b, out, params: outs.append(out) or real(a, b, out=out, params=params))
    got = {}

    def race(runs, baseline, **kw):                 # run each contender once, keep its C
        for k, fn in {**runs, "baseline": baseline}.items():
            fn()
            got[k] = outs[0].clone()
        return {}
    monkeypatch.setattr(tuner.pipeline, "race", race)
    tuner._against_torch(prob, {"default": default_params(cpu.bf16_isa()[0], 1, dtype="bf16")}, 1)
    a, b = prob.operands(0, torch.bfloat16)
    ref = a.double() @ b.double()
    assert got["default"].dtype == got["baseline"].dtype == torch.float32
    assert torch.equal(got["baseline"], torch.matmul(a, b).float())         # torch's product, cast
    assert not torch.equal(got["default"], got["default"].bfloat16().float())  # fp32 sums, not rounded
    k = prob.gemm_mkn[1]                            # (the tokens: TN's k)
    assert (got["default"].double() - ref).abs().max() <= 2 * k * 2.0 ** -24 * (a.double().abs() @ b.double().abs()).max()
    monkeypatch.undo()
    monkeypatch.setenv("AUTOHC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("AUTOHC_REGISTRY", raising=False)
    tuner.tune_problem(prob, 1, trials=1, timeout=120, dtype="bf16")
    assert registry.lookup("gemm", "TN", 64, 80, 96, 1, exact=True, dtype="bf16")[1]["c_fp32"] is True
    registry.forget()


def test_export_writes_bf16_kernels_with_their_flags(tmp_path, monkeypatch):
    """The exported bf16 default builds from its manifest entry (with the skinny paths' object
    it lists, linked once beside every other exported kernel) and, where the CPU runs it,
    computes X W^T from bf16 X and fp32 W (in_f32 = 2) without Python, by the packed path
    (M = 33) and the skinny one (M = 5)."""
    import textwrap
    from autohc.tune.export import export
    monkeypatch.setenv("AUTOHC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("AUTOHC_REGISTRY", raising=False)
    manifest = export(tmp_path / "exp")
    k = next(k for k in manifest["kernels"] if k.get("dtype") == "bf16" and k["threads"] == 1)
    isa = k["params"]["isa"]
    assert set(GEMM_ISAS[isa].cflags) <= set(k["cflags"])
    main = tmp_path / "main.c"
    main.write_text(textwrap.dedent(f"""
        #include <stdio.h>
        #include <string.h>
        #include "autohc_kernels.h"
        static uint16_t bf(float f) {{ uint32_t u; memcpy(&u, &f, 4); return (uint16_t)(u >> 16); }}
        int main(void) {{
            enum {{ M = 33, K = 40, N = 24 }};
            static uint16_t x[M * K]; static float w[N * K], y[M * N];
            for (int i = 0; i < M * K; ++i) x[i] = bf((float)((i * 7) % 13) - 6.0f);
            for (int i = 0; i < N * K; ++i) w[i] = (float)((i * 5) % 11) - 5.0f;
            {k['symbol']}_bind((void *)autohc_pool_run);
            if (!{k['symbol']}_isa_supported()) return 3;
            if ({k['symbol']}_gemm(M, N, K, 1.0f, x, K, 1, w, 1, K, 0.0f, y, N, 2)) return 2;
            for (int i = 0; i < M * N; ++i) printf("%.1f\\n", y[i]);
            if ({k['symbol']}_gemm(5, N, K, 1.0f, x, K, 1, w, 1, K, 0.0f, y, N, 2)) return 2;
            for (int i = 0; i < 5 * N; ++i) printf("%.1f\\n", y[i]);
            return 0;
        }}"""))
    exe = tmp_path / "prog"
    out = tmp_path / "exp"
    skinny = GemmParams.from_dict(k["params"]).skinny_m > 0      # (bf16 back-ends: M <= 16)
    assert bool(k["objects"]) == skinny and all((out / o["source"]).exists() for o in k["objects"])
    kernels = [e for e in manifest["kernels"] if e["params"]["isa"] == isa]
    objects = sorted({o["source"] for e in kernels for o in e["objects"]})
    assert len(objects) == (skinny or any(e["objects"] for e in kernels))   # (the isa's skinny paths: one shared object;
                                                        #  a widened bf16 kernel shares its isa with the fp32 ones)
    proc = subprocess.run(["gcc", *k["cflags"], f"-I{out}", str(main), *(str(out / e["source"]) for e in kernels),
                           *(str(out / o) for o in objects), str(out / manifest["pool"]["source"]),
                           "-o", str(exe), *k["ldflags"]], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if isa not in cpu.runnable_bf16_isas() + cpu.runnable_isas():
        pytest.skip("compiled; this CPU cannot run it")
    got = np.array(subprocess.run([str(exe)], check=True, capture_output=True, text=True)
                   .stdout.split(), dtype=np.float64)
    x = (np.arange(33 * 40) * 7 % 13 - 6.0).reshape(33, 40)
    w = (np.arange(24 * 40) * 5 % 11 - 5.0).reshape(24, 40)
    assert np.array_equal(got[:33 * 24].reshape(33, 24), x @ w.T)   # small integers: exact in bf16 and fp32
    assert np.array_equal(got[33 * 24:].reshape(5, 24), x[:5] @ w.T)


def test_bench_gemm_bf16_says_which_path_runs():
    from autohc.bench.gemm import bench_gemm
    r = bench_gemm("dit-s", 1, repeats=1, images=1, dtype="bf16")
    assert r["dtype"] == "bf16" and r["bf16_isa"] == cpu.bf16_isa()[0] and r["bf16_why"]
    units = {"amx": ("tile",), "avx512bf16": ("dot", "fma")}.get(r["bf16_isa"], (None,))
    assert r["bf16_skinny_unit"] in units
    assert len(r["rows"]) == 15 and all(w["dtype"] == "bf16" for w in r["rows"])
    w = r["rows"][0]
    assert w["gflops"] > 0 and w["torch_gflops"] > 0 and w["torch_fp32_gflops"] > 0
    assert w["speedup_vs_fp32"] == pytest.approx(
        w["gflops"] / max(w["torch_fp32_gflops"], w["numpy_gflops"]), rel=0.01)


@pytest.mark.parametrize("unit", ["dot", "fma", "tile"])
def test_skinny_paths_adaln_shapes(unit_isa, unit):
    """M = batch (adaLN): the dot path (NT) and the rows path (NN, A's K pairs contiguous),
    on vdpbf16ps, on fp32 FMAs (bf16 widened) and on AMX tiles (W unpacked: K tails past 32,
    rows past 16 and columns past 32 from padded copies or masks), every pair of input types,
    odd K, ragged N, beta; a TN or strided A takes the packed path."""
    isa = unit_isa
    if unit == "tile" and isa != "amx":     # AMX tiles: the amx back-end's unit alone
        with pytest.raises(ParamError, match="skinny_unit='tile'"):
            bf16_params(isa, 1, skinny_m=16, skinny_unit=unit)
        return
    rng = random.Random(8)
    prebuild([bf16_params(isa, threads, skinny_m=16, skinny_unit=unit) for threads in (1, 2)])
    for threads in (1, 2):
        p = bf16_params(isa, threads, skinny_m=16, skinny_unit=unit)
        assert get_kernel(p).skinny_unit() == unit
        for m, k, n in [(8, 1152, 6912 // 8), (1, 1, 1), (3, 37, 50), (16, 33, 17), (5, 2, 100), (13, 95, 49),
                        (9, 16, 48), (4, 17, 97), (7, 64, 113)]:
            # (TN takes the packed path, whichever the unit: run it once)
            for layout in ("NT", "NN", "TN") if unit == "dot" else ("NT", "NN"):
                a, b = operands(layout, m, k, n, rng)
                for fa in (0, 1):
                    for fb in (0, 1):
                        A = a if fa else a.to(torch.bfloat16)
                        B = b if fb else b.to(torch.bfloat16)
                        c0 = torch.randn(m, n)
                        alpha, beta = (0.5, -1.5) if (fa + fb + m) % 2 else (1.0, 0.0)
                        out = c0.clone()
                        autohc.matmul(A, B, out=out, alpha=alpha, beta=beta, params=p, compute="bf16")
                        check_bf16(out, A, B, c0, alpha, beta, f"{isa} {unit} t{threads} {layout} {m}x{k}x{n} {fa}{fb}")


def test_skinny_unit_auto_is_one_of_the_two(unit_isa):
    """skinny_unit auto: on AMX the tiles; elsewhere a probe of vdpbf16ps against FMA
    throughput picks one form once per process; the result is that form's, bit for bit."""
    rng = random.Random(3)
    auto = get_kernel(bf16_params(unit_isa, 1, skinny_m=16))
    chosen = auto.skinny_unit()
    assert chosen == "tile" if unit_isa == "amx" else chosen in ("dot", "fma")
    same = bf16_params(unit_isa, 1, skinny_m=16, skinny_unit=chosen)
    for layout in ("NT", "NN"):
        a, b = operands(layout, 6, 301, 77, rng)
        a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
        got = autohc.matmul(a, b, params=auto.params)
        want = autohc.matmul(a, b, params=same)
        assert torch.equal(got, want), layout
    with pytest.raises(ParamError, match="skinny_unit"):
        GemmParams(isa="avx512", vl=16, mr=12, nr=32, skinny_unit="fma").validate()
    with pytest.raises(ParamError, match="skinny_unit='tile'"):
        GemmParams(isa="avx512bf16", vl=16, mr=16, nr=32, dtype="bf16", skinny_unit="tile").validate()


def test_bf16_out_is_written_by_the_kernel_and_equals_fp32_rounded(unit_isa):
    """A bf16 C is written by the bf16 back-ends' own store (the last K panel rounds into it;
    earlier panels' sums in an fp32 workspace): bit for bit the fp32 C of the same kernel
    rounded to nearest even, on one and several K panels, the skinny paths, K = 0, a bias,
    both loop orders, a C that is a column slice of a wider tensor (ldc > N)."""
    isa = unit_isa
    from autohc.kernels.gemm.matmul import gemm_bf16_into
    rng = random.Random(31)
    # (with this CPU's defaults, which gemm_bf16_into and matmul without params run below)
    prebuild([bf16_params(isa, threads, kc=64, a_outer=a_outer) for threads in (1, 2) for a_outer in (False, True)]
             + [default_kernel_params(t, isa, "bf16") for t in {1, torch.get_num_threads()}])
    for threads in (1, 2):
        for a_outer in (False, True):
            p = bf16_params(isa, threads, kc=64, a_outer=a_outer)
            assert get_kernel(p).writes_bf16
            for m, k, n in [(37, 64, 50), (61, 200, 97), (5, 130, 33), (130, 1, 17), (16, 64, 48), (9, 0, 7)]:
                for li, layout in enumerate(("NT", "NN", "TN")):
                    a, b = operands(layout, m, k, n, rng)
                    a, b = a.to(torch.bfloat16), b if rng.random() < 0.5 else b.to(torch.bfloat16)
                    alpha = (-0.75, 1.0)[li % 2]        # (alpha 1: the store without a multiply)
                    what = f"{isa} t{threads} a_outer={a_outer} {layout} {m}x{k}x{n} alpha {alpha}"
                    bf16_out_as_fp32_rounded(a, b, alpha, p, what)
                    if threads == 2 or a_outer:
                        continue            # (the bias: once per shape and layout)
                    bias = torch.randn(n)
                    out_b = torch.empty(m, n, dtype=torch.bfloat16)
                    assert gemm_bf16_into(a, b, out_b, 0.5, threads, bias, -2.0)
                    ref = autohc.matmul(a, b, out=(-2.0 * bias).expand(m, n).contiguous(), alpha=0.5,
                                        beta=1.0, compute="bf16")
                    err = (out_b.float() - ref).abs() <= 2.0 ** -8 * ref.abs() + 1e-6
                    assert err.all(), what + " bias"


def test_bf16_out_nan_and_rounding_of_the_store():
    """The store rounds the fp32 sum as torch does: nearest, ties to even; NaN and Inf kept.
    Columns j: 1 + x_j with x_j exact in bf16, so the sums are exact in fp32 and the store
    alone rounds (2^-8: a tie, down to 1; 3 * 2^-8: a tie, up to 1 + 2^-6)."""
    isas = cpu.runnable_bf16_isas()
    if not isas:
        pytest.skip("no bf16 back-end here")
    for threads in (1, 2):
        p = bf16_params(isas[0], threads)
        a = torch.ones(5, 2, dtype=torch.bfloat16)
        b = torch.zeros(2, 37, dtype=torch.bfloat16)
        b[0] = 1.0
        b[1, :4] = torch.tensor([2.0 ** -8, 3 * 2.0 ** -8, float("inf"), float("nan")])
        b[1, 4:] = torch.arange(33) * 2.0 ** -9
        out = autohc.matmul(a, b, params=p)
        exp = (a.double() @ b.double()).float().to(torch.bfloat16)
        assert out.dtype == torch.bfloat16
        assert (out[:, 0] == 1.0).all() and (out[:, 1] == 1.0 + 2.0 ** -6).all()
        assert torch.isinf(out[:, 2]).all() and torch.isnan(out[:, 3]).all()
        assert torch.equal(out[:, 4:], exp[:, 4:])


@pytest.fixture(params=[u for u in BF16_UNITS] or ["none"])
def packing_unit(request):
    if request.param == "none":
        pytest.skip("no bf16 back-end here: nothing reads a B packed whole")
    with backend(request.param) as name:
        yield name


def test_b_packed_whole_gives_the_packed_per_call_bits(packing_unit):
    """A weight packed once (pack_b_whole, what autohc.frozen keeps) and read by the A_OUTER
    panels instead of packing B per call: bit for bit the per-call result, with bias and
    without, a bf16 and an fp32 W (rounded while packed), K over one and several panels (a
    ragged last one), KC_INNER steps, A from its rows with one K panel past kc, own rows and
    shared A blocks, 1 and 2 threads, ragged M and N, a bf16 C that is a column slice; a
    packing of zeros changes the result (it is read), and M up to skinny_m reads W itself."""
    isa = packing_unit
    amx = isa == "amx"
    extra = [dict(kc_inner=64, kc=128), dict(a_direct=True, one_panel_k=320, kc=128)] if amx else [dict(a_direct=True)]
    configs = [bf16_params(isa, t, mc=96, nc=96, a_outer=True, own_rows=own, **more, **PACKED_ONLY)
               for t, own, more in ((1, False, dict(kc=64)), (2, True, dict(kc=64)), (2, False, dict(kc=128)))]
    configs += [bf16_params(isa, 2, mc=96, nc=96, a_outer=True, own_rows=True, **more, **PACKED_ONLY)
                for more in extra]
    prebuild(configs)
    for p in configs:
        kernel = get_kernel(p)
        assert kernel.reads_packed_b and kernel.packed_b_layout == (isa, p.nr)
        for m, k, n in ((71, 64, 101), (96, 320, 64), (64 + 7, 64 * 3 + 33, 96 * 2 + 5), (33, 96, 16)):
            x = torch.randn(m, k).to(torch.bfloat16)
            w32 = torch.randn(n, k)
            for w, in_f32 in ((w32.to(torch.bfloat16), 0), (w32, 2)):
                pk = torch.empty(kernel.packed_b_elems(k, n), dtype=torch.bfloat16)
                kernel.pack_b_whole(k, n, w.data_ptr(), 1, k, in_f32, pk.data_ptr())
                for bias in (None, torch.randn(n)):
                    wide = [torch.full((m, n + 5), 3.0, dtype=torch.bfloat16) for _ in range(3)]
                    outs = [o[:, 2:2 + n] for o in wide]
                    for out, packed in zip(outs, (None, lambda _k: pk, lambda _k: torch.zeros_like(pk))):
                        assert _run_bf16c("torch", x, w.t(), operand_raw(x), operand_raw(w.t()), operand_raw(out),
                                          1.0, p.threads, p, bias, 1.0, packed)
                    what = f"{isa} t{p.threads} own {p.own_rows} kc {p.kc} {m}x{k}x{n} W fp32 {in_f32} bias {bias is not None}"
                    assert torch.equal(outs[0], outs[1]), what
                    assert not torch.equal(outs[2], outs[0]), what + ": the packing was not read"
                    assert all((o[:, :2] == 3).all() and (o[:, 2 + n:] == 3).all() for o in wide), what
                    check_bf16(outs[1], x.float(), w.t().float(), (bias if bias is not None else torch.zeros(n)).expand(m, n),
                               1.0, 1.0 if bias is not None else 0.0, what)
    # a kernel with the skinny paths: M up to skinny_m reads W itself (a packing of zeros is not read)
    p = bf16_params(isa, 2)
    kernel = get_kernel(p)
    m, k, n = p.skinny_m, 96, 80
    x, w = torch.randn(m, k).to(torch.bfloat16), torch.randn(n, k).to(torch.bfloat16)
    zeros = torch.zeros(kernel.packed_b_elems(k, n), dtype=torch.bfloat16)
    outs = [torch.empty(m, n, dtype=torch.bfloat16) for _ in range(2)]
    for out, packed in zip(outs, (None, lambda _k: zeros)):
        _run_bf16c("torch", x, w.t(), operand_raw(x), operand_raw(w.t()), operand_raw(out), 1.0, 2, p, None, 1.0, packed)
    assert torch.equal(outs[0], outs[1])
    # the B-outer order packs B itself: it takes no packing
    assert not get_kernel(bf16_params(isa, 1, a_outer=False, a_direct=False, **PACKED_ONLY)).reads_packed_b


def _epilogue_cases(isa: str, rng: random.Random, layouts: tuple[str, str]):
    """The epilogue tests' problems: (params, what, a, b, bias, f32) over 1 and 2 threads, both
    loop orders, one and several K panels (kc 64), M under the skinny bound, ragged N, K = 0,
    a bias and none, strided A; f32 the same kernel's fp32 result (alpha 0.5, the bias beta 1)."""
    for threads in (1, 2):
        for a_outer in (False, True):
            p = bf16_params(isa, threads, kc=64, a_outer=a_outer, skinny_m=0)
            for m, k, n in [(37, 64, 50), (61, 200, 97), (5, 130, 33), (16, 64, 48), (9, 0, 7)]:
                layout = layouts[(m + threads) % 2]
                a, b = operands(layout, m, k, n, rng, strided=(m + (layout == layouts[0])) % 2 == 1)
                a = a.to(torch.bfloat16)
                bias = torch.randn(n) if (m + k) % 2 else None
                what = f"{isa} t{threads} a_outer={a_outer} {layout} {m}x{k}x{n} bias={bias is not None}"
                c0 = torch.zeros(m, n) if bias is None else bias.expand(m, n).contiguous()
                yield p, what, a, b, bias, autohc.matmul(a, b, out=c0, alpha=0.5, beta=1.0, params=p, compute="bf16")


def test_gelu_epilogue_is_gelu_of_the_fp32_result_rounded_once(unit_isa, monkeypatch):
    """epilogue gelu_tanh (fc1 + bias + GELU in one kernel): the bf16 C is GELU of the same
    kernel's fp32 result, rounded once: within a bf16 half-ulp plus the GELU form's 3e-7
    relative of float64 GELU of it, on one and several K panels, M under the skinny bound,
    ragged N, K = 0 (GELU of the bias), a bias and none, both loop orders, strided A, a C
    that is a column slice of a wider tensor (nothing written outside it), 1 and 2 threads; with
    the pre-activation written beside it, that is the plain kernel's bf16 C bit for bit."""
    isa = unit_isa
    from autohc.kernels.gemm import matmul
    from autohc.kernels.gemm.matmul import gemm_bf16_into
    rng = random.Random(7)
    gelu64 = lambda t: torch.nn.functional.gelu(t.double(), approximate="tanh")
    for p, what, a, b, bias, f32 in _epilogue_cases(isa, rng, ("NT", "NN")):
        (m, k), n = a.shape, b.shape[1]
        threads = p.threads
        wide = torch.full((m, n + 9), 7.0, dtype=torch.bfloat16)
        out = wide[:, 3:3 + n]
        # (the problem's kernel, as the registry would choose it)
        monkeypatch.setattr(matmul, "_override_params", lambda *_, **__: p)
        assert gemm_bf16_into(a, b, out, 0.5, threads, bias, 1.0, epilogue="gelu_tanh")
        ref = gelu64(f32)
        err = (out.double() - ref).abs()
        assert (err <= 2.0 ** -8 * ref.abs() + 4e-7 * ref.abs() + 1e-7).all(), what
        assert (wide[:, :3] == 7).all() and (wide[:, 3 + n:] == 7).all(), what + ": wrote outside C"
        plain = torch.empty(m, n, dtype=torch.bfloat16)
        assert gemm_bf16_into(a, b, plain, 0.5, threads, bias, 1.0)
        assert not torch.equal(out, plain) or k == 0 and bias is None, what + ": no GELU"
        # with the pre-activation (training's fc1): the same GELU, and the result itself
        # rounded once, bit for bit the plain kernel's bf16 C
        both = torch.full((2, m, n + 9), 7.0, dtype=torch.bfloat16)
        g, h = both[0, :, 3:3 + n], both[1, :, 3:3 + n]
        assert gemm_bf16_into(a, b, g, 0.5, threads, bias, 1.0, epilogue="gelu_tanh", pre=h)
        assert torch.equal(g, out) and torch.equal(h, plain), what + ": pre"
        assert (both[:, :, :3] == 7).all() and (both[:, :, 3 + n:] == 7).all(), what + ": pre wrote outside"
    with pytest.raises(ParamError, match="epilogue"):
        dataclasses.replace(bf16_params("avx512bf16", 1), skinny_m=16, epilogue="gelu_tanh").validate()
    with pytest.raises(ParamError, match="epilogue"):
        GemmParams(isa="avx512", vl=16, mr=12, nr=32, epilogue="gelu_tanh").validate()


def test_gelu_backward_epilogue_is_the_derivative_at_the_pre_activation_rounded_once(unit_isa, monkeypatch):
    """epilogue gelu_tanh_bwd (fc2's input gradient and GELU's backward in one kernel): the bf16
    C is GELU'(h) times the same kernel's fp32 result, h the bf16 pre-activation read from a
    tensor laid out as C, rounded once: within a bf16 half-ulp plus the GELU form's error of
    float64's, on one and several K panels, M under the skinny bound, ragged N, K = 0, a bias
    and none, both loop orders, strided A, C and h column slices of wider tensors (nothing
    written outside C, h unchanged), 1 and 2 threads; h read from C itself gives the same bits;
    without h it is refused."""
    isa = unit_isa
    from autohc.kernels.gemm import matmul
    from autohc.kernels.gemm.matmul import gemm_bf16_into
    from autohc.kernels.gemm.kernel import KernelError
    rng = random.Random(11)

    def gelu_grad64(g, h):
        return torch.ops.aten.gelu_backward(g.double(), h.double(), approximate="tanh")
    for p, what, a, b, bias, f32 in _epilogue_cases(isa, rng, ("NN", "NT")):
        (m, k), n = a.shape, b.shape[1]
        threads = p.threads
        both = torch.full((2, m, n + 9), 7.0, dtype=torch.bfloat16)
        out, h = both[0, :, 3:3 + n], both[1, :, 3:3 + n]
        h.copy_(torch.randn(m, n) * 3)
        h0 = h.clone()
        monkeypatch.setattr(matmul, "_override_params", lambda *_, **__: p)
        assert gemm_bf16_into(a, b, out, 0.5, threads, bias, 1.0, epilogue="gelu_tanh_bwd", pre=h)
        ref = gelu_grad64(f32, h0)
        err = (out.double() - ref).abs()
        assert (err <= 2.0 ** -8 * ref.abs() + 2e-6 * f32.double().abs() + 1e-7).all(), what
        if k or bias is not None:
            plain = torch.ops.aten.gelu_backward(f32.to(torch.bfloat16), h0, approximate="tanh")
            # (the two calls round twice, g and then the result: within three half-ulps;
            # where GELU' nears 0 its terms cancel in fp32 in both forms, hence the g term)
            assert ((out.double() - plain.double()).abs()
                    <= 2.0 ** -6 * plain.double().abs() + 2e-6 * f32.double().abs()).all(), \
                what + ": not the composition"
            assert not torch.equal(out, f32.to(torch.bfloat16)), what + ": no derivative"
        assert torch.equal(h, h0), what + ": h written"
        assert (both[:, :, :3] == 7).all() and (both[:, :, 3 + n:] == 7).all(), what + ": wrote outside C"
        # h read from C itself (in place): the same bits
        inplace = h0.clone()
        assert gemm_bf16_into(a, b, inplace, 0.5, threads, bias, 1.0, epilogue="gelu_tanh_bwd", pre=inplace)
        assert torch.equal(inplace, out), what + ": in place"
    with pytest.raises(KernelError, match="pre"):
        gemm_bf16_into(a, b, out, 0.5, 1, None, 1.0, epilogue="gelu_tanh_bwd")
    # where first-use tuning timed ATen faster on the plain product, the epilogues still run
    # (ATen would add their pass); the plain product goes to ATen
    monkeypatch.undo()
    p = bf16_params(isa, 1, kc=64, skinny_m=0)
    monkeypatch.setattr(matmul, "_choice", lambda *_, **__: (p, True))
    a, b = operands("NN", 40, 64, 48, rng)
    a, out, h = a.to(torch.bfloat16), torch.empty(40, 48, dtype=torch.bfloat16), torch.randn(40, 48).to(torch.bfloat16)
    with pytest.raises(matmul.AtenFaster):
        gemm_bf16_into(a, b, out, 1.0, 1)
    assert gemm_bf16_into(a, b, out, 1.0, 1, epilogue="gelu_tanh_bwd", pre=h)
    assert gemm_bf16_into(a, b, out, 1.0, 1, epilogue="gelu_tanh")

