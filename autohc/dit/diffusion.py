"""Gaussian diffusion as DiT trains it: 1000 steps, linear betas 1e-4..0.02, epsilon
prediction, MSE loss; DDPM (posterior variance) and DDIM (eta 0) samplers with
classifier-free guidance. DDPM on fewer steps walks the reference's respaced chain
(diffusion/respace.py: `create_diffusion("250")` in DiT's sample.py). With learn_sigma models
the extra channels are ignored: sampling uses the fixed posterior variance."""
from __future__ import annotations

from typing import Callable

import torch


class GaussianDiffusion:
    def __init__(self, steps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02, *,
                 betas: torch.Tensor | None = None):
        """The linear schedule of `steps` betas, or (`betas`) a chain on the given ones."""
        if betas is None:
            if steps < 1:
                raise ValueError(f"diffusion steps must be >= 1, got {steps}")
            # schedule in float64 (as the reference), used as float32 per batch
            betas = torch.linspace(beta_start, beta_end, steps, dtype=torch.float64)
        elif betas.dim() != 1 or len(betas) < 1:
            raise ValueError(f"betas must be a 1-D tensor of at least one step, got shape {tuple(betas.shape)}")
        self.num_timesteps = len(betas)
        self._schedule(betas)

    def _schedule(self, betas: torch.Tensor) -> None:
        self.betas = betas
        self.alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        prev = torch.cat([torch.ones(1, dtype=torch.float64), self.alphas_cumprod[:-1]])
        self.alphas_cumprod_prev = prev
        self.posterior_variance = betas * (1.0 - prev) / (1.0 - self.alphas_cumprod)
        # log of the posterior variance, with the t = 0 entry (zero) replaced as the reference
        pv = torch.cat([self.posterior_variance[1:2], self.posterior_variance[1:]]) if len(betas) > 1 \
            else torch.ones(1, dtype=torch.float64)       # one step: never adds noise
        self.posterior_log_variance = torch.log(pv)
        self.posterior_mean_coef1 = betas * prev.sqrt() / (1.0 - self.alphas_cumprod)
        self.posterior_mean_coef2 = (1.0 - prev) * (1.0 - betas).sqrt() / (1.0 - self.alphas_cumprod)

    def respaced(self, steps: int) -> tuple["GaussianDiffusion", list[int]]:
        """The chain on `steps` of the timesteps, as the reference's SpacedDiffusion: the kept
        timesteps (its space_timesteps with one section: evenly spaced from 0 to T-1, Python's
        rounding) and a diffusion whose betas join them, 1 - alphas_cumprod[t] / alphas_cumprod[t'],
        so each kept step keeps its alphas_cumprod."""
        stride = 1 if steps <= 1 else (self.num_timesteps - 1) / (steps - 1)
        kept, at = [], 0.0
        for _ in range(steps):
            kept.append(round(at))
            at += stride
        ac = self.alphas_cumprod[kept]
        betas = 1.0 - ac / torch.cat([torch.ones(1, dtype=torch.float64), ac[:-1]])
        return GaussianDiffusion(betas=betas), kept

    @staticmethod
    def _at(a: torch.Tensor, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return a[t].to(x.dtype).reshape(-1, *([1] * (x.dim() - 1)))

    def q_sample(self, x0, t, noise):
        ac = self._at(self.alphas_cumprod, t, x0)
        return ac.sqrt() * x0 + (1.0 - ac).sqrt() * noise

    def training_loss(self, model: Callable, x0, t, y, noise, **model_kwargs) -> torch.Tensor:
        """MSE between the noise and the model's epsilon (its first C output channels)."""
        eps = model(self.q_sample(x0, t, noise), t, y, **model_kwargs)[:, :x0.shape[1]]
        return torch.mean((eps - noise) ** 2)

    def _x0_from_eps(self, x, t, eps):
        ac = self._at(self.alphas_cumprod, t, x)
        return (x - (1.0 - ac).sqrt() * eps) / ac.sqrt()

    @torch.no_grad()
    def sample(self, eps_fn: Callable, shape, *, sampler: str = "ddim", steps: int | None = None,
               generator: torch.Generator | None = None, clip: bool = True,
               progress: Callable | None = None,
               generators: list[torch.Generator] | None = None) -> torch.Tensor:
        """Draw samples: eps_fn(x, t) -> epsilon. DDPM walks `steps` of the num_timesteps (all by
        default; fewer: the respaced chain); DDIM (eta 0) walks `steps` evenly spaced ones (50 by
        default). clip: clamp predicted x0 to [-1, 1] (images). generators: one per image (row i's
        initial noise and DDPM step noise from generators[i] only, so an image does not depend
        on the batch it is drawn in); else `generator` draws the whole batch's noise."""
        if sampler not in ("ddim", "ddpm"):
            raise ValueError(f"sampler must be 'ddim' or 'ddpm', got {sampler!r}")
        steps = self.default_steps(sampler) if steps is None else steps
        if not 1 <= steps <= self.num_timesteps:
            raise ValueError(f"sampling steps must be in [1, {self.num_timesteps}], got {steps}")
        if generators is not None and len(generators) != shape[0]:
            raise ValueError(f"{len(generators)} generators for a batch of {shape[0]}")

        def noise(like_shape):
            if generators is None:
                return torch.randn(like_shape, generator=generator)
            return torch.stack([torch.randn(like_shape[1:], generator=g) for g in generators])

        x = noise(shape)
        n = shape[0]
        if sampler == "ddpm":
            chain, kept = self.respaced(steps) if steps < self.num_timesteps else (self, range(steps))
            walk = [(kept[i], i) for i in range(steps - 1, -1, -1)]     # (model's t, chain's index)
        else:
            chain = self
            ts = torch.linspace(self.num_timesteps - 1, 0, steps).round().long().unique_consecutive().tolist()
            walk = [(ti, ti) for ti in ts]
        for i, (ti, ci) in enumerate(walk):
            t = torch.full((n,), ti, dtype=torch.long)
            c = torch.full((n,), ci, dtype=torch.long)
            eps = eps_fn(x, t)
            x0 = chain._x0_from_eps(x, c, eps)
            if clip:
                x0 = x0.clamp(-1, 1)
            if sampler == "ddpm":
                mean = chain._at(chain.posterior_mean_coef1, c, x) * x0 + chain._at(chain.posterior_mean_coef2, c, x) * x
                if ci > 0:
                    std = (0.5 * chain._at(chain.posterior_log_variance, c, x)).exp()
                    x = mean + std * noise(x.shape)
                else:
                    x = mean
            else:
                # eps consistent with the (clipped) x0, then the deterministic DDIM step
                ac = self._at(self.alphas_cumprod, t, x)
                eps = (x - ac.sqrt() * x0) / (1.0 - ac).sqrt()
                prev = ts[i + 1] if i + 1 < len(ts) else -1
                ac_prev = (self.alphas_cumprod[prev] if prev >= 0 else torch.tensor(1.0, dtype=torch.float64)).to(x.dtype)
                x = ac_prev.sqrt() * x0 + (1.0 - ac_prev).sqrt() * eps
            if progress:
                progress()
        return x

    def default_steps(self, sampler: str) -> int:
        """DDIM: 50 steps; DDPM: the whole chain."""
        return self.num_timesteps if sampler == "ddpm" else 50
