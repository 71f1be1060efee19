"""Under `torch.autocast("cpu", dtype=torch.bfloat16)` and install(): a Linear on its fp32
weight, with no bf16 copy of it.

Stock autocast runs a Linear on bf16 copies: it casts the fp32 weight (and bias) to bf16 in
the forward, keeps that copy for the backward, and casts the weight's bf16 gradient back to
fp32. On DiT-XL/2 that is 675 M weights copied twice a step, and their bf16 copies held from
the forward to the backward (measured in docs/history.md, stops 62 and 64). The bf16 GEMM
kernels round fp32 operands to bf16 while they pack them, so the copies are not needed: install() registers aten::linear's AutocastCPU
kernel (`autocast_linear`), which sends a Linear it serves to `autohc::linear_fp32w`:
- forward: y (bf16) = x (bf16) · Wᵀ + b, W read in fp32 and rounded to bf16 while packed (the
  rounding of autocast's cast: to nearest, ties to even), the fp32 bias added to the fp32
  sums before y's one rounding;
- backward: dX (bf16) = dY · W (NN, W rounded the same way); dW = dYᵀ · X written straight
  into an fp32 gradient (TN); db summed as stock sums it.
The products are stock autocast's; dW skips stock's rounding to bf16 and the cast back, and
the bias is added unrounded, so those are slightly closer to fp32 than stock's. y, dX and dW
come from the result pool (runtime/memory.py), as the fp32 path's results do: from glibc they
were often new pages that the kernel faulted in (docs/history.md, stop 69).

Everything else (another autocast dtype, a CPU without a bf16 back-end, a weight or bias not
float32, a 1-D input, products under the GEMMs' minimum) goes to autocast's own kernel,
captured before the override: stock's casts, cache and result. A GEMM whose kernel cannot run,
or whose problem first-use tuning left to ATen, runs as stock autocast runs it: ATen's kernel
on a bf16 copy of W, a bf16 dW cast to fp32.
"""
from __future__ import annotations

import torch

from ..kernels.gemm.matmul import gemm_bf16_into, gemm_into
from ..kernels.gemm.params import RANGES
from ..runtime.memory import fresh_empty
from . import fallback, frozen, served
from .direct import runs_direct, unwatched
from .threads import kernel_threads

_KEY = torch._C.DispatchKey.AutocastCPU


def _captured_autocast_linear():
    """autocast's own aten::linear kernel, or None where this torch offers no handle (then
    install() leaves autocast's Linear as it is)."""
    try:
        return torch._C._dispatch_get_computed_kernel_for_dispatch_key("aten::linear", _KEY)
    except (AttributeError, RuntimeError):
        return None


STOCK_AUTOCAST_LINEAR = _captured_autocast_linear()


