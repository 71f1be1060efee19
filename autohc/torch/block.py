"""A DiT block under torch.autocast bf16 and install() as one call (FusedOps.block): in training
one autograd node, forward and backward; in sampling one plain call.

Op by op, DiT._chained runs a block as six ops: the qkv Linear, attention, the proj Linear, gated
residual + LayerNorm + modulate, the MLP, gated residual + LayerNorm + modulate, each with its
module call, autocast's checks and, in training, a custom op's dispatch and an autograd node, all
in Python, after each kernel has swept the core's L2 (docs/history.md, stops 87-88). Here the
same implementations run one after the other: in training under one torch.autograd.Function
whose backward runs the ops' backwards in reverse, in sampling (nothing to record) as plain
calls. The same kernels in the same order on the same operands, so the same values bit for bit.

Where anything differs from that case (fp32, not installed, a hook or a subclassed module,
attention split across ranks, tracing, a dispatch mode, the profiler, a weight the kernels do
not serve), `block_step` answers None and the block runs op by op, as before."""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from . import served
from .attention import attention_qkv_backward_impl, attention_qkv_impl
from .autocast import (gelu_linear_backward_impl, linear_backward_impl, linear_gelu_impl,
                       linear_gelu_train_impl, linear_impl, linear_served, records_grad,
                       second_linear_served, unhooked)
from .direct import unwatched

_BF16 = torch.bfloat16


def _forward(x, h, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_n, scale_n,
             wq, bq, wp, bp, w1, b1, w2, b2, heads, eps, gres_ln_impl, train):
    """(x', h', what the backward reads or None): the block's ops' implementations in the order
    DiT._chained calls them; in training fc1 also writes its pre-activation for GELU's backward."""
    B, T, D = x.shape
    h2 = h.reshape(B * T, D)
    qkv = linear_impl(h2, wq, bq)
    att, lse = attention_qkv_impl(qkv.view(B, T, 3 * D), heads, None)
    att2 = att.reshape(B * T, D)
    a = linear_impl(att2, wp, bp)
    x1, hm, mean1, rstd1 = gres_ln_impl(x, a.view(B, T, D), gate_msa, scale_mlp, shift_mlp, eps)
    hm2 = hm.view(B * T, D)
    if train:
        g, pre = linear_gelu_train_impl(hm2, w1, b1)
    else:
        g, pre = linear_gelu_impl(hm2, w1, b1), None
    m = linear_impl(g, w2, b2)
    x2, hn, mean2, rstd2 = gres_ln_impl(x1, m.view(B, T, D), gate_mlp, scale_n, shift_n, eps)
    saved = ((h2, qkv, att2, lse, a, x1, mean1, rstd1, hm2, g, pre, m, x2, mean2, rstd2,
              gate_msa, scale_mlp, gate_mlp, scale_n, wq, wp, w1, w2) if train else None)
    return x2, hn, saved


