"""A small latent-DiT world made here, for the README's latent example (no downloads):
a folder of 64x64 class images (circles, squares, triangles, crosses in random places, sizes
and colours) and a small diffusers AutoencoderKL trained on them (64x64x3 -> 16x16x4, KL
weight 1e-6 as Stable Diffusion's), saved with save_pretrained. Then:

    python bench/latent_shapes.py --out shapes/            # images + VAE, a few minutes
    autohc encode --data folder:shapes/images --vae shapes/vae --out shapes/latents
    autohc train --model DiT-S/2 --data latents:shapes/latents --steps 2000 --out shapes/run
    autohc sample --ckpt shapes/run --per-class 8 --out shapes/samples.png
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

SHAPES = ("circle", "square", "triangle", "cross")


def draw(kind: str, rng: np.random.Generator, size: int = 64):
    from PIL import Image, ImageDraw
    bg = tuple(int(v) for v in rng.integers(0, 90, 3))
    fg = tuple(int(v) for v in rng.integers(140, 256, 3))
    im = Image.new("RGB", (size, size), bg)
    d = ImageDraw.Draw(im)
    r = int(rng.integers(size // 6, size // 3))
    cx, cy = (int(v) for v in rng.integers(r + 2, size - r - 2, 2))
    if kind == "circle":
        d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fg)
    elif kind == "square":
        d.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fg)
    elif kind == "triangle":
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fg)
    else:
        w = max(2, r // 3)
        d.rectangle((cx - r, cy - w, cx + r, cy + w), fill=fg)
        d.rectangle((cx - w, cy - r, cx + w, cy + r), fill=fg)
    return im


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="shapes", help="folder for images/ and vae/ (default: shapes)")
    ap.add_argument("--per-class", type=int, default=250, help="images per class (default: 250)")
    ap.add_argument("--vae-steps", type=int, default=600, help="VAE training steps (default: 600)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from diffusers import AutoencoderKL
    out = Path(args.out)
    rng = np.random.default_rng(args.seed)
    arrays = []
    for kind in SHAPES:
        (out / "images" / kind).mkdir(parents=True, exist_ok=True)
        for i in range(args.per_class):
            im = draw(kind, rng)
            im.save(out / "images" / kind / f"{i:04d}.png")
            arrays.append(np.asarray(im))
    x = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 127.5 - 1
    torch.manual_seed(args.seed)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
                        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(32, 64, 64),
                        layers_per_block=1, latent_channels=4, norm_num_groups=16, sample_size=64)
    opt = torch.optim.AdamW(vae.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    for step in range(1, args.vae_steps + 1):
        batch = x[torch.randint(0, len(x), (16,))]
        post = vae.encode(batch).latent_dist
        rec = vae.decode(post.sample()).sample
        loss = torch.mean((rec - batch) ** 2) + 1e-6 * post.kl().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == args.vae_steps:
            print(f"vae step {step}/{args.vae_steps}: reconstruction MSE {loss.item():.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    # a latent scale that gives the latents unit variance, as Stable Diffusion's 0.18215 does
    with torch.no_grad():
        z = torch.cat([vae.encode(x[i:i + 64]).latent_dist.mean for i in range(0, len(x), 64)])
    vae.register_to_config(scaling_factor=float(1.0 / z.std()))
    vae.eval().save_pretrained(out / "vae")
    print(f"wrote {len(x)} images to {out / 'images'} and the VAE (scaling factor "
          f"{vae.config.scaling_factor:.4f}) to {out / 'vae'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
