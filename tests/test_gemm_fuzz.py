"""Seeded fuzz of the generated GEMM against float64 torch, for every back-end this CPU runs.

Each problem draws: layout (NN, NT, TN, TT), M/N/K from small primes, tile edges and powers
of two (0 and 1 included), strided / offset / broadcast views, torch or numpy, alpha, beta
(beta = 0 over a NaN-filled C: C must not be read), and the shape of C (row-major, column-major,
row-padded, no unit stride).
"""
import dataclasses
import random

import pytest
import torch

import autohc
from autohc.hw import cpu
from autohc.kernels.gemm.params import GemmParams, default_params
from autohc.kernels.isa import ISAS

from gemm_reference import check

SIZES = [0, 1, 2, 3, 5, 7, 13, 31, 64, 127, 257]
ALPHAS = [1.0, -1.0, 0.5, 2.25, 0.0]
BETAS = [0.0, 0.0, 1.0, -0.75, 0.3]


def edge_sizes(p: GemmParams) -> list[int]:
    edges = {p.mr - 1, p.mr, p.mr + 1, 2 * p.mr + 1, p.nr - 1, p.nr, p.nr + 1,
             p.kc - 1, p.kc, p.kc + 1, p.mc + 1, p.nc + 1, p.k_unroll + 1}
    return sorted(e for e in edges if 0 <= e <= 600)


def make_operand(rows, cols, transposed, style, lib, rng):
    """A rows x cols float32 view with the storage layout and style asked for."""
    shape = (cols, rows) if transposed else (rows, cols)
    if style == "contiguous":
        base = torch.randn(*shape)
        view = base
    elif style == "strided":            # every 2nd row, every 3rd column
        base = torch.randn(shape[0] * 2, shape[1] * 3)
        view = base[::2, ::3]
    elif style == "offset":             # a window inside a larger row-padded tensor
        base = torch.randn(shape[0] + 3, shape[1] + 5)
        view = base[1:1 + shape[0], 2:2 + shape[1]]
    elif style == "broadcast":          # zero stride: one row repeated
        base = torch.randn(1, shape[1])
        view = base.expand(shape[0], shape[1])
    else:
        raise AssertionError(style)
    view = view.t() if transposed else view
    if lib == "numpy":
        arr = view.numpy()
        if style == "strided" and rng.random() < 0.5:
            arr = arr[::-1, :] if arr.shape[0] > 0 else arr   # negative stride
        return arr
    return view


def make_out(M, N, style, lib, fill):
    if style == "rowmajor":
        c = torch.empty(M, N)
    elif style == "colmajor":
        c = torch.empty(N, M).t()
    elif style == "padded":
        c = torch.empty(M, N + 7)[:, :N]
    else:                                # no unit stride
        c = torch.empty(M * 2, N * 2)[::2, ::2]
    c.copy_(fill)
    return c.numpy() if lib == "numpy" else c


def run_fuzz(params: GemmParams, n_problems: int, seed: int):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    sizes = SIZES + edge_sizes(params)
    for i in range(n_problems):
        M, N, K = (rng.choice(sizes) for _ in range(3))
        ta, tb = rng.random() < 0.5, rng.random() < 0.5
        lib = rng.choice(["torch", "numpy"])
        sa = rng.choice(["contiguous", "contiguous", "strided", "offset", "broadcast"])
        sb = rng.choice(["contiguous", "contiguous", "strided", "offset"])
        so = rng.choice(["rowmajor", "rowmajor", "colmajor", "padded", "nounit"])
        alpha, beta = rng.choice(ALPHAS), rng.choice(BETAS)
        a = make_operand(M, K, ta, sa, lib, rng)
        b = make_operand(K, N, tb, sb, lib, rng)
        c0 = torch.randn(M, N)
        fill = c0 if beta != 0.0 else torch.full((M, N), float("nan"))
        out = make_out(M, N, so, lib, fill)
        what = (f"problem {i} [{params.isa} {params.jc_ways}x{params.ic_ways}x{params.jr_ways}]: "
                f"M={M} N={N} K={K} layout={'T' if ta else 'N'}{'T' if tb else 'N'} "
                f"a={sa} b={sb} out={so} {lib} alpha={alpha} beta={beta}")
        res = autohc.matmul(a, b, out=out, alpha=alpha, beta=beta, params=params)
        assert res is out, what
        check(res, a, b, c0, alpha, beta, what)


