"""Element-wise operators (templates/ops): GELU(tanh), SiLU, forward and backward.

Stated float32 accuracy (abs error vs float64 torch, inputs ~ N(0, 4^2)): fast tanh <= 4e-7;
GELU <= 2e-6; dGELU <= 5e-5 * |grad|; SiLU and dSiLU <= 5e-6. NaN / Inf / -0 as torch.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autohc
import autohc.torch.ops as ops
from autohc.hw import cpu

ISAS = cpu.runnable_isas()
F64 = {
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


@pytest.fixture(autouse=True)
def clean():
    autohc.uninstall()
    yield
    autohc.uninstall()


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_fast_tanh_error_bound(isa):
    if isa not in ISAS:
        pytest.skip(f"this CPU cannot run {isa}")
    x = torch.linspace(-12, 12, 1_000_001)
    got = ops._run("tanh_fwd", x, params=ops.default_eltwise(isa))
    assert (got.double() - torch.tanh(x.double())).abs().max().item() <= 4e-7


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
@pytest.mark.parametrize("n", [1, 2, 7, 15, 16, 17, 33, 1000, 70001])
def test_forward_backward_accuracy_ragged_sizes(isa, n):
    if isa not in ISAS:
        pytest.skip(f"this CPU cannot run {isa}")
    p = ops.default_eltwise(isa)
    torch.manual_seed(n)
    x, g = torch.randn(n) * 4, torch.randn(n)
    xd, gd = x.double(), g.double()
    assert (ops._run("gelu_tanh_fwd", x, params=p).double() - F64["gelu"](xd)).abs().max() <= 2e-6
    ref = torch.ops.aten.gelu_backward(gd, xd, approximate="tanh")
    assert ((ops._run("gelu_tanh_bwd", g, x, params=p).double() - ref).abs() <= 5e-5 * (1 + gd.abs())).all()
    assert (ops._run("silu_fwd", x, params=p).double() - F.silu(xd)).abs().max() <= 5e-6
    ref = torch.ops.aten.silu_backward(gd, xd)
    assert (ops._run("silu_bwd", g, x, params=p).double() - ref).abs().max() <= 5e-6 * (1 + gd.abs().max())


SPECIAL = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e30, -1e30, 3.0,
                        -3.0, 9.5, -9.5, 1e-30, -1e-30])


@pytest.mark.parametrize("which", ["gelu", "silu", "gelu_bwd", "silu_bwd"])
def test_nan_inf_and_signed_zero_as_torch(which):
    x, g = SPECIAL, torch.ones_like(SPECIAL)
    got, ref = {
        "gelu": (ops.gelu_tanh(x), F.gelu(x, approximate="tanh")),
        "silu": (ops.silu(x), F.silu(x)),
        "gelu_bwd": (ops.gelu_tanh_backward(g, x), torch.ops.aten.gelu_backward(g, x, approximate="tanh")),
        "silu_bwd": (ops.silu_backward(g, x), torch.ops.aten.silu_backward(g, x)),
    }[which]
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    fin = torch.isfinite(ref)
    assert torch.equal(torch.signbit(got[fin]), torch.signbit(ref[fin]))
    assert torch.allclose(got[fin], ref[fin], rtol=1e-5, atol=1e-6)


def test_non_contiguous_and_multithreaded():
    base = torch.randn(300, 1000) * 3
    x = base[:, ::2]                                   # non-contiguous, 150k elements
    assert not x.is_contiguous()
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        y = ops.gelu_tanh(x)
    finally:
        torch.set_num_threads(old)
    assert torch.allclose(y, F.gelu(x, approximate="tanh"), atol=2e-6)


def test_autograd_and_gradcheck():
    x = (torch.randn(5, 37) * 3).requires_grad_()
    ops.gelu_tanh(x).sum().backward()
    ref = torch.ops.aten.gelu_backward(torch.ones_like(x), x.detach(), approximate="tanh")
    assert torch.allclose(x.grad, ref, atol=5e-5)
    xd = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)  # the fallback serves float64
    assert torch.autograd.gradcheck(ops.gelu_tanh, (xd,))
    assert torch.autograd.gradcheck(ops.silu, (xd,))


@pytest.mark.parametrize("op, args", [
    ("gelu_tanh", lambda: (torch.randn(3, 40),)),
    ("silu", lambda: (torch.randn(3, 40),)),
    ("gelu_tanh_backward", lambda: (torch.randn(3, 40), torch.randn(3, 40))),
    ("silu_backward", lambda: (torch.randn(3, 40), torch.randn(3, 40))),
])
def test_opcheck(op, args):
    torch.library.opcheck(getattr(torch.ops.autohc, op).default, args())


def test_install_routes_torch_gelu_and_silu():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(40, 64), nn.GELU(approximate="tanh"), nn.Linear(64, 64), nn.SiLU())
    x = torch.randn(16, 40, requires_grad=True)
    w = torch.randn(16, 64)                 # a dense upstream gradient (sum() gives an expanded one)
    ref = m(x)
    (ref * w).sum().backward()
    gref = x.grad.clone()
    x.grad = None
    calls = []
    real = ops._run
    import autohc.torch.ops as o
    o._run = lambda name, *t, **k: calls.append(name) or real(name, *t, **k)
    try:
        with autohc.installed():
            y = m(x)
            (y * w).sum().backward()
    finally:
        o._run = real
    assert {"gelu_tanh_fwd", "gelu_tanh_bwd", "silu_fwd", "silu_bwd"} <= set(calls)
    assert torch.allclose(y, ref, atol=1e-5) and torch.allclose(x.grad, gref, atol=1e-4)
    # exact GELU (approximate="none"), other dtypes: ATen, bit for bit
    z = torch.randn(100)
    with autohc.installed():
        assert torch.equal(F.gelu(z), F.gelu(z.clone()))
        zd = z.double()
        assert torch.equal(F.silu(zd), torch.ops.aten.silu.out(zd, out=torch.empty(0, dtype=torch.float64)))


# ------------------------------------------------------------ LayerNorm + adaLN modulate

def _ln_check(B, T, D, with_scale=True, with_shift=True, seed=0):
    torch.manual_seed(seed)
    x = (torch.randn(B, T, D) * 3 + 1).requires_grad_()
    sc = (torch.randn(B, D) * 0.2).requires_grad_() if with_scale else None
    sh = torch.randn(B, D).requires_grad_() if with_shift else None
    y = ops.layernorm_modulate(x, sc, sh)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    ref_in = [t.detach().double().requires_grad_() if t is not None else None for t in (x, sc, sh)]
    yr = ops._ln_reference(*ref_in, 1e-6)
    (yr * g.double()).sum().backward()
    assert (y.double() - yr).abs().max() <= 1e-5 * (1 + yr.abs().max())
    for a, b in zip((x, sc, sh), ref_in):
        if a is not None:
            assert (a.grad.double() - b.grad).abs().max() <= 1e-4 * (1 + b.grad.abs().max()) * max(1, T) ** 0.5


@pytest.mark.parametrize("B, T, D", [(1, 1, 1), (2, 5, 7), (3, 17, 33), (2, 3, 16), (4, 64, 385)])
def test_layernorm_modulate_forward_backward(B, T, D):
    _ln_check(B, T, D)


@pytest.mark.parametrize("with_scale, with_shift", [(False, False), (True, False), (False, True)])
def test_layernorm_modulate_optional_inputs(with_scale, with_shift):
    _ln_check(2, 9, 40, with_scale, with_shift, seed=3)


def test_layernorm_modulate_dit_size_multithreaded():
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _ln_check(8, 256, 1152, seed=5)
    finally:
        torch.set_num_threads(old)


def test_layernorm_modulate_gradcheck_float64_and_bad_shapes():
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    sc = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    sh = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: ops.layernorm_modulate(a, b, c), (x, sc, sh))
    with pytest.raises(ValueError, match="B, T, D"):
        ops.layernorm_modulate(torch.randn(3, 4))
    with pytest.raises(ValueError, match="scale must be"):
        ops.layernorm_modulate(torch.randn(2, 3, 4), torch.randn(3, 4))


def test_layernorm_modulate_nan_stays_in_its_row():
    x = torch.randn(2, 4, 16)
    x[1, 2, 5] = float("nan")
    y = ops.layernorm_modulate(x, torch.zeros(2, 16), torch.zeros(2, 16))
    assert torch.isnan(y[1, 2]).all()
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1, 2] = False
    assert torch.isfinite(y[mask]).all()


def test_layernorm_modulate_opcheck():
    x, sc, sh = torch.randn(2, 5, 24), torch.randn(2, 24), torch.randn(2, 24)
    torch.library.opcheck(torch.ops.autohc.layernorm_modulate.default, (x, sc, sh, 1e-6))


# ------------------------------------------------------------ softmax, gated residual

@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (2, 7), (4, 33), (2, 3, 130)])
def test_softmax_forward_backward(shape):
    torch.manual_seed(len(shape))
    x = (torch.randn(*shape) * 5).requires_grad_()
    y = ops.softmax(x)
    g = torch.randn(*shape)
    (y * g).sum().backward()
    xr = x.detach().double().requires_grad_()
    yr = torch.softmax(xr, -1)
    (yr * g.double()).sum().backward()
    assert (y.double() - yr).abs().max() <= 1e-6
    assert (x.grad.double() - xr.grad).abs().max() <= 5e-6 * (1 + g.abs().max())


def test_softmax_masks_nan_and_inf_as_torch():
    x = torch.tensor([[0., float("-inf"), 1.], [float("nan"), 1., 2.], [float("-inf"), float("-inf"), 0.],
                      [1e30, 0., -1e30], [float("-inf")] * 3])
    got, ref = ops.softmax(x), torch.softmax(x, -1)
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    fin = ~torch.isnan(ref)
    assert torch.allclose(got[fin], ref[fin], atol=1e-7)


def test_softmax_opcheck_and_install_routes_it():
    torch.library.opcheck(torch.ops.autohc.softmax.default, (torch.randn(4, 40),))
    calls = []
    real = ops._rows_call
    ops._rows_call = lambda name, *a, **k: calls.append(name) or real(name, *a, **k)
    try:
        x = torch.randn(2, 4, 50, requires_grad=True)
        w = torch.randn(2, 4, 50)
        with autohc.installed():
            y = torch.softmax(x, -1)
            (y * w).sum().backward()
            torch.softmax(torch.randn(5, 6), 0)      # not the last dim: ATen
    finally:
        ops._rows_call = real
    assert calls == ["softmax_fwd", "softmax_bwd"]
    xr = x.detach().double().requires_grad_()
    (torch.softmax(xr, -1) * w.double()).sum().backward()
    assert torch.allclose(x.grad.double(), xr.grad, atol=1e-5)


def test_gated_residual_forward_backward_and_bad_shapes():
    torch.manual_seed(7)
    x, y = torch.randn(3, 5, 37, requires_grad=True), torch.randn(3, 5, 37, requires_grad=True)
    gate = torch.randn(3, 37, requires_grad=True)
    out = ops.gated_residual(x, y, gate)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    refs = [t.detach().double().requires_grad_() for t in (x, y, gate)]
    ref = refs[0] + refs[2][:, None, :] * refs[1]
    (ref * g.double()).sum().backward()
    assert (out.double() - ref).abs().max() <= 1e-6
    for a, b in zip((x, y, gate), refs):
        assert (a.grad.double() - b.grad).abs().max() <= 1e-5
    torch.library.opcheck(torch.ops.autohc.gated_residual.default,
                          (torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.randn(2, 8)))
    with pytest.raises(ValueError, match="gated_residual"):
        ops.gated_residual(torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.randn(3, 4))


@pytest.mark.parametrize("isa,vl", [("avx2", 4), ("avx2", 8), ("avx2", 16), ("avx512", 16)])
def test_streaming_stores_give_the_same_bits(isa, vl):
    """stream_stores=True (non-temporal stores from 8 MB per call) on an output that starts off
    the vector alignment, a ragged length and the row kernels: bit for bit what plain stores write.
    One case per form of the non-temporal store (vl 4 and 8 store one 16- or 32-byte vector on
    either ISA; vl 16 two 32-byte halves on AVX2, one 64-byte vector on AVX-512)."""
    if isa not in ISAS:
        pytest.skip(f"this CPU cannot run {isa}")
    plain = ops.EltwiseParams(isa=isa, vl=vl, unroll=2, stream_stores=False, threads=1)
    stream = ops.EltwiseParams(isa=isa, vl=vl, unroll=2, stream_stores=True, threads=1)
    n = (9 << 20) // 4 + 13                                   # 9 MB + a ragged tail
    torch.manual_seed(vl)
    x, g = torch.randn(n) * 4, torch.randn(n)
    for name, ins in (("gelu_tanh_fwd", (x,)), ("silu_bwd", (g, x))):
        outs = []
        for p in (plain, stream):
            ffi, fn = ops.kernel_fn(name, p)
            buf = torch.full((n + 8,), float("nan"))
            for off in (0, 3):                                # aligned and misaligned output
                fn(*[ffi.cast("float *", t.data_ptr()) for t in ins],
                   ffi.cast("float *", buf.data_ptr()) + off, n, 1)
                outs.append(buf[off:off + n].clone())
        assert all(torch.equal(outs[0], o) for o in outs[1:]), name
    B, T, D = 8, 256, 1152                                    # 9.4 MB rows: above the threshold
    xs, ys = torch.randn(B, T, D), torch.randn(B, T, D)
    sc, sh = torch.randn(B, D) * 0.1, torch.randn(B, D) * 0.1
    att = torch.randn(B * 4, T, T)
    cases = {"ln_mod_fwd": lambda: ops.layernorm_modulate(xs, sc, sh),
             "gated_residual": lambda: ops.gated_residual(xs, ys, sc),
             "softmax_fwd": lambda: ops.softmax(att),
             "softmax_bwd": lambda: ops.softmax_backward(att, att)}
    for kernel, run in cases.items():
        got = []
        for p in (plain, stream):
            with ops.forced_params(kernel, p):
                got.append(run())
        assert torch.equal(got[0], got[1]), kernel
    xl = xs.clone().requires_grad_()
    grads = []
    for p in (plain, stream):
        with ops.forced_params("ln_mod_bwd", p):
            xl.grad = None
            (ops.layernorm_modulate(xl, sc, sh) * ys).sum().backward()
            grads.append(xl.grad.clone())
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("shape,ns,affine", [((4, 7, 33), (33,), "both"), ((2, 5, 6, 8), (6, 8), "both"),
                                            ((3, 64), (64,), "none"), ((1, 1), (1,), "weight"),
                                            ((300, 1152), (1152,), "bias"), ((2, 3, 17), (17,), "both")])
def test_install_routes_torch_layernorm(shape, ns, affine, monkeypatch):
    """F.layer_norm / nn.LayerNorm under install(): autohc's kernel, forward and backward, with
    or without weight and bias, any trailing normalized_shape; float64 reference."""
    calls = []
    real = ops._ln_fwd_kernel
    monkeypatch.setattr(ops, "_ln_fwd_kernel", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(len(shape))
    x = (torch.randn(shape) * 3 + 1).requires_grad_()
    w = torch.randn(ns).requires_grad_() if affine in ("both", "weight") else None
    b = torch.randn(ns).requires_grad_() if affine in ("both", "bias") else None
    g = torch.randn(shape)
    leaves = [t for t in (x, w, b) if t is not None]
    with autohc.installed(threads=2):
        y = F.layer_norm(x, ns, w, b, 1e-5)
        grads = torch.autograd.grad(y, leaves, g)
    assert calls
    d = [t.detach().double().requires_grad_() for t in leaves]
    it = iter(d)
    xd, wd, bd = next(it), (next(it) if w is not None else None), (next(it) if b is not None else None)
    yd = F.layer_norm(xd, ns, wd, bd, 1e-5)
    ref = torch.autograd.grad(yd, d, g.double())
    D = 1
    for s in ns:
        D *= s
    assert (y.double() - yd).abs().max() <= 1e-5 * (1 + (w.abs().max().item() if w is not None else 0))
    rows = x.numel() // D
    for got, want in zip(grads, ref):                 # dweight / dbias sum over the rows
        assert (got.double() - want).abs().max() <= 2e-5 * (1 + rows ** 0.5) * (1 + want.abs().max())


def test_install_layernorm_other_dtypes_and_layouts(monkeypatch):
    """float64 / bfloat16 / empty go to ATen (its GroupNorm kernel, one group: the same
    normalisation); a non-contiguous float32 input is served (copied first, as ATen does)."""
    calls = []
    real = ops._ln_fwd_kernel
    monkeypatch.setattr(ops, "_ln_fwd_kernel", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    cases = [(torch.randn(6, 10).double(), 1e-12), (torch.randn(6, 10).bfloat16(), 6e-2),
             (torch.randn(0, 10), 0), (torch.randn(10, 6).t(), 1e-5)]
    def run(x):
        x = x.clone().requires_grad_()
        w = torch.randn(x.shape[-1], dtype=x.dtype, generator=torch.Generator().manual_seed(1)).requires_grad_()
        y = F.layer_norm(x, x.shape[-1:], w, None, 1e-5)
        y.backward(torch.ones_like(y) + torch.arange(y.numel(), dtype=y.dtype).view(y.shape) / 7)
        return y.detach(), x.grad, w.grad
    want = [run(x) for x, _ in cases]
    with autohc.installed(threads=2):
        got = [run(x) for x, _ in cases]
    assert len(calls) == 1                                     # the non-contiguous float32 one
    for (x, tol), g, w in zip(cases, got, want):
        for a, b in zip(g, w):
            assert a.shape == b.shape and a.dtype == b.dtype
            torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def test_softmax_accuracy_over_the_exp_range():
    """Rows spanning exp's whole float32 range (-87..0) and N(0, 10^2) rows: relative error
    against float64 no worse than torch's own float32 softmax (both about 4e-6 here)."""
    x = torch.cat([torch.linspace(-87, 0, 256 * 500).reshape(500, 256), torch.randn(500, 256) * 10])
    ref = torch.softmax(x.double(), -1)
    keep = ref > 1e-30
    def rel(y):
        return ((y.double() - ref).abs() / ref)[keep].max().item()
    assert rel(ops.softmax(x)) <= 1.25 * rel(torch.softmax(x, -1)) + 1e-7


