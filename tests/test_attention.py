"""Fused attention (templates/ops/attention.c.j2): forward and backward against torch's math
path in float64, ragged lengths, head dims of the DiT family, strided q/k/v, the custom op's
opcheck, and the routing of F.scaled_dot_product_attention under autohc.install()."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autohc
from autohc.bench import timing
from autohc.kernels.attention import AttentionParams, default_attention
from autohc.kernels.attention.codegen import render_attention
from autohc.kernels.family import ParamError
from autohc.torch import attention as A
from autohc.torch.threads import set_kernel_threads


def reference(q, k, v, scale=None):
    """The math path in float64: out, lse."""
    qd, kd, vd = q.double(), k.double(), v.double()
    s = (qd @ kd.transpose(-2, -1)) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    return torch.softmax(s, -1) @ vd, torch.logsumexp(s, -1)


def qkv_views(B, T, H, D, seed=0, L=None):
    """q, k, v as DiT makes them: strided views of one qkv tensor (B, T, 3, H, D) permuted."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, 3, H, D, generator=g).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    if L is not None:
        q = torch.randn(B, H, L, D, generator=g)
    return q, k, v


def tol(D):
    # fp32 sums over D (scores) and over T (outputs): errors grow like sqrt of the lengths;
    # observed ~1e-6 at D 80, T 257 for unit-variance inputs
    return dict(rtol=1e-4, atol=2e-6 * math.sqrt(D) * 4)


@pytest.mark.parametrize("T", [1, 7, 255, 257])
@pytest.mark.parametrize("D", [64, 72, 80])
def test_forward_and_backward_match_math_path(T, D):
    q, k, v = qkv_views(2, T, 3, D, seed=T + D)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    assert not q.is_contiguous()
    out, lse = A.forward_kernel(q, k, v, None)
    ref, ref_lse = reference(q, k, v)
    torch.testing.assert_close(out.double(), ref, **tol(D))
    torch.testing.assert_close(lse.double(), ref_lse, **tol(D))
    grad = torch.randn_like(out)
    dq, dk, dv = A.backward_kernel(grad, q, k, v, out, lse, None)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference(qd, kd, vd)[0].backward(grad.double())
    for got, want in ((dq, qd.grad), (dk, kd.grad), (dv, vd.grad)):
        torch.testing.assert_close(got.double(), want, **tol(D))


