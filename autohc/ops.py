"""AI operators from templates/ops: GELU(tanh), SiLU, LayerNorm + adaLN modulate, softmax,
gated residual (forward + backward).

    autohc.ops.gelu_tanh(x), autohc.ops.silu(x)      torch custom ops with autograd
    autohc.ops.layernorm_modulate(x, scale, shift)   DiT's modulate(norm(x), shift, scale)
    autohc.ops.softmax(x), autohc.ops.gated_residual(x, y, gate)
    autohc.install()                                 also routes F.gelu(approximate="tanh"),
                                                     F.silu, F.layer_norm and last-dim softmax
                                                     on float32 CPU tensors (ATEN_IMPLS)

float32 CPU tensors run the generated kernels, split over autohc.override.kernel_threads() threads
(install()'s count while installed, else torch.get_num_threads())
(cffi releases the GIL); everything else runs torch's own implementation.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

from . import cpu, numa
from .build import build
from .codegen.params import ISAS, ParamError
from .codegen.render import environment
from .memory import fresh_like as _fresh_like
from .override import kernel_threads

PARALLEL_MIN = 1 << 16          # below this many elements one thread is faster


@dataclass(frozen=True)
class EltwiseParams:
    isa: str = "avx2"
    vl: int = 8                 # fp32 lanes per vector
    unroll: int = 2             # vectors per loop iteration
    nt: bool = False            # non-temporal stores for results of 8 MB and more per call
    threads: int = 0            # threads an op splits over: 0 = all of kernel_threads()

    def validate(self) -> "EltwiseParams":
        if self.isa not in ISAS:
            raise ParamError(f"isa={self.isa!r}: one of {tuple(ISAS)}")
        if type(self.vl) is not int or self.vl not in (4, 8, 16):
            raise ParamError(f"vl={self.vl!r}: one of (4, 8, 16)")
        if type(self.unroll) is not int or not 1 <= self.unroll <= 8:
            raise ParamError(f"unroll={self.unroll!r}: an int in [1, 8]")
        if type(self.nt) is not bool:
            raise ParamError(f"nt={self.nt!r}: true or false")
        if type(self.threads) is not int or not 0 <= self.threads <= 1024:
            raise ParamError(f"threads={self.threads!r}: an int in [0, 1024] (0: all)")
        return self

    @property
    def compiled(self) -> tuple[str, int, int, bool]:
        """What the generated code depends on (threads is the caller's split)."""
        return (self.isa, self.vl, self.unroll, self.nt)

    @property
    def symbol(self) -> str:
        return f"autohc_ew_{self.isa}_{self.vl}_{self.unroll}" + ("_nt" if self.nt else "")

    def split_threads(self, elems: int) -> int:
        """Threads for an op of `elems` elements: one below PARALLEL_MIN, else this op's count
        (0: all), never more than kernel_threads()."""
        if elems < PARALLEL_MIN:
            return 1
        avail = kernel_threads()
        return min(self.threads, avail) if self.threads else avail


FUNCS = ("gelu_tanh_fwd", "silu_fwd", "tanh_fwd")
BWD_FUNCS = ("gelu_tanh_bwd", "silu_bwd")


@functools.lru_cache(maxsize=None)
def default_eltwise(isa: str | None = None) -> EltwiseParams:
    isa = isa or cpu.best_isa()
    return EltwiseParams(isa=isa, vl={"avx512": 16, "avx2": 8}.get(isa, 4), unroll=2).validate()


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
    from . import registry
    entry = registry.lookup_op("eltwise", kernel, kernel_threads())
    if entry is not None:
        try:
            p = EltwiseParams(**entry["params"]).validate()
            if p.isa in cpu.runnable_isas():
                return p
        except (ParamError, TypeError):
            pass            # an invalid entry is ignored, as for GEMMs
    return default_eltwise()


def library(params: EltwiseParams):
    """The compiled kernels of these parameters (built once per compiled set)."""
    return _library(*params.validate().compiled)


@functools.lru_cache(maxsize=None)
def _library(isa: str, vl: int, unroll: int, nt: bool):
    p = EltwiseParams(isa=isa, vl=vl, unroll=unroll, nt=nt).validate()
    src = environment().get_template("ops/eltwise.c.j2").render(
        isa=p.isa, vl=p.vl, unroll=p.unroll, nt=p.nt, sym=p.symbol)
    cdef = "".join(f"void {p.symbol}_{f}(const float *x, float *y, int64_t n);\n" for f in FUNCS)
    cdef += "".join(f"void {p.symbol}_{f}(const float *g, const float *x, float *dx, int64_t n);\n"
                    for f in BWD_FUNCS)
    cdef += (f"void {p.symbol}_ln_mod_fwd(const float *x, const float *scale, const float *shift, "
             "float *y, float *mean_out, float *rstd_out, int64_t r0, int64_t r1, int64_t D, "
             "int64_t T, float eps, int plus_one);\n"
             f"void {p.symbol}_ln_mod_bwd(const float *dy, const float *x, const float *scale, "
             "const float *mean, const float *rstd, float *dx, float *dscale, float *dshift, "
             "int64_t b0, int64_t b1, int64_t D, int64_t T, int64_t rows, int64_t sstride, "
             "int plus_one);\n"
             f"void {p.symbol}_adamw(float *p, const float *g, float *m, float *v, int64_t n, "
             "float lr, float b1, float b2, float eps, float wd, float bc1, float bc2);\n"
             f"void {p.symbol}_adamw_multi(float *const *p, const float *const *g, float *const *m, "
             "float *const *v, const int64_t *n, int64_t count, int64_t start, int64_t stop, "
             "float lr, float b1, float b2, float eps, float wd, float bc1, float bc2);\n"
             f"void {p.symbol}_gated_residual(const float *x, const float *y, const float *gate, "
             "float *out, int64_t r0, int64_t r1, int64_t D, int64_t T);\n"
             f"void {p.symbol}_softmax_fwd(const float *x, float *y, int64_t r0, int64_t r1, int64_t D);\n"
             f"void {p.symbol}_softmax_bwd(const float *g, const float *y, float *dx, int64_t r0, "
             "int64_t r1, int64_t D);\n")
    # -fno-math-errno: sqrt becomes one vector instruction (the AdamW moments are never < 0)
    lib = build(src, cdef, (*ISAS[p.isa].cflags, "-fno-math-errno"),
                meta={"op": "eltwise", "params": {k: v for k, v in asdict(p).items() if k != "threads"}})
    return lib


@functools.lru_cache(maxsize=None)
def _pool(n: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=n, thread_name_prefix="autohc-ew")


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    return [(n * i // parts, n * (i + 1) // parts) for i in range(parts) if n * i // parts < n * (i + 1) // parts]


def _split_lines(n: int, parts: int) -> list[tuple[int, int]]:
    """n elements in `parts` nearly equal ranges of whole cache lines (64 floats)."""
    bounds = [min(n, -(-n * i // parts // 64) * 64) for i in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if a < b]


def _in_threads(fn, ranges):
    """fn(a, b) for each range, one thread each; on several NUMA nodes, range i runs on its
    node's CPUs (autohc.numa), so the result's pages it writes first are local to it."""
    if len(ranges) == 1:
        fn(*ranges[0])
        return

    def part(i, a, b):
        numa.pin(i, len(ranges))
        fn(a, b)
    for j in [_pool(len(ranges)).submit(part, i, a, b) for i, (a, b) in enumerate(ranges)]:
        j.result()


def _run(name: str, *tensors: torch.Tensor, params: EltwiseParams | None = None) -> torch.Tensor:
    """out = f(*tensors) on contiguous float32 CPU tensors of one shape."""
    p = params or params_for(name)
    lib = library(p)
    fn = getattr(lib.lib, f"{p.symbol}_{name}")
    ffi = lib.ffi
    ins = [t.contiguous() for t in tensors]
    out = _fresh_like(ins[-1])
    n = out.numel()
    ptrs = [ffi.cast("float *", t.data_ptr()) for t in ins]
    optr = ffi.cast("float *", out.data_ptr())
    _in_threads(lambda a, b: fn(*[q + a for q in ptrs], optr + a, b - a),
                _split_lines(n, p.split_threads(n)))
    return out


def _fast(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.layout == torch.strided
               for t in ts) and len({t.shape for t in ts}) == 1


# ----------------------------------------------------------------- torch custom ops

@torch.library.custom_op("autohc::gelu_tanh", mutates_args=())
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (as F.gelu(x, approximate="tanh"))."""
    if _fast(x):
        return _run("gelu_tanh_fwd", x)
    return torch.nn.functional.gelu(x, approximate="tanh")


@torch.library.custom_op("autohc::gelu_tanh_backward", mutates_args=())
def gelu_tanh_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if _fast(grad, x):
        return _run("gelu_tanh_bwd", grad, x)
    return torch.ops.aten.gelu_backward(grad, x, approximate="tanh")


@torch.library.custom_op("autohc::silu", mutates_args=())
def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU x * sigmoid(x) (as F.silu)."""
    if _fast(x):
        return _run("silu_fwd", x)
    return torch.nn.functional.silu(x)


@torch.library.custom_op("autohc::silu_backward", mutates_args=())
def silu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if _fast(grad, x):
        return _run("silu_bwd", grad, x)
    return torch.ops.aten.silu_backward(grad, x)


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


@torch.library.custom_op("autohc::layernorm_modulate", mutates_args=())
def _ln_mod(x: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None,
            eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, D = x.shape
    if not _fast(x) or any(t is not None and not _fast(t) for t in (scale, shift)):
        xd = x.double()
        mean = xd.mean(-1).reshape(-1).to(x.dtype)
        rstd = (xd.var(-1, unbiased=False) + eps).rsqrt().reshape(-1).to(x.dtype)
        return _ln_reference(x, scale, shift, eps), mean, rstd
    return _ln_fwd_kernel(x.contiguous(), scale.contiguous() if scale is not None else None,
                          shift.contiguous() if shift is not None else None, B * T, D, T, eps, 1)


def _ln_fwd_kernel(xc, sc, sh, rows: int, D: int, T: int, eps: float, plus_one: int):
    """ln_mod_fwd over `rows` rows of D (contiguous float32); scale/shift per T rows."""
    p = params_for("ln_mod_fwd")
    lib = library(p)
    ffi, fn = lib.ffi, getattr(lib.lib, f"{p.symbol}_ln_mod_fwd")
    y = _fresh_like(xc)
    mean = torch.empty(rows)
    rstd = torch.empty(rows)
    ptr = lambda t: ffi.cast("float *", t.data_ptr()) if t is not None else ffi.NULL  # noqa: E731
    args = (ptr(xc), ptr(sc), ptr(sh), ptr(y), ptr(mean), ptr(rstd))
    _in_threads(lambda r0, r1: fn(*args, r0, r1, D, T, float(eps), plus_one),
                _split(rows, p.split_threads(xc.numel())))
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
    if not all(_fast(t) for t in (dy, x)) or (scale is not None and not _fast(scale)):
        # other dtypes: the same formula as the kernel, in torch ops (no autograd in here)
        xhat = (x - mean.reshape(B, T, 1)) * rstd.reshape(B, T, 1)
        g = dy * (1 + scale[:, None, :]) if scale is not None else dy
        dx = rstd.reshape(B, T, 1) * (g - g.mean(-1, keepdim=True)
                                      - xhat * (g * xhat).mean(-1, keepdim=True))
        dsc = (dy * xhat).sum(1) if want_scale else x.new_zeros(0)
        dsh = dy.sum(1) if want_shift else x.new_zeros(0)
        return dx, dsc, dsh
    p = params_for("ln_mod_bwd")
    dx, dscale, dshift = _ln_bwd_kernel(
        p, dy.contiguous(), x.contiguous(), scale.contiguous() if scale is not None else None,
        mean.contiguous(), rstd.contiguous(), B, T, D, D, 1, want_scale, want_shift,
        p.split_threads(x.numel()))
    return (dx, dscale if want_scale else x.new_zeros(0), dshift if want_shift else x.new_zeros(0))


def _ln_bwd_kernel(p, dyc, xc, sc, mean, rstd, samples: int, T: int, D: int, sstride: int,
                   plus_one: int, want_scale: bool, want_shift: bool, threads: int):
    """ln_mod_bwd over `samples` blocks of T rows (the last may be short) of D, contiguous
    float32; the samples are split over `threads`. Returns dx and the per-sample dscale /
    dshift (samples x D, or None where not wanted)."""
    lib = library(p)
    ffi, fn = lib.ffi, getattr(lib.lib, f"{p.symbol}_ln_mod_bwd")
    rows = xc.numel() // D
    dx = _fresh_like(xc)
    dscale = torch.empty(samples, D) if want_scale else None
    dshift = torch.empty(samples, D) if want_shift else None
    ptr = lambda t: ffi.cast("float *", t.data_ptr()) if t is not None else ffi.NULL  # noqa: E731
    args = (ptr(dyc), ptr(xc), ptr(sc), ptr(mean), ptr(rstd), ptr(dx), ptr(dscale), ptr(dshift))
    _in_threads(lambda b0, b1: fn(*args, b0, b1, D, T, rows, sstride, plus_one),
                _split(samples, threads))
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
    return _ln_mod(x, scale, shift, float(eps))[0]


# ------------------------------------------------------------ softmax, gated residual

def _rows_call(name: str, *tensors, extra=(), out_like=None):
    """Run a row kernel `name(*ptrs, out, r0, r1, *extra)` over all rows, split over threads."""
    p = params_for(name)
    lib = library(p)
    ffi, fn = lib.ffi, getattr(lib.lib, f"{p.symbol}_{name}")
    ins = [t.contiguous() for t in tensors]
    out = _fresh_like(out_like if out_like is not None else ins[0])
    rows = out.numel() // out.shape[-1] if out.dim() else 1
    ptrs = [ffi.cast("float *", t.data_ptr()) for t in ins] + [ffi.cast("float *", out.data_ptr())]
    _in_threads(lambda r0, r1: fn(*ptrs, r0, r1, *extra), _split(rows, p.split_threads(out.numel())))
    return out


@torch.library.custom_op("autohc::softmax", mutates_args=())
def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension (as torch.softmax(x, -1))."""
    if _fast(x) and x.dim() > 0 and x.numel() > 0:
        return _rows_call("softmax_fwd", x, extra=(x.shape[-1],))
    return torch.softmax(x, -1)


@torch.library.custom_op("autohc::softmax_backward", mutates_args=())
def softmax_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if _fast(grad, y) and y.dim() > 0 and y.numel() > 0:
        return _rows_call("softmax_bwd", grad, y, extra=(y.shape[-1],))
    return y * (grad - (grad * y).sum(-1, keepdim=True))


softmax.register_fake(lambda x: torch.empty_like(x, memory_format=torch.contiguous_format))
softmax_backward.register_fake(lambda g, y: torch.empty_like(y, memory_format=torch.contiguous_format))
softmax.register_autograd(lambda ctx, g: softmax_backward(g, ctx.saved_tensors[0]),
                          setup_context=lambda ctx, inputs, output: ctx.save_for_backward(output))


@torch.library.custom_op("autohc::gated_residual", mutates_args=())
def _gated(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    B, T, D = x.shape
    if _fast(x, y) and _fast(gate) and x.numel() > 0:
        return _rows_call("gated_residual", x, y, gate, extra=(D, T), out_like=x)
    return x + gate[:, None, :] * y


_gated.register_fake(lambda x, y, gate: torch.empty_like(x, memory_format=torch.contiguous_format))


def _gated_setup(ctx, inputs, output):
    x, y, gate = inputs
    ctx.save_for_backward(y, gate)


def _gated_backward(ctx, g):
    y, gate = ctx.saved_tensors
    return g, g * gate[:, None, :], (g * y).sum(1)


_gated.register_autograd(_gated_backward, setup_context=_gated_setup)


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """DiT's `x + gate.unsqueeze(1) * y` in one pass; x, y: (B, T, D), gate: (B, D)."""
    if x.dim() != 3 or y.shape != x.shape or tuple(gate.shape) != (x.shape[0], x.shape[2]):
        raise ValueError(f"gated_residual: x, y must be (B, T, D) and gate (B, D); got "
                         f"{tuple(x.shape)}, {tuple(y.shape)}, {tuple(gate.shape)}")
    return _gated(x, y, gate)


# ------------------------------------------------- aten CPU kernels for autohc.install()

def _dense(*ts: torch.Tensor) -> bool:
    """Served by autohc only where the result's layout is the same as ATen's (contiguous)."""
    return _fast(*ts) and all(t.is_contiguous() for t in ts) and ts[0].numel() > 0


def aten_gelu(x, *, approximate="none"):
    if approximate == "tanh" and _dense(x):
        return _run("gelu_tanh_fwd", x)
    return torch.ops.aten.gelu.out(x, approximate=approximate, out=x.new_empty(0))


def aten_gelu_backward(grad, x, *, approximate="none"):
    if approximate == "tanh" and _dense(grad, x):
        return _run("gelu_tanh_bwd", grad, x)
    return torch.ops.aten.gelu_backward.grad_input(grad, x, approximate=approximate,
                                                   grad_input=x.new_empty(0))


def aten_silu(x):
    if _dense(x):
        return _run("silu_fwd", x)
    return torch.ops.aten.silu.out(x, out=x.new_empty(0))


def aten_silu_backward(grad, x):
    if _dense(grad, x):
        return _run("silu_bwd", grad, x)
    return torch.ops.aten.silu_backward.grad_input(grad, x, grad_input=x.new_empty(0))


def aten_softmax(x, dim, half_to_float):
    if not half_to_float and x.dim() > 0 and dim in (-1, x.dim() - 1) and _dense(x):
        return _rows_call("softmax_fwd", x, extra=(x.shape[-1],))
    return torch.ops.aten._softmax.out(x, dim, half_to_float, out=x.new_empty(0))


def aten_softmax_backward(grad, out, dim, input_dtype):
    if input_dtype == torch.float32 and out.dim() > 0 and dim in (-1, out.dim() - 1) \
            and _dense(grad, out):
        return _rows_call("softmax_bwd", grad, out, extra=(out.shape[-1],))
    return torch.ops.aten._softmax_backward_data.out(grad, out, dim, input_dtype,
                                                     grad_input=grad.new_empty(0))


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
        y, mean, rstd = _ln_fwd_kernel(x.contiguous(), w, b, rows, D, rows, eps, 0)
        return y.view(x.shape), mean.view(stat), rstd.view(stat)
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
        p = params_for("ln_mod_bwd")
        threads = p.split_threads(x.numel())
        T = -(-rows // threads)                 # a block of rows per thread, one shared weight
        dx, dw, db = _ln_bwd_kernel(
            p, grad.contiguous(), x.contiguous(), weight.contiguous() if weight is not None else None,
            mean, rstd, -(-rows // T), T, D, 0, 0, mask[1], mask[2], threads)
        shape = tuple(normalized_shape)
        return (dx.view(x.shape) if mask[0] else None,
                dw.sum(0).view(shape) if dw is not None else None,
                db.sum(0).view(shape) if db is not None else None)
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
    library(default_eltwise())