def test_install_layernorm_strided_weight_and_bias():
    x = torch.randn(5, 12)
    w, b = torch.randn(24)[::2], torch.randn(12, 2)[:, 1]          # views with stride 2
    want = F.layer_norm(x, (12,), w, b)
    with autohc.installed(threads=2):
        got = F.layer_norm(x, (12,), w, b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_calls_without_autograd_skip_the_custom_op_and_nothing_watching_loses_it(monkeypatch):
    """layernorm_modulate and gated_residual under no_grad run their implementation directly
    (same bits as the op); with autograd to record, under a dispatch mode, the profiler or
    torch.compile they go through the custom op, which those see."""
    from dispatch_log import DispatchLog
    from autohc.torch import direct
    torch.manual_seed(0)
    x, y = torch.randn(2, 33, 96), torch.randn(2, 33, 96)
    gate, scale, shift = torch.randn(2, 96), torch.randn(2, 96), torch.randn(2, 96)
    calls = []
    for name in ("_gated", "_ln_mod"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))

    def both():
        return ops.gated_residual(x, y, gate), ops.layernorm_modulate(x, scale, shift)
    want = both()                                           # (grad enabled, nothing requires it)
    assert calls == []
    with torch.no_grad():
        got = both()
    assert calls == [] and all(torch.equal(a, b) for a, b in zip(got, want))
    xg = x.clone().requires_grad_()
    ops.gated_residual(xg, y, gate).sum().backward()
    assert calls == ["_gated"] and xg.grad is not None

    with torch.no_grad(), DispatchLog() as log:
        got = both()
    assert any("autohc.gated_residual" in n for n in log.names) and any("autohc.layernorm_modulate" in n for n in log.names)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    calls.clear()
    with torch.no_grad(), torch.profiler.profile():
        both()
    assert calls == ["_gated", "_ln_mod"]
    import warnings
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)     # (the shape checks)
        warnings.simplefilter("ignore", DeprecationWarning)          # (torch.jit.trace is, still traced by users)
        traced = torch.jit.trace(lambda x, y, g: ops.gated_residual(x, y, g), (x, y, gate))
    assert "autohc::gated_residual" in str(traced.graph)
    inside = []
    torch.vmap(lambda t: inside.append(direct.runs_direct(t)) or t)(x)
    assert direct.runs_direct(x) and inside == [False]