def linear_served(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    if torch.get_autocast_dtype("cpu") != torch.bfloat16 or not served.bf16_served():
        return False
    if w.dim() != 2 or x.dim() < 2 or not served.tensor_ok(w):
        return False
    if not (served.tensor_ok(x) or served.tensor_ok(x, dtype=torch.bfloat16)):
        return False
    K = w.shape[1]
    return x.shape[-1] == K and weights_served(x.numel() // K if K else 0, w, b)


def weights_served(M: int, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """w (N x K) and b of a Linear on M rows, served (w checked as 2-D float32 by the caller)."""
    N, K = w.shape
    if b is not None and not (served.tensor_ok(b) and tuple(b.shape) == (N,)):
        return False
    return M * N > 0 and M * N * K >= served.MIN_MACS


def autocast_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """aten::linear under autocast (install()'s AutocastCPU kernel)."""
    if not linear_served(x, w, b):
        return STOCK_AUTOCAST_LINEAR.call_boxed(torch._C.DispatchKeySet(_KEY), x, w, b)
    N, K = w.shape
    x2 = x.to(torch.bfloat16).reshape(-1, K)
    # (w and b are Parameters, which runs_direct refuses by type: they count only for autograd)
    y = (linear_impl if runs_direct(x2) and not records_grad(w, b) else linear_fp32w)(x2, w, b)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], N)


def _aten_weight(w: torch.Tensor) -> torch.Tensor:
    """The bf16 w that the way back to ATen multiplies: a copy autohc holds already (frozen, or
    training's working copy), else a cast, as stock autocast takes on every call (the same bits)."""
    w16 = frozen.bf16_weight(w)
    if w16 is None:
        w16 = frozen.working_bf16(w)
    return w.to(torch.bfloat16) if w16 is None else w16


def _aten_linear(x, w, b):
    """Stock autocast's forward on ATen's own kernels: bf16 copies of w and b."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
    wt = _aten_weight(w).t()
    if b is None:
        return served.aten_out("mm.out")(x, wt, out=out)
    return served.aten_out("addmm.out")(b.to(torch.bfloat16), x, wt, out=out)


@torch.library.custom_op("autohc::linear_fp32w", mutates_args=())
def linear_fp32w(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """y (bf16, M x N) = x (bf16, M x K) · wᵀ + b, w (N x K) and b (N) float32, rounded to bf16
    by the kernel while packing."""
    return linear_impl(x, w, b)


def linear_impl(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = fresh_empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
    w16 = frozen.bf16_weight(w)         # inside autohc.frozen: rounded and packed once
    packed = frozen.packed_weight(w) if w16 is not None else None
    wk = w16 if w16 is not None else _kernel_weight(w, x.shape[0])

    def kernel():
        gemm_bf16_into(x, wk.t(), y, 1.0, kernel_threads(), b, 1.0, packed)
        return served.by_autohc(y)
    return fallback.kernel_or(kernel, lambda: served.by_aten(_aten_linear(x, w, b)), "linear")


@linear_fp32w.register_fake
def _(x, w, b):
    return x.new_empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)


def linear_gelu_impl(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = fresh_empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
    w16 = frozen.bf16_weight(w)
    packed = frozen.packed_weight(w) if w16 is not None else None

    def kernel():
        gemm_bf16_into(x, (w if w16 is None else w16).t(), y, 1.0, kernel_threads(), b, 1.0, packed,
                       epilogue="gelu_tanh")
        return served.by_autohc(y)
    return fallback.kernel_or(kernel, lambda: torch.nn.functional.gelu(
        linear_fp32w(x, w, b), approximate="tanh"), "linear_gelu")


# (no autograd: linear_gelu takes it only where there is no gradient to record)
_linear_gelu = torch.library.custom_op("autohc::linear_gelu_fp32w", mutates_args=())(linear_gelu_impl)
_linear_gelu.__doc__ = """GELU(tanh)(x (bf16, M x K) · wᵀ + b) in bf16, w (N x K) and b float32:
    linear_fp32w's GEMM with GELU applied in its store, the pre-activation never written."""


@_linear_gelu.register_fake
def _(x, w, b):
    return x.new_empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)


