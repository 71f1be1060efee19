"""A DiT written by hand, as a user would, trained with and without `autohc.install()`.

Not autohc's model: plain nn modules, adaLN-Zero blocks as in facebookresearch/DiT, attention
through F.scaled_dot_product_attention. Two copies start from the same weights and see the
same batches; their training steps (forward, backward, torch's AdamW and the reference's EMA
update, as facebookresearch/DiT's train.py runs them) are timed interleaved by the project's
timing protocol (autohc.bench.timing), the installed one inside `autohc.installed()`.
Prints the step times, the speedup and the largest relative loss difference.

    python bench/hand_written_dit.py [--depth 12 --dim 384 --heads 6 --batch 8] [--autocast] [--compile] [--no-ema] [--json]
"""
import argparse
import copy
import importlib.util
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import autohc
from autohc.bench import timing
from autohc.hw import cpu
from autohc.torch import optim, served


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).reshape(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * dim, dim))
        self.adaLN = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x, c):
        s1, g1, a1, s2, g2, a2 = self.adaLN(c).chunk(6, dim=1)
        x = x + a1.unsqueeze(1) * self.attn(modulate(self.norm1(x), s1, g1))
        return x + a2.unsqueeze(1) * self.mlp(modulate(self.norm2(x), s2, g2))


class HandDiT(nn.Module):
    """Latents (B, C, H, W) in patches, a timestep and a class label; predicts the noise."""

    def __init__(self, depth, dim, heads, channels=4, patch=2, size=32, classes=1000):
        super().__init__()
        self.patch, self.channels = patch, channels
        self.embed = nn.Linear(channels * patch * patch, dim)
        self.pos = nn.Parameter(torch.randn(1, (size // patch) ** 2, dim) * 0.02)
        self.t_mlp = nn.Sequential(nn.Linear(256, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.y_embed = nn.Embedding(classes, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.out = nn.Linear(dim, channels * patch * patch)

    def forward(self, x, t, y):
        B, C, H, W = x.shape
        p = self.patch
        x = x.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5).reshape(B, -1, C * p * p)
        x = self.embed(x) + self.pos
        freqs = torch.exp(-math.log(10000) * torch.arange(128, dtype=torch.float32) / 128)
        args = t[:, None].float() * freqs[None]
        c = self.t_mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=1)) + self.y_embed(y)
        for block in self.blocks:
            x = block(x, c)
        x = self.out(self.norm(x))
        return x.reshape(B, H // p, W // p, C, p, p).permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)


@torch.no_grad()
def update_ema(ema_model, model, decay=0.9999):
    """The reference's EMA step (facebookresearch/DiT train.py), as written there."""
    ema_params = dict(ema_model.named_parameters())
    for name, param in model.named_parameters():
        ema_params[name].mul_(decay).add_(param.data, alpha=1 - decay)


class Trainer:
    """One model copy, its AdamW, its EMA (unless ema=False) and its own batch stream (same
    seed for both copies)."""

    def __init__(self, model, batch, installed, autocast=False, compiled=False, ema=True):
        self.batch, self.installed, self.autocast = batch, installed, autocast
        self.raw, self.ema = model, copy.deepcopy(model).requires_grad_(False) if ema else None
        # compiled: torch.compile of the same module, traced on its first step (for the
        # installed copy inside autohc.installed(), so the graph holds autohc's ops)
        self.model = torch.compile(model) if compiled else model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.gen = torch.Generator().manual_seed(1)
        self.losses = []

    def step(self):
        g = self.gen
        x = torch.randn(self.batch, 4, 32, 32, generator=g)
        noise = torch.randn(x.shape, generator=g)
        t = torch.randint(0, 1000, (self.batch,), generator=g)
        y = torch.randint(0, 1000, (self.batch,), generator=g)
        with autohc.installed() if self.installed else torch.enable_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                pred = self.model(x + noise, t, y)
            loss = F.mse_loss(pred.float(), noise)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            if self.ema is not None:
                update_ema(self.ema, self.raw)
        self.losses.append(loss.item())


def _own_code():
    """This file loaded again as a module of its own: the same classes with code objects of
    their own. torch.compile keeps its graphs per code object, so a copy of the stock model
    would run the graph traced for the stock side (traced without install()) instead of being
    traced under install()."""
    spec = importlib.util.spec_from_file_location("hand_written_dit_twin", __file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=12, help="blocks (default 12, DiT-S)")
    ap.add_argument("--dim", type=int, default=384, help="hidden size (default 384, DiT-S)")
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--samples", type=int, default=6, help="timed steps per side (default 6)")
    ap.add_argument("--autocast", action="store_true",
                    help="both sides run the forward under torch.autocast('cpu', bfloat16)")
    ap.add_argument("--compile", action="store_true",
                    help="both sides run torch.compile of the model (default mode)")
    ap.add_argument("--no-ema", action="store_true",
                    help="leave the EMA update out of both sides' steps (default: the reference's update_ema)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.dim % args.heads:
        ap.error(f"--dim {args.dim} is not a multiple of --heads {args.heads}")
    torch.manual_seed(0)
    model = HandDiT(args.depth, args.dim, args.heads)
    twin = _own_code().HandDiT(args.depth, args.dim, args.heads)
    twin.load_state_dict(model.state_dict())
    sides = {"stock": Trainer(model, args.batch, False, args.autocast, args.compile, not args.no_ema),
             "autohc": Trainer(twin, args.batch, True, args.autocast, args.compile, not args.no_ema)}
    # one step per sample: both copies take the same number of steps, so see the same batches
    t = timing.interleaved({k: s.step for k, s in sides.items()}, samples=args.samples,
                           warmup=2, min_sample_s=0.0)
    a, b = sides["autohc"].losses, sides["stock"].losses
    out = {"cpu": cpu.detect().model, "autocast_bf16": args.autocast, "compiled": args.compile,
           "ema": not args.no_ema, "depth": args.depth, "dim": args.dim, "batch": args.batch,
           "stock_s": t["stock"].median, "autohc_s": t["autohc"].median,
           "stock_spread_pct": t["stock"].spread_pct, "autohc_spread_pct": t["autohc"].spread_pct,
           "speedup": t["stock"].median / t["autohc"].median, "steps": len(a),
           "max_loss_rel_diff": max(abs(x - y) / abs(y) for x, y in zip(a, b)),
           "ops_served_by_autohc": served.stats["autohc"],
           "optimizer_params_served_by_autohc": optim.stats["autohc"]}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"hand-written DiT ({args.depth} blocks, dim {args.dim}), batch {args.batch}"
              f"{', autocast bf16' if args.autocast else ''}{', torch.compile' if args.compile else ''}"
              f"{', AdamW + EMA' if out['ema'] else ', AdamW, no EMA'}, on {out['cpu']}:")
        print(f"  stock  {out['stock_s']:.3f} s/step (spread {out['stock_spread_pct']} %)")
        print(f"  autohc {out['autohc_s']:.3f} s/step (spread {out['autohc_spread_pct']} %)")
        print(f"  {out['ops_served_by_autohc']} calls served by autohc's kernels, "
              f"{out['optimizer_params_served_by_autohc']} parameter updates by its AdamW pass")
        print(f"  speedup {out['speedup']:.2f}x; max relative loss difference over {out['steps']} "
              f"steps {out['max_loss_rel_diff']:.2e}")


if __name__ == "__main__":
    main()
