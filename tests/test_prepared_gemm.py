"""Prepared routes inside the GEMM entry points the fused ops and autocast's Linear call
(kernels/gemm/matmul.py: gemm_bf16_into, gemm_into): a problem met again runs the kernel its
first call chose, on the same arguments. A routed call must give the whole path's bits, never
read an operand its C overlaps, and never outlive what its choice was made under."""
import pytest
import torch

from autohc.hw import cpu
from autohc.kernels.gemm import matmul as MM
from autohc.kernels.gemm.kernel import KernelError, default_kernel_params, get_kernel

BF16_STORE = get_kernel(default_kernel_params(2, dtype="bf16")).writes_bf16 \
    if cpu.runnable_bf16_isas() else False
needs_bf16_store = pytest.mark.skipif(not BF16_STORE, reason="this CPU's bf16 back-end writes no bf16 C")


@pytest.fixture(autouse=True)
def own_registry(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOHC_REGISTRY", str(tmp_path / "registry.json"))
    monkeypatch.setenv("AUTOHC_FIRST_USE", "0")
    MM.forget_choices()
    yield
    MM.forget_choices()


def _bf16_cases():
    """(name, M, K, N, kwargs maker): the forms the Linear, the MLP and their backward call."""
    g = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=g)
    return [
        ("NT fp32 W, fp32 bias", 96, 72, 130, lambda M, N: {"bias": r(N)}),
        ("NT bf16 W, bf16 bias", 96, 72, 130, lambda M, N: {"bias": r(N).bfloat16(), "w16": True}),
        ("NN no bias", 64, 130, 72, lambda M, N: {"nn": True}),
        ("ragged", 37, 65, 129, lambda M, N: {"bias": r(N)}),
        ("few rows", 8, 96, 64, lambda M, N: {"bias": r(N)}),
        ("GELU with its pre-activation", 64, 72, 96,
         lambda M, N: {"bias": r(N), "epilogue": "gelu_tanh", "pre": torch.empty(M, N, dtype=torch.bfloat16)}),
        ("GELU' in place", 64, 96, 72, lambda M, N: {"epilogue": "gelu_tanh_bwd", "in_place": r(M, N).bfloat16()}),
    ]


def _operands(M, K, N, kw, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g).bfloat16()
    w = torch.randn(N, K, generator=g)
    if kw.get("w16"):
        w = w.bfloat16()
    b = w.t().contiguous() if kw.get("nn") else w.t()
    return a, b


def _call(fn, a, b, M, N, kw):
    out = kw["in_place"].clone() if "in_place" in kw else torch.empty(M, N, dtype=torch.bfloat16)
    pre = out if "in_place" in kw else (kw["pre"].clone() if "pre" in kw else None)
    fn(a, b, out, 1.0, 2, kw.get("bias"), 1.0, epilogue=kw.get("epilogue", "none"), pre=pre)
    return out, pre


@needs_bf16_store
@pytest.mark.parametrize("case", range(len(_bf16_cases())), ids=[c[0] for c in _bf16_cases()])
def test_bf16_routes_give_the_whole_paths_bits(case):
    name, M, K, N, make = _bf16_cases()[case]
    kw = make(M, N)
    hits = MM.route_stats["hits"]
    for seed in range(4):                       # the first call makes the route, the others take it
        a, b = _operands(M, K, N, kw, seed)
        routed, rpre = _call(MM.gemm_bf16_into, a, b, M, N, kw)
        whole, wpre = _call(MM.gemm_bf16_into_whole, a, b, M, N, kw)
        assert torch.equal(routed, whole), (name, seed)
        if rpre is not None:
            assert torch.equal(rpre, wpre), (name, seed)
    assert len(MM._routes_now()) == 1 and MM.route_stats["hits"] - hits == 3, name


