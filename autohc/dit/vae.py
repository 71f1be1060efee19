"""The image autoencoder of a latent DiT: diffusers' `AutoencoderKL`, as facebookresearch/DiT
and fast-DiT use it (`stabilityai/sd-vae-ft-ema` or `-mse`, latents scaled by the VAE's
`scaling_factor`, 0.18215 for those).

`load(spec)` takes what a user passes to `--vae`: a local folder written by `save_pretrained`
(or a pipeline folder with a `vae/` inside) or a hub id, loaded as diffusers loads it (no
download here when the machine has no network: the hub id must then be in the local cache).
diffusers is the optional extra `pip install -e '.[latent]'`.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .data import InputError


class VaeError(InputError):
    """--vae names no loadable AutoencoderKL."""


def diffusers_module():
    try:
        import diffusers
    except ImportError:
        raise InputError("latent DiTs need diffusers: pip install -e '.[latent]' "
                         "(or pip install diffusers safetensors)") from None
    diffusers.utils.logging.set_verbosity_error()      # no "install accelerate" notes per load
    return diffusers


def load(spec: str | Path) -> "torch.nn.Module":
    """The AutoencoderKL at `spec` (folder or hub id), in eval mode, fp32."""
    diffusers = diffusers_module()
    spec = str(spec)
    p = Path(spec)
    kw = {}
    if p.is_dir() and not (p / "config.json").is_file() and (p / "vae" / "config.json").is_file():
        kw["subfolder"] = "vae"         # a whole pipeline folder (DiTPipeline.save_pretrained)
    elif p.exists() and not (p / "config.json").is_file():
        raise VaeError(f"--vae {spec}: not a diffusers AutoencoderKL folder (no config.json)")
    try:
        vae = _from_pretrained(diffusers, spec, p.exists(), kw)
    except Exception as e:  # noqa: BLE001 - diffusers/huggingface_hub raise many types
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        where = "" if p.exists() else (" (not a local folder, not in the Hugging Face cache, and not "
                                       "downloadable from here: download it where there is a network, "
                                       "or pass a local folder)")
        raise VaeError(f"--vae {spec}: not a loadable AutoencoderKL{where} ({type(e).__name__}: {first[:200]})") from None
    return vae.float().eval().requires_grad_(False)


def _from_pretrained(diffusers, spec: str, local: bool, kw: dict):
    """AutoencoderKL.from_pretrained, a hub id first from the local Hugging Face cache (a compute
    node often has no network), with the hub's retry log lines and warnings kept off the
    terminal: a failure is said once, by load()."""
    import logging
    import socket
    import warnings
    from urllib.parse import urlparse
    hub = logging.getLogger("huggingface_hub")
    level = hub.level
    hub.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if not local:
                try:
                    return diffusers.AutoencoderKL.from_pretrained(spec, local_files_only=True, **kw)
                except Exception:  # noqa: BLE001 - not cached: the hub, if it can be reached
                    from huggingface_hub import constants
                    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
                    try:        # (else the hub retries for half a minute before it fails)
                        socket.getaddrinfo(host, 443)
                    except OSError as e:
                        raise OSError(f"cannot reach {host} ({e})") from None
            return diffusers.AutoencoderKL.from_pretrained(spec, **kw)
    finally:
        hub.setLevel(level)


def scaling_factor(vae) -> float:
    return float(getattr(vae.config, "scaling_factor", 0.18215) or 0.18215)


def downsampling(vae) -> int:
    """Image pixels per latent pixel (8 for the Stable Diffusion VAEs)."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


@torch.no_grad()
def encode(vae, images: torch.Tensor, noise_seeds: list[int], precision: str = "fp32") -> torch.Tensor:
    """Scaled latents of images (B, C, H, W) in [-1, 1]: a draw from the posterior, as the
    reference's `latent_dist.sample() * 0.18215`, each image's draw from its own seed, so the
    result does not depend on the batch it came in (and an encode that resumes is the same).
    precision (resolved: "fp32" or "bf16"): bf16 runs the VAE's encoder forward under
    torch.autocast("cpu", bfloat16); the posterior's mean and std, the draw and the latents
    are fp32 either way."""
    from . import precision as precisionlib
    with precisionlib.autocast(precision):
        dist = vae.encode(images).latent_dist
    if dist.parameters.dtype != torch.float32:     # bf16 moments: mean and std from fp32 ones
        dist = type(dist)(dist.parameters.float(), deterministic=getattr(dist, "deterministic", False))
    noise = torch.stack([torch.randn(dist.mean.shape[1:], generator=torch.Generator().manual_seed(s))
                         for s in noise_seeds])
    return (dist.mean + dist.std * noise) * scaling_factor(vae)


@torch.no_grad()
def decode(vae, latents: torch.Tensor, scale: float) -> torch.Tensor:
    """Images in [-1, 1] from scaled latents."""
    return vae.decode(latents / scale).sample.clamp(-1, 1)
