"""DiT (facebookresearch/DiT, Peebles & Xie 2023) with the reference's layers, names and init.

Same modules and parameter names as the reference (`x_embedder.proj`, `t_embedder.mlp`,
`y_embedder.embedding_table`, `blocks.N.{attn.qkv, attn.proj, mlp.fc1, mlp.fc2,
adaLN_modulation.1}`, `final_layer`), so the parameter counts are the reference's exactly:
DiT-S/2 32,963,360 and DiT-XL/2 675,129,632 at 256px (32x32x4 latents, learn_sigma=True).

The fused operators are passed in, not read from global state: `DiT.use_fused_ops(ops)` (or
build_model(..., fused_ops=ops)) with an object that has `layernorm_modulate(x, scale, shift,
eps)` and `gated_residual(x, y, gate)` (autohc.ops.FUSED has both) makes each block's LayerNorm +
adaLN modulate and gated residual one fused kernel each, and, where it also has
`qkv_attention(qkv, heads)` (FUSED has), the attention reads q, k, v from the qkv output and
its backward writes d qkv in one pass, and where it has `linear_gelu(x, fc1)` (FUSED has), the
MLP's fc1 and GELU are one call (one kernel when sampling in bf16), and where it has
`mlp(x, fc1, fc2)` (FUSED has), the whole MLP is (in bf16 training its backward also takes
GELU's derivative in fc2's input-gradient kernel), and where it has `gated_residual_norm(x, y,
gate, scale, shift, eps)` (FUSED has), each gated residual and the LayerNorm + modulate after it
are one op, the blocks run as one chain (DiT._chained), and where it also has `modulations(c,
adaLN_modulation modules)` (FUSED has), every block's adaLN Linear is one op, where it has
`block(...)` (FUSED has), a whole block is one call where that is the same thing, and where it
has `patch_embed(x, conv)` (FUSED has), the patch embedding may run as a GEMM; without them,
plain torch, the same results to float32 rounding.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F

from .sizes import MODELS, SIZES, DiTConfig, config  # noqa: F401  (the names model users import)


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def norm_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, fused=None) -> torch.Tensor:
    """modulate(LayerNorm(x) without affine, eps 1e-6): one kernel with fused ops given."""
    if fused is not None:
        return fused.layernorm_modulate(x, scale, shift, 1e-6)
    return modulate(F.layer_norm(x, x.shape[-1:], eps=1e-6), shift, scale)


def gated_add(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, fused=None) -> torch.Tensor:
    if fused is not None:
        return fused.gated_residual(x, y, gate)
    return x + gate.unsqueeze(1) * y


class PatchEmbed(nn.Module):
    """timm's PatchEmbed as DiT uses it: a stride-p conv, flattened to (B, T, D)."""

    def __init__(self, img_size: int, patch: int, in_chans: int, dim: int):
        super().__init__()
        if img_size % patch:
            raise ValueError(f"image size {img_size} is not a multiple of the patch size {patch}")
        self.grid = img_size // patch
        self.num_patches = self.grid ** 2
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch, stride=patch, bias=True)
        self.fused = None           # the fused operators, set by DiT.use_fused_ops

    def forward(self, x):
        embed = getattr(self.fused, "patch_embed", None)
        if embed is not None:
            return embed(x, self.proj)
        return self.proj(x).flatten(2).transpose(1, 2)


class TimestepEmbedder(nn.Module):
    def __init__(self, dim: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim, bias=True), nn.SiLU(), nn.Linear(dim, dim, bias=True))

    @staticmethod
    def timestep_embedding(t, dim, max_period=10000):
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
        args = t[:, None].float() * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
        return emb

    def forward(self, t):
        return self.mlp(self.timestep_embedding(t, self.freq_dim))