@pytest.mark.parametrize("spread", [1.0, 12.0, 200.0])
def test_exp_holds_over_peaked_and_underflowing_scores(spread):
    """The softmax's exp (2^t with log2 e folded into the scale): scores from near-uniform rows
    to rows whose terms underflow (spread 200: most exps below the smallest float), forward and
    backward against float64."""
    q, k, v = qkv_views(2, 130, 2, 64, seed=int(spread))
    q = (q * spread).detach().requires_grad_()
    k, v = k.detach().requires_grad_(), v.detach().requires_grad_()
    out, lse = A.forward_kernel(q, k, v, None)
    ref, ref_lse = reference(q, k, v)
    # the fp32 scores' own rounding grows with their size, so every bound does (the exp
    # adds nothing it could see: the former Cody-Waite exp gave the same greatest errors)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=tol(64)["atol"] + 1e-6 * spread)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=2e-6 * spread)
    grad = torch.randn_like(out)
    dq, dk, dv = A.backward_kernel(grad, q, k, v, out, lse, None)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference(qd, kd, vd)[0].backward(grad.double())
    for got, want in ((dq, qd.grad), (dk, kd.grad), (dv, vd.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=2e-5 * spread)


@pytest.mark.parametrize("scale", [0.05, -0.3])
def test_cross_attention_other_lengths_and_scales(scale):
    q, k, v = qkv_views(2, 33, 2, 16, seed=1, L=19)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    got = autohc.ops.attention(q, k, v, scale=scale)
    ref, _ = reference(q, k, v, scale)
    torch.testing.assert_close(got.double(), ref, **tol(16))
    g = torch.randn_like(got)
    got.backward(g)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference(qd, kd, vd, scale)[0].backward(g.double())
    for t, r in ((q, qd), (k, kd), (v, vd)):
        torch.testing.assert_close(t.grad.double(), r.grad, **tol(16))


@pytest.mark.parametrize("L,S,D", [(1, 7, 72), (50, 33, 13), (97, 200, 64)])
def test_forward_tiles_with_remainders_everywhere(L, S, D):
    """Odd micro-tiles (3 query vectors, 5 keys, 7 head-dim rows, 3 x 2 row-major) and key
    blocks shorter than S (the online softmax rescales): every edge, forward and backward."""
    base = default_attention()
    odd = {**base.to_dict(), "block_q": 3 * base.vl, "qv": 3, "fk": 5, "fd": 7, "mr": 3, "dc": 2,
           "block_k": 2 * base.vl, "prefetch": 1}
    try:
        p = AttentionParams(**odd).validate()
    except ParamError:      # 16 vector registers (AVX2): one query vector a tile, 3 in a block
        p = AttentionParams(**{**odd, "qv": 1})
    q, k, v = qkv_views(2, S, 3, D, seed=L + S, L=L)
    with A.forced_params(p):
        for scale in (None, -0.2):
            out, lse = A.forward_kernel(q, k, v, scale)
            ref, ref_lse = reference(q, k, v, scale)
            torch.testing.assert_close(out.double(), ref, **tol(D))
            torch.testing.assert_close(lse.double(), ref_lse, **tol(D))
            grad = torch.randn_like(out)
            got = A.backward_kernel(grad, q, k, v, out, lse, scale)
            qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
            reference(qd, kd, vd, scale)[0].backward(grad.double())
            for g, want in zip(got, (qd.grad, kd.grad, vd.grad)):
                torch.testing.assert_close(g.double(), want, **tol(D))


def test_every_thread_count_gives_the_same_bits():
    q, k, v = qkv_views(3, 100, 5, 72, seed=4)
    try:
        set_kernel_threads(1)
        one = A.forward_kernel(q, k, v, None)
        g = torch.randn_like(one[0])
        one_b = A.backward_kernel(g, q, k, v, *one, None)
        set_kernel_threads(2)
        two = A.forward_kernel(q, k, v, None)
        two_b = A.backward_kernel(g, q, k, v, *two, None)
    finally:
        set_kernel_threads(None)
    for a, b in zip((*one, *one_b), (*two, *two_b)):
        assert torch.equal(a, b)


def test_opcheck_custom_op():
    q, k, v = (t.contiguous().requires_grad_() for t in qkv_views(2, 9, 2, 8, seed=2))
    torch.library.opcheck(torch.ops.autohc.attention.default, (q, k, v, None))
    torch.library.opcheck(torch.ops.autohc.attention.default, (q, k, v, 0.25))


def test_bad_shapes_are_one_line_errors():
    q = torch.randn(2, 3, 5, 8)
    with pytest.raises(ValueError, match="attention: q must be"):
        autohc.ops.attention(q, torch.randn(2, 3, 5, 7), torch.randn(2, 3, 5, 7))
    with pytest.raises(ValueError, match="attention: q must be"):
        autohc.ops.attention(q[0], q[0], q[0])


def test_params_are_validated_and_every_knob_changes_the_c():
    with pytest.raises(ParamError, match="block_k"):
        AttentionParams(isa="avx512", vl=16, block_k=0).validate()
    with pytest.raises(ParamError, match="registers"):
        AttentionParams(isa="avx2", vl=8, mr=8, dc=4).validate()
    with pytest.raises(ParamError, match="isa"):
        AttentionParams(isa="sse9").validate()
    with pytest.raises(ParamError, match="block_q"):           # not a multiple of qv * vl
        AttentionParams(isa="avx2", vl=8, block_q=40, qv=2).validate()
    with pytest.raises(ParamError, match="registers"):
        AttentionParams(isa="avx2", vl=8, qv=2, fk=8).validate()
    base = AttentionParams(isa="avx2", vl=8, block_q=64, block_k=256, mr=4, dc=3)
    other = dict(block_q=32, block_k=128, mr=3, dc=2, qv=1, fk=4, fd=5, prefetch=0, threads=1)
    src = render_attention(base)
    for knob, value in other.items():
        p = AttentionParams(**{**base.to_dict(), knob: value}).validate()
        assert render_attention(p) != src, knob
    assert default_attention().validate()


def _sdpa_step(q, k, v, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, **kw)
    out.backward(torch.ones_like(out))
    return out.detach(), q.grad, k.grad, v.grad


def test_install_serves_sdpa_forward_and_backward():
    q, k, v = qkv_views(2, 40, 4, 24, seed=3)
    stock = _sdpa_step(q, k, v)
    before = dict(A.stats)
    with autohc.installed():
        got = _sdpa_step(q, k, v)
    assert A.stats["autohc"] - before["autohc"] == 2       # forward and backward
    for a, b in zip(got, stock):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("aten_ms, aten_forward", [(0.5, True), (2.0, False)])
def test_first_use_races_the_forward_against_atens(monkeypatch, aten_ms, aten_forward):
    """With first-use tuning on, the forward is raced against ATen's flash forward once per
    problem (timings faked here); where ATen's wins twice it runs the forward, autohc's kernel
    the backward on ATen's out and logsumexp, and the results stay stock's."""
    from autohc.tune import first_use
    raced = []

    def fake(fns, **kw):
        raced.append(sorted(fns))
        return {k: timing.Timing((aten_ms if k == "aten" else 1.0) * 1e-3, 0.01) for k in fns}
    monkeypatch.setattr(timing, "interleaved", fake)
    monkeypatch.setenv("AUTOHC_FIRST_USE", "1")
    monkeypatch.setattr(A, "_forward_aten", {})
    q, k, v = qkv_views(2, 40, 4, 24, seed=4)
    stock = _sdpa_step(q, k, v)
    before = dict(A.stats)
    with autohc.installed():
        got = _sdpa_step(q, k, v)
        got2 = _sdpa_step(q, k, v)                         # the same problem: not raced again
    assert not first_use.enabled()
    assert raced == [["aten", "autohc"]] * (2 if aten_forward else 1)
    assert A.stats["aten"] - before["aten"] == (2 if aten_forward else 0)          # the forwards
    assert A.stats["autohc"] - before["autohc"] == (2 if aten_forward else 4)      # + the backwards
    for a, b, c in zip(got, got2, stock):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(b, c, rtol=1e-4, atol=1e-5)


def test_no_forward_race_without_first_use_tuning(monkeypatch):
    monkeypatch.setattr(timing, "interleaved", lambda fns, **kw: pytest.fail("raced"))
    monkeypatch.setattr(A, "_forward_aten", {})
    q, k, v = qkv_views(2, 40, 4, 24, seed=5)
    before = A.stats["autohc"]
    with autohc.installed():                               # (AUTOHC_FIRST_USE=0 in the suite)
        _sdpa_step(q, k, v)
    assert A.stats["autohc"] - before == 2


@pytest.mark.parametrize("case", ["mask", "causal", "float64", "dropout", "empty", "head_dims"])
def test_install_leaves_what_it_does_not_serve_to_aten(case):
    """Masks, the causal mask, other dtypes, zero-size: ATen's own flash kernel, bit for bit.
    Dropout and a v head dim other than q's never reach the flash op (SDPA takes its math
    path, whose softmax autohc's element-wise kernel serves): the same within rounding."""
    q, k, v = qkv_views(2, 12, 2, 8, seed=6)
    kw = {}
    if case == "mask":
        kw["attn_mask"] = torch.randn(12, 12)
    elif case == "causal":
        kw["is_causal"] = True
    elif case == "float64":
        q, k, v = q.double(), k.double(), v.double()
    elif case == "dropout":
        kw["dropout_p"] = 0.3
    elif case == "empty":
        q, k, v = q[:, :, :0], k[:, :, :0], v[:, :, :0]
    elif case == "head_dims":       # v with another head dim than q, k
        v = torch.randn(2, 2, 12, 5)
    torch.manual_seed(0)
    stock = _sdpa_step(q, k, v, **kw)
    before = A.stats["autohc"]
    with autohc.installed():
        torch.manual_seed(0)
        got = _sdpa_step(q, k, v, **kw)
    assert A.stats["autohc"] == before
    for a, b in zip(got, stock):
        if case in ("dropout", "head_dims"):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(a, b)


class UserAttention(nn.Module):
    """Written as a user would: nn modules and F.scaled_dot_product_attention."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, D))


class UserBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = UserAttention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def _train_user_model(installed: bool, steps: int = 10):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 96), UserBlock(96, 6), UserBlock(96, 6), nn.Linear(96, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    ctx = autohc.installed() if installed else torch.enable_grad()
    with ctx:
        for _ in range(steps):
            x = torch.randn(4, 64, 16, generator=g)
            loss = F.mse_loss(model(x), torch.flip(x, [1]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def test_a_hand_written_dit_style_model_trains_the_same_under_install():
    before = A.stats["autohc"]
    got = _train_user_model(True)
    assert A.stats["autohc"] - before == 10 * 2 * 2        # 2 blocks, forward + backward
    want = _train_user_model(False)
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-3 * abs(b)
    assert want[-1] < want[0]


def test_sampling_paths_are_served_too():
    """Sampling runs under no_grad or inference_mode: the forward is served there as well."""
    q, k, v = qkv_views(2, 33, 4, 16, seed=8)
    want = F.scaled_dot_product_attention(q, k, v)
    before = A.stats["autohc"]
    with autohc.installed():
        with torch.inference_mode():
            a = F.scaled_dot_product_attention(q, k, v)
        with torch.no_grad():
            b = F.scaled_dot_product_attention(q, k, v)
    assert A.stats["autohc"] - before == 2
    torch.testing.assert_close(a, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(b, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", ["contiguous", "qkv_view", "heads_first", "one_head"])
def test_results_are_laid_out_as_atens(layout):
    """torch.compile's fake kernels of the flash op promise ATen's layouts: the output in the
    query's dim order, the log-sum-exp and the gradients (B, L, H, D) in memory."""
    if layout == "contiguous":
        q = k = v = torch.randn(2, 3, 5, 8)
    elif layout == "qkv_view":
        q, k, v = qkv_views(2, 5, 3, 8)
    elif layout == "heads_first":
        q = k = v = torch.randn(3, 2, 5, 8).transpose(0, 1)
    else:
        q = k = v = torch.randn(1, 5, 1, 8).transpose(1, 2)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    o, lse = flash(q, k, v)
    g = torch.randn(o.shape)
    want = (o, lse, *flash_backward(g, q, k, v, o, lse, 0.0, False))
    mo, mlse = A.forward_kernel(q, k, v, None)
    got = (mo, mlse, *A.backward_kernel(g, q, k, v, mo, mlse, None))
    for a, b in zip(got, want):
        assert a.stride() == b.stride()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
