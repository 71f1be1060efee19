"""DiT model, Gaussian diffusion, data and trainer (`autohc train`)."""
from .sizes import MODELS, config

__all__ = ["DiT", "MODELS", "config"]


def __getattr__(name: str):
    # the model needs torch; the sizes (the CLI's choices) do not
    if name == "DiT":
        from .model import DiT
        return DiT
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