@torch.library.custom_op("autohc::linear_gelu_fp32w_train", mutates_args=())
def _linear_gelu_train(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, h): h = x · wᵀ + b and g = GELU(tanh)(h), both bf16 (M x N), from one kernel: the GEMM's
    store rounds h and GELU of its fp32 value (training's fc1: GELU's backward reads h)."""
    return linear_gelu_train_impl(x, w, b)


# rows past every skinny path's (GemmParams.skinny_m's bound): a working copy gives the master's
# bits only where the GEMM packs W (a skinny path sums a bf16 W otherwise than an fp32 one)
_PACKED_ROWS = RANGES["skinny_m"][1]


def _kernel_weight(w: torch.Tensor, rows: int) -> torch.Tensor:
    """What the bf16 GEMMs read for w on `rows` rows of the other operand: w's frozen bf16 copy
    (sampling), or its working copy (training, past the skinny paths), or w: the same bits,
    since the kernels round an fp32 w as the copies were rounded."""
    w16 = frozen.bf16_weight(w)
    if w16 is None and rows > _PACKED_ROWS:
        w16 = frozen.working_bf16(w)
    return w if w16 is None else w16


def linear_gelu_train_impl(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    g = fresh_empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
    h = fresh_empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)

    def kernel():
        gemm_bf16_into(x, _kernel_weight(w, x.shape[0]).t(), g, 1.0, kernel_threads(), b, 1.0,
                       epilogue="gelu_tanh", pre=h)
        return served.by_autohc(g), h

    def two_calls():
        pre = linear_fp32w(x, w, b)
        return torch.nn.functional.gelu(pre, approximate="tanh"), pre
    return fallback.kernel_or(kernel, two_calls, "linear_gelu")


@_linear_gelu_train.register_fake
def _(x, w, b):
    return (x.new_empty(x.shape[0], w.shape[0], dtype=torch.bfloat16),
            x.new_empty(x.shape[0], w.shape[0], dtype=torch.bfloat16))


def _lg_setup(ctx, inputs, output):
    x, w, b = inputs
    ctx.save_for_backward(x, w, output[1])
    ctx.has_bias = b is not None
    ctx.set_materialize_grads(False)


def _lg_backward(ctx, dg, dh):
    x, w, h = ctx.saved_tensors
    if dg is None and dh is None:
        return None, None, None
    d = torch.ops.autohc.gelu_tanh_backward(dg.to(torch.bfloat16), h) if dg is not None else None
    d = dh if d is None else d if dh is None else d + dh
    return _linear_grads(ctx, d, x, w)


_linear_gelu_train.register_autograd(_lg_backward, setup_context=_lg_setup)


def unhooked(linear: torch.nn.Module) -> bool:
    """A plain nn.Linear whose forward nothing watches or changes (calling F.linear on its
    parameters is then the same as calling it)."""
    return type(linear) is torch.nn.Linear and _forward_unwatched(linear)


def _forward_unwatched(m: torch.nn.Module) -> bool:
    """No forward hook on m, nor a global one."""
    from torch.nn.modules import module
    return (not m._forward_hooks and not m._forward_pre_hooks
            and not module._global_forward_hooks and not module._global_forward_pre_hooks)


def linear_gelu(x: torch.Tensor, linear: torch.nn.Module) -> torch.Tensor:
    """F.gelu(linear(x), approximate="tanh"): DiT's fc1 and GELU (a FusedOps field). Under
    install() and autocast bf16, one kernel: fc1's GEMM with its bias and GELU in its bf16
    store, so the pre-activation is not read back; with no gradient to record (sampling) it is
    not written either, in training it is written beside GELU's result for GELU's backward.
    Elsewhere (fp32, not installed, a hooked or subclassed Linear) exactly the two calls."""
    if unhooked(linear):
        return linear_gelu_fn(x, linear.weight, linear.bias)
    return torch.nn.functional.gelu(linear(x), approximate="tanh")


def records_grad(*ts: torch.Tensor | None) -> bool:
    """Whether autograd records a call on ts (training), as against sampling."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def linear_gelu_fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.gelu(F.linear(x, w, b), approximate="tanh"), as linear_gelu on a plain Linear's
    parameters: what install()'s pass over torch.compile graphs (compile_pass.py) puts in their
    place, decided again when the graph is traced (under autocast bf16 and install(): the fused
    kernel; elsewhere the two calls)."""
    if torch.is_autocast_enabled("cpu") and served.is_installed() and linear_served(x, w, b):
        N, K = w.shape
        x2 = x.to(torch.bfloat16).reshape(-1, K)
        if records_grad(x, w, b):
            y = _linear_gelu_train(x2, w, b)[0]
        else:
            y = (linear_gelu_impl if runs_direct(x2) else _linear_gelu)(x2, w, b)   # (w, b: Parameters)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], N)
    return torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b), approximate="tanh")


def _dx(dy: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """dX (bf16) = dY · W, W float32 rounded while packed (NN)."""
    dx = fresh_empty(dy.shape[0], w.shape[1], dtype=torch.bfloat16)

    def kernel():
        gemm_bf16_into(dy, _kernel_weight(w, dy.shape[0]), dx, 1.0, kernel_threads())
        return served.by_autohc(dx)
    aten = lambda: served.by_aten(served.aten_out("mm.out")(dy, _aten_weight(w), out=dx))
    return fallback.kernel_or(kernel, aten, "linear_backward")


def _dw(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW (fp32) = dYᵀ · X, products of bf16 values summed in fp32 (TN)."""
    dw = fresh_empty(dy.shape[1], x.shape[1])
    kernel = lambda: served.by_autohc(gemm_into(dy.t(), x, dw, 1.0, 0.0, kernel_threads(), dtype="bf16"))

    def aten():                 # stock autocast's: a bf16 gradient, cast to fp32
        dw16 = served.aten_out("mm.out")(dy.t(), x, out=torch.empty(dw.shape, dtype=torch.bfloat16))
        return served.by_aten(dw.copy_(dw16))
    return fallback.kernel_or(kernel, aten, "linear_backward")