class LabelEmbedder(nn.Module):
    """Class embedding with one extra 'null' class; labels are dropped (-> null) with
    probability dropout_prob in training, for classifier-free guidance."""

    def __init__(self, num_classes: int, dim: int, dropout_prob: float):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), dim)
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob

    def forward(self, labels, train: bool, drop_draws=None):
        """drop_draws: uniform draws in [0, 1), one per label, in place of torch.rand (a
        data-parallel rank passes its slice of the global batch's draws)."""
        if train and self.dropout_prob > 0:
            u = torch.rand(labels.shape[0]) if drop_draws is None else drop_draws
            labels = torch.where(u < self.dropout_prob, self.num_classes, labels)
        return self.embedding_table(labels)


class Attention(nn.Module):
    """timm's Attention (qkv bias, no qk-norm), through F.scaled_dot_product_attention as the
    reference DiT and timm write it: torch's CPU flash kernel when stock, autohc's fused
    attention kernel under autohc.install()."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"hidden size {dim} is not a multiple of the head count {heads}")
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)
        self.fused = None           # the fused operators, set by DiT.use_fused_ops
        self.token_split = None     # patch parallel sampling (dit/sample_parallel.py): K/V gathered

    def forward(self, x):
        B, T, _ = x.shape
        qkv = self.qkv(x)
        if self.token_split is not None:
            return self.proj(self.token_split.attention(qkv, self.heads))
        fused_attention = getattr(self.fused, "qkv_attention", None)
        if fused_attention is not None:
            return self.proj(fused_attention(qkv, self.heads))
        # the head dim from qkv's width: under tensor parallelism (bench/parallel.py) qkv holds
        # this rank's heads only and `heads` counts them
        hd = qkv.shape[-1] // (3 * self.heads)
        q, k, v = qkv.reshape(B, T, 3, self.heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, T, self.heads * hd))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=True)
        self.fc2 = nn.Linear(hidden, dim, bias=True)
        self.fused = None           # the fused operators, set by DiT.use_fused_ops

    def forward(self, x):
        mlp = getattr(self.fused, "mlp", None)
        if mlp is not None:
            return mlp(x, self.fc1, self.fc2)
        fc1_gelu = getattr(self.fused, "linear_gelu", None)
        if fc1_gelu is not None:
            return self.fc2(fc1_gelu(x, self.fc1))
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DiTBlock(nn.Module):
    """adaLN-Zero block. norm1/norm2 (LayerNorm, no affine, eps 1e-6) hold no parameters; they
    are fused with the modulate (norm_modulate)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.attn = Attention(dim, heads)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim, bias=True))
        self.fused = None           # the fused operators, set by DiT.use_fused_ops

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        f = self.fused
        x = gated_add(x, self.attn(norm_modulate(x, shift_msa, scale_msa, f)), gate_msa, f)
        x = gated_add(x, self.mlp(norm_modulate(x, shift_mlp, scale_mlp, f)), gate_mlp, f)
        return x


class FinalLayer(nn.Module):
    def __init__(self, dim: int, patch: int, out_channels: int):
        super().__init__()
        self.linear = nn.Linear(dim, patch * patch * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim, bias=True))
        self.fused = None

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(norm_modulate(x, shift, scale, self.fused))


