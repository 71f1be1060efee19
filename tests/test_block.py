"""A DiT block under autocast bf16 as one call (autohc/torch/block.py, FusedOps.block): in
training one autograd node, in sampling plain calls; the same implementations as the op-by-op
chain, in the same order, so the output and every gradient equal the chain's bit for bit, but
proj's and fc2's bias gradients, which the gated residual's backward sums as it writes their dY
(fp32 sums in another order, one rounding to bf16 as autocast's: within a bf16 rounding); and
the block runs op by op wherever one call would not be the same thing (fp32, not installed,
hooks, the profiler). Frozen weights get no gradient."""
import copy

import pytest
import torch

import autohc
import autohc.torch.block as block
from autohc.dit.model import DiT
from autohc.torch.ops import FUSED
from autohc.torch.served import bf16_served

BF = torch.bfloat16
# (a CPU without a bf16 GEMM back-end runs every block op by op: the equalities still hold)
ONE = bf16_served()


@pytest.fixture(autouse=True)
def clean():
    autohc.uninstall()
    yield
    autohc.uninstall()


def _pair(hidden=64, heads=4, input_size=8, depth=2):
    """(one node a block, op by op): the same weights, every path carrying a signal."""
    torch.manual_seed(hidden + input_size)
    whole = DiT(input_size=input_size, patch_size=2, hidden_size=hidden, depth=depth, num_heads=heads,
                num_classes=10)
    with torch.no_grad():
        for p in whole.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)          # no adaLN-Zero zeros
    ops = copy.deepcopy(whole)
    whole.use_fused_ops(FUSED)
    ops.use_fused_ops(FUSED._replace(block=None))
    return whole, ops


def _batch(n, size):
    g = torch.Generator().manual_seed(n)
    return (torch.randn((n, 4, size, size), generator=g), torch.randint(0, 1000, (n,), generator=g),
            torch.randint(0, 10, (n,), generator=g))


def _step(m, x, t, y):
    m.zero_grad(set_to_none=True)
    out = m(x, t, y, drop_draws=torch.ones(len(y)))
    (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}


@pytest.fixture
def taken(monkeypatch):
    """How many blocks ran as one node."""
    seen = []
    real = block.block_step

    def counting(*a, **kw):
        out = real(*a, **kw)
        seen.append(out is not None)
        return out
    monkeypatch.setattr(block, "block_step", counting)
    return seen


# ragged sizes: 25 tokens a image (input 10, patch 2), a hidden size not a multiple of 32
@pytest.mark.parametrize("hidden,heads,size,batch", [(64, 4, 8, 4), (96, 3, 10, 3), (80, 5, 8, 2)])
def test_one_node_equals_the_ops_bit_for_bit(taken, hidden, heads, size, batch):
    whole, ops = _pair(hidden, heads, size)
    x, t, y = _batch(batch, size)
    with autohc.installed(first_use_tuning=False), torch.autocast("cpu", dtype=BF):
        got, g = _step(whole, x, t, y)
        assert taken == [ONE, ONE]
        ref, gref = _step(ops, x, t, y)
    assert taken == [ONE, ONE]            # (the op-by-op model never asks)
    assert torch.equal(got, ref)
    assert g.keys() == gref.keys() and len(g) == sum(p.requires_grad for p in whole.parameters())
    for n in g:
        if n.endswith(("attn.proj.bias", "mlp.fc2.bias")):     # (summed as the gated residual's
            _within_a_bf16_rounding(g[n], gref[n], n)           # backward writes dY, fp32 order)
        else:
            assert torch.equal(g[n], gref[n]), n


def _within_a_bf16_rounding(got, ref, what):
    assert (got - ref).abs().max() <= 2 ** -8 * ref.abs().max() + 1e-6, what


def test_frozen_weights_get_no_gradient_and_the_rest_are_the_ops(taken):
    whole, ops = _pair()
    for m in (whole, ops):
        m.blocks[0].attn.qkv.weight.requires_grad_(False)
        m.blocks[1].mlp.fc2.bias.requires_grad_(False)
    x, t, y = _batch(2, 8)
    with autohc.installed(first_use_tuning=False), torch.autocast("cpu", dtype=BF):
        got, g = _step(whole, x, t, y)
        ref, gref = _step(ops, x, t, y)
    assert taken == [ONE, ONE]
    assert "blocks.0.attn.qkv.weight" not in g and "blocks.1.mlp.fc2.bias" not in g
    assert g.keys() == gref.keys() and torch.equal(got, ref)
    for n in g:
        if n.endswith(("attn.proj.bias", "mlp.fc2.bias")):
            _within_a_bf16_rounding(g[n], gref[n], n)
        else:
            assert torch.equal(g[n], gref[n]), n