def _db(dy: torch.Tensor) -> torch.Tensor:
    """db = dY summed over rows, as autocast's addmm backward sums it (bf16 sums accumulated in
    fp32, one rounding), then fp32: a sum with dtype=float32 would first copy all of dY."""
    return dy.sum(0).float()


def linear_backward_impl(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, want_x: bool,
                     want_w: bool, want_b: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dX bf16, dW fp32, db fp32) of linear_fp32w; an unwanted one is an empty tensor."""
    dy = dy.to(torch.bfloat16)
    unwanted = lambda dtype: dy.new_empty(0, dtype=dtype)     # (a custom op's outputs: no aliases)
    return (_dx(dy, w) if want_x else unwanted(torch.bfloat16),
            _dw(dy, x) if want_w else unwanted(torch.float32),
            _db(dy) if want_b else unwanted(torch.float32))


linear_fp32w_backward = torch.library.custom_op("autohc::linear_fp32w_backward", mutates_args=())(linear_backward_impl)


@linear_fp32w_backward.register_fake
def _(dy, x, w, want_x, want_w, want_b):
    return (x.new_empty(x.shape if want_x else (0,), dtype=torch.bfloat16),
            w.new_empty(w.shape if want_w else (0,), dtype=torch.float32),
            w.new_empty((w.shape[0],) if want_b else (0,), dtype=torch.float32))


def _linear_backward_op():
    """linear_fp32w_backward, or its implementation where nothing traces or watches the backward
    (the op's dispatch then only costs time: docs/history.md, stop 88)."""
    return linear_backward_impl if unwatched() else linear_fp32w_backward


def _setup(ctx, inputs, output):
    x, w, b = inputs
    ctx.save_for_backward(x, w)
    ctx.has_bias = b is not None


def _linear_grads(ctx, dy, x, w):
    """(dx, dw, db) of y = x wᵀ + b for the inputs autograd asks for (None for the others)."""
    want_x, want_w, want_b = ctx.needs_input_grad
    want_b = want_b and ctx.has_bias
    dx, dw, db = _linear_backward_op()(dy, x, w, want_x, want_w, want_b)
    return dx if want_x else None, dw if want_w else None, db if want_b else None


def _backward(ctx, dy):
    x, w = ctx.saved_tensors
    return _linear_grads(ctx, dy, x, w)


linear_fp32w.register_autograd(_backward, setup_context=_setup)


def _dx_gelu(dy: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """GELU'(h) (dY · W) in bf16, W float32 rounded while packed (NN): fc2's input gradient with
    GELU's backward in its store (epilogue gelu_tanh_bwd), dY · W never written."""
    d = fresh_empty(dy.shape[0], w.shape[1], dtype=torch.bfloat16)

    def kernel():
        gemm_bf16_into(dy, _kernel_weight(w, dy.shape[0]), d, 1.0, kernel_threads(), epilogue="gelu_tanh_bwd", pre=h)
        return served.by_autohc(d)
    return fallback.kernel_or(kernel, lambda: torch.ops.autohc.gelu_tanh_backward(_dx(dy, w), h),
                              "linear_backward")


def gelu_linear_backward_impl(dy: torch.Tensor, g: torch.Tensor, h: torch.Tensor, w: torch.Tensor,
                          want_w: bool, want_b: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dH bf16, dW fp32, db fp32) of y = GELU(h) · wᵀ + b, g = GELU(h) (bf16): dH = GELU'(h) (dY · W)
    from one kernel; an unwanted dW or db is an empty tensor."""
    dy = dy.to(torch.bfloat16)
    unwanted = lambda: dy.new_empty(0, dtype=torch.float32)
    return (_dx_gelu(dy, w, h), _dw(dy, g) if want_w else unwanted(), _db(dy) if want_b else unwanted())


gelu_linear_fp32w_backward = torch.library.custom_op("autohc::gelu_linear_fp32w_backward",
                                                     mutates_args=())(gelu_linear_backward_impl)


@gelu_linear_fp32w_backward.register_fake
def _(dy, g, h, w, want_w, want_b):
    return (h.new_empty(h.shape, dtype=torch.bfloat16),
            w.new_empty(w.shape if want_w else (0,), dtype=torch.float32),
            w.new_empty((w.shape[0],) if want_b else (0,), dtype=torch.float32))


@torch.library.custom_op("autohc::mlp_fp32w_train", mutates_args=())
def _mlp_train(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
               b2: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, g, h), all bf16: h = x · w1ᵀ + b1 and g = GELU(tanh)(h) from one kernel (fc1 with GELU
    in its store), y = g · w2ᵀ + b2 (fc2). Its backward runs fc2's input gradient and GELU's
    backward as one kernel (gelu_linear_fp32w_backward)."""
    g, h = linear_gelu_train_impl(x, w1, b1)
    return linear_impl(g, w2, b2), g, h


@_mlp_train.register_fake
def _(x, w1, b1, w2, b2):
    hidden = x.new_empty(x.shape[0], w1.shape[0], dtype=torch.bfloat16)
    return x.new_empty(x.shape[0], w2.shape[0], dtype=torch.bfloat16), hidden, torch.empty_like(hidden)


def _mlp_setup(ctx, inputs, output):
    x, w1, b1, w2, b2 = inputs
    ctx.save_for_backward(x, w1, w2, output[1], output[2])
    ctx.has_bias = b1 is not None, b2 is not None
    ctx.set_materialize_grads(False)


def _mlp_backward(ctx, dy, dg, dh):
    x, w1, w2, g, h = ctx.saved_tensors
    want_x, want_w1, want_b1, want_w2, want_b2 = ctx.needs_input_grad
    want_b1, want_b2 = want_b1 and ctx.has_bias[0], want_b2 and ctx.has_bias[1]
    d, dw2, db2 = None, None, None
    if dy is not None:
        fc2 = gelu_linear_backward_impl if unwatched() else gelu_linear_fp32w_backward
        d, dw2, db2 = fc2(dy, g, h, w2, want_w2, want_b2)
    if dg is not None:          # (g or h read outside the op too: their gradients join dH)
        dgh = torch.ops.autohc.gelu_tanh_backward(dg.to(torch.bfloat16), h)
        d = dgh if d is None else d + dgh
    if dh is not None:
        d = dh if d is None else d + dh
    if d is None:
        return None, None, None, None, None
    dx, dw1, db1 = _linear_backward_op()(d, x, w1, want_x, want_w1, want_b1)
    return (dx if want_x else None, dw1 if want_w1 else None, db1 if want_b1 else None,
            dw2 if want_w2 else None, db2 if want_b2 else None)     # (None where dy was)


_mlp_train.register_autograd(_mlp_backward, setup_context=_mlp_setup)


def mlp(x: torch.Tensor, fc1: torch.nn.Module, fc2: torch.nn.Module) -> torch.Tensor:
    """fc2(F.gelu(fc1(x), approximate="tanh")): DiT's MLP (a FusedOps field). Under install() and
    autocast bf16, in training, fc1 with GELU in its store (linear_gelu) and, in the backward,
    fc2's input gradient with GELU's backward in its store; elsewhere (sampling, fp32, not
    installed, a hooked or subclassed Linear) fc2 of linear_gelu."""
    if unhooked(fc1) and unhooked(fc2):
        return mlp_fn(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias)
    return fc2(linear_gelu(x, fc1))


def second_linear_served(M: int, w1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor | None) -> bool:
    """fc2 (w2, b2) of an MLP whose fc1 is w1, on M rows, served (fc1 checked by the caller)."""
    return (w2.dim() == 2 and served.tensor_ok(w2) and w2.shape[1] == w1.shape[0]
            and weights_served(M, w2, b2))


def mlp_fn(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
           b2: torch.Tensor | None) -> torch.Tensor:
    """F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2), as mlp on plain Linears'
    parameters (and what install()'s pass over torch.compile graphs puts in place of that)."""
    if (torch.is_autocast_enabled("cpu") and served.is_installed() and records_grad(x, w1, b1, w2, b2)
            and linear_served(x, w1, b1) and second_linear_served(x.numel() // w1.shape[1], w1, w2, b2)):
        N, K = w2.shape[0], w1.shape[1]
        y = _mlp_train(x.to(torch.bfloat16).reshape(-1, K), w1, b1, w2, b2)[0]
        return y if x.dim() == 2 else y.view(*x.shape[:-1], N)
    return torch.nn.functional.linear(linear_gelu_fn(x, w1, b1), w2, b2)


def patch_embed(x: torch.Tensor, conv: torch.nn.Module) -> torch.Tensor:
    """conv(x).flatten(2).transpose(1, 2): DiT's patch embedding (a FusedOps field), a p x q
    convolution with stride (p, q) over (B, C, H, W) images, as (B, tokens, D). Under install()
    and autocast bf16, one GEMM on the images' patches (a (B * tokens, C p q) copy of x, the
    weight seen as (D, C p q)): autohc's bf16 kernel instead of oneDNN's convolution, products
    summed in fp32 in another order (within a bf16 rounding of the conv). Elsewhere (fp32, not
    installed, a hooked or subclassed conv, padding, dilation, groups) exactly the conv."""
    if (torch.is_autocast_enabled("cpu") and served.is_installed() and _plain_patch_conv(conv)
            and x.dim() == 4 and x.shape[1] == conv.in_channels):
        B, C, H, W = x.shape
        p, q = conv.kernel_size
        if H % p == 0 and W % q == 0:
            w = conv.weight.reshape(conv.out_channels, C * p * q)
            patches = x.reshape(B, C, H // p, p, W // q, q).permute(0, 2, 4, 1, 3, 5).reshape(-1, C * p * q)
            if linear_served(patches, w, conv.bias):
                return torch.nn.functional.linear(patches, w, conv.bias).view(B, (H // p) * (W // q), -1)
    return conv(x).flatten(2).transpose(1, 2)


def _plain_patch_conv(conv: torch.nn.Module) -> bool:
    return (type(conv) is torch.nn.Conv2d and tuple(conv.stride) == tuple(conv.kernel_size)
            and tuple(conv.padding) == (0, 0) and tuple(conv.dilation) == (1, 1) and conv.groups == 1
            and conv.padding_mode == "zeros" and _forward_unwatched(conv))


# what install() registers at the AutocastCPU key (nothing where autocast's own kernel, the
# way back for what it does not serve, cannot be had)
AUTOCAST_IMPLS = {"linear": autocast_linear} if STOCK_AUTOCAST_LINEAR is not None else {}


# ------------------------------- adaLN: every block's modulation Linear on the same SiLU(c)

@torch.library.custom_op("autohc::modulations_fp32w", mutates_args=())
def _modulations(c: torch.Tensor, ws: list[torch.Tensor], bs: list[torch.Tensor]) -> list[torch.Tensor]:
    """[bf16(SiLU(c)) · wᵢᵀ + bᵢ], each bf16 (B x Nᵢ): linear_fp32w of every block's adaLN Linear
    on the conditioning c (fp32, B x D), SiLU taken once."""
    return _modulations_impl(c, ws, bs)


def _modulations_impl(c, ws, bs):
    s = torch.nn.functional.silu(c).to(torch.bfloat16)
    return [linear_impl(s, w, b) for w, b in zip(ws, bs)]


@_modulations.register_fake
def _(c, ws, bs):
    return [c.new_empty(c.shape[0], w.shape[0], dtype=torch.bfloat16) for w in ws]


def _mod_setup(ctx, inputs, output):
    c, ws, bs = inputs
    ctx.save_for_backward(c, *ws)
    ctx.set_materialize_grads(False)


def _mod_backward(ctx, dys):
    """dc = SiLU'(c) Σᵢ dYᵢ Wᵢ, the sum in fp32 (per block, autograd would add the blocks' fp32
    gradients of c); dWᵢ, dbᵢ as linear_fp32w's backward."""
    c, *ws = ctx.saved_tensors
    want_c, want_ws, want_bs = ctx.needs_input_grad      # (a flag per tensor of a list)
    s = torch.nn.functional.silu(c).to(torch.bfloat16)
    ds = torch.zeros(c.shape) if want_c else None
    dws, dbs = [], []
    backward = _linear_backward_op()
    for dy, w, want_w, want_b in zip(dys, ws, want_ws, want_bs):
        if dy is None:
            dws.append(None)
            dbs.append(None)
            continue
        dx, dw, db = backward(dy, s, w, want_c, want_w, want_b)
        if want_c:
            ds += dx
        dws.append(dw if want_w else None)
        dbs.append(db if want_b else None)
    dc = None
    if want_c:
        sig = torch.sigmoid(c)
        dc = ds * (sig * (1 + c * (1 - sig)))
    return dc, dws, dbs


_modulations.register_autograd(_mod_backward, setup_context=_mod_setup)


def _silu_linear(m: torch.nn.Module) -> bool:
    """m is nn.Sequential(nn.SiLU(), nn.Linear) as DiT's adaLN_modulation, nothing hooked."""
    return (type(m) is torch.nn.Sequential and len(m) == 2 and type(m[0]) is torch.nn.SiLU
            and not (m._forward_hooks or m._forward_pre_hooks or m[0]._forward_hooks
                     or m[0]._forward_pre_hooks) and unhooked(m[1]))


def modulations(c: torch.Tensor, adaln: list[torch.nn.Module]) -> list[torch.Tensor]:
    """[m(c) for m in adaln] for DiT's adaLN_modulation modules (SiLU then a Linear), which all
    read the same c (a FusedOps field): SiLU taken once; under install() and autocast bf16 the
    Linears in one op, one autograd node whose backward sums c's gradient over the blocks; the
    same values as module by module (the backward's sum to fp32 rounding order)."""
    if not all(_silu_linear(m) for m in adaln):
        return [m(c) for m in adaln]
    lins = [m[1] for m in adaln]
    if (torch.is_autocast_enabled("cpu") and served.is_installed() and c.dim() == 2
            and all(linear_served(c, lin.weight, lin.bias) and lin.bias is not None for lin in lins)):
        ws, bs = [lin.weight for lin in lins], [lin.bias for lin in lins]
        if runs_direct(c, *ws, *bs):
            return _modulations_impl(c, ws, bs)
        return list(_modulations(c, ws, bs))
    s = torch.nn.functional.silu(c)
    return [lin(s) for lin in lins]