class DiT(nn.Module):
    def __init__(self, input_size: int = 32, patch_size: int = 2, in_channels: int = 4,
                 hidden_size: int = 1152, depth: int = 28, num_heads: int = 16,
                 mlp_ratio: float = 4.0, class_dropout_prob: float = 0.1,
                 num_classes: int = 1000, learn_sigma: bool = True):
        super().__init__()
        for name, v in (("input_size", input_size), ("patch_size", patch_size),
                        ("in_channels", in_channels), ("hidden_size", hidden_size),
                        ("depth", depth), ("num_heads", num_heads), ("num_classes", num_classes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"DiT: {name} must be a positive int, got {v!r}")
        self.learn_sigma = learn_sigma
        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.patch_size = patch_size
        self.input_size = input_size
        self.num_classes = num_classes
        self.x_embedder = PatchEmbed(input_size, patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        # frozen 2-D sin-cos position embedding (a parameter without grad, as the reference)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.x_embedder.num_patches, hidden_size), requires_grad=False)
        self.blocks = nn.ModuleList([DiTBlock(hidden_size, num_heads, mlp_ratio) for _ in range(depth)])
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)
        self.token_split = None     # patch parallel sampling (dit/sample_parallel.py): this rank's tokens
        self.initialize_weights()

    def use_fused_ops(self, ops) -> "DiT":
        """Run the blocks' LayerNorm + modulate and gated residual on `ops` (e.g. autohc.ops),
        or on plain torch with None."""
        for m in self.modules():
            if isinstance(m, (DiTBlock, FinalLayer, Attention, Mlp, PatchEmbed)):
                m.fused = ops
        return self

    @classmethod
    def from_name(cls, name: str, **kw) -> "DiT":
        c = config(name)
        return cls(patch_size=c.patch, hidden_size=c.hidden, depth=c.depth, num_heads=c.heads, **kw)

    def initialize_weights(self):
        def _basic(m):
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        self.apply(_basic)
        pos = sincos_2d(self.pos_embed.shape[-1], self.x_embedder.grid)
        self.pos_embed.data.copy_(torch.from_numpy(pos).float().unsqueeze(0))
        w = self.x_embedder.proj.weight.data
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.proj.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        for block in self.blocks:            # adaLN-Zero: every block starts as the identity
            nn.init.zeros_(block.adaLN_modulation[-1].weight)
            nn.init.zeros_(block.adaLN_modulation[-1].bias)
        for m in (self.final_layer.adaLN_modulation[-1], self.final_layer.linear):
            nn.init.zeros_(m.weight)
            nn.init.zeros_(m.bias)

    def unpatchify(self, x):
        c, p, h = self.out_channels, self.patch_size, self.x_embedder.grid
        x = x.reshape(x.shape[0], h, h, p, p, c)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(x.shape[0], c, h * p, h * p)

    def forward(self, x, t, y, drop_draws=None):
        """x: (N, C, H, W) images or latents, t: (N,) timesteps, y: (N,) labels -> (N, out_C, H, W).
        drop_draws: (N,) uniform draws for the label dropout (default: torch.rand)."""
        if x.dim() != 4 or tuple(x.shape[1:]) != (self.in_channels, self.input_size, self.input_size):
            raise ValueError(f"DiT: x must be (N, {self.in_channels}, {self.input_size}, {self.input_size}), "
                             f"got {tuple(x.shape)}")
        # (pos_embed first: the sum takes its contiguous layout, not the patch embedding's
        # transposed one, which every block's first fused op would otherwise copy)
        x = self.pos_embed + self.x_embedder(x)
        split = self.token_split
        if split is not None:
            x = split.local(x)
        c = self.t_embedder(t) + self.y_embedder(y, self.training, drop_draws)
        chain = self._chain_ops()
        if chain is not None:
            x = self._chained(x, c, chain)
        else:
            for block in self.blocks:
                x = block(x, c)
            x = self.final_layer(x, c)
        return self.unpatchify(x if split is None else split.gather(x))

    def _chain_ops(self):
        """The fused ops, where they have gated_residual_norm and the blocks and the final layer
        are this file's, with no hooks that calling them one by one would run; else None."""
        f = self.blocks[0].fused if len(self.blocks) else None
        if getattr(f, "gated_residual_norm", None) is None:
            return None
        from torch.nn.modules import module as nn_module
        if (nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks
                or nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks):
            return None
        heads = [*self.blocks, self.final_layer]
        if any(type(m) not in (DiTBlock, FinalLayer) or m.fused is not f or m._forward_hooks
               or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks for m in heads):
            return None
        return f

    def _chained(self, x, c, f):
        """The blocks and the final layer with each gated residual and the LayerNorm + modulate
        after it (the next sub-block's, the next block's or the final layer's) as one op,
        f.gated_residual_norm: the values of DiTBlock.forward and FinalLayer.forward, block by
        block, with the residual stream read once per pair instead of twice. Every block's
        modulation is taken first (a block's last LayerNorm needs the next block's), by
        f.modulations where f has it (one op for all the adaLN Linears)."""
        adaln = [b.adaLN_modulation for b in self.blocks] + [self.final_layer.adaLN_modulation]
        every = getattr(f, "modulations", None)
        outs = every(c, adaln) if every is not None else [m(c) for m in adaln]
        mods = [o.chunk(6, dim=1) for o in outs[:-1]]
        fin_shift, fin_scale = outs[-1].chunk(2, dim=1)
        h = norm_modulate(x, mods[0][0], mods[0][1], f)
        whole = getattr(f, "block", None)
        for i, block in enumerate(self.blocks):
            _, _, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods[i]
            shift, scale = (mods[i + 1][0], mods[i + 1][1]) if i + 1 < len(mods) else (fin_shift, fin_scale)
            own = type(block.attn) is Attention and type(block.mlp) is Mlp    # (what `whole` runs)
            out = None if whole is None or not own else whole(block, x, h, gate_msa, shift_mlp, scale_mlp,
                                                                gate_mlp, shift, scale, 1e-6)
            if out is not None:
                x, h = out
                continue
            x, h = f.gated_residual_norm(x, block.attn(h), gate_msa, scale_mlp, shift_mlp, 1e-6)
            x, h = f.gated_residual_norm(x, block.mlp(h), gate_mlp, scale, shift, 1e-6)
        return self.final_layer.linear(h)

    def forward_with_cfg(self, x, t, y, cfg_scale: float):
        """Classifier-free guidance: eps = eps(null) + s (eps(y) - eps(null)) on the first C channels,
        formed in fp32 (under autocast the eps come out bf16; CFG parallel guides in fp32 too)."""
        null = torch.full_like(y, self.num_classes)
        out = self.forward(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, null]))
        eps, rest = out[:, :self.in_channels], out[:, self.in_channels:]
        cond, uncond = eps.float().chunk(2)
        guided = uncond + cfg_scale * (cond - uncond)
        return torch.cat([guided, rest.chunk(2)[0]], dim=1)

    def flops_per_image(self) -> float:
        """Forward FLOPs (2 per multiply-add) of one image's GEMMs; a training step is about 3x."""
        D, T = self.pos_embed.shape[-1], self.x_embedder.num_patches
        L, pp = len(self.blocks), self.patch_size ** 2
        blocks = L * (12 * D * D * T + 2 * T * T * D + 6 * D * D)   # linears, QK^T and AV, adaLN
        ends = T * pp * D * (self.in_channels + self.out_channels) + 2 * D * D + 256 * D + D * D
        return 2.0 * (blocks + ends)


def expect_forwards(model: nn.Module, forwards: int):
    """first-use tuning told the job ahead (tune/first_use.py expect_calls): `forwards` forwards
    (or training steps) of `model`, which call each of its blocks' GEMM problems once a block."""
    from ..tune import first_use
    return first_use.expect_calls(forwards * max(1, len(getattr(model, "blocks", ()))))


def sincos_2d(dim: int, grid: int) -> np.ndarray:
    """The reference's get_2d_sincos_pos_embed (MAE): (grid*grid, dim)."""
    ar = np.arange(grid, dtype=np.float32)
    g = np.stack(np.meshgrid(ar, ar), axis=0).reshape(2, 1, grid, grid)   # (w, h) order, as MAE
    return np.concatenate([_sincos_1d(dim // 2, g[0]), _sincos_1d(dim // 2, g[1])], axis=1)


def _sincos_1d(dim: int, pos: np.ndarray) -> np.ndarray:
    omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
    out = np.einsum("m,d->md", pos.reshape(-1), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)