RUNNABLE = cpu.runnable_isas()


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_fuzz_default_config_500(isa):
    """The acceptance fuzz: 500 problems per back-end, zero failures."""
    if isa not in RUNNABLE:
        pytest.skip(f"this CPU cannot run {isa} (compile-only test in test_codegen)")
    run_fuzz(default_params(isa, 1), 500, seed=20261122)


@pytest.mark.parametrize("ways", [1, 2])
@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_fuzz_two_threads(isa, ways):
    """The 2-thread default blocks in both geometries: one JC way (the threads split M, sharing
    B) and two (CFTP's clusters, or own_ways_up_to: the ways split N, or M where N < M, each
    thread packing all of B)."""
    if isa not in RUNNABLE:
        pytest.skip(f"this CPU cannot run {isa}")
    p = dataclasses.replace(default_params(isa, 2), jc_ways=ways, ic_ways=2 // ways, jr_ways=1).validate()
    run_fuzz(p, 200, seed=7 + ways)


# Thread and buffering geometries with tiny tiles, so that every problem crosses many
# KC / MC / NC panels, every thread edge and the ring of B buffers.
STRESS = [
    dict(isa="avx2", mr=6, nr=16, kc=8, mc=12, nc=32, k_unroll=8, jc_ways=2, ic_ways=2, jr_ways=2, depth=3,
         prefetch_a=4, prefetch_b=2, skinny_m=0),      # small M through the packed path
    dict(isa="avx2", mr=4, nr=24, kc=16, mc=8, nc=48, k_unroll=2, jc_ways=1, ic_ways=2, jr_ways=1, depth=1),
    dict(isa="avx2", mr=8, nr=8, kc=12, mc=16, nc=24, k_unroll=1, jc_ways=1, ic_ways=1, jr_ways=2, depth=2,
         prefetch_c=False),
    dict(isa="avx512", mr=14, nr=32, kc=12, mc=28, nc=64, k_unroll=4, jc_ways=2, ic_ways=1, jr_ways=1, depth=2),
    dict(isa="avx512", mr=6, nr=64, kc=20, mc=12, nc=128, k_unroll=8, jc_ways=1, ic_ways=2, jr_ways=2, depth=3,
         skinny_m=64),                                  # every M <= 64 in NT: skinny path
    dict(isa="portable", vl=4, mr=4, nr=8, kc=8, mc=8, nc=16, k_unroll=2, jc_ways=2, ic_ways=1, jr_ways=2, depth=3),
    dict(isa="portable", vl=8, mr=3, nr=16, kc=9, mc=9, nc=32, k_unroll=4, jc_ways=1, ic_ways=3, jr_ways=1, depth=1,
         skinny_m=64),
    # a_outer (BLIS's loop order): a way's threads share its A blocks (equal blocks of whole
    # micro-panels, two buffers, one barrier each) and split its N slice into own B panels
    dict(isa="avx2", mr=6, nr=16, kc=8, mc=24, nc=32, k_unroll=4, jc_ways=1, ic_ways=2, jr_ways=1, a_outer=True),
    dict(isa="avx512", mr=12, nr=32, kc=12, mc=36, nc=64, k_unroll=4, jc_ways=2, ic_ways=1, jr_ways=1,
         a_outer=True, skinny_m=0),                     # one thread per way: ways split M or N
    dict(isa="portable", vl=4, mr=4, nr=8, kc=8, mc=12, nc=16, k_unroll=2, jc_ways=1, ic_ways=1, jr_ways=3,
         a_outer=True, prefetch_c=False),
    dict(isa="portable", vl=4, mr=5, nr=8, kc=7, mc=10, nc=24, k_unroll=1, jc_ways=2, ic_ways=2, jr_ways=1,
         a_outer=True),
    # own_rows: where threads * N <= M each thread packs its own rows and all of B
    dict(isa="avx512", mr=12, nr=32, kc=12, mc=36, nc=64, k_unroll=4, jc_ways=1, ic_ways=2, jr_ways=1,
         a_outer=True, own_rows=True, skinny_m=0),
    dict(isa="portable", vl=4, mr=5, nr=8, kc=7, mc=15, nc=24, k_unroll=1, jc_ways=1, ic_ways=3, jr_ways=1,
         a_outer=True, own_rows=True),
]


@pytest.mark.parametrize("cfg", STRESS, ids=lambda c: f"{c['isa']}-{c['mr']}x{c['nr']}-"
                         f"{c['jc_ways']}x{c['ic_ways']}x{c['jr_ways']}-"
                         f"{'a_outer' if c.get('a_outer') else 'd' + str(c.get('depth', 2))}")
def test_fuzz_stress_geometries(cfg):
    params = geometry_params(cfg)
    cfg = {"vl": params.vl, **cfg}
    run_fuzz(params, 120, seed=sum(map(ord, repr(sorted(cfg.items())))))


def geometry_params(cfg: dict) -> GemmParams:
    """GemmParams of a test geometry (vl: the back-end's first vector width where not given);
    skips where this CPU cannot run its back-end."""
    if cfg["isa"] not in RUNNABLE:
        pytest.skip(f"this CPU cannot run {cfg['isa']}")
    return GemmParams(**{"vl": ISAS[cfg["isa"]].vector_lanes[0], **cfg}).validate()


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_own_rows_gives_the_shared_blocks_results_bit_for_bit(isa):
    """own_rows changes which thread computes which tile, never a tile's sum: on shapes where
    it applies (threads * N <= M; several K panels and A blocks, ragged edges) and where it
    does not, C is bit-identical to the shared A blocks' C, and both match float64."""
    if isa not in RUNNABLE:
        pytest.skip(f"this CPU cannot run {isa}")
    base = default_params(isa, 2)
    small = dict(kc=16, mc=6 * base.mr, nc=2 * base.nr, a_outer=True, jc_ways=1, ic_ways=2, jr_ways=1,
                 skinny_m=0)
    shared = GemmParams(**{**base.__dict__, **small, "own_rows": False}).validate()
    own = GemmParams(**{**base.__dict__, **small, "own_rows": True}).validate()
    torch.manual_seed(3)
    for M, K, N in [(257, 45, 31), (100, 33, 50), (64, 16, 17), (31, 40, 257), (1, 5, 1)]:
        for a, b in [(torch.randn(M, K), torch.randn(N, K).t()), (torch.randn(K, M).t(), torch.randn(K, N))]:
            c_shared = autohc.matmul(a, b, params=shared)
            c_own = autohc.matmul(a, b, params=own)
            what = f"{isa} M={M} K={K} N={N}"
            assert torch.equal(c_shared, c_own), what
            check(c_own, a, b, torch.zeros(M, N), 1.0, 0.0, what)


BIAS_GEOMETRIES = [
    None,                                                       # this CPU's 2-thread default
    dict(isa="avx2", mr=6, nr=16, kc=8, mc=12, nc=32, k_unroll=8, jc_ways=2, ic_ways=2, jr_ways=2, depth=3),
    dict(isa="avx512", mr=12, nr=32, kc=12, mc=36, nc=64, k_unroll=4, jc_ways=1, ic_ways=2, jr_ways=1,
         a_outer=True, own_rows=True),
    dict(isa="portable", vl=4, mr=5, nr=8, kc=7, mc=10, nc=24, k_unroll=1, jc_ways=2, ic_ways=2, jr_ways=1,
         a_outer=True),
    dict(isa="portable", vl=4, mr=4, nr=8, kc=8, mc=8, nc=16, k_unroll=2, jc_ways=1, ic_ways=1, jr_ways=3,
         skinny_m=8),
]


@pytest.mark.parametrize("cfg", BIAS_GEOMETRIES, ids=lambda c: "default" if c is None else
                         f"{c['isa']}-{c['jc_ways']}x{c['ic_ways']}x{c['jr_ways']}"
                         f"{'-a_outer' if c.get('a_outer') else ''}")
def test_bias_rows_match_float64_and_never_read_c(cfg):
    """_gemm_bias: C := alpha AB + beta bias down every row, over C full of NaN (never read),
    on ragged shapes crossing K panels, A blocks and thread edges (full and edge micro-tiles),
    the skinny paths (M <= 8), K = 0 and alpha = 0; and through gemm_into (the override's
    path) with a strided and a broadcast bias, which it makes contiguous."""
    from autohc.kernels.gemm.matmul import gemm_into
    from autohc.kernels.gemm.kernel import get_kernel
    params = default_params(cpu.best_isa(), 2) if cfg is None else geometry_params(cfg)
    kernel = get_kernel(params)
    torch.manual_seed(5)
    cases = [(97, 45, 61, 1.0, 1.0), (5, 30, 70, 1.0, 1.0), (257, 13, 33, -0.5, 2.0), (1, 9, 17, 1.0, 1.0),
             (40, 0, 20, 1.0, 0.5), (33, 20, 40, 0.0, 1.5), (64, 16, 1, 1.0, 1.0)]
    for M, K, N, alpha, beta in cases:
        for transposed in (False, True):
            a = torch.randn(K, M).t() if transposed else torch.randn(M, K)
            b = torch.randn(N, K).t()
            bias = torch.randn(N)
            c = torch.full((M, N + 3), float("nan"))[:, :N]
            kernel.run(M, N, K, alpha, a.data_ptr(), a.stride(0), a.stride(1), b.data_ptr(),
                       b.stride(0), b.stride(1), beta, c.data_ptr(), c.stride(0), bias_ptr=bias.data_ptr())
            check(c, a, b, bias.expand(M, N), alpha, beta, f"M={M} K={K} N={N} alpha={alpha} beta={beta}")
    for bias in (torch.randn(2 * 61)[::2], torch.randn(1).expand(61)):
        a, b = torch.randn(97, 45), torch.randn(61, 45).t()
        c = torch.full((97, 61), float("nan"))
        gemm_into(a, b, c, 1.0, 0.75, params.threads, bias)
        check(c, a, b, bias.expand(97, 61), 1.0, 0.75, f"gemm_into, bias stride {bias.stride(0)}")


def test_nan_and_inf_propagate():
    params = default_params(cpu.best_isa(), 1)
    a = torch.randn(9, 20)
    b = torch.randn(20, 17)
    a[3, 5] = float("nan")
    b[2, 4] = float("inf")
    out = autohc.matmul(a, b, params=params)
    ref = a.double() @ b.double()
    assert torch.isnan(out[3]).all()
    same = ~torch.isnan(ref)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(torch.isinf(out[same]), torch.isinf(ref[same]))


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_skinny_row_path_tiles_and_edges(isa):
    """M <= skinny_m in NN and TN takes the unpacked register-tiled path: every row-tile
    remainder (1..17 rows), K across its K blocks, ragged N (whole tiles, single vectors,
    scalar columns), beta = 0 over NaN, and an Inf in B that must reach only its own column."""
    if isa not in RUNNABLE:
        pytest.skip(f"this CPU cannot run {isa}")
    params = default_params(isa, 2)
    torch.manual_seed(3)
    for M in (1, 2, 5, 8, 9, 16):
        for K in (1, 31, 32, 33, 200):
            for N in (1, 15, 47, 48, 49, 161):
                for ta in (False, True):
                    a = torch.randn(K, M).t() if ta else torch.randn(M, K)
                    b = torch.randn(K, N)
                    alpha, beta = (1.0, 0.0) if (M + K + N) % 2 else (-0.5, 0.75)
                    c0 = torch.randn(M, N)
                    out = c0.clone() if beta else torch.full((M, N), float("nan"))
                    res = autohc.matmul(a, b, out=out, alpha=alpha, beta=beta, params=params)
                    check(res, a, b, c0, alpha, beta, f"{isa} M={M} K={K} N={N} ta={ta}")
    a, b = torch.randn(8, 40), torch.randn(40, 50)
    b[7, 49] = float("inf")
    res = autohc.matmul(a, b, params=params)
    assert torch.isinf(res[:, 49]).all() and torch.isfinite(res[:, :49]).all()