def test_the_block_runs_op_by_op_where_one_node_is_not_the_same_thing(taken):
    whole, _ = _pair()
    x, t, y = _batch(2, 8)
    with torch.autocast("cpu", dtype=BF):               # not installed
        _step(whole, x, t, y)
    with autohc.installed(first_use_tuning=False):
        _step(whole, x, t, y)                           # fp32
        with torch.autocast("cpu", dtype=BF):
            with torch.autograd.profiler.profile():     # the profiler names each op
                _step(whole, x, t, y)
            handle = whole.blocks[1].mlp.fc1.register_forward_hook(lambda *a: None)
            _step(whole, x, t, y)
            handle.remove()
            _step(whole, x, t, y)
            own = type(whole.blocks[0].attn)
            whole.blocks[0].attn.__class__ = type("Subclassed", (own,), {})    # (not asked at all)
            _step(whole, x, t, y)
            whole.blocks[0].attn.__class__ = own
    assert taken == [False] * 6 + [ONE, False] + [ONE, ONE] + [ONE]


def test_a_hooked_block_part_keeps_its_hook_called():
    whole, _ = _pair()
    seen = []
    whole.blocks[0].attn.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    x, t, y = _batch(2, 8)
    with autohc.installed(first_use_tuning=False), torch.autocast("cpu", dtype=BF):
        _step(whole, x, t, y)
    assert seen == [torch.Size([2, 16, 64])]


@pytest.mark.parametrize("frozen_weights", [False, True])
def test_sampling_one_call_equals_the_ops_bit_for_bit(taken, frozen_weights):
    """No gradient to record (sampling, with weights rounded once or not): plain calls, the
    op-by-op chain's output."""
    from autohc.torch.frozen import frozen
    whole, ops = _pair(96, 3, 10)
    whole.eval(), ops.eval()            # (no label dropout)
    x, t, y = _batch(3, 10)
    with autohc.installed(first_use_tuning=False), torch.autocast("cpu", dtype=BF), torch.no_grad():
        if frozen_weights:
            with frozen(whole), frozen(ops):
                got, ref = whole(x, t, y), ops(x, t, y)
        else:
            got, ref = whole(x, t, y), ops(x, t, y)
    assert taken == [ONE, ONE] and torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, BF])
@pytest.mark.parametrize("B,T,D", [(2, 5, 67), (3, 17, 16), (1, 1, 1), (4, 64, 96)])
def test_the_bias_gradient_summed_in_the_gated_residual_backward(dtype, B, T, D):
    """gres_ln_backward_bias_impl: the five gradients of gres_ln_backward_impl bit for bit, and dy
    summed over every row (in y's dtype, as autocast's dY.sum(0) gives it, then float32)."""
    from autohc.torch import ops
    torch.manual_seed(B * T * D)
    x, y = torch.randn(B, T, D), torch.randn(B, T, D).to(dtype)
    gate, scale, shift = (torch.randn(B, D).to(dtype) for _ in range(3))
    out, h, mean, rstd = ops.gres_ln_impl(x, y, gate, scale, shift, 1e-6)
    dh, gout = torch.randn(B, T, D).to(dtype), torch.randn(B, T, D)
    five = ops.gres_ln_backward_impl(dh, gout, out, y, gate, scale, mean, rstd)
    *same, db = ops.gres_ln_backward_bias_impl(dh, gout, out, y, gate, scale, mean, rstd)
    assert all(torch.equal(a, b) for a, b in zip(five, same))
    ref = five[1].reshape(-1, D).sum(0).float()
    assert db.dtype == torch.float32 and db.shape == (D,)
    if dtype == BF:
        _within_a_bf16_rounding(db, ref, "db")
    else:
        assert (db - ref).abs().max() <= 1e-5 * (1 + five[1].abs().sum(1).max()), "db"


def test_the_node_saves_through_automems_hooks(tmp_path, taken):
    """The block node saves what its backward reads with save_for_backward, so AutoMem's saved-
    tensor hooks see it (offloaded, brought back): the same loss and gradients as without."""
    from autohc.runtime.automem import AutoMem
    from autohc.runtime.tiers import FileTier
    whole, _ = _pair(96, 3, 10)
    x, t, y = _batch(4, 10)
    with autohc.installed(first_use_tuning=False), torch.autocast("cpu", dtype=BF):
        ref, gref = _step(whole, x, t, y)
        am = AutoMem(FileTier(tmp_path), whole, min_bytes=1 << 12)
        with am:
            got, g = _step(whole, x, t, y)
        am.close()
    assert taken == [ONE, ONE] * 2
    assert am.stats["offloaded"] > 0 and torch.equal(got, ref)
    assert g.keys() == gref.keys() and all(torch.equal(g[n], gref[n]) for n in g)