class _Block(torch.autograd.Function):
    """(x, h, the block's gate_msa, shift_mlp, scale_mlp, gate_mlp, the next LayerNorm's shift
    and scale, the four Linears' weights and biases) -> (x', h'): x' the block's residual
    stream (fp32), h' = the next LayerNorm + modulate of it (bf16). `norm`: the gated residual +
    LayerNorm + modulate's implementation and its backward's, the one that also sums y's bias
    gradient (torch/ops.py's, passed in: ops.py is the module that offers this one)."""

    @staticmethod
    def forward(ctx, x, h, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_n, scale_n,
                wq, bq, wp, bp, w1, b1, w2, b2, heads, eps, norm):
        x2, hn, saved = _forward(x, h, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_n, scale_n,
                                 wq, bq, wp, bp, w1, b1, w2, b2, heads, eps, norm[0], True)
        ctx.save_for_backward(*saved)
        ctx.heads, ctx.norm_backward = heads, norm[1]
        return x2, hn

    @staticmethod
    @once_differentiable
    def backward(ctx, dx2, dhn):
        (h2, qkv, att2, lse, a, x1, mean1, rstd1, hm2, g, pre, m, x2, mean2, rstd2,
         gate_msa, scale_mlp, gate_mlp, scale_n, wq, wp, w1, w2) = ctx.saved_tensors
        need, gres_ln_backward = ctx.needs_input_grad, ctx.norm_backward
        B, T, D = x2.shape
        # (the ops' own backwards in reverse: second gated residual + norm, MLP, first, proj,
        # attention, qkv; each gated residual's backward also sums the dY it writes, proj's and
        # fc2's, for their biases)
        dx1, dm, dgate_mlp, dscale_n, dshift_n, db2 = gres_ln_backward(
            dhn.to(_BF16), dx2, x2, m.view(B, T, D), gate_mlp, scale_n, mean2, rstd2)
        d, dw2, _ = gelu_linear_backward_impl(dm.view(B * T, D), g, pre, w2, need[14], False)
        dhm, dw1, db1 = linear_backward_impl(d, hm2, w1, True, need[12], need[13])
        dx, da, dgate_msa, dscale_mlp, dshift_mlp, dbp = gres_ln_backward(
            dhm.view(B, T, D), dx1, x1, a.view(B, T, D), gate_msa, scale_mlp, mean1, rstd1)
        datt, dwp, _ = linear_backward_impl(da.view(B * T, D), att2, wp, True, need[10], False)
        dqkv = attention_qkv_backward_impl(datt.view(B, T, D), qkv.view(B, T, 3 * D), att2.view(B, T, D),
                                           lse, ctx.heads, None)
        dh, dwq, dbq = linear_backward_impl(dqkv.view(B * T, 3 * D), h2, wq, need[1], need[8], need[9])
        wanted = lambda t, i: t if need[i] else None
        return (wanted(dx, 0), dh.view(B, T, D) if need[1] else None,
                wanted(dgate_msa, 2), wanted(dshift_mlp, 3), wanted(dscale_mlp, 4), wanted(dgate_mlp, 5),
                wanted(dshift_n, 6), wanted(dscale_n, 7), wanted(dwq, 8), wanted(dbq, 9), wanted(dwp, 10),
                wanted(dbp, 11), wanted(dw1, 12), wanted(db1, 13), wanted(dw2, 14), wanted(db2, 15), None, None, None)


def _plain_block(block) -> bool:
    """Nothing hooked on block's attention, MLP or Linears, nothing split across ranks (that
    they are dit.model's Attention and Mlp is the caller's to know: DiT._chained asks only then)."""
    attn, mlp = block.attn, block.mlp
    return (attn.token_split is None
            and not any(mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks
                        or mod._backward_pre_hooks for mod in (attn, mlp))
            and all(unhooked(lin) for lin in (attn.qkv, attn.proj, mlp.fc1, mlp.fc2)))


def _served_here(x, h, mods, lins) -> bool:
    """The case the block's op-by-op path would run on autohc's bf16 kernels throughout."""
    if not (torch.is_autocast_enabled("cpu") and served.is_installed()):
        return False
    if x.dim() != 3 or x.dtype != torch.float32 or h.shape != x.shape or h.dtype != _BF16:
        return False
    B, T, D = x.shape
    if any(t.dtype != _BF16 or tuple(t.shape) != (B, D) for t in mods):
        return False
    if any(type(t) is not torch.Tensor for t in (x, h, *mods)):
        return False
    qkv, proj, fc1, fc2 = lins
    if any(lin.bias is None for lin in lins) or qkv.weight.shape[0] != 3 * D:
        return False
    if not all(linear_served(h, lin.weight, lin.bias) for lin in (qkv, proj, fc1)):
        return False
    return fc2.weight.shape[0] == D and second_linear_served(B * T, fc1.weight, fc2.weight, fc2.bias)


def block_step(block, x, h, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_n, scale_n, eps, *, norm):
    """(x', h') of one DiT block under autocast bf16 as one call (in training one autograd
    node), or None where the block should run op by op (see the module's doc). norm: (gated
    residual + LayerNorm + modulate, its backward with y's bias gradient), the implementations
    (ops.gres_ln_impl, ops.gres_ln_backward_bias_impl)."""
    mods = (gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_n, scale_n)
    lins = (block.attn.qkv, block.attn.proj, block.mlp.fc1, block.mlp.fc2)
    params = [t for lin in lins for t in (lin.weight, lin.bias)]
    if not (unwatched() and _plain_block(block) and _served_here(x, h, mods, lins)):
        return None
    heads, eps = int(block.attn.heads), float(eps)
    if not records_grad(x, h, *mods, *params):
        # sampling: nothing to record, the same implementations without the autograd node
        return _forward(x, h, *mods, *params, heads, eps, norm[0], False)[:2]
    return _Block.apply(x, h, *mods, *params, heads, eps, tuple(norm))
