"""Gaussian diffusion as DiT trains it: 1000 steps, linear betas 1e-4..0.02, epsilon
prediction, MSE loss; DDPM (posterior variance) and DDIM (eta 0) samplers with
classifier-free guidance. With learn_sigma models the extra channels are ignored: sampling
uses the fixed posterior variance."""
from __future__ import annotations

from typing import Callable

import torch


class GaussianDiffusion:
    def __init__(self, steps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02):
        if steps < 1:
            raise ValueError(f"diffusion steps must be >= 1, got {steps}")
        self.num_timesteps = steps
        # schedule in float64 (as the reference), used as float32 per batch
        betas = torch.linspace(beta_start, beta_end, steps, dtype=torch.float64)
        self.betas = betas
        self.alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        prev = torch.cat([torch.ones(1, dtype=torch.float64), self.alphas_cumprod[:-1]])
        self.alphas_cumprod_prev = prev
        self.posterior_variance = betas * (1.0 - prev) / (1.0 - self.alphas_cumprod)
        # log of the posterior variance, with the t = 0 entry (zero) replaced as the reference
        pv = torch.cat([self.posterior_variance[1:2], self.posterior_variance[1:]])
        self.posterior_log_variance = torch.log(pv)
        self.posterior_mean_coef1 = betas * prev.sqrt() / (1.0 - self.alphas_cumprod)
        self.posterior_mean_coef2 = (1.0 - prev) * (1.0 - betas).sqrt() / (1.0 - self.alphas_cumprod)

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
    def sample(self, eps_fn: Callable, shape, *, sampler: str = "ddim", steps: int = 50,
               generator: torch.Generator | None = None, clip: bool = True,
               progress: Callable | None = None) -> torch.Tensor:
        """Draw samples: eps_fn(x, t) -> epsilon. DDPM walks all num_timesteps; DDIM (eta 0)
        walks `steps` evenly spaced ones. clip: clamp predicted x0 to [-1, 1] (images)."""
        if sampler not in ("ddim", "ddpm"):
            raise ValueError(f"sampler must be 'ddim' or 'ddpm', got {sampler!r}")
        if not 1 <= steps <= self.num_timesteps:
            raise ValueError(f"sampling steps must be in [1, {self.num_timesteps}], got {steps}")
        x = torch.randn(shape, generator=generator)
        n = shape[0]
        if sampler == "ddpm":
            ts = list(range(self.num_timesteps - 1, -1, -1))
        else:
            ts = torch.linspace(self.num_timesteps - 1, 0, steps).round().long().unique_consecutive().tolist()
        for i, ti in enumerate(ts):
            t = torch.full((n,), ti, dtype=torch.long)
            eps = eps_fn(x, t)
            x0 = self._x0_from_eps(x, t, eps)
            if clip:
                x0 = x0.clamp(-1, 1)
            if sampler == "ddpm":
                mean = self._at(self.posterior_mean_coef1, t, x) * x0 + self._at(self.posterior_mean_coef2, t, x) * x
                if ti > 0:
                    std = (0.5 * self._at(self.posterior_log_variance, t, x)).exp()
                    x = mean + std * torch.randn(x.shape, generator=generator)
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
