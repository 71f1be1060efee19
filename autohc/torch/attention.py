"""Fused attention (templates/ops/attention.c.j2, flash style) in torch: a custom op with
autograd, and the CPU kernels that autohc.install() puts under F.scaled_dot_product_attention.

    autohc.ops.attention(q, k, v, scale=None)     softmax(scale q kᵀ) v, (B, H, L, D) tensors
    autohc.install()                              also serves torch's CPU flash-attention op
                                                  (what F.scaled_dot_product_attention runs on
                                                  CPU) and its backward

Served: float32 CPU tensors, 4-D, q, k, v of one batch, head count and head dim, the last dim
contiguous (other strides are read in place), no mask, no causal mask, no dropout (SDPA runs
dropout on its math path, never on this op). Everything else goes to ATen's own flash kernel,
captured before install() registers its own, so those calls give exactly ATen's result.
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch

from ..hw import cpu
from ..kernels.attention import AttentionParams, default_attention
from ..kernels.attention.codegen import library
from ..kernels.attention.params import KERNEL
from ..tune import registry
from . import fallback
from .threads import kernel_threads

FLASH = "_scaled_dot_product_flash_attention_for_cpu"
FLASH_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward"
_forced: list[AttentionParams] = []     # set by the tuner for one trial
stats = {"autohc": 0, "aten": 0}        # SDPA calls served by each under install()


@contextlib.contextmanager
def forced_params(params: AttentionParams):
    """Run the attention kernel with these parameters inside the block (the tuner's trials)."""
    _forced.append(params.validate())
    try:
        yield
    finally:
        _forced.pop()


def params_for() -> AttentionParams:
    """The tuner's trial, else the registry's tuned parameters for this CPU and thread count
    (`autohc tune --op attention`), else the default."""
    if _forced:
        return _forced[-1]
    return (registry.tuned_op_params("attention", KERNEL, kernel_threads())
            or default_attention(cpu.best_isa()))


@functools.lru_cache(maxsize=None)
def _functions(p: AttentionParams):
    lib = library(p)
    sym = p.symbol()
    return lib.ffi, getattr(lib.lib, f"{sym}_forward"), getattr(lib.lib, f"{sym}_backward")


def served(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """What the kernel computes: the shapes and dtypes above (masks, dropout are the caller's
    to check)."""
    ts = (q, k, v)
    if not all(t.dtype == torch.float32 and t.device.type == "cpu" and t.layout == torch.strided
               and t.dim() == 4 for t in ts):
        return False
    B, H, L, D = q.shape
    return (k.shape[:2] == (B, H) and v.shape == k.shape and k.shape[3] == D
            and q.numel() > 0 and k.numel() > 0)


def _inner(t: torch.Tensor) -> torch.Tensor:
    """t with its last dim contiguous (the kernel reads the other three at any stride)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _strides(ffi, *ts):
    return ffi.new("int64_t[]", [s for t in ts for s in t.stride()[:3]])


def _ptr(ffi, t):
    return ffi.cast("float *", t.data_ptr())


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise MemoryError(f"autohc attention {what}: a thread could not allocate its buffers")


def forward_kernel(q, k, v, scale: float | None):
    """(out (B, H, L, D) contiguous, lse (B, H, L) laid out as ATen's: (B, L, H) in memory)."""
    ffi, fwd, _ = _functions(params_for())
    q, k, v = _inner(q), _inner(k), _inner(v)
    B, H, L, D = q.shape
    S = k.shape[2]
    out = torch.empty(B, H, L, D)
    lse = torch.empty(B, L, H).transpose(1, 2)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    _check(fwd(_ptr(ffi, q), _ptr(ffi, k), _ptr(ffi, v), _ptr(ffi, out), _ptr(ffi, lse),
               B, H, L, S, D, _strides(ffi, q, k, v, out, lse), scale, kernel_threads()), "forward")
    return out, lse


def backward_kernel(grad, q, k, v, out, lse, scale: float | None):
    """(dq, dk, dv), contiguous, from the forward's out and lse."""
    ffi, _, bwd = _functions(params_for())
    grad, q, k, v, out = (_inner(t) for t in (grad, q, k, v, out))
    B, H, L, D = q.shape
    S = k.shape[2]
    dq, dk, dv = torch.empty(B, H, L, D), torch.empty(B, H, S, D), torch.empty(B, H, S, D)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    _check(bwd(_ptr(ffi, grad), _ptr(ffi, q), _ptr(ffi, k), _ptr(ffi, v), _ptr(ffi, out),
               _ptr(ffi, lse), _ptr(ffi, dq), _ptr(ffi, dk), _ptr(ffi, dv), B, H, L, S, D,
               _strides(ffi, q, k, v, out, grad, lse, dq, dk, dv), scale, kernel_threads()), "backward")
    return dq, dk, dv


# ----------------------------------------------------------------- the custom op

def _math(q, k, v, scale):
    """The reference (ATen's math): other dtypes and the fallback of the custom op."""
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


@torch.library.custom_op("autohc::attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    return fallback.kernel_or(lambda: forward_kernel(q, k, v, scale), lambda: _math(q, k, v, scale),
                              "attention", served=served(q, k, v))


@_attention.register_fake
def _(q, k, v, scale):
    B, H, L, D = q.shape
    return q.new_empty(B, H, L, D), q.new_empty(B, L, H).transpose(1, 2)


@torch.library.custom_op("autohc::attention_backward", mutates_args=())
def _attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor,
                        scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    def math_path():
        sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        p = torch.exp((q @ k.transpose(-2, -1)) * sc - lse.unsqueeze(-1))
        dp = grad @ v.transpose(-2, -1)
        ds = p * (dp - (grad * out).sum(-1, keepdim=True)) * sc
        return ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ grad
    return fallback.kernel_or(lambda: backward_kernel(grad, q, k, v, out, lse, scale), math_path,
                              "attention_backward", served=served(q, k, v) and grad.dtype == torch.float32)


@_attention_backward.register_fake
def _(grad, q, k, v, out, lse, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.scale = scale


def _backward(ctx, gout, glse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _attention_backward(gout.contiguous(), q, k, v, out, lse, ctx.scale)
    return dq, dk, dv, None


_attention.register_autograd(_backward, setup_context=_setup)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """softmax(scale q kᵀ) v over (B, H, L, D) q and (B, H, S, D) k, v (as
    F.scaled_dot_product_attention without mask or dropout); scale 1/sqrt(D) by default."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or k.shape[:2] != q.shape[:2] \
            or k.shape[3] != q.shape[3]:
        raise ValueError(f"attention: q must be (B, H, L, D) and k, v (B, H, S, D); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    return _attention(q, k, v, None if scale is None else float(scale))[0]


# ------------------------------------------- aten CPU kernels for autohc.install()

def _aten_kernel(name: str):
    """ATen's own CPU kernel of aten::name, captured before install() overrides it (None
    where this torch does not offer the handle: the op is then left to ATen entirely)."""
    try:
        return torch._C._dispatch_get_computed_kernel_for_dispatch_key(f"aten::{name}", torch._C.DispatchKey.CPU)
    except (AttributeError, RuntimeError):
        return None


ATEN_FLASH = {name: _aten_kernel(name) for name in (FLASH, FLASH_BACKWARD)}


def _counted(who: str, result):
    stats[who] += 1
    return result


def _call_aten(name: str, *args, **kwargs):
    stats["aten"] += 1
    return ATEN_FLASH[name].call_boxed(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **kwargs)


def _flash_served(q, k, v, dropout_p, is_causal, attn_mask) -> bool:
    return dropout_p == 0.0 and not is_causal and attn_mask is None and served(q, k, v)


def aten_flash(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    return fallback.kernel_or(
        lambda: _counted("autohc", forward_kernel(query, key, value, scale)),
        lambda: _call_aten(FLASH, query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale),
        "scaled_dot_product_attention", served=_flash_served(query, key, value, dropout_p, is_causal, attn_mask))


def aten_flash_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                        attn_mask=None, scale=None):
    return fallback.kernel_or(
        lambda: _counted("autohc", backward_kernel(grad_out, query, key, value, out, logsumexp, scale)),
        lambda: _call_aten(FLASH_BACKWARD, grad_out, query, key, value, out, logsumexp, dropout_p,
                           is_causal, attn_mask=attn_mask, scale=scale),
        "scaled_dot_product_attention_backward",
        served=_flash_served(query, key, value, dropout_p, is_causal, attn_mask)
        and grad_out.dtype == torch.float32 and logsumexp.dtype == torch.float32)


# only where ATen's own kernels could be captured, so that every call not served still has them
ATEN_IMPLS = ({FLASH: aten_flash, FLASH_BACKWARD: aten_flash_backward}
              if all(ATEN_FLASH.values()) else {})
