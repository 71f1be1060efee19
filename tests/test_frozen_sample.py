"""Frozen bf16 weights (autohc.frozen), sampling precision and `autohc bench sample`."""
import pytest
import torch

import autohc
from autohc.torch import frozen as frozen_mod
from autohc.torch import served


def _bf16_linear(lin, x):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return lin(x).float()


@pytest.mark.skipif(not served.bf16_served(), reason="this CPU has no bf16 GEMM back-end")
def test_frozen_equals_unfrozen_and_edits_are_repacked():
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 80)
    x = torch.randn(64, 96)
    with autohc.installed(first_use_tuning=False):
        plain = _bf16_linear(lin, x)
        with autohc.frozen(lin):
            copies = frozen_mod.stats["copies"]
            a = _bf16_linear(lin, x)
            b = _bf16_linear(lin, x)
            assert frozen_mod.stats["copies"] == copies + 1      # rounded once, served twice
            assert torch.equal(a, plain) and torch.equal(b, plain)
            with torch.no_grad():
                lin.weight.mul_(2)                              # an edit: never served stale
            c = _bf16_linear(lin, x)
            assert frozen_mod.stats["copies"] == copies + 2
        again = _bf16_linear(lin, x)
    assert torch.equal(c, again) and not torch.equal(c, plain)
    assert not frozen_mod._weights                              # freed at the block's end


def test_frozen_rejects_non_modules():
    with pytest.raises(TypeError, match="nn.Module"):
        with autohc.frozen(torch.zeros(3)):
            pass


def test_guided_eps_bf16_returns_fp32_close_to_fp32():
    from autohc.bench.sample import random_weights
    from autohc.bench.step import synthetic_model
    from autohc.dit.sample import guided_eps
    arch = {"in_channels": 4, "class_dropout": 0.1}
    m = random_weights(synthetic_model("DiT-Ti/8", 16)).eval()
    x, t, y = torch.randn(2, 4, 16, 16), torch.tensor([10, 900]), torch.tensor([1, 2])
    with torch.no_grad():
        e32 = guided_eps(m, arch, y, 4.0, "fp32")(x, t)
        e16 = guided_eps(m, arch, y, 4.0, "bf16")(x, t)
    assert e16.dtype == torch.float32 and e16.shape == e32.shape
    assert float((e16 - e32).abs().max()) <= 5e-2 * float(e32.abs().max())
    assert not torch.equal(e16, e32)


def test_bench_sample_tiny_model():
    from autohc.bench.sample import bench_sample
    r = bench_sample("DiT-Ti/8", 2, image_size=16, samples=2, warmup=1, sample_steps=10,
                     modes=["diffusers", "diffusers-bf16", "autohc", "autohc-bf16"], first_use_tuning=False)
    assert set(r["step_s"]) == {"diffusers", "diffusers-bf16", "autohc", "autohc-bf16"}
    for m, s in r["step_s"].items():
        assert s > 0 and r["s_per_image"][m] == pytest.approx(s * 10 / 2)
    assert r["eps_reference"]["autohc-bf16"] == "autohc"
    assert r["max_rel_eps_diff"]["autohc-bf16"] < 0.1
    assert r["max_rel_eps_diff"]["diffusers-bf16"] < 0.1
    # the two fp32 models differ only by diffusers' timestep embedding: close, not equal
    assert 0 < r["max_rel_eps_diff"]["autohc"] < 0.2
    assert r["max_rel_eps_diff"]["diffusers"] is None


def test_bench_sample_bad_mode():
    from autohc.bench.sample import bench_sample
    with pytest.raises(ValueError, match="unknown modes"):
        bench_sample("DiT-Ti/8", 1, modes=["nope"])


