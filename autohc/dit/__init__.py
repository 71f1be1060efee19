"""DiT model, Gaussian diffusion, data and trainer (`autohc train`)."""
from .model import DiT, MODELS, config

__all__ = ["DiT", "MODELS", "config"]
