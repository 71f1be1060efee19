"""Fused attention (templates/ops/attention.c.j2, flash style) in torch: a custom op with
autograd, and the CPU kernels that autohc.install() puts under F.scaled_dot_product_attention.

    autohc.ops.attention(q, k, v, scale=None)     softmax(scale q kᵀ) v, (B, H, L, D) tensors
    autohc.install()                              also serves torch's CPU flash-attention op
                                                  (what F.scaled_dot_product_attention runs on
                                                  CPU) and its backward

Served: float32 or bfloat16 CPU tensors (bf16: what SDPA sees under torch.autocast; fp32 sums,
on AMX tiles or AVX512_BF16 dot products where the CPU has them), 4-D, q, k, v of one batch, head count and head dim, the last dim
contiguous (other strides are read in place), no mask, no causal mask, no dropout (SDPA runs
dropout on its math path, never on this op). Everything else goes to ATen's own flash kernel,
captured before install() registers its own, so those calls give exactly ATen's result.
With first-use tuning on, the forward of a problem goes to ATen's flash kernel where a race
found it faster (`_aten_forward_faster`); the backward stays autohc's.
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch

from ..hw import cpu
from ..kernels.attention import AttentionParams, default_attention
from ..kernels.attention.params import bf16_attention
from ..kernels.family import ParamError
from ..kernels.isa import ISAS
from ..kernels.attention.codegen import library
from ..kernels.attention.params import KERNEL
from ..kernels.gemm.kernel import tiles_emulated
from ..kernels.gemm.matmul import AtenFaster
from ..runtime.memory import fresh_empty
from ..tune import first_use, pipeline, registry
from . import fallback
from .direct import runs_direct
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


def params_for(dtype: torch.dtype = torch.float32) -> AttentionParams:
    """The tuner's trial, else the registry's tuned parameters for this CPU and thread count
    (`autohc tune --op attention [--dtype bf16]`), else the default; bf16 without its own
    entry takes the fp32 blocks and tiles on the bf16 back-end (bf16_isa)."""
    if _forced and _forced[-1].dtype == ("bf16" if dtype == torch.bfloat16 else "fp32"):
        return _forced[-1]
    bf16 = dtype == torch.bfloat16
    p = ((bf16 and registry.tuned_op_params("attention", KERNEL + "_bf16", kernel_threads()))
         or registry.tuned_op_params("attention", KERNEL, kernel_threads())
         or default_attention(cpu.best_isa()))
    if not bf16:
        return p
    isa = bf16_isa()[0]
    try:
        return bf16_attention(p, isa)
    except ParamError:          # tuned for another vector width: the default's tiles
        return bf16_attention(default_attention(isa if isa in ISAS else cpu.best_isa()), isa)


def bf16_isa() -> tuple[str, str]:
    """(back-end, why) of bf16 attention: the GEMMs' (cpu.bf16_isa: AMX tiles, AVX512_BF16
    dot products, else the fp32 kernels on widened inputs; AUTOHC_BF16_ISA picks). The AMX
    kernel's softmax and packs are AVX512_BF16 vector code, which every CPU that cpu.bf16_isa
    gives amx runs (runnable_bf16_isas lists amx only beside avx512bf16)."""
    return cpu.bf16_isa()


def _functions(p: AttentionParams):
    return _functions_of(p, p.amx and tiles_emulated())


@functools.lru_cache(maxsize=None)
def _functions_of(p: AttentionParams, emulate_tiles: bool):
    lib = library(p, emulate_tiles)
    sym = p.symbol()
    return lib.ffi, getattr(lib.lib, f"{sym}_forward"), getattr(lib.lib, f"{sym}_backward")


def served(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """What the kernel computes: the shapes and dtypes above (masks, dropout are the caller's
    to check)."""
    ts = (q, k, v)
    if q.dtype not in (torch.float32, torch.bfloat16) or not all(
            t.dtype == q.dtype and t.device.type == "cpu" and t.layout == torch.strided
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
    return ffi.cast("uint16_t *" if t.dtype == torch.bfloat16 else "float *", t.data_ptr())


def out_like_query(q: torch.Tensor) -> torch.Tensor:
    """An empty result laid out as ATen's flash attention lays out its output: as
    empty_like(query), dense in the query's stride order (DiT's q view of qkv gives
    (B, L, H, D) memory)."""
    return torch.empty_like(q, memory_format=torch.preserve_format)


def grad_like(t: torch.Tensor, pooled: bool = False) -> torch.Tensor:
    """An empty gradient laid out as ATen's flash-attention backward gives it: (B, L, H, D)
    in memory. pooled (the kernel's own results, fp32 or bf16): a block of the result pool
    where it is large, as the GEMMs' results are. A fresh mapping is faulted in and zeroed by
    the OS inside the kernel's first write: with a new 14 MB d qkv per layer, the 28 attention
    backward calls of a DiT-XL/2 step (batch 4, Zen 5, 2 threads) took 0.24-0.51 s; from the
    pool, 0.24-0.26. (The fake kernel and the ATen path take plain torch.empty.)"""
    B, H, L, D = t.shape
    if pooled:
        return fresh_empty(B, L, H, D, dtype=t.dtype).transpose(1, 2)
    return torch.empty(B, L, H, D, dtype=t.dtype).transpose(1, 2)


def lse_like(q: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp as ATen lays it out: (B, L, H) in memory, seen as (B, H, L)."""
    B, H, L, _ = q.shape
    return torch.empty(B, L, H, dtype=torch.float32).transpose(1, 2)


def _scale(scale: float | None, head_dim: int) -> float:
    """SDPA's scale: 1/sqrt(head dim) unless given."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _check(rc: int, what: str) -> None:
    if rc == -2:
        raise RuntimeError(f"autohc attention {what}: the OS did not permit the AMX tiles "
                           "(ARCH_REQ_XCOMP_PERM); AUTOHC_BF16_ISA=avx512bf16 runs without them")
    if rc != 0:
        raise MemoryError(f"autohc attention {what}: a thread could not allocate its buffers")


def forward_kernel(q, k, v, scale: float | None):
    """(out (B, H, L, D), lse (B, H, L)), both laid out as ATen's flash attention lays them
    out (what torch.compile's fake kernels of that op promise)."""
    ffi, fwd, _ = _functions(params_for(q.dtype))
    q, k, v = _inner(q), _inner(k), _inner(v)
    B, H, L, D = q.shape
    S = k.shape[2]
    out, lse = out_like_query(q), lse_like(q)
    scale = _scale(scale, D)
    _check(fwd(_ptr(ffi, q), _ptr(ffi, k), _ptr(ffi, v), _ptr(ffi, out), _ptr(ffi, lse),
               B, H, L, S, D, _strides(ffi, q, k, v, out, lse), scale, kernel_threads()), "forward")
    return out, lse


def backward_kernel(grad, q, k, v, out, lse, scale: float | None, into=None):
    """(dq, dk, dv) from the forward's out and lse, laid out as ATen's backward: (B, L, H, D)
    in memory; or written into `into`, three (B, H, L, D) views with a unit last stride
    (attention_qkv: the views of one packed gradient)."""
    ffi, _, bwd = _functions(params_for(q.dtype))
    grad, q, k, v, out = (_inner(t) for t in (grad, q, k, v, out))
    B, H, L, D = q.shape
    S = k.shape[2]
    dq, dk, dv = into if into is not None else tuple(grad_like(t, pooled=True) for t in (q, k, v))
    scale = _scale(scale, D)
    _check(bwd(_ptr(ffi, grad), _ptr(ffi, q), _ptr(ffi, k), _ptr(ffi, v), _ptr(ffi, out),
               _ptr(ffi, lse), _ptr(ffi, dq), _ptr(ffi, dk), _ptr(ffi, dv), B, H, L, S, D,
               _strides(ffi, q, k, v, out, grad, lse, dq, dk, dv), scale, kernel_threads()), "backward")
    return dq, dk, dv


# ----------------------------------------------------------------- the custom op

def _math(q, k, v, scale):
    """The reference (ATen's math): other dtypes and the fallback of the custom op (bf16 in
    fp32, the output rounded to bf16, the log-sum-exp fp32 as the kernel's)."""
    dtype = q.dtype
    if dtype == torch.bfloat16:
        q, k, v = q.float(), k.float(), v.float()
    s = (q @ k.transpose(-2, -1)) * _scale(scale, q.shape[-1])
    return (torch.softmax(s, -1) @ v).to(dtype), torch.logsumexp(s, -1)


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.bfloat16 else dtype


def _laid_out(t: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """t in the layout of `empty` (the math path's results take the kernel's layouts, so the
    op's fake kernel holds on every path)."""
    return empty.copy_(t) if t.stride() != empty.stride() else t


def _attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    def math_path():
        out, lse = _math(q, k, v, scale)
        return (_laid_out(out, out_like_query(q)),
                _laid_out(lse, lse_like(q).to(lse.dtype)))
    return fallback.kernel_or(lambda: forward_kernel(q, k, v, scale), math_path, "attention",
                              served=served(q, k, v))


_attention = torch.library.custom_op("autohc::attention", mutates_args=())(_attention_impl)


@_attention.register_fake
def _(q, k, v, scale):
    return out_like_query(q), lse_like(q).to(_lse_dtype(q.dtype))


@torch.library.custom_op("autohc::attention_backward", mutates_args=())
def _attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor,
                        scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    def math_path():
        sc = _scale(scale, q.shape[-1])
        wide = [t.float() if t.dtype == torch.bfloat16 else t for t in (grad, q, k, v, out)]
        gw, qw, kw, vw, ow = wide
        p = torch.exp((qw @ kw.transpose(-2, -1)) * sc - lse.to(qw.dtype).unsqueeze(-1))
        dp = gw @ vw.transpose(-2, -1)
        ds = p * (dp - (gw * ow).sum(-1, keepdim=True)) * sc
        return tuple(_laid_out(g.to(t.dtype), grad_like(t))
                     for g, t in ((ds @ kw, q), (ds.transpose(-2, -1) @ qw, k), (p.transpose(-2, -1) @ gw, v)))
    return fallback.kernel_or(lambda: backward_kernel(grad, q, k, v, out, lse, scale), math_path,
                              "attention_backward", served=_backward_served(grad, q, k, v, out, lse))


@_attention_backward.register_fake
def _(grad, q, k, v, out, lse, scale):
    return grad_like(q), grad_like(k), grad_like(v)


def _backward_served(grad, q, k, v, out, lse) -> bool:
    """The backward kernel's inputs: the forward's dtypes, the log-sum-exp fp32."""
    return (served(q, k, v) and grad.dtype == q.dtype and out.dtype == q.dtype
            and lse.dtype == torch.float32)


def _setup(ctx, inputs, output):
    q, k, v, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.scale = scale


def _backward(ctx, gout, glse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _attention_backward(gout.contiguous(), q, k, v, out, lse, ctx.scale)
    return dq, dk, dv, None


_attention.register_autograd(_backward, setup_context=_setup)


# ------------------------------- attention straight from the packed qkv GEMM output

def qkv_views(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as (B, H, T, hd) views of a (B, T, 3 * H * hd) qkv (timm's reshape/permute/unbind,
    without the autograd nodes whose backward stacks and copies the gradient twice)."""
    B, T, C = qkv.shape
    return qkv.reshape(B, T, 3, heads, C // (3 * heads)).permute(2, 0, 3, 1, 4).unbind(0)


def _heads_view(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, T, H * hd) -> a (B, H, T, hd) view."""
    B, T, C = t.shape
    return t.reshape(B, T, heads, C // heads).transpose(1, 2)


def _check_qkv(qkv: torch.Tensor, heads: int) -> None:
    if qkv.dim() != 3 or heads < 1 or qkv.shape[-1] % (3 * heads):
        raise ValueError(f"attention_qkv: qkv must be (B, T, 3 * heads * head_dim); got "
                         f"{tuple(qkv.shape)} with {heads} heads")


def attention_qkv_impl(qkv: torch.Tensor, heads: int,
                       scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, T, H * hd), lse (B, H, T)) of the attention of qkv's q, k, v (the inner
    attention called as a function: this op is what tracing and the profiler see)."""
    B, T, C = qkv.shape
    out, lse = _attention_impl(*qkv_views(qkv, heads), scale)     # out: (B, T, H, hd) in memory
    return out.transpose(1, 2).reshape(B, T, C // 3), lse


_attention_qkv = torch.library.custom_op("autohc::attention_qkv", mutates_args=())(attention_qkv_impl)


@_attention_qkv.register_fake
def _(qkv, heads, scale):
    B, T, C = qkv.shape
    q = qkv_views(qkv, heads)[0]
    return qkv.new_empty(B, T, C // 3), lse_like(q).to(_lse_dtype(qkv.dtype))


def attention_qkv_backward_impl(grad: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor,
                                lse: torch.Tensor, heads: int, scale: float | None) -> torch.Tensor:
    """d qkv (B, T, 3 * H * hd, contiguous): the kernel writes dq, dk, dv straight into their
    thirds of it; elsewhere the three gradients of attention_backward, packed."""
    B, T, C = qkv.shape
    q, k, v = qkv_views(qkv, heads)
    g, o = _heads_view(grad, heads), _heads_view(out, heads)

    def kernel():
        dqkv = fresh_empty(B, T, C, dtype=qkv.dtype)     # from the result pool (grad_like)
        backward_kernel(g, q, k, v, o, lse, scale, into=qkv_views(dqkv, heads))
        return dqkv

    def packed_math():
        dq, dk, dv = _attention_backward(g, q, k, v, o, lse, scale)
        return torch.stack([t.transpose(1, 2) for t in (dq, dk, dv)], dim=2).reshape(B, T, C)
    return fallback.kernel_or(kernel, packed_math, "attention_backward",
                              served=_backward_served(g, q, k, v, o, lse))


_attention_qkv_backward = torch.library.custom_op("autohc::attention_qkv_backward",
                                                  mutates_args=())(attention_qkv_backward_impl)


@_attention_qkv_backward.register_fake
def _(grad, qkv, out, lse, heads, scale):
    return torch.empty_like(qkv, memory_format=torch.contiguous_format)


def _qkv_setup(ctx, inputs, output):
    qkv, heads, scale = inputs
    ctx.save_for_backward(qkv, *output)
    ctx.heads, ctx.scale = heads, scale


def _qkv_backward(ctx, gout, glse):
    qkv, out, lse = ctx.saved_tensors
    return _attention_qkv_backward(gout.contiguous(), qkv, out, lse, ctx.heads, ctx.scale), None, None


_attention_qkv.register_autograd(_qkv_backward, setup_context=_qkv_setup)


def attention_qkv(qkv: torch.Tensor, heads: int, scale: float | None = None) -> torch.Tensor:
    """F.scaled_dot_product_attention(q, k, v) of the q, k, v that timm's Attention takes out of
    a (B, T, 3 * heads * head_dim) qkv, returned as (B, T, heads * head_dim) (what goes into
    proj); its backward writes d qkv in one pass (no stack, no permute copy)."""
    _check_qkv(qkv, heads)
    op = attention_qkv_impl if runs_direct(qkv) else _attention_qkv
    return op(qkv, int(heads), None if scale is None else float(scale))[0]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """softmax(scale q kᵀ) v over (B, H, L, D) q and (B, H, S, D) k, v (as
    F.scaled_dot_product_attention without mask or dropout); scale 1/sqrt(D) by default."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or k.shape[:2] != q.shape[:2] \
            or k.shape[3] != q.shape[3]:
        raise ValueError(f"attention: q must be (B, H, L, D) and k, v (B, H, S, D); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    op = _attention_impl if runs_direct(q, k, v) else _attention
    return op(q, k, v, None if scale is None else float(scale))[0]


# ------------------------------------------- aten CPU kernels for autohc.install()

ATEN_FLASH = {name: fallback.captured(name) for name in (FLASH, FLASH_BACKWARD)}


def _counted(who: str, result):
    stats[who] += 1
    return result


def _call_aten(name: str, *args, **kwargs):
    stats["aten"] += 1
    return fallback.call_captured(ATEN_FLASH[name], *args, **kwargs)


def _flash_served(q, k, v, dropout_p, is_causal, attn_mask) -> bool:
    return dropout_p == 0.0 and not is_causal and attn_mask is None and served(q, k, v)


# First-use tuning of the forward (under install(), first-use on): per problem, whether ATen's
# flash forward is faster here than autohc's. Its out and logsumexp are laid out and valued as
# autohc's, so autohc's backward takes them either way. On an AMX Xeon (family 6 model 167),
# DiT-S/2's bf16 attention (8 x 6 x 256 x 64, 2 threads): ATen's forward 1.66 ms against 4.62
# (its brgemm runs on the tiles), ATen's forward and backward 18.05 ms against 16.95.
_forward_aten: dict = {}
MAX_FORWARD_PROBLEMS = 1024


def _aten_forward_faster(q, k, v, scale) -> bool:
    """Race the two forwards once per problem and process (both only read q, k, v; their
    results are dropped): ATen's where it is faster in the race and in a second one (no
    margin: at a tie either is as good). False where first-use tuning is off."""
    if not first_use.enabled():
        return False
    key = (tuple(q.shape), tuple(k.shape), q.dtype, q.stride(), k.stride(), v.stride(), scale,
           kernel_threads())
    hit = _forward_aten.get(key)
    if hit is None:
        runs = {"autohc": lambda: forward_kernel(q, k, v, scale),
                "aten": lambda: fallback.call_captured(ATEN_FLASH[FLASH], q, k, v, 0.0, False, scale=scale)}
        race = first_use.racer(runs)
        hit = pipeline.faster_twice(race(list(runs)), "autohc", "aten", race)[0]
        if len(_forward_aten) >= MAX_FORWARD_PROBLEMS:
            _forward_aten.clear()
        _forward_aten[key] = hit
    return hit


def aten_flash(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    def kernel():
        if _aten_forward_faster(query, key, value, scale):
            raise AtenFaster("attention forward")
        return _counted("autohc", forward_kernel(query, key, value, scale))
    return fallback.kernel_or(
        kernel,
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
        and _backward_served(grad_out, query, key, value, out, logsumexp))


# only where ATen's own kernels could be captured, so that every call not served still has them
ATEN_IMPLS = ({FLASH: aten_flash, FLASH_BACKWARD: aten_flash_backward}
              if all(ATEN_FLASH.values()) else {})