@needs_bf16_store
def test_a_bf16_route_never_reads_an_operand_its_c_overlaps():
    """The shapes and strides of a routed problem, but C lies over A's later rows (C's row i is
    A's row i + 16): the whole path reads a copy of A, so C is still A @ B."""
    M, K, N = 256, 64, 64
    g = torch.Generator().manual_seed(1)
    b = torch.randn(K, N, generator=g).bfloat16()
    for _ in range(2):                          # apart: makes the route, then takes it
        MM.gemm_bf16_into(torch.randn(M, K, generator=g).bfloat16(), b, torch.empty(M, N, dtype=torch.bfloat16),
                          1.0, 2)
    assert len(MM._routes_now()) == 1
    buf = torch.randn(M + 16, K, generator=g).bfloat16()
    a, out = buf[:M], buf[16:]
    want = torch.empty(M, N, dtype=torch.bfloat16)
    MM.gemm_bf16_into_whole(a.clone(), b, want, 1.0, 2)
    hits = MM.route_stats["hits"]
    MM.gemm_bf16_into(a, b, out, 1.0, 2)
    assert torch.equal(out, want) and MM.route_stats["hits"] == hits


@needs_bf16_store
def test_forgotten_choices_end_the_routes():
    M, K, N = 64, 72, 96
    a, b = torch.randn(M, K).bfloat16(), torch.randn(K, N).bfloat16()
    for _ in range(2):
        MM.gemm_bf16_into(a, b, torch.empty(M, N, dtype=torch.bfloat16), 1.0, 2)
    assert len(MM._routes_now()) == 1
    MM.forget_choices()                         # (first-use tuning forgot its tunings)
    assert len(MM._routes_now()) == 0


def test_a_kernel_error_leaves_no_route_behind(monkeypatch):
    """Where the whole path raises before its kernel runs (a pre-activation laid out otherwise
    than C), the next call raises the same: nothing was remembered for it."""
    M, K, N = 32, 64, 48
    a, b = torch.randn(M, K).bfloat16(), torch.randn(K, N).bfloat16()
    for _ in range(2):
        with pytest.raises(KernelError):
            MM.gemm_bf16_into(a, b, torch.empty(M, N, dtype=torch.bfloat16), 1.0, 2, epilogue="gelu_tanh_bwd",
                              pre=torch.empty(N, M, dtype=torch.bfloat16).t())
    assert len(MM._routes_now()) == 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gemm_into_routes_give_the_whole_paths_bits(dtype):
    """A weight gradient (dYᵀ X, TN, beta 0, fp32 C) and an fp32 addmm with a bias row."""
    if dtype == "bf16" and not cpu.runnable_bf16_isas():
        pytest.skip("no bf16 back-end runs here")
    g = torch.Generator().manual_seed(2)
    hits = MM.route_stats["hits"]
    cast = (lambda t: t.bfloat16()) if dtype == "bf16" else (lambda t: t)
    for seed in range(4):
        dy, x = cast(torch.randn(96, 40, generator=g)), cast(torch.randn(96, 72, generator=g))
        bias = torch.randn(72, generator=g)
        for args in ((dy.t(), x, 1.0, 0.0, None), (dy.t(), x, 2.0, 1.0, bias if dtype == "fp32" else None)):
            a, b, alpha, beta, bi = args
            routed, whole = torch.zeros(40, 72), torch.zeros(40, 72)
            MM.gemm_into(a, b, routed, alpha, beta, 2, bi, dtype=dtype)
            MM.gemm_into_whole(a, b, whole, alpha, beta, 2, bi, dtype=dtype)
            assert torch.equal(routed, whole), (dtype, seed, alpha, beta)
    assert len(MM._routes_now()) == 2 and MM.route_stats["hits"] - hits == 6


def test_a_gemm_into_route_never_reads_an_operand_its_c_overlaps():
    M, K, N = 256, 64, 64
    g = torch.Generator().manual_seed(4)
    b = torch.randn(K, N, generator=g)
    for _ in range(2):
        MM.gemm_into(torch.randn(M, K, generator=g), b, torch.empty(M, N), 1.0, 0.0, 2)
    assert len(MM._routes_now()) == 1
    buf = torch.randn(M + 16, K, generator=g)
    a, out = buf[:M], buf[16:]
    want = a @ b
    hits = MM.route_stats["hits"]
    MM.gemm_into(a, b, out, 1.0, 0.0, 2)
    assert torch.allclose(out, want, rtol=1e-4, atol=1e-4) and MM.route_stats["hits"] == hits