@pytest.mark.skipif(not served.bf16_served(), reason="this CPU has no bf16 GEMM back-end")
def test_frozen_packed_weights_equal_unfrozen_and_edits_are_repacked():
    """frozen(packed=True): each weight packed once into its kernel's panels, the forward the
    same bits as unfrozen (M past the skinny paths: the packed path reads the packing), an
    in-place edit packed again, never served stale; without packed=True nothing is packed."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(160, 200)
    x = torch.randn(300, 160)
    with autohc.installed(first_use_tuning=False):
        plain = _bf16_linear(lin, x)
        packs = frozen_mod.stats["packs"]
        with autohc.frozen(lin):
            assert torch.equal(_bf16_linear(lin, x), plain)
        assert frozen_mod.stats["packs"] == packs                # not asked for
        with autohc.frozen(lin, packed=True):
            a = _bf16_linear(lin, x)
            b = _bf16_linear(lin, x)
            took = frozen_mod.stats["packs"] - packs
            assert took <= 1 and torch.equal(a, plain) and torch.equal(b, plain)
            with torch.no_grad():
                lin.weight.mul_(-3)
            c = _bf16_linear(lin, x)
            assert frozen_mod.stats["packs"] - packs == 2 * took
        again = _bf16_linear(lin, x)
    assert torch.equal(c, again) and not torch.equal(c, plain)
    with pytest.raises(TypeError, match="packed"):
        with autohc.frozen(lin, packed="yes"):
            pass


@pytest.mark.skipif(not served.bf16_served(), reason="this CPU has no bf16 GEMM back-end")
def test_fc1_gelu_is_one_kernel_when_sampling_and_two_calls_when_training():
    """FusedOps.linear_gelu: with nothing to differentiate, under install() and autocast bf16,
    fc1 + bias + GELU run as one kernel (GELU in the GEMM's store): GELU of the fp32 result
    rounded once, so within a bf16 rounding of the two calls (which round the pre-activation
    too); frozen or not, and an fc1 edited while frozen is served as edited. With gradients
    (training) the kernel also writes the pre-activation, and the gradients are the two
    calls' bit for bit. Not installed, or on a hooked fc1: exactly F.gelu(fc1(x))."""
    from autohc.ops import FUSED
    from autohc.torch import autocast as ac
    torch.manual_seed(0)
    fc1 = torch.nn.Linear(96, 200)
    x = torch.randn(3, 43, 96)

    def both(x, **kw):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (FUSED.linear_gelu(x, fc1),
                    torch.nn.functional.gelu(fc1(x), approximate="tanh"))

    calls = []
    real = ac.linear_gelu_impl
    with autohc.installed(first_use_tuning=False), torch.no_grad():
        ac.linear_gelu_impl = lambda *a: calls.append(1) or real(*a)
        try:
            fused, two = both(x)
            assert calls and fused.shape == (3, 43, 200) and fused.dtype == torch.bfloat16
            err = (fused.float() - two.float()).abs()
            assert (err <= 2 ** -7 * two.float().abs() + 2e-3).all() and not torch.equal(fused, two)
            with autohc.frozen(fc1):
                assert torch.equal(both(x)[0], fused)
                fc1.weight.mul_(-1)                       # an edit: never served stale
                edited, two_edited = both(x)
            assert (edited.float() - two_edited.float()).abs().max() <= 2 ** -7 * two_edited.float().abs().max() + 2e-3
            assert not torch.equal(edited, fused)
            fc1.weight.mul_(-1)
            n = len(calls)
            fc1.register_forward_hook(lambda *a: None)
            hooked, two = both(x)
            assert len(calls) == n and torch.equal(hooked, two)
            fc1._forward_hooks.clear()
        finally:
            ac.linear_gelu_impl = real
    with autohc.installed(first_use_tuning=False):
        grads = []
        for fuse in (True, False):          # training: the pre-activation written beside GELU
            xg = x.clone().requires_grad_()
            fc1.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = FUSED.linear_gelu(xg, fc1) if fuse else torch.nn.functional.gelu(fc1(xg), approximate="tanh")
            y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(y.dtype))
            grads.append((y, xg.grad, fc1.weight.grad, fc1.bias.grad))
        (y, *g1), (ref, *g2) = grads
        assert (y.float() - ref.float()).abs().max() <= 2 ** -7 * ref.float().abs().max() and not torch.equal(y, ref)
        for a, b in zip(g1, g2):    # GELU's backward reads the same bf16 pre-activation
            assert torch.equal(a, b)
        w, b = fc1.weight.detach(), fc1.bias.detach()
        x16 = x.reshape(-1, 96).to(torch.bfloat16)
        torch.library.opcheck(torch.ops.autohc.linear_gelu_fp32w.default, (x16, w, b))
        torch.library.opcheck(torch.ops.autohc.linear_gelu_fp32w_train.default,
                              (x16.requires_grad_(), w.requires_grad_(), b.requires_grad_()))
    with torch.autocast("cpu", dtype=torch.bfloat16):       # not installed: the two calls
        assert torch.equal(FUSED.linear_gelu(x, fc1), torch.nn.functional.gelu(fc1(x), approximate="tanh"))


