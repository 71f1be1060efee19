"""Class-conditional sampling from a checkpoint (EMA weights by default) and the PNGs the
trainer writes: a sample grid (one row per class) and the loss curve."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from .data import InputError
from .diffusion import GaussianDiffusion
from .precision import autocast
from .train import build_model


def load_weights(ckpt: str | Path, *, ema: bool = True, fused_ops=None):
    """(model in eval mode, the convert.Weights it was built from: arch, step, source)."""
    from .convert import read
    w = read(ckpt)                  # autohc, facebookresearch/DiT or diffusers
    model = build_model(w.arch, fused_ops)
    model.load_state_dict(w.best if ema else w.model)
    return model.eval(), w


def load_model(ckpt: str | Path, *, ema: bool = True, fused_ops=None):
    """(model in eval mode, arch dict, checkpoint path) from a file or a run folder; its blocks
    on `fused_ops` (autohc.ops) if given."""
    model, w = load_weights(ckpt, ema=ema, fused_ops=fused_ops)
    return model, w.arch, Path(w.source)


def guided_eps(model, arch: dict, y: torch.Tensor, cfg: float, precision: str = "fp32"):
    """eps_fn(x, t) of the diffusion sampler for labels y: classifier-free guidance at scale cfg
    (the batch doubled: conditional and null class) where the model learned a null class
    (label dropout), else the conditional model alone. precision "bf16": the model under
    torch.autocast bf16 (dit/precision.py), its eps guided in fp32 (DiT.forward_with_cfg) and
    handed back in fp32, so that the guidance and the sampler's update (DDIM, DDPM) are fp32
    as in CFG parallel."""
    C = arch["in_channels"]
    guided = cfg != 1.0 and arch["class_dropout"] > 0

    def eps_fn(x, t):
        with autocast(precision):
            out = model.forward_with_cfg(x, t, y, cfg) if guided else model(x, t, y)
        return out[:, :C].float()
    return eps_fn


@torch.no_grad()
def check_classes(arch: dict, classes: list[int]) -> None:
    """InputError naming the classes the model does not have."""
    n = arch["num_classes"]
    bad = [c for c in classes if not 0 <= c < n]
    if bad:
        raise InputError(f"--classes {' '.join(map(str, bad))}: out of range: this model has classes 0..{n - 1}")


def generate(model, arch: dict, classes: list[int], *, per_class: int = 8, sampler: str = "ddim",
             steps: int | None = None, cfg: float = 4.0, seed: int = 0,
             progress: bool = False, precision: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """Samples (len(classes) * per_class, C, H, W) and their requested labels, class-major.
    steps: None is the sampler's default (DDIM 50, DDPM all 1000). precision: "fp32" or
    "bf16" (the model's forward under autocast, the sampler in fp32; resolve "auto" with
    precision.resolve first)."""
    check_classes(arch, classes)
    if per_class < 1:
        raise ValueError(f"per_class must be >= 1, got {per_class}")
    diffusion = GaussianDiffusion()
    y = torch.tensor(classes, dtype=torch.long).repeat_interleave(per_class)
    shape = (len(y), arch["in_channels"], arch["input_size"], arch["input_size"])
    eps_fn = guided_eps(model, arch, y, cfg, precision)
    g = torch.Generator().manual_seed(seed)
    total = diffusion.default_steps(sampler) if steps is None else steps
    from ..torch.frozen import frozen
    with frozen(model):                 # bf16: each weight rounded once for the whole run
        if progress:
            from rich.console import Console
            from rich.progress import Progress
            # (a bar only on a terminal: elsewhere rich leaves an empty line in the log)
            with Progress(transient=True, console=Console(stderr=True), disable=not sys.stderr.isatty()) as bar:
                task = bar.add_task("sampling", total=total)
                x = diffusion.sample(eps_fn, shape, sampler=sampler, steps=steps, generator=g,
                                     clip=arch["images"], progress=lambda: bar.advance(task))
        else:
            x = diffusion.sample(eps_fn, shape, sampler=sampler, steps=steps, generator=g, clip=arch["images"])
    return x, y


def decode_latents(x: torch.Tensor, arch: dict, vae_spec: str | None = None) -> torch.Tensor:
    """Images in [-1, 1] from a latent model's samples, through the VAE it was trained with
    (or vae_spec); a pixel-space model's samples as they are."""
    decode = latent_decoder(arch, vae_spec)
    return x if decode is None else decode(x)


def latent_decoder(arch: dict, vae_spec: str | None = None):
    """decode(latents) -> images in [-1, 1] through a latent model's VAE (or vae_spec), loaded
    once here (VaeError in one line if it cannot be); None for a pixel-space model."""
    from . import vae as vaelib
    latent = arch.get("latent")
    if not latent and vae_spec:         # e.g. a facebookresearch/DiT state dict: it names no VAE
        latent = {"vae": vae_spec, "scaling_factor": None}
    if not latent:
        return None
    try:
        vae = vaelib.load(vae_spec or latent["vae"])
    except vaelib.VaeError as e:
        if vae_spec:
            raise
        raise vaelib.VaeError(f"{e}; the model was trained on that VAE's latents: pass --vae PATH_OR_ID") from None
    scale = latent["scaling_factor"] or vaelib.scaling_factor(vae)
    return lambda x: torch.cat([vaelib.decode(vae, part, scale) for part in x.split(16)])


def to_uint8(x: torch.Tensor) -> np.ndarray:
    """(N, C, H, W) in [-1, 1] -> (N, H, W, C) uint8; a per-batch min-max stretch for latents."""
    a = x.detach().float().numpy()
    if a.min() < -1.001 or a.max() > 1.001:
        a = 2 * (a - a.min()) / max(a.max() - a.min(), 1e-8) - 1
    return np.clip((a + 1) * 127.5 + 0.5, 0, 255).astype(np.uint8).transpose(0, 2, 3, 1)


def save_grid(x: torch.Tensor, rows: int, path: str | Path, *, cell: int = 64) -> Path:
    """Write x as a PNG grid with `rows` rows (one per class), each image scaled to ~cell px."""
    from PIL import Image
    imgs = to_uint8(x)
    n, h, w, c = imgs.shape
    if c not in (1, 3):
        imgs, c = imgs[..., :3] if c > 3 else np.repeat(imgs[..., :1], 3, -1), 3
    cols = -(-n // rows)
    scale = max(1, cell // max(h, w))
    pad = 2
    grid = np.full((rows * (h * scale + pad) + pad, cols * (w * scale + pad) + pad, c), 255, np.uint8)
    for i, im in enumerate(imgs):
        r, k = divmod(i, cols)
        big = im.repeat(scale, 0).repeat(scale, 1)
        y0, x0 = pad + r * (h * scale + pad), pad + k * (w * scale + pad)
        grid[y0:y0 + h * scale, x0:x0 + w * scale] = big
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    Image.fromarray(grid[..., 0] if c == 1 else grid).save(tmp, format="PNG")
    tmp.replace(path)
    return path


def plot_losses(losses: list[float], path: str | Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    path = Path(path)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    steps = np.arange(1, len(losses) + 1)
    ax.plot(steps, losses, lw=0.6, alpha=0.4, label="loss")
    if len(losses) >= 20:
        k = max(5, len(losses) // 50)
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1:], smooth, lw=1.5, label=f"mean of {k}")
    ax.set_xlabel("step")
    ax.set_ylabel("epsilon MSE")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(path)
    return path
