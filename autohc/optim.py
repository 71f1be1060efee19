"""Public name of the fused optimizer: `autohc.optim.AdamW` (autohc/torch/optim.py)."""
from .torch.optim import AdamW

__all__ = ["AdamW"]