@pytest.mark.skipif(not served.bf16_served(), reason="this CPU has no bf16 GEMM back-end")
def test_mlp_backward_takes_gelus_derivative_in_fc2s_input_gradient():
    """FusedOps.mlp in bf16 training under install(): the forward is fc2(linear_gelu(x, fc1))
    bit for bit; in the backward fc2's input gradient and GELU's backward are one kernel (no
    separate GELU backward call), so fc1's gradients and dx are within the bf16 roundings of
    the unfused calls' (which round dY·W before GELU' multiplies it) and fc2's are the same
    bits. A leaf of every kind (x only, weights only, no bias) gets its gradient; sampling, a
    hooked fc2 or no install() take the unfused calls. opcheck on the new ops."""
    from autohc.ops import FUSED
    from autohc.torch import autocast as ac
    torch.manual_seed(2)
    fc1, fc2 = torch.nn.Linear(96, 256), torch.nn.Linear(256, 80)
    x = torch.randn(2, 37, 96)
    seed = torch.linspace(-1, 1, 2 * 37 * 80).reshape(2, 37, 80)

    def run(fused, want_x=True, fc2_bias=True):
        xg = x.clone().requires_grad_(want_x)
        for p in (*fc1.parameters(), *fc2.parameters()):
            p.grad = None
        bias = fc2.bias
        if not fc2_bias:
            fc2.bias = None
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = FUSED.mlp(xg, fc1, fc2) if fused else fc2(FUSED.linear_gelu(xg, fc1))
            y.backward(seed.to(y.dtype))
        finally:
            fc2.bias = bias
        return y, [xg.grad, fc1.weight.grad, fc1.bias.grad, fc2.weight.grad, fc2.bias.grad]

    calls = []
    real = torch.ops.autohc.gelu_tanh_backward
    with autohc.installed(first_use_tuning=False):
        for want_x, fc2_bias in ((True, True), (False, True), (True, False)):
            y0, g0 = run(False, want_x, fc2_bias)
            try:
                ac.torch.ops.autohc.gelu_tanh_backward = lambda *a: calls.append(1) or real(*a)
                y1, g1 = run(True, want_x, fc2_bias)
            finally:
                ac.torch.ops.autohc.gelu_tanh_backward = real
            what = f"x grad {want_x}, fc2 bias {fc2_bias}"
            assert torch.equal(y1, y0), what
            assert not calls, what + ": GELU's backward ran on its own"
            for i, (a, b) in enumerate(zip(g1, g0)):
                if b is None:
                    assert a is None, what
                elif i >= 3:            # fc2's own gradients: the same kernels
                    assert torch.equal(a, b), what
                else:
                    assert ((a.float() - b.float()).abs().max() <= 2 ** -6 * b.float().abs().max()).item(), (what, i)
                    assert not torch.equal(a, b), (what, i, "the fused kernel did not run")
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):     # sampling: fc2 of linear_gelu
            assert torch.equal(FUSED.mlp(x, fc1, fc2), fc2(FUSED.linear_gelu(x, fc1)))
        y0, g0 = run(False)
        handle = fc2.register_forward_hook(lambda *a: None)
        y, g = run(True)
        handle.remove()
        assert torch.equal(y, y0) and torch.equal(g[0], g0[0])       # (the two calls: hooked fc2)
        x16 = x.reshape(-1, 96).to(torch.bfloat16)
        w1, b1, w2, b2 = (p.detach() for p in (*fc1.parameters(), *fc2.parameters()))
        torch.library.opcheck(torch.ops.autohc.mlp_fp32w_train.default,
                              (x16.requires_grad_(), w1.requires_grad_(), b1.requires_grad_(),
                               w2.requires_grad_(), b2.requires_grad_()))
        dy = torch.randn(74, 80).to(torch.bfloat16)
        g16, h16 = (torch.randn(74, 256).to(torch.bfloat16) for _ in range(2))
        torch.library.opcheck(torch.ops.autohc.gelu_linear_fp32w_backward.default,
                              (dy, g16, h16, w2.detach(), True, True))
    with torch.autocast("cpu", dtype=torch.bfloat16):       # not installed: the two calls
        assert torch.equal(FUSED.mlp(x, fc1, fc2), fc2(torch.nn.functional.gelu(fc1(x), approximate="tanh")))


def test_bench_sample_drop_in_modes_run_diffusers_on_autohc():
    """The +autohc modes: diffusers' own model under install(), its GEMMs on autohc's kernels,
    its eps that of stock diffusers (fp32: to summation order; bf16: to its rounding)."""
    from autohc.bench.sample import bench_sample
    before = served.stats["autohc"]
    r = bench_sample("DiT-Ti/8", 2, image_size=16, samples=1, warmup=1, sample_steps=10,
                     modes=["diffusers", "diffusers+autohc", "diffusers-bf16+autohc"], first_use_tuning=False)
    assert served.stats["autohc"] > before
    assert r["eps_reference"]["diffusers+autohc"] == r["eps_reference"]["diffusers-bf16+autohc"] == "diffusers"
    assert r["max_rel_eps_diff"]["diffusers+autohc"] < 1e-4
    assert r["max_rel_eps_diff"]["diffusers-bf16+autohc"] < 0.1
    assert set(r["speedups"]) == {"diffusers+autohc vs diffusers", "diffusers-bf16+autohc vs diffusers"}
