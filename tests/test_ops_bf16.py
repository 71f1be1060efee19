"""The element-wise operators' bf16 forms (torch.autocast's tensors): GELU(tanh) and SiLU reading
and writing bf16; under autocast to bf16, LayerNorm + modulate of the fp32 stream with bf16
scale / shift writing the bf16 GEMM input; the gated residual adding a bf16 GEMM output to the
fp32 stream; their backwards.

Stated accuracy, against float64 of the same (bf16-valued) inputs: a bf16 result is the fp32
result rounded once, so |out - ref| <= 2^-8 |ref| + the fp32 kernel's own bound (test_ops.py;
1e-5 here, 5e-5 (1 + |g|) for dGELU); fp32 results (dx, the gated sum) as the fp32 kernels.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autohc
import autohc.torch.ops as ops
from autohc.hw import cpu

BF = torch.bfloat16
HALF_ULP = 2.0 ** -8            # bf16 rounding, relative
ISAS = cpu.runnable_isas()


@pytest.fixture(autouse=True)
def clean():
    autohc.uninstall()
    yield
    autohc.uninstall()


def bf16_close(got, ref, abs_tol):
    """got (bf16) within one rounding of the float64 reference, plus abs_tol (per element)."""
    assert got.dtype == BF
    err = (got.double() - ref).abs()
    bound = HALF_ULP * ref.abs() + abs_tol
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
@pytest.mark.parametrize("n", [1, 7, 16, 17, 33, 70001])
def test_gelu_silu_bf16_accuracy_ragged_sizes(isa, n):
    if isa not in ISAS:
        pytest.skip(f"this CPU cannot run {isa}")
    p = ops.default_eltwise(isa)
    torch.manual_seed(n)
    x, g = (torch.randn(n) * 4).to(BF), torch.randn(n).to(BF)
    xd, gd = x.double(), g.double()
    bf16_close(ops._run("gelu_tanh_fwd", x, params=p), F.gelu(xd, approximate="tanh"), 1e-5)
    bf16_close(ops._run("gelu_tanh_bwd", g, x, params=p),
               torch.ops.aten.gelu_backward(gd, xd, approximate="tanh"), 5e-5 * (1 + gd.abs()))
    bf16_close(ops._run("silu_fwd", x, params=p), F.silu(xd), 1e-5)
    bf16_close(ops._run("silu_bwd", g, x, params=p), torch.ops.aten.silu_backward(gd, xd),
               1e-5 * (1 + gd.abs()))


def test_gelu_silu_bf16_special_values_and_layouts():
    """NaN / inf as torch's bf16 ops; a non-contiguous input and 2 threads give the same bits."""
    s = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e30, -1e30, 3.0,
                      -9.5, 1e-30]).to(BF)
    for mine, aten in ((ops.gelu_tanh, lambda t: F.gelu(t, approximate="tanh")),
                       (ops.silu, F.silu)):
        got, ref = mine(s), aten(s)
        assert torch.equal(got.isnan(), ref.isnan())
        inf, fin = ref.isinf(), ref.isfinite()
        assert torch.equal(got[inf], ref[inf])
        assert (got[fin].double() - ref[fin].double()).abs().le(HALF_ULP * 2 * ref[fin].double().abs()).all()
    torch.manual_seed(0)
    x = torch.randn(300, 700).to(BF)
    xt = x.t()                                              # non-contiguous: copied first
    assert torch.equal(ops.gelu_tanh(xt), ops.gelu_tanh(xt.contiguous()))
    with autohc.installed(threads=1):
        one = ops.silu(x)
    with autohc.installed(threads=2):
        two = ops.silu(x)
    assert torch.equal(one, two)


def test_install_routes_bf16_gelu_not_silu_under_autocast():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(40, 64), nn.GELU(approximate="tanh"), nn.Linear(64, 64), nn.SiLU())
    x = torch.randn(16, 40, requires_grad=True)
    w = torch.randn(16, 64)
    with torch.autocast("cpu", dtype=BF):
        ref = m(x)
    (ref.float() * w).sum().backward()
    gref, x.grad = x.grad.clone(), None
    calls = []
    real = ops._run
    ops._run = lambda name, *t, **k: calls.append((name, t[-1].dtype)) or real(name, *t, **k)
    try:
        with autohc.installed():
            with torch.autocast("cpu", dtype=BF):
                y = m(x)
            (y.float() * w).sum().backward()
    finally:
        ops._run = real
    assert {(k, BF) for k in ("gelu_tanh_fwd", "gelu_tanh_bwd")} <= set(calls)
    assert not {(k, BF) for k in ("silu_fwd", "silu_bwd")} & set(calls)     # ATen's is faster
    assert y.dtype == BF
    assert (y.float() - ref.float()).abs().max() <= 2 * HALF_ULP * ref.float().abs().max()
    assert (x.grad - gref).abs().max() <= 0.05 * gref.abs().max()
    # exact GELU, float16: ATen's, not ours
    calls.clear()
    ops._run = lambda name, *t, **k: calls.append(name) or real(name, *t, **k)
    try:
        with autohc.installed():
            z = torch.randn(100).to(BF)
            assert torch.equal(F.gelu(z), torch.ops.aten.gelu.default(z))
            h = torch.randn(100).half()
            F.silu(h)
    finally:
        ops._run = real
    assert calls == []


def _ln_ref(x, sc, sh):
    xd = x.detach().double().requires_grad_()
    scd = sc.detach().double().requires_grad_() if sc is not None else None
    shd = sh.detach().double().requires_grad_() if sh is not None else None
    y = F.layer_norm(xd, xd.shape[-1:], eps=1e-6)
    if scd is not None:
        y = y * (1 + scd[:, None, :])
    if shd is not None:
        y = y + shd[:, None, :]
    return y, xd, scd, shd


