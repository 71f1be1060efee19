"""AI operators from templates/ops: GELU(tanh), SiLU, LayerNorm + adaLN modulate, softmax,
gated residual (forward + backward).

    autohc.ops.gelu_tanh(x), autohc.ops.silu(x)      torch custom ops with autograd
    autohc.ops.layernorm_modulate(x, scale, shift)   DiT's modulate(norm(x), shift, scale)
    autohc.ops.softmax(x), autohc.ops.gated_residual(x, y, gate)
    autohc.install()                                 also routes F.gelu(approximate="tanh"),
                                                     F.silu, F.layer_norm and last-dim softmax
                                                     on float32 CPU tensors (ATEN_IMPLS)

float32 CPU tensors run the generated kernels as teams of the native worker pool, over
autohc.torch.threads.kernel_threads() threads (install()'s count while installed, else
torch.get_num_threads()); cffi releases the GIL. bfloat16 tensors (torch.autocast's) run the
kernels' `_bf16` forms: GELU and SiLU read and write bf16 (install() serves bf16 GELU); under
autocast to bf16, layernorm_modulate of the fp32 stream with bf16 scale / shift writes the bf16
input of the next GEMM, and gated_residual adds a bf16 GEMM output to the fp32 stream. The arithmetic is fp32,
each bf16 result rounded once. Everything else runs torch's own implementation.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
from typing import Callable, NamedTuple

import torch

from ..hw import cpu
from ..kernels.eltwise import KERNELS, EltwiseParams, default_eltwise
from ..kernels.eltwise.codegen import library
from ..runtime.memory import fresh_like as _fresh_like
from ..tune import registry
from . import fallback
from .direct import runs_direct
from .threads import kernel_threads

_forced: dict[str, EltwiseParams] = {}     # kernel -> params, set by the tuner for one trial


@contextlib.contextmanager
def forced_params(kernel: str, params: EltwiseParams):
    """Run `kernel` with these parameters inside the block (the tuner's trials)."""
    _forced[kernel] = params.validate()
    try:
        yield
    finally:
        _forced.pop(kernel, None)


def params_for(kernel: str) -> EltwiseParams:
    """The parameters `kernel` runs with: the tuner's trial, else the registry's tuned ones for
    this CPU and thread count (`autohc tune --op`), else the default."""
    if kernel in _forced:
        return _forced[kernel]
    return (registry.tuned_op_params("eltwise", kernel, kernel_threads())
            or default_eltwise(cpu.best_isa()))


def kernel_fn(kernel: str, params: EltwiseParams | None = None):
    """(ffi, the kernel's exported team function <prefix>_<kernel>_par)."""
    return _functions(kernel, params or params_for(kernel))[:2]


def split_threads(kernel: str, elems: int, params: EltwiseParams | None = None) -> int:
    """Threads a call of `kernel` over `elems` elements uses (the kernel's own rule)."""
    return _functions(kernel, params or params_for(kernel))[2](elems, kernel_threads())


@functools.lru_cache(maxsize=None)
def _functions(kernel: str, p: EltwiseParams):
    """(ffi, <prefix>_<kernel>_par, <prefix>_split) of a kernel: looked up once, called often."""
    lib = library(kernel, p)
    sym = p.for_kernel(kernel).symbol(kernel)
    return lib.ffi, getattr(lib.lib, f"{sym}_{kernel}_par"), getattr(lib.lib, f"{sym}_split")


def _ptr(ffi, t):
    if t is None:
        return ffi.NULL
    return ffi.cast("uint16_t *" if t.dtype == torch.bfloat16 else "float *", t.data_ptr())


def _run(name: str, *tensors: torch.Tensor, params: EltwiseParams | None = None) -> torch.Tensor:
    """out = f(*tensors) on contiguous CPU tensors of one shape and dtype (element-wise
    kernels): float32 runs `name`, bfloat16 its `name_bf16` form."""
    bf16 = tensors[-1].dtype == torch.bfloat16
    ffi, fn = kernel_fn(name + "_bf16" if bf16 else name, params)
    ins = [t.contiguous() for t in tensors]
    out = _fresh_like(ins[-1], ins[-1].dtype)
    fn(*[_ptr(ffi, t) for t in ins], _ptr(ffi, out), out.numel(), kernel_threads())
    return out


def _strided_cpu(*ts: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.layout == torch.strided for t in ts)


def _fast(*ts: torch.Tensor) -> bool:
    return (all(t.dtype == torch.float32 for t in ts) and _strided_cpu(*ts)
            and len({t.shape for t in ts}) == 1)


def _fast_any(*ts: torch.Tensor) -> bool:
    """One shape, all float32 or all bfloat16: an element-wise kernel (or its bf16 form) runs it."""
    return (len({t.dtype for t in ts}) == 1 and ts[0].dtype in (torch.float32, torch.bfloat16)
            and _strided_cpu(*ts) and len({t.shape for t in ts}) == 1)


# ----------------------------------------------------------------- torch custom ops

@torch.library.custom_op("autohc::gelu_tanh", mutates_args=())
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (as F.gelu(x, approximate="tanh"))."""
    return fallback.kernel_or(
        lambda: _run("gelu_tanh_fwd", x),
        lambda: torch.nn.functional.gelu(x, approximate="tanh"),
        "gelu_tanh", served=_fast_any(x))


@torch.library.custom_op("autohc::gelu_tanh_backward", mutates_args=())
def gelu_tanh_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return fallback.kernel_or(
        lambda: _run("gelu_tanh_bwd", grad, x),
        lambda: torch.ops.aten.gelu_backward(grad, x, approximate="tanh"),
        "gelu_tanh_backward", served=_fast_any(grad, x))


@torch.library.custom_op("autohc::silu", mutates_args=())
def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU x * sigmoid(x) (as F.silu)."""
    return fallback.kernel_or(
        lambda: _run("silu_fwd", x),
        lambda: torch.nn.functional.silu(x),
        "silu", served=_fast_any(x))


@torch.library.custom_op("autohc::silu_backward", mutates_args=())
def silu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return fallback.kernel_or(
        lambda: _run("silu_bwd", grad, x),
        lambda: torch.ops.aten.silu_backward(grad, x),
        "silu_backward", served=_fast_any(grad, x))


for _op in (gelu_tanh, silu):
    _op.register_fake(lambda x: torch.empty_like(x, memory_format=torch.contiguous_format))
for _op in (gelu_tanh_backward, silu_backward):
    _op.register_fake(lambda g, x: torch.empty_like(x, memory_format=torch.contiguous_format))


def _save_input(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


gelu_tanh.register_autograd(lambda ctx, g: gelu_tanh_backward(g, ctx.saved_tensors[0]),
                            setup_context=_save_input)
silu.register_autograd(lambda ctx, g: silu_backward(g, ctx.saved_tensors[0]),
                       setup_context=_save_input)


# ------------------------------------------- LayerNorm (no affine) + adaLN modulate, fused

def _ln_reference(x, scale, shift, eps):
    y = torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=eps)
    if scale is not None:
        y = y * (1 + scale[:, None, :])
    if shift is not None:
        y = y + shift[:, None, :]
    return y


def _ln_mod_reference(x, scale, shift, eps):
    """(y, mean, rstd) in torch ops: other dtypes, and the fallback."""
    xd = x.double()
    mean = xd.mean(-1).reshape(-1).to(x.dtype)
    rstd = (xd.var(-1, unbiased=False) + eps).rsqrt().reshape(-1).to(x.dtype)
    return _ln_reference(x, scale, shift, eps), mean, rstd


def _ln_mod_impl(x: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None,
            eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, D = x.shape
    if not _fast(x) or any(t is not None and not _fast(t) for t in (scale, shift)):
        return _ln_mod_reference(x, scale, shift, eps)
    try:
        return _ln_fwd_kernel(x.contiguous(), scale.contiguous() if scale is not None else None,
                              shift.contiguous() if shift is not None else None, B * T, D, T, eps, 1)
    except fallback.FAILURES as e:
        fallback.report(e, "layernorm_modulate")
        return _ln_mod_reference(x, scale, shift, eps)


_ln_mod = torch.library.custom_op("autohc::layernorm_modulate", mutates_args=())(_ln_mod_impl)


def _ln_fwd_kernel(xc, sc, sh, rows: int, D: int, T: int, eps: float, plus_one: int,
                   kernel: str = "ln_mod_fwd"):
    """ln_mod_fwd (or its bf16 form: bf16 scale, shift and y) over `rows` rows of D
    (contiguous float32 x); scale/shift per T rows."""
    ffi, fn = kernel_fn(kernel)
    y = _fresh_like(xc, torch.bfloat16 if kernel.endswith("_bf16") else torch.float32)
    mean = torch.empty(rows)
    rstd = torch.empty(rows)
    fn(*(_ptr(ffi, t) for t in (xc, sc, sh, y, mean, rstd)), rows, D, T, float(eps), plus_one,
       kernel_threads())
    return y, mean, rstd


@_ln_mod.register_fake
def _(x, scale, shift, eps):
    B, T, D = x.shape
    return torch.empty_like(x), x.new_empty(B * T), x.new_empty(B * T)


@torch.library.custom_op("autohc::layernorm_modulate_backward", mutates_args=())
def _ln_mod_bwd(dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor | None,
                mean: torch.Tensor, rstd: torch.Tensor, want_scale: bool,
                want_shift: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, D = x.shape
    if all(_fast(t) for t in (dy, x)) and (scale is None or _fast(scale)):
        try:
            dx, dscale, dshift = _ln_bwd_kernel(
                dy.contiguous(), x.contiguous(), scale.contiguous() if scale is not None else None,
                mean.contiguous(), rstd.contiguous(), B, T, D, D, 1, want_scale, want_shift)
            return (dx, dscale if want_scale else x.new_zeros(0),
                    dshift if want_shift else x.new_zeros(0))
        except fallback.FAILURES as e:
            fallback.report(e, "layernorm_modulate_backward")
    # other dtypes (and the fallback): the kernel's formula in torch ops (no autograd here)
    xhat = (x - mean.reshape(B, T, 1)) * rstd.reshape(B, T, 1)
    g = dy * (1 + scale[:, None, :]) if scale is not None else dy
    dx = rstd.reshape(B, T, 1) * (g - g.mean(-1, keepdim=True)
                                  - xhat * (g * xhat).mean(-1, keepdim=True))
    dsc = (dy * xhat).sum(1) if want_scale else x.new_zeros(0)
    dsh = dy.sum(1) if want_shift else x.new_zeros(0)
    return dx, dsc, dsh


def _ln_bwd_kernel(dyc, xc, sc, mean, rstd, samples: int, T: int, D: int, sstride: int,
                   plus_one: int, want_scale: bool, want_shift: bool, kernel: str = "ln_mod_bwd"):
    """ln_mod_bwd over `samples` blocks of T rows (the last may be short) of D, contiguous
    float32 x (dy and scale bf16 in the bf16 form); the samples are split over the team.
    Returns dx and the per-sample dscale / dshift (float32 samples x D, or None where not
    wanted)."""
    ffi, fn = kernel_fn(kernel)
    rows = xc.numel() // D
    dx = _fresh_like(xc)
    dscale = torch.empty(samples, D) if want_scale else None
    dshift = torch.empty(samples, D) if want_shift else None
    fn(*(_ptr(ffi, t) for t in (dyc, xc, sc, mean, rstd, dx, dscale, dshift)), samples, D, T,
       rows, sstride, plus_one, kernel_threads())
    return dx, dscale, dshift


@_ln_mod_bwd.register_fake
def _(dy, x, scale, mean, rstd, want_scale, want_shift):
    B, T, D = x.shape
    return (torch.empty_like(x), x.new_empty((B, D) if want_scale else (0,)),
            x.new_empty((B, D) if want_shift else (0,)))


def _ln_setup(ctx, inputs, output):
    x, scale, shift, eps = inputs
    ctx.save_for_backward(x, scale, output[1], output[2])
    ctx.has_scale, ctx.has_shift = scale is not None, shift is not None


def _ln_backward(ctx, gy, gmean, grstd):
    x, scale, mean, rstd = ctx.saved_tensors
    dx, dsc, dsh = _ln_mod_bwd(gy, x, scale, mean, rstd, ctx.has_scale, ctx.has_shift)
    return dx, (dsc if ctx.has_scale else None), (dsh if ctx.has_shift else None), None


_ln_mod.register_autograd(_ln_backward, setup_context=_ln_setup)


def layernorm_modulate(x: torch.Tensor, scale: torch.Tensor | None = None,
                       shift: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """DiT's `modulate(norm(x), shift, scale)` in one pass: LayerNorm over the last dim without
    affine (eps 1e-6 as DiT), then x̂ (1 + scale) + shift with scale, shift per sample
    (B x D), broadcast over the T tokens. x: (B, T, D)."""
    if x.dim() != 3:
        raise ValueError(f"layernorm_modulate: x must be (B, T, D), got shape {tuple(x.shape)}")
    B, T, D = x.shape
    for name, t in (("scale", scale), ("shift", shift)):
        if t is not None and tuple(t.shape) != (B, D):
            raise ValueError(f"layernorm_modulate: {name} must be (B, D) = {(B, D)}, got {tuple(t.shape)}")
    if (_autocast_bf16() and x.dtype == torch.float32
            and all(t is None or t.dtype == torch.bfloat16 for t in (scale, shift))):
        return (_ln_mod16_impl if runs_direct(x, scale, shift) else _ln_mod16)(x, scale, shift, float(eps))[0]
    return (_ln_mod_impl if runs_direct(x, scale, shift) else _ln_mod)(x, scale, shift, float(eps))[0]


# ------------------------- LayerNorm + modulate under torch.autocast: the bf16 GEMM input

def _autocast_bf16() -> bool:
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def _bf16_cpu(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.bfloat16 and _strided_cpu(t))


def _ln_mod16_impl(x: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None,
              eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Under autocast: the fp32 stream x, the bf16 adaLN scale / shift -> y in bf16 (the next
    GEMM's input, rounded once from the fp32 result as autocast would round it), mean and
    rstd fp32."""
    B, T, D = x.shape
    if _fast(x) and x.numel() > 0 and _bf16_cpu(scale) and _bf16_cpu(shift):
        try:
            return _ln_fwd_kernel(x.contiguous(), *(t.contiguous() if t is not None else None
                                                    for t in (scale, shift)),
                                  B * T, D, T, eps, 1, kernel="ln_mod_fwd_bf16")
        except fallback.FAILURES as e:
            fallback.report(e, "layernorm_modulate")
    y, mean, rstd = _ln_mod_reference(x.float(), *(t.float() if t is not None else None
                                                   for t in (scale, shift)), eps)
    return y.to(torch.bfloat16), mean, rstd


_ln_mod16 = torch.library.custom_op("autohc::layernorm_modulate_bf16", mutates_args=())(_ln_mod16_impl)


@_ln_mod16.register_fake
def _(x, scale, shift, eps):
    B, T, D = x.shape
    return torch.empty_like(x, dtype=torch.bfloat16), x.new_empty(B * T), x.new_empty(B * T)


@torch.library.custom_op("autohc::layernorm_modulate_bf16_backward", mutates_args=())
def _ln_mod16_bwd(dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor | None,
                  mean: torch.Tensor, rstd: torch.Tensor, want_scale: bool,
                  want_shift: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx (fp32, as x), dscale and dshift (bf16, as scale and shift), each summed in fp32."""
    B, T, D = x.shape
    if (dy.dtype == torch.bfloat16 and _strided_cpu(dy) and dy.shape == x.shape and _fast(x)
            and _bf16_cpu(scale) and x.numel() > 0
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in (mean, rstd))):
        try:
            dx, dsc, dsh = _ln_bwd_kernel(
                dy.contiguous(), x.contiguous(), scale.contiguous() if scale is not None else None,
                mean, rstd, B, T, D, D, 1, want_scale, want_shift, kernel="ln_mod_bwd_bf16")
            return (dx, dsc.to(torch.bfloat16) if want_scale else x.new_zeros(0, dtype=torch.bfloat16),
                    dsh.to(torch.bfloat16) if want_shift else x.new_zeros(0, dtype=torch.bfloat16))
        except fallback.FAILURES as e:
            fallback.report(e, "layernorm_modulate_backward")
    dx, dsc, dsh = _ln_mod_bwd(dy.float(), x.float(), scale.float() if scale is not None else None,
                               mean.float(), rstd.float(), want_scale, want_shift)
    return dx, dsc.to(torch.bfloat16), dsh.to(torch.bfloat16)


@_ln_mod16_bwd.register_fake
def _(dy, x, scale, mean, rstd, want_scale, want_shift):
    B, T, D = x.shape
    return (torch.empty_like(x), x.new_empty((B, D) if want_scale else (0,), dtype=torch.bfloat16),
            x.new_empty((B, D) if want_shift else (0,), dtype=torch.bfloat16))


def _ln16_backward(ctx, gy, gmean, grstd):
    x, scale, mean, rstd = ctx.saved_tensors
    dx, dsc, dsh = _ln_mod16_bwd(gy, x, scale, mean, rstd, ctx.has_scale, ctx.has_shift)
    return dx, (dsc if ctx.has_scale else None), (dsh if ctx.has_shift else None), None


_ln_mod16.register_autograd(_ln16_backward, setup_context=_ln_setup)


# ------------------------------------------------------------ softmax, gated residual

def _rows_call(name: str, *tensors, extra=(), out_like=None):
    """Run a row kernel `name(*ptrs, out, rows, *extra)` over all rows, split over the team."""
    ffi, fn = kernel_fn(name)
    ins = [t.contiguous() for t in tensors]
    out = _fresh_like(out_like if out_like is not None else ins[0])
    rows = out.numel() // out.shape[-1] if out.dim() else 1
    fn(*[_ptr(ffi, t) for t in ins], _ptr(ffi, out), rows, *extra, kernel_threads())
    return out


@torch.library.custom_op("autohc::softmax", mutates_args=())
def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension (as torch.softmax(x, -1))."""
    return fallback.kernel_or(
        lambda: _rows_call("softmax_fwd", x, extra=(x.shape[-1],)),
        lambda: torch.softmax(x, -1),
        "softmax", served=_fast(x) and x.dim() > 0 and x.numel() > 0)


@torch.library.custom_op("autohc::softmax_backward", mutates_args=())
def softmax_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return fallback.kernel_or(
        lambda: _rows_call("softmax_bwd", grad, y, extra=(y.shape[-1],)),
        lambda: y * (grad - (grad * y).sum(-1, keepdim=True)),
        "softmax_backward", served=_fast(grad, y) and y.dim() > 0 and y.numel() > 0)


softmax.register_fake(lambda x: torch.empty_like(x, memory_format=torch.contiguous_format))
softmax_backward.register_fake(lambda g, y: torch.empty_like(y, memory_format=torch.contiguous_format))
softmax.register_autograd(lambda ctx, g: softmax_backward(g, ctx.saved_tensors[0]),
                          setup_context=lambda ctx, inputs, output: ctx.save_for_backward(output))


def _gated_impl(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    B, T, D = x.shape
    return fallback.kernel_or(
        lambda: _rows_call("gated_residual", x, y, gate, extra=(D, T), out_like=x),
        lambda: x + gate[:, None, :] * y,
        "gated", served=_fast(x, y) and _fast(gate) and x.numel() > 0)


_gated = torch.library.custom_op("autohc::gated_residual", mutates_args=())(_gated_impl)


def _gated16_impl(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Under autocast: the fp32 stream x plus a bf16 GEMM output y times the bf16 gate, in fp32
    (the product is not rounded to bf16 first)."""
    B, T, D = x.shape
    return fallback.kernel_or(
        lambda: _rows_call("gated_residual_bf16", x, y, gate, extra=(D, T), out_like=x),
        lambda: x + gate.float()[:, None, :] * y.float(),
        "gated", served=_fast(x) and _fast_any(y) and y.dtype == torch.bfloat16
        and y.shape == x.shape and _bf16_cpu(gate) and x.numel() > 0)


_gated16 = torch.library.custom_op("autohc::gated_residual_bf16", mutates_args=())(_gated16_impl)


for _op in (_gated, _gated16):
    _op.register_fake(lambda x, y, gate: torch.empty_like(x, memory_format=torch.contiguous_format))


@torch.library.custom_op("autohc::gated_residual_backward", mutates_args=())
def _gated_bwd(g: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy, dgate) of x + gate[:, None, :] * y for the fp32 gradient g: dy = g gate in y's
    dtype, dgate = the sum over T of g y in gate's (float32 or bfloat16; sums in fp32)."""
    B, T, D = y.shape
    if (_fast(g) and g.shape == y.shape and _fast_any(y) and gate.dtype == y.dtype
            and _strided_cpu(gate) and g.numel() > 0):
        try:
            ffi, fn = kernel_fn("gated_residual_bwd" + ("_bf16" if y.dtype == torch.bfloat16 else ""))
            gc, yc, gatec = g.contiguous(), y.contiguous(), gate.contiguous()
            dy, dgate = _fresh_like(yc, y.dtype), torch.empty(B, D)
            fn(*(_ptr(ffi, t) for t in (gc, yc, gatec, dy, dgate)), B, D, T, B * T, kernel_threads())
            return dy, dgate.to(gate.dtype)
        except fallback.FAILURES as e:
            fallback.report(e, "gated_residual_backward")
    gf = g.float()
    return (gf * gate.float()[:, None, :]).to(y.dtype), (gf * y.float()).sum(1).to(gate.dtype)


@_gated_bwd.register_fake
def _(g, y, gate):
    return torch.empty_like(y, memory_format=torch.contiguous_format), torch.empty_like(gate)


def _gated_setup(ctx, inputs, output):
    x, y, gate = inputs
    ctx.save_for_backward(y, gate)


def _gated_backward(ctx, g):
    y, gate = ctx.saved_tensors
    return g, *_gated_bwd(g, y, gate)


for _op in (_gated, _gated16):
    _op.register_autograd(_gated_backward, setup_context=_gated_setup)


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """DiT's `x + gate.unsqueeze(1) * y` in one pass; x, y: (B, T, D), gate: (B, D)."""
    if x.dim() != 3 or y.shape != x.shape or tuple(gate.shape) != (x.shape[0], x.shape[2]):
        raise ValueError(f"gated_residual: x, y must be (B, T, D) and gate (B, D); got "
                         f"{tuple(x.shape)}, {tuple(y.shape)}, {tuple(gate.shape)}")
    direct = runs_direct(x, y, gate)
    if x.dtype == torch.float32 and y.dtype == gate.dtype == torch.bfloat16:
        return (_gated16_impl if direct else _gated16)(x, y, gate)
    return (_gated_impl if direct else _gated)(x, y, gate)


# --------------- a gated residual and the next LayerNorm + modulate of its result, fused

def _gres_ln_kernel(x, y, gate, scale, shift) -> str | None:
    """The kernel that runs gated_residual_norm on these tensors, or None (the two ops run)."""
    if not (_fast(x) and x.numel() > 0 and y.shape == x.shape and _strided_cpu(y, gate, scale, shift)):
        return None
    B, T, D = x.shape
    if any(tuple(t.shape) != (B, D) for t in (gate, scale, shift)):
        return None
    dtypes = {t.dtype for t in (y, gate, scale, shift)}
    if dtypes == {torch.float32}:
        return "gres_ln_mod_fwd"
    if dtypes == {torch.bfloat16}:
        return "gres_ln_mod_fwd_bf16"
    return None


def gres_ln_impl(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, scale: torch.Tensor,
                 shift: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, h, mean, rstd): out = x + gate y (fp32), h = LayerNorm(out) (1 + scale) + shift in
    y's dtype, mean and rstd of out's rows (fp32)."""
    B, T, D = x.shape
    kernel = _gres_ln_kernel(x, y, gate, scale, shift)
    if kernel is not None:
        try:
            ffi, fn = kernel_fn(kernel)
            xc, yc, gc, sc, sh = (t.contiguous() for t in (x, y, gate, scale, shift))
            out = _fresh_like(xc)
            h = _fresh_like(xc, y.dtype)
            mean, rstd = torch.empty(B * T), torch.empty(B * T)
            fn(*(_ptr(ffi, t) for t in (xc, yc, gc, sc, sh, out, h, mean, rstd)), B * T, D, T, float(eps),
               kernel_threads())
            return out, h, mean, rstd
        except fallback.FAILURES as e:
            fallback.report(e, "gated_residual_norm")
    out = x + gate.float()[:, None, :] * y.float()
    h, mean, rstd = _ln_mod_reference(out, scale.float(), shift.float(), eps)
    return out, h.to(y.dtype), mean, rstd


_gres_ln = torch.library.custom_op("autohc::gated_residual_norm", mutates_args=())(gres_ln_impl)


@_gres_ln.register_fake
def _(x, y, gate, scale, shift, eps):
    B, T, D = x.shape
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, dtype=y.dtype, memory_format=torch.contiguous_format),
            x.new_empty(B * T), x.new_empty(B * T))


def gres_ln_backward_impl(dh: torch.Tensor, gout: torch.Tensor | None, out: torch.Tensor, y: torch.Tensor,
                          gate: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor,
                          rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx fp32, dy, dgate, dscale, dshift) of gated_residual_norm for the gradients dh of h and
    gout of out (None: out not used further); dy, dgate, dscale, dshift in y's dtype, sums in fp32."""
    return _gres_ln_grads(dh, gout, out, y, gate, scale, mean, rstd, False)[:5]


def gres_ln_backward_bias_impl(dh, gout, out, y, gate, scale, mean, rstd):
    """gres_ln_backward_impl's five gradients and a sixth: the bias gradient of the Linear whose
    output y is, dy summed over every row (float32 (D,), rounded to y's dtype first, as
    autocast's addmm backward sums its bf16 dY), taken as the kernel writes dy."""
    return _gres_ln_grads(dh, gout, out, y, gate, scale, mean, rstd, True)


def _gres_ln_grads(dh, gout, out, y, gate, scale, mean, rstd, bias: bool):
    B, T, D = out.shape
    bf16 = y.dtype == torch.bfloat16
    kernel = "gres_ln_mod_bwd_bf16" if bf16 else "gres_ln_mod_bwd"
    if (_gres_ln_kernel(out, y, gate, scale, scale) is not None and dh.shape == out.shape
            and dh.dtype == y.dtype and _strided_cpu(dh) and (gout is None or _fast(gout, out))
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in (mean, rstd))):
        try:
            ffi, fn = kernel_fn(kernel)
            dhc, oc, yc, gc, sc = (t.contiguous() for t in (dh, out, y, gate, scale))
            goc = gout.contiguous() if gout is not None else None
            dx = _fresh_like(oc)
            dy = _fresh_like(oc, y.dtype)
            dgate, dscale, dshift = torch.empty(B, D), torch.empty(B, D), torch.empty(B, D)
            dbias = torch.empty(B, D) if bias else None     # (per sample: summed below)
            fn(*(_ptr(ffi, t) for t in (dhc, goc, oc, sc, mean, rstd, yc, gc, dx, dy, dgate, dscale, dshift,
                                        dbias)),
               B, D, T, B * T, kernel_threads())
            db = dbias.sum(0).to(y.dtype).float() if bias else None
            return dx, dy, dgate.to(y.dtype), dscale.to(y.dtype), dshift.to(y.dtype), db
        except fallback.FAILURES as e:
            fallback.report(e, "gated_residual_norm_backward")
    # the LayerNorm's own backward, then the residual's and the gate's (no autograd here)
    dx, dscale, dshift = _ln_mod_bwd(dh.float(), out.float(), scale.float(), mean.float(), rstd.float(),
                                     True, True)
    if gout is not None:
        dx = dx + gout
    dy = (dx * gate.float()[:, None, :]).to(y.dtype)
    return (dx, dy, (dx * y.float()).sum(1).to(y.dtype), dscale.to(y.dtype), dshift.to(y.dtype),
            dy.reshape(-1, D).sum(0).float() if bias else None)


_gres_ln_bwd = torch.library.custom_op("autohc::gated_residual_norm_backward", mutates_args=())(gres_ln_backward_impl)


@_gres_ln_bwd.register_fake
def _(dh, gout, out, y, gate, scale, mean, rstd):
    return (torch.empty_like(out, memory_format=torch.contiguous_format),
            torch.empty_like(y, memory_format=torch.contiguous_format),
            torch.empty_like(gate), torch.empty_like(gate), torch.empty_like(gate))


def _gres_ln_setup(ctx, inputs, output):
    x, y, gate, scale, shift, eps = inputs
    out, h, mean, rstd = output
    ctx.save_for_backward(out, y, gate, scale, mean, rstd)


def _gres_ln_backward(ctx, gout, gh, gmean, grstd):
    out, y, gate, scale, mean, rstd = ctx.saved_tensors
    if gh is None:                      # (h unused: only the residual's gradient)
        gh = torch.zeros_like(out, dtype=y.dtype)
    dx, dy, dgate, dscale, dshift = _gres_ln_bwd(gh, gout, out, y, gate, scale, mean, rstd)
    return dx, dy, dgate, dscale, dshift, None


_gres_ln.register_autograd(_gres_ln_backward, setup_context=_gres_ln_setup)


def gated_residual_norm(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, scale: torch.Tensor,
                        shift: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, h) with out = gated_residual(x, y, gate) and h = layernorm_modulate(out, scale,
    shift, eps), in one pass over the rows (DiT: a block's residual add and the next LayerNorm
    + modulate); its backward is one pass too. x: (B, T, D) float32; y: (B, T, D) and gate,
    scale, shift: (B, D), all float32 or all bfloat16 (autocast's: h is then bf16, as
    layernorm_modulate's under autocast). Other dtypes run the two ops."""
    if x.dim() != 3 or y.shape != x.shape or any(tuple(t.shape) != (x.shape[0], x.shape[2])
                                                 for t in (gate, scale, shift)):
        raise ValueError(f"gated_residual_norm: x, y must be (B, T, D) and gate, scale, shift (B, D); got "
                         f"{tuple(x.shape)}, {tuple(y.shape)}, {tuple(gate.shape)}, {tuple(scale.shape)}, "
                         f"{tuple(shift.shape)}")
    if _gres_ln_kernel(x, y, gate, scale, shift) is None:
        out = gated_residual(x, y, gate)
        return out, layernorm_modulate(out, scale, shift, eps)
    fn = gres_ln_impl if runs_direct(x, y, gate, scale, shift) else _gres_ln
    out, h, _, _ = fn(x, y, gate, scale, shift, float(eps))
    return out, h


class FusedOps(NamedTuple):
    """The fused operators a DiT's blocks take (dit.DiT.use_fused_ops)."""
    layernorm_modulate: Callable
    gated_residual: Callable
    qkv_attention: Callable | None = None
    linear_gelu: Callable | None = None     # (x, fc1) -> GELU(tanh)(fc1(x))
    mlp: Callable | None = None             # (x, fc1, fc2) -> fc2(GELU(tanh)(fc1(x)))
    # (x, y, gate, scale, shift, eps) -> (gated_residual(x, y, gate), layernorm_modulate of it)
    gated_residual_norm: Callable | None = None
    # (c, adaLN_modulation modules) -> [m(c) for each]: every block's modulation at once
    modulations: Callable | None = None
    # (block, x, h, gate_msa, shift_mlp, scale_mlp, gate_mlp, next shift, next scale, eps) ->
    # (x', h') of a whole block as one call (one autograd node in training), or None: run it op by op
    block: Callable | None = None
    # (images, the patch conv) -> conv(images) as (B, tokens, D)
    patch_embed: Callable | None = None


def _qkv_attention(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    from .attention import attention_qkv     # (attention.py is imported after this module)
    return attention_qkv(qkv, heads)


def _linear_gelu(x: torch.Tensor, linear: torch.nn.Module) -> torch.Tensor:
    from .autocast import linear_gelu     # (autocast.py is imported after this module)
    return linear_gelu(x, linear)


def _mlp(x: torch.Tensor, fc1: torch.nn.Module, fc2: torch.nn.Module) -> torch.Tensor:
    from .autocast import mlp
    return mlp(x, fc1, fc2)


def _modulations(c: torch.Tensor, adaln: list) -> list:
    from .autocast import modulations
    return modulations(c, adaln)


def _block(block, x, h, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_n, scale_n, eps):
    from .block import block_step
    return block_step(block, x, h, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_n, scale_n, eps,
                      norm=(gres_ln_impl, gres_ln_backward_bias_impl))


def _patch_embed(x: torch.Tensor, conv: torch.nn.Module) -> torch.Tensor:
    from .autocast import patch_embed
    return patch_embed(x, conv)


FUSED = FusedOps(layernorm_modulate, gated_residual, _qkv_attention, _linear_gelu, _mlp,
                 gated_residual_norm, _modulations, _block, _patch_embed)


# ------------------------------------------------- aten CPU kernels for autohc.install()

def _dense(*ts: torch.Tensor) -> bool:
    """Served by autohc only where the result's layout is the same as ATen's (contiguous)."""
    return _fast(*ts) and all(t.is_contiguous() for t in ts) and ts[0].numel() > 0


def _dense_any(*ts: torch.Tensor) -> bool:
    """_dense, float32 or bfloat16 (autocast's GELU / SiLU: the kernels' bf16 forms)."""
    return _fast_any(*ts) and all(t.is_contiguous() for t in ts) and ts[0].numel() > 0


def aten_gelu(x, *, approximate="none"):
    return fallback.kernel_or(
        lambda: _run("gelu_tanh_fwd", x),
        lambda: torch.ops.aten.gelu.out(x, approximate=approximate, out=x.new_empty(0)),
        "gelu", served=approximate == "tanh" and _dense_any(x))


def aten_gelu_backward(grad, x, *, approximate="none"):
    return fallback.kernel_or(
        lambda: _run("gelu_tanh_bwd", grad, x),
        lambda: torch.ops.aten.gelu_backward.grad_input(grad, x, approximate=approximate,
                                                        grad_input=x.new_empty(0)),
        "gelu_backward", served=approximate == "tanh" and _dense_any(grad, x))


# bf16 SiLU stays ATen's under install(): its bf16 kernel is slower there (measured on a Zen 4,
# `autohc bench ops --dtype bf16`: 0.82x forward, 0.88x backward); autohc.ops.silu still takes bf16
def aten_silu(x):
    return fallback.kernel_or(
        lambda: _run("silu_fwd", x),
        lambda: torch.ops.aten.silu.out(x, out=x.new_empty(0)),
        "silu", served=_dense(x))


def aten_silu_backward(grad, x):
    return fallback.kernel_or(
        lambda: _run("silu_bwd", grad, x),
        lambda: torch.ops.aten.silu_backward.grad_input(grad, x, grad_input=x.new_empty(0)),
        "silu_backward", served=_dense(grad, x))


def aten_softmax(x, dim, half_to_float):
    return fallback.kernel_or(
        lambda: _rows_call("softmax_fwd", x, extra=(x.shape[-1],)),
        lambda: torch.ops.aten._softmax.out(x, dim, half_to_float, out=x.new_empty(0)),
        "softmax", served=not half_to_float and x.dim() > 0 and dim in (-1, x.dim() - 1) and _dense(x))


def aten_softmax_backward(grad, out, dim, input_dtype):
    return fallback.kernel_or(
        lambda: _rows_call("softmax_bwd", grad, out, extra=(out.shape[-1],)),
        lambda: torch.ops.aten._softmax_backward_data.out(grad, out, dim, input_dtype,
                                                          grad_input=grad.new_empty(0)),
        "softmax_backward", served=input_dtype == torch.float32 and out.dim() > 0
        and dim in (-1, out.dim() - 1) and _dense(grad, out))


def _ln_served(x, normalized_shape, *affine) -> bool:
    """float32, non-empty, shapes as LayerNorm wants (a non-contiguous x is copied: ATen's
    LayerNorm makes it contiguous too, and its results are contiguous either way)."""
    nd = len(normalized_shape)
    shape = tuple(normalized_shape)
    return (nd >= 1 and x.dim() >= nd and _fast(x) and x.numel() > 0
            and tuple(x.shape[x.dim() - nd:]) == shape
            and all(t is None or (_fast(t) and tuple(t.shape) == shape) for t in affine))


def _ln_as_group_norm(x, normalized_shape):
    """(x as rows x D x 1, rows, D): LayerNorm over D is GroupNorm with one group over D
    channels, which ATen still computes itself while LayerNorm is autohc's (its .out form
    calls back into the overridden kernel)."""
    D = math.prod(normalized_shape)
    rows = x.numel() // D if D else 0
    return x.reshape(rows, D, 1), rows, D


def aten_native_layer_norm(x, normalized_shape, weight, bias, eps):
    """torch's LayerNorm (any normalized_shape over contiguous trailing dims, with or without
    weight and bias): the ln_mod_fwd kernel with the weight as its scale (plus_one 0)."""
    nd = len(normalized_shape)
    stat = tuple(x.shape[:x.dim() - nd]) + (1,) * nd
    if _ln_served(x, normalized_shape, weight, bias):
        D = math.prod(normalized_shape)
        rows = x.numel() // D
        w = weight.contiguous() if weight is not None else None     # the kernel reads D in a row
        b = bias.contiguous() if bias is not None else None
        try:
            y, mean, rstd = _ln_fwd_kernel(x.contiguous(), w, b, rows, D, rows, eps, 0)
            return y.view(x.shape), mean.view(stat), rstd.view(stat)
        except fallback.FAILURES as e:
            fallback.report(e, "native_layer_norm")
    x3, rows, D = _ln_as_group_norm(x, normalized_shape)
    w = weight.reshape(D) if weight is not None else None
    b = bias.reshape(D) if bias is not None else None
    y, mean, rstd = torch.ops.aten.native_group_norm(x3, w, b, rows, D, 1, 1, eps)
    return y.view(x.shape), mean.view(stat), rstd.view(stat)


def aten_native_layer_norm_backward(grad, x, normalized_shape, mean, rstd, weight, bias, mask):
    """Its backward: each thread takes a block of rows (a "sample" of ln_mod_bwd with a shared
    weight) and writes partial dweight / dbias, added up here."""
    if _ln_served(x, normalized_shape, weight) and _fast(grad, x) \
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in (mean, rstd)):
        D = math.prod(normalized_shape)
        rows = x.numel() // D
        try:
            threads = split_threads("ln_mod_bwd", x.numel())
            T = -(-rows // threads)             # a block of rows per thread, one shared weight
            dx, dw, db = _ln_bwd_kernel(
                grad.contiguous(), x.contiguous(), weight.contiguous() if weight is not None else None,
                mean, rstd, -(-rows // T), T, D, 0, 0, mask[1], mask[2])
            shape = tuple(normalized_shape)
            return (dx.view(x.shape) if mask[0] else None,
                    dw.sum(0).view(shape) if dw is not None else None,
                    db.sum(0).view(shape) if db is not None else None)
        except fallback.FAILURES as e:
            fallback.report(e, "native_layer_norm_backward")
    x3, rows, D = _ln_as_group_norm(x, normalized_shape)
    w = weight.reshape(D) if weight is not None else None
    dx, dw, db = torch.ops.aten.native_group_norm_backward(
        grad.reshape(rows, D, 1), x3, mean.reshape(rows, 1), rstd.reshape(rows, 1), w, rows, D, 1,
        1, [mask[0], mask[1] and weight is not None, mask[2] and bias is not None])
    shape = tuple(normalized_shape)
    return (dx.view(x.shape) if dx is not None else None,
            dw.view(shape) if dw is not None else None, db.view(shape) if db is not None else None)


ATEN_IMPLS = {"gelu": aten_gelu, "gelu_backward": aten_gelu_backward,
              "silu": aten_silu, "silu_backward": aten_silu_backward,
              "native_layer_norm": aten_native_layer_norm,
              "native_layer_norm_backward": aten_native_layer_norm_backward,
              "_softmax": aten_softmax, "_softmax_backward_data": aten_softmax_backward}

if os.environ.get("AUTOHC_EAGER_BUILD"):     # compile at import (e.g. before forking workers)
    for _kernel in KERNELS:
        library(_kernel, default_eltwise(cpu.best_isa()))
