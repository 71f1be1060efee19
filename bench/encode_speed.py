"""`autohc encode` against the VAE called directly, on the Stable Diffusion VAE's architecture
(sd-vae-ft-ema's config, random weights: the speed does not depend on the weights; no
download) and 256x256 images: does encoding cost more than the VAE's own convolutions?

    python bench/encode_speed.py --images 32 --batch 8
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SD_VAE = dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, norm_num_groups=32,
              block_out_channels=(128, 256, 512, 512), sample_size=256,
              down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    from diffusers import AutoencoderKL
    from PIL import Image
    root = Path(tempfile.mkdtemp(prefix="encode-speed-"))
    torch.manual_seed(0)
    vae = AutoencoderKL(**SD_VAE).eval()
    vae.save_pretrained(root / "vae")
    rng = np.random.default_rng(0)
    for i in range(args.images):
        (root / "imgs" / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(root / "imgs" / f"c{i % 2}" / f"{i}.png")
    x = torch.rand(args.batch, 3, 256, 256) * 2 - 1
    with torch.no_grad():
        vae.encode(x[:1])                                  # warm-up
        t0 = time.perf_counter()
        for _ in range(0, args.images, args.batch):
            vae.encode(x).latent_dist.sample()
        direct = args.images / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "autohc.cli", "encode", "--data", f"folder:{root / 'imgs'}",
                        "--vae", str(root / "vae"), "--out", str(root / "lat"), "--batch", str(args.batch),
                        "--json", "--no-progress"], capture_output=True, text=True, check=True)
    import json
    enc = json.loads(r.stdout)["images_per_s"]
    print(f"sd-vae-ft-ema architecture, 256x256 -> 32x32x4, batch {args.batch}, {torch.get_num_threads()} "
          f"threads: vae.encode directly {direct:.2f} images/s, autohc encode {enc:.2f} images/s "
          f"(ratio {enc / direct:.2f}; the command's start-up, {time.perf_counter() - t0:.0f} s in all, not counted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