@pytest.mark.parametrize("B,T,D", [(2, 5, 67), (1, 1, 1), (3, 17, 16), (2, 300, 384)])
def test_layernorm_modulate_under_autocast_is_bf16(B, T, D):
    torch.manual_seed(D)
    x = (torch.randn(B, T, D) * 2 + 0.5).requires_grad_()
    sc = (torch.randn(B, D) * 0.3).to(BF).requires_grad_()
    sh = (torch.randn(B, D) * 0.3).to(BF).requires_grad_()
    with torch.autocast("cpu", dtype=BF):
        y = ops.layernorm_modulate(x, sc, sh)
    yref, xd, scd, shd = _ln_ref(x, sc, sh)
    bf16_close(y, yref.detach(), 1e-5)
    g = torch.randn(B, T, D).to(BF)
    (y.float() * g.float()).sum().backward()
    (yref * g.double()).sum().backward()
    assert x.grad.dtype == torch.float32 and sc.grad.dtype == BF and sh.grad.dtype == BF
    assert (x.grad.double() - xd.grad).abs().max() <= 1e-4 * (1 + xd.grad.abs().max())
    for got, ref in ((sc.grad, scd.grad), (sh.grad, shd.grad)):
        bf16_close(got, ref, 1e-4 * (1 + ref.abs().max()))


def test_layernorm_modulate_bf16_optional_inputs_and_fallbacks(monkeypatch):
    torch.manual_seed(1)
    x, s = torch.randn(2, 9, 40), (torch.randn(2, 40) * 0.2).to(BF)
    for sc, sh in ((s, None), (None, s), (None, None)):
        with torch.autocast("cpu", dtype=BF):
            y = ops.layernorm_modulate(x, sc, sh)
        bf16_close(y, _ln_ref(x, sc, sh)[0].detach(), 1e-5)
    calls = []
    real = ops._ln_fwd_kernel
    monkeypatch.setattr(ops, "_ln_fwd_kernel", lambda *a, **k: calls.append(k.get("kernel")) or real(*a, **k))
    y = ops.layernorm_modulate(x, s, s)                          # no autocast: fp32, by torch ops
    assert y.dtype == torch.float32 and calls == []
    with torch.autocast("cpu", dtype=BF):
        ops.layernorm_modulate(x, s.float(), s.float())          # fp32 scale: the fp32 kernel
        ops.layernorm_modulate(x, s, s)
    assert calls == [None, "ln_mod_fwd_bf16"]


def test_gated_residual_bf16_forward_backward():
    torch.manual_seed(3)
    for B, T, D in ((3, 5, 37), (1, 300, 200), (2, 1, 1)):     # (1, 300, 200): strips of columns
        x = torch.randn(B, T, D, requires_grad=True)
        y = torch.randn(B, T, D).to(BF).requires_grad_()
        gate = torch.randn(B, D).to(BF).requires_grad_()
        out = ops.gated_residual(x, y, gate)
        assert out.dtype == torch.float32
        g = torch.randn(B, T, D)
        (out * g).sum().backward()
        refs = [t.detach().double().requires_grad_() for t in (x, y, gate)]
        ref = refs[0] + refs[2][:, None, :] * refs[1]
        (ref * g.double()).sum().backward()
        assert (out.double() - ref).abs().max() <= 1e-5 * (1 + ref.abs().max())
        assert torch.equal(x.grad, g)
        bf16_close(y.grad, refs[1].grad, 1e-6)
        bf16_close(gate.grad, refs[2].grad, 1e-5 * (1 + refs[2].grad.abs().max()))


def test_gated_residual_backward_fp32_strips_and_threads():
    """The fp32 backward kernel: samples and column strips over the team, same result."""
    torch.manual_seed(4)
    g, y, gate = torch.randn(1, 64, 1000), torch.randn(1, 64, 1000), torch.randn(1, 1000)
    with autohc.installed(threads=1):
        one = ops._gated_bwd(g, y, gate)
    with autohc.installed(threads=2):
        two = ops._gated_bwd(g, y, gate)
    ref = (g.double() * gate.double()[:, None, :], (g.double() * y.double()).sum(1))
    for a, b, r in zip(one, two, ref):
        assert torch.equal(a, b)
        assert (a.double() - r).abs().max() <= 1e-5 * (1 + r.abs().max())


def test_opcheck_bf16_custom_ops():
    x, y = torch.randn(2, 3, 8), torch.randn(2, 3, 8).to(BF)
    s = torch.randn(2, 8).to(BF)
    mean, rstd = torch.randn(6), torch.rand(6) + 0.5
    torch.library.opcheck(torch.ops.autohc.gelu_tanh.default, (y,))
    torch.library.opcheck(torch.ops.autohc.silu_backward.default, (y, y))
    torch.library.opcheck(torch.ops.autohc.layernorm_modulate_bf16.default, (x, s, s, 1e-6))
    torch.library.opcheck(torch.ops.autohc.layernorm_modulate_bf16_backward.default,
                          (y, x, s, mean, rstd, True, True))
    torch.library.opcheck(torch.ops.autohc.gated_residual_bf16.default, (x, y, s))
    torch.library.opcheck(torch.ops.autohc.gated_residual_backward.default, (x, y, s))
    torch.library.opcheck(torch.ops.autohc.gated_residual_backward.default,
                          (x, x.clone(), torch.randn(2, 8)))
