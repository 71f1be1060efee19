"""The fused attention family (flash style, forward and backward): params (typed, validated
block sizes and micro-tiles) and codegen (templates/ops/attention.c.j2 -> C + its declaration
-> a pool-bound library)."""
from .params import AttentionParams, default_attention

__all__ = ["AttentionParams", "default_attention"]
