"""A gated residual and the next LayerNorm + modulate of its result as one op
(autohc.torch.ops.gated_residual_norm, kernels gres_ln_mod_fwd / _bwd) and DiT's blocks chained
through it (DiT._chained), every block's adaLN Linear in one op (autocast.modulations).

Stated accuracy: the forward is the two ops' own arithmetic in their order, so out and h equal
gated_residual then layernorm_modulate bit for bit (fp32 and bf16). The backward equals their
backward bit for bit where out has no gradient of its own; where it has, dx adds it to the
LayerNorm's gradient in the same pass, and the fp32 sums may round otherwise (FMA contraction):
within 1e-6 of the largest gradient. Against float64: the fp32 kernels' bounds (test_ops.py)."""
import copy

import pytest
import torch

import autohc
import autohc.torch.ops as ops
from autohc.torch import autocast
from autohc.dit.model import DiT
from autohc.torch.ops import FUSED

BF = torch.bfloat16
SHAPES = [(2, 5, 67), (1, 1, 1), (3, 17, 16), (2, 300, 384)]


@pytest.fixture(autouse=True)
def clean():
    autohc.uninstall()
    yield
    autohc.uninstall()


def _inputs(B, T, D, dtype, strided=False):
    torch.manual_seed(B * 1000 + T * 10 + D)
    x = (torch.randn(B, T, D) * 2 + 0.3).requires_grad_()
    if strided:             # y and the modulations as views with other strides (as chunks of adaLN)
        y = torch.randn(B, D, T).to(dtype).transpose(1, 2).requires_grad_()
        mods = (torch.randn(B, 3 * D) * 0.3).to(dtype).requires_grad_()
        gate, scale, shift = mods.chunk(3, dim=1)
        leaves = (x, y, mods)
    else:
        y = torch.randn(B, T, D).to(dtype).requires_grad_()
        gate, scale, shift = ((torch.randn(B, D) * 0.3).to(dtype).requires_grad_() for _ in range(3))
        leaves = (x, y, gate, scale, shift)
    return (x, y, gate, scale, shift), leaves


def _two_ops(x, y, gate, scale, shift):
    bf16 = y.dtype == BF
    with torch.autocast("cpu", dtype=BF, enabled=bf16):
        out = ops.gated_residual(x, y, gate)
        return out, ops.layernorm_modulate(out, scale, shift, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, BF])
@pytest.mark.parametrize("B,T,D", SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_equals_the_two_ops_forward_and_backward(dtype, B, T, D, strided):
    args, leaves = _inputs(B, T, D, dtype, strided)
    out, h = ops.gated_residual_norm(*args)
    out2, h2 = _two_ops(*args)
    assert out.dtype == torch.float32 and h.dtype == dtype
    assert torch.equal(out, out2) and torch.equal(h, h2)
    wh, wo = torch.randn(B, T, D), torch.randn(B, T, D)
    # h alone has a gradient (the last block's residual): the two ops' backward bit for bit
    g = torch.autograd.grad((h.float() * wh).sum(), leaves, retain_graph=True)
    g2 = torch.autograd.grad((h2.float() * wh).sum(), leaves, retain_graph=True)
    for a, b in zip(g, g2):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # both: out's own gradient joins the LayerNorm's in the kernel
    g = torch.autograd.grad((h.float() * wh).sum() + (out * wo).sum(), leaves)
    g2 = torch.autograd.grad((h2.float() * wh).sum() + (out2 * wo).sum(), leaves)
    for a, b in zip(g, g2):
        assert a.dtype == b.dtype
        tol = 1e-6 * (1 + b.double().abs().max()) if dtype == torch.float32 else 0
        assert (a.double() - b.double()).abs().max() <= tol


@pytest.mark.parametrize("B,T,D", [(2, 5, 67), (3, 40, 256)])
def test_against_float64(B, T, D):
    (x, y, gate, scale, shift), leaves = _inputs(B, T, D, torch.float32)
    out, h = ops.gated_residual_norm(x, y, gate, scale, shift)
    wh, wo = torch.randn(B, T, D), torch.randn(B, T, D)
    ((h * wh).sum() + (out * wo).sum()).backward()
    refs = [t.detach().double().requires_grad_() for t in leaves]
    xr, yr, gr, scr, shr = refs
    outr = xr + gr[:, None, :] * yr
    hr = torch.nn.functional.layer_norm(outr, (D,), eps=1e-6) * (1 + scr[:, None, :]) + shr[:, None, :]
    ((hr * wh.double()).sum() + (outr * wo.double()).sum()).backward()
    assert (out.double() - outr).abs().max() <= 1e-6 * (1 + outr.abs().max())
    assert (h.double() - hr).abs().max() <= 1e-5 * (1 + hr.abs().max())
    for a, b in zip(leaves, refs):
        assert (a.grad.double() - b.grad).abs().max() <= 1e-4 * (1 + b.grad.abs().max())


def test_threads_give_the_same_bits():
    args, leaves = _inputs(5, 64, 200, BF)
    results = []
    for threads in (1, 2):
        with autohc.installed(threads=threads):
            out, h = ops.gated_residual_norm(*args)
            grads = torch.autograd.grad((h.float().sin()).sum() + out.cos().sum(), leaves)
        results.append((out, h, *grads))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_other_dtypes_run_the_two_ops_and_bad_shapes_are_errors():
    x, y = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 3, 8, dtype=torch.float64)
    m = torch.randn(2, 8, dtype=torch.float64)
    out, h = ops.gated_residual_norm(x, y, m, m, m)
    assert out.dtype == h.dtype == torch.float64
    ref = x + m[:, None, :] * y
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(h, torch.nn.functional.layer_norm(ref, (8,), eps=1e-6) * (1 + m[:, None])
                               + m[:, None])
    with pytest.raises(ValueError, match="gated_residual_norm"):
        ops.gated_residual_norm(torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.randn(2, 7),
                                torch.randn(2, 8), torch.randn(2, 8))
    with pytest.raises(ValueError, match="gated_residual_norm"):
        ops.gated_residual_norm(torch.randn(6, 8), torch.randn(6, 8), *torch.randn(3, 2, 8))


