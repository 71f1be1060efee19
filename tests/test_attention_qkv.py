"""Attention straight from the packed qkv GEMM output (autohc::attention_qkv, what autohc's DiT
blocks run with the fused ops): the same kernel as autohc::attention on the q, k, v views, so
forward and backward equal that op's bit for bit; its backward writes d qkv in one buffer
(no stack, no permute copy); other dtypes go through the math path; opcheck."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autohc.dit.model import DiT
from autohc.torch import attention as A
from autohc.torch.ops import FUSED


def _unpacked(qkv, heads):
    """The reference: autohc::attention on q, k, v as timm takes them out of qkv."""
    B, T, C = qkv.shape
    out = A.attention(*A.qkv_views(qkv, heads))
    return out.transpose(1, 2).reshape(B, T, C // 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,H,D", [(2, 1, 2, 64), (1, 7, 3, 72), (2, 61, 6, 64), (1, 257, 2, 16)])
def test_packed_equals_the_unpacked_op_bit_for_bit(dtype, B, T, H, D):
    g = torch.Generator().manual_seed(T * H + D)
    x = torch.randn(B, T, 3 * H * D, generator=g).to(dtype)
    grad = torch.randn(B, T, H * D, generator=g).to(dtype)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_a, out_b = A.attention_qkv(a, H), _unpacked(b, H)
    assert out_a.shape == (B, T, H * D) and out_a.dtype == dtype
    assert torch.equal(out_a, out_b)
    out_a.backward(grad)
    out_b.backward(grad)
    assert a.grad.is_contiguous() and torch.equal(a.grad, b.grad)


def test_against_sdpa_and_the_math_path_for_other_dtypes():
    """float64 is not served: the math path, packed the same way; both against SDPA."""
    B, T, H, D = 2, 19, 3, 32
    for dtype, atol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        x = torch.randn(B, T, 3 * H * D, dtype=dtype)
        a, r = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = A.attention_qkv(a, H)
        ref = F.scaled_dot_product_attention(*A.qkv_views(r, H)).transpose(1, 2).reshape(B, T, H * D)
        torch.testing.assert_close(out, ref, atol=atol, rtol=1e-5)
        g = torch.randn_like(out)
        out.backward(g)
        ref.backward(g)
        torch.testing.assert_close(a.grad, r.grad, atol=10 * atol, rtol=1e-5)


def test_opcheck_and_bad_shapes():
    x = torch.randn(2, 9, 3 * 2 * 16, requires_grad=True)
    torch.library.opcheck(torch.ops.autohc.attention_qkv.default, (x, 2, None))
    out, lse = torch.ops.autohc.attention_qkv(x, 2, None)
    g = torch.randn_like(out)
    torch.library.opcheck(torch.ops.autohc.attention_qkv_backward.default,
                          (g, x.detach(), out.detach(), lse.detach(), 2, None))
    for bad, heads in ((torch.randn(2, 9, 100), 2), (torch.randn(9, 96), 2), (torch.randn(2, 9, 96), 0)):
        with pytest.raises(ValueError, match="attention_qkv"):
            A.attention_qkv(bad, heads)


def test_dit_with_fused_ops_runs_it_and_matches_plain_torch():
    torch.manual_seed(0)
    plain = DiT(input_size=8, patch_size=2, in_channels=4, hidden_size=64, depth=2, num_heads=4,
                num_classes=10)
    fused = DiT(input_size=8, patch_size=2, in_channels=4, hidden_size=64, depth=2, num_heads=4,
                num_classes=10)
    fused.load_state_dict(plain.state_dict())
    fused.use_fused_ops(FUSED)
    assert all(b.attn.fused is FUSED for b in fused.blocks)
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3, 700]), torch.tensor([1, 7])
    calls = []
    orig = A._attention_qkv
    try:
        A._attention_qkv = lambda *a: calls.append(1) or orig(*a)
        out_f = fused(x, t, y)
    finally:
        A._attention_qkv = orig
    assert len(calls) == 2                               # one per block
    out_p = plain(x, t, y)
    torch.testing.assert_close(out_f, out_p, rtol=1e-4, atol=1e-5)
    out_f.square().mean().backward()
    out_p.square().mean().backward()
    for (n, pf), (_, pp) in zip(fused.named_parameters(), plain.named_parameters()):
        if pp.grad is not None:
            torch.testing.assert_close(pf.grad, pp.grad, rtol=1e-3, atol=1e-6, msg=n)


def test_calls_without_autograd_run_the_kernel_directly_and_a_mode_still_sees_the_op(monkeypatch):
    """attention_qkv and attention under no_grad skip the custom ops' dispatch (the same bits);
    with autograd to record, or under a dispatch mode, they are the ops."""
    from dispatch_log import DispatchLog
    torch.manual_seed(0)
    qkv = torch.randn(2, 40, 3 * 4 * 16)
    q, k, v = (torch.randn(2, 4, 40, 16) for _ in range(3))
    want = A.attention_qkv(qkv, 4), A.attention(q, k, v)
    calls = []
    for name in ("_attention_qkv", "_attention"):
        real = getattr(A, name)
        monkeypatch.setattr(A, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    with torch.no_grad():
        got = A.attention_qkv(qkv, 4), A.attention(q, k, v)
    assert calls == [] and all(torch.equal(a, b) for a, b in zip(got, want))
    A.attention_qkv(qkv.clone().requires_grad_(), 4).sum().backward()
    assert calls == ["_attention_qkv"]

    with torch.no_grad(), DispatchLog() as log:
        got = A.attention_qkv(qkv, 4)
    assert any("autohc.attention_qkv" in n for n in log.names) and torch.equal(got, want[0])
