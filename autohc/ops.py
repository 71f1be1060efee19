"""Public name of the fused operators: `autohc.ops.gelu_tanh(x)`, `autohc.ops.softmax(x)`,
`autohc.ops.layernorm_modulate(x, scale, shift)`, `autohc.ops.attention(q, k, v)`, ...
(implemented in autohc/torch/ops.py and autohc/torch/attention.py)."""
from .torch.attention import attention
from .torch.ops import (FUSED, gated_residual, gelu_tanh, gelu_tanh_backward, layernorm_modulate,
                        params_for, silu, silu_backward, softmax, softmax_backward)

__all__ = ["FUSED", "attention", "gated_residual", "gelu_tanh", "gelu_tanh_backward",
           "layernorm_modulate", "params_for", "silu", "silu_backward", "softmax", "softmax_backward"]
