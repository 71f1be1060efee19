"""DiT's patch embedding as a GEMM on the patches (autohc.torch.autocast.patch_embed,
FusedOps.patch_embed): under install() and autocast bf16 within a bf16 rounding of the conv,
forward and the weight's and bias's gradients (products summed in fp32 in another order,
one rounding); elsewhere exactly the conv."""
import pytest
import torch

import autohc
from autohc.torch.autocast import patch_embed
from autohc.torch.served import bf16_served

BF = torch.bfloat16


@pytest.fixture(autouse=True)
def clean():
    autohc.uninstall()
    yield
    autohc.uninstall()


def _conv_and_images(C, D, p, B, H, W, seed=0):
    torch.manual_seed(seed)
    conv = torch.nn.Conv2d(C, D, kernel_size=p, stride=p)
    return conv, torch.randn(B, C, H, W)


def _both(conv, x, **ctx):
    outs, grads = [], []
    for f in (lambda: patch_embed(x, conv), lambda: conv(x).flatten(2).transpose(1, 2)):
        conv.zero_grad(set_to_none=True)
        y = f()
        (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append(y.detach())
        grads.append((conv.weight.grad.clone(), conv.bias.grad.clone()))
    return outs, grads


def _close(a, b, rel):
    return (a.float() - b.float()).abs().max() <= rel * b.float().abs().max() + 1e-6


# a 4-channel 2x2 patch (DiT/2), a ragged one (3 channels, 3x3 patches, 40 x 36 images)
@pytest.mark.parametrize("C,D,p,B,H,W", [(4, 96, 2, 3, 16, 16), (3, 80, 3, 2, 36, 30)])
def test_the_gemm_is_the_conv_within_a_bf16_rounding(C, D, p, B, H, W):
    conv, x = _conv_and_images(C, D, p, B, H, W)
    with autohc.installed(first_use_tuning=False), torch.autocast("cpu", dtype=BF):
        (y, ref), ((dw, db), (dw_ref, db_ref)) = _both(conv, x)
    assert y.shape == ref.shape == (B, (H // p) * (W // p), D) and y.dtype == ref.dtype == BF
    assert y.is_contiguous()
    assert _close(y, ref, 2 ** -7)
    # (the two gradients: bf16 products of the same values, summed in fp32, rounded once or twice)
    assert _close(dw, dw_ref, 2 ** -6) and _close(db, db_ref, 2 ** -7)
    if bf16_served():       # (the GEMM ran: not the conv's bits)
        assert not torch.equal(y, ref) or not torch.equal(dw, dw_ref)


def test_elsewhere_exactly_the_conv():
    conv, x = _conv_and_images(4, 64, 2, 2, 8, 8)
    ref = conv(x).flatten(2).transpose(1, 2)
    assert torch.equal(patch_embed(x, conv), ref)                       # not installed
    with autohc.installed(first_use_tuning=False):
        assert torch.equal(patch_embed(x, conv), ref)                   # fp32
        with torch.autocast("cpu", dtype=BF):
            stock = conv(x).flatten(2).transpose(1, 2)
            padded = torch.nn.Conv2d(4, 64, 2, stride=2, padding=1)
            assert torch.equal(patch_embed(x, padded), padded(x).flatten(2).transpose(1, 2))
            seen = []
            conv.register_forward_hook(lambda *a: seen.append(1))
            assert torch.equal(patch_embed(x, conv), stock) and seen == [1]