def test_opcheck():
    for dt in (torch.float32, BF):
        x, y = torch.randn(2, 3, 8), torch.randn(2, 3, 8).to(dt)
        gate, scale, shift = (torch.randn(2, 8).to(dt) for _ in range(3))
        torch.library.opcheck(torch.ops.autohc.gated_residual_norm.default, (x, y, gate, scale, shift, 1e-6))
        out, h, mean, rstd = torch.ops.autohc.gated_residual_norm(x, y, gate, scale, shift, 1e-6)
        for gout in (torch.randn(2, 3, 8), None):
            torch.library.opcheck(torch.ops.autohc.gated_residual_norm_backward.default,
                                  (torch.randn(2, 3, 8).to(dt), gout, out, y, gate, scale, mean, rstd))


def test_modulations_opcheck():
    c = torch.randn(3, 16)
    ws, bs = [torch.randn(48, 16) * 0.1, torch.randn(32, 16) * 0.1], [torch.randn(48), torch.randn(32)]
    torch.library.opcheck(torch.ops.autohc.modulations_fp32w.default, (c, ws, bs))


# ---------------------------------------------------------------- DiT's blocks as one chain

def _models(depth=3):
    """(FUSED, FUSED without modulations, FUSED without either: block by block), same weights."""
    torch.manual_seed(0)
    chained = DiT(input_size=8, patch_size=2, hidden_size=64, depth=depth, num_heads=4, num_classes=10)
    with torch.no_grad():
        for p in chained.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)          # no adaLN-Zero zeros: every path carries a signal
    per_module, block_by_block = copy.deepcopy(chained), copy.deepcopy(chained)
    # (op by op: FUSED.block, a whole block as one node, has its own test, test_block.py)
    chained.use_fused_ops(FUSED._replace(block=None))
    per_module.use_fused_ops(FUSED._replace(modulations=None, block=None))
    block_by_block.use_fused_ops(FUSED._replace(gated_residual_norm=None, modulations=None, block=None))
    return chained, per_module, block_by_block


def _step(m, x, t, y):
    m.zero_grad(set_to_none=True)
    out = m(x, t, y, drop_draws=torch.ones(len(y)))
    (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("bf16", [False, True])
def test_dit_chained_equals_block_by_block(bf16, monkeypatch):
    """The chain (with the adaLN Linears as one op or module by module) against the blocks one
    by one: the same output; the same gradients, but that c's gradient (the timestep and label
    embedders') is summed over the blocks in the modulations op's order, within 1e-5."""
    chained, per_module, block_by_block = _models()
    x, t, y = torch.randn(4, 4, 8, 8), torch.tensor([1, 20, 300, 999]), torch.tensor([0, 3, 9, 5])
    calls, mods = [], []
    real, real_mods = ops._gres_ln, autocast._modulations
    monkeypatch.setattr(ops, "_gres_ln", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(autocast, "_modulations", lambda *a: mods.append(1) or real_mods(*a))
    with autohc.installed(first_use_tuning=False), torch.autocast("cpu", dtype=BF, enabled=bf16):
        got, g = _step(chained, x, t, y)
        assert len(calls) == 2 * 3 and len(mods) == int(bf16)   # two per block; one op under autocast
        mid, gmid = _step(per_module, x, t, y)
        ref, gref = _step(block_by_block, x, t, y)
    assert len(calls) == 12 and len(mods) == int(bf16)
    assert torch.equal(got, ref) and torch.equal(mid, ref)
    assert g.keys() == gref.keys() == gmid.keys()
    for n in g:
        tol = 1e-5 * (1 + gref[n].abs().max())
        assert (gmid[n] - gref[n]).abs().max() <= (tol if not bf16 else 0), n
        exact = bf16 and not n.startswith(("t_embedder", "y_embedder"))
        assert (g[n] - gref[n]).abs().max() <= (0 if exact else tol), n


def test_modulations_outside_autocast_and_with_a_hook_are_the_modules():
    chained, _, _ = _models(depth=2)
    adaln = [b.adaLN_modulation for b in chained.blocks]
    c = torch.randn(3, 64)
    with torch.no_grad():
        ref = [m(c) for m in adaln]
        assert all(torch.equal(a, b) for a, b in zip(autocast.modulations(c, adaln), ref))
        seen = []
        adaln[1][1].register_forward_hook(lambda m, i, o: seen.append(1))
        with autohc.installed(), torch.autocast("cpu", dtype=BF):
            out = autocast.modulations(c, adaln)
        assert seen == [1] and [o.dtype for o in out] == [BF, BF]


def test_dit_hooks_keep_the_blocks_calls():
    chained, _, _ = _models(depth=2)
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([1, 20]), torch.tensor([0, 3])
    assert chained._chain_ops() is chained.blocks[0].fused
    seen = []
    handle = chained.blocks[1].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    assert chained._chain_ops() is None
    with torch.no_grad():
        hooked = chained(x, t, y, drop_draws=torch.ones(2))
    assert seen == [torch.Size([2, 16, 64])]
    handle.remove()
    with torch.no_grad():
        assert torch.equal(chained(x, t, y, drop_draws=torch.ones(2)), hooked)
    handle = chained.final_layer.register_full_backward_hook(lambda m, gi, go: None)
    assert chained._chain_ops() is None
    handle.remove()
    assert chained._chain_ops() is chained.blocks[0].fused
