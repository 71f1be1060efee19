"""Drop-in override: `autohc.install()` makes unmodified torch code run its GEMMs (and the fused
operators of autohc/torch/ops.py, and F.scaled_dot_product_attention through
autohc/torch/attention.py) on autohc.

We register CPU kernels for aten::mm, aten::addmm, aten::bmm and aten::baddbmm through
torch.library (the supported extension point; no Python attribute is patched). They sit below
autograd, so nn.Linear, F.linear, torch.matmul / @, mm, addmm, bmm all reach them in the
forward pass, and autograd's own derivative formulas reach them in the backward pass (dX = dY·W
is NN, dW = dYᵀ·X is TN, both as strided views, no copies).

The `.out` forms (mm.out, addmm.out, bmm.out, baddbmm.out) are served too: they are what
torch.compile's inductor calls for its GEMMs (extern kernels writing into a buffer of its own),
so compiled graphs run their GEMMs on autohc while inductor fuses the element-wise rest. A `.out`
call autohc does not serve (a result that needs resizing or overlaps an input, other dtypes)
goes to ATen's own kernel, captured before the override.

Under torch.autocast to bf16, aten::linear's AutocastCPU kernel is registered too
(autohc/torch/autocast.py): a Linear with an fp32 weight runs the bf16 kernels on that weight,
rounded while packed, instead of on autocast's bf16 copy of it.

Whatever autohc does not do (other dtypes, complex, zero-size, tiny problems where the call
overhead does not pay) goes to ATen's own `.out` kernels, which these registrations leave
untouched: same results, same errors. A kernel that cannot be built or started (no compiler,
a pool that cannot start threads) also sends its call to ATen, with one warning per cause
(autohc/torch/fallback.py). `uninstall()` removes the registrations.

One admissibility predicate per argument kind (`served.tensor_ok` for tensors, `_serve` for a
GEMM's operands) decides what autohc takes; everything else is ATen's.
"""
from __future__ import annotations

import contextlib
import threading
import warnings

import torch

from ..kernels.gemm.matmul import (AtenFaster, bmm_into, byte_offsets, gemm_bf16_into, gemm_into,
                                   prepared_gemm_into)
from ..runtime import omp
from ..runtime import plan as cpu_plan
from ..runtime.memory import fresh_empty
from ..tune import first_use
from . import fallback, prepared
from .attention import ATEN_IMPLS as ATTENTION_IMPLS
from .ops import ATEN_IMPLS
from .served import ATEN_OUT, MIN_MACS, aten_out, bf16_served, by_aten, by_autohc, is_installed, tensor_ok
from .served import override as _override
from .threads import kernel_threads, set_kernel_threads

# bmm runs as one batched C call (one pool wake per matrix): routed for matrices of this size up.
MIN_BMM_MACS = 128 * 128 * 128

_lock = threading.Lock()
_state = {"threads": None, "torch_threads_before": None, "told_one_thread": False}


def _serve(a: torch.Tensor, b: torch.Tensor, min_macs: int = MIN_MACS, dtype=torch.float32) -> bool:
    if a.dim() != 2 or b.dim() != 2 or not tensor_ok(a, b, dtype=dtype):
        return False
    m, k = a.shape
    n = b.shape[1]
    return b.shape[0] == k and m * n > 0 and m * n * k >= min_macs


def _serve16(a: torch.Tensor, b: torch.Tensor) -> bool:
    return _serve(a, b, dtype=torch.bfloat16) and bf16_served()


def _real(*scalars) -> bool:
    return not any(isinstance(s, complex) for s in scalars)


def _batched(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0] and a.shape[0] > 0 \
        and _serve(a[0], b[0], MIN_BMM_MACS)


def _mm_shape(a, b) -> tuple:
    return (a.shape[0], b.shape[1])


def _bmm_shape(a, b) -> tuple:
    return (a.shape[0], a.shape[1], b.shape[2])


def _broadcasts(inp: torch.Tensor, shape) -> bool:
    try:
        inp.expand(shape)
        return True
    except RuntimeError:
        return False


def _plus_ok(pair_ok: bool, inp, beta, alpha, shape) -> bool:
    """addmm/baddbmm: the pair served, inp a float32 CPU tensor that broadcasts to the result
    (`shape()` is asked only then: ATen raises its own errors for the rest), real scalars."""
    return pair_ok and tensor_ok(inp) and _real(beta, alpha) and _broadcasts(inp, shape())


def _fits(out: torch.Tensor, shape, *inputs: torch.Tensor, dtype=torch.float32) -> bool:
    """out is a float32 (dtype) row-major result of `shape` sharing no memory with the inputs."""
    if not (tensor_ok(out, dtype=dtype) and tuple(out.shape) == tuple(shape) and out.is_contiguous()):
        return False
    mem = out.untyped_storage().data_ptr()
    return all(t.untyped_storage().data_ptr() != mem for t in inputs)


def _result(served: bool, shape, like: torch.Tensor) -> torch.Tensor:
    """The functional forms' result: a fresh block where autohc serves, else an empty tensor
    for ATen's `.out` kernel to resize."""
    return fresh_empty(*shape()) if served else like.new_empty(0)


def _start_in(out: torch.Tensor, inp: torch.Tensor, beta) -> torch.Tensor:
    if beta != 0:
        out.copy_(inp.expand(out.shape))
    return out


def _row_bias(out: torch.Tensor, inp: torch.Tensor, beta):
    """addmm's inp as one row broadcast down out's rows (a Linear's bias), else None."""
    if beta == 0 or out.dim() != 2:
        return None
    e = inp.expand(out.shape)
    return e[0] if out.shape[0] == 1 or e.stride(0) == 0 else None


def _gemm(name: str, into, served: bool, out, x, y, inp=None, beta=0, alpha=1):
    """out := alpha * x @ y (+ beta * inp where inp is given) by autohc's `into` (gemm_into,
    bmm_into) where served, else by ATen's own `<name>.out` kernel into `out`: the one path
    of the functional and the `.out` forms of mm, addmm, bmm and baddbmm. A Linear's bias
    goes to the kernel, which writes it tile by tile (no copy of it into out first)."""
    aten = aten_out(f"{name}.out")
    if inp is None:
        return fallback.kernel_or(lambda: by_autohc(into(x, y, out, 1.0, 0.0, kernel_threads())),
                                  lambda: by_aten(aten(x, y, out=out)), name, served=served)
    bias = _row_bias(out, inp, beta) if into is gemm_into and served else None

    def kernel():
        if bias is not None:
            return gemm_into(x, y, out, float(alpha), float(beta), kernel_threads(), bias)
        return into(x, y, _start_in(out, inp, beta), float(alpha), float(beta), kernel_threads())
    return fallback.kernel_or(lambda: by_autohc(kernel()),
                              lambda: by_aten(aten(inp, x, y, beta=beta, alpha=alpha, out=out)),
                              name, served=served)


def _gemm16(name: str, out, x, y, inp=None, beta=0, alpha=1):
    """The bf16 form of _gemm (mm and addmm of bfloat16 tensors, as torch.autocast runs a
    Linear): out (bfloat16) := bf16(alpha * x @ y + beta * bias), by the bf16 kernels' own
    bf16 store; a Linear's bias only (any other inp is ATen's, decided by the caller)."""
    aten = aten_out(f"{name}.out")
    bias = None if inp is None else _row_bias(out, inp, beta)

    def kernel():
        gemm_bf16_into(x, y, out, float(alpha), kernel_threads(), bias, float(beta))
        return out

    def at():
        return aten(x, y, out=out) if inp is None else aten(inp, x, y, beta=beta, alpha=alpha, out=out)
    return fallback.kernel_or(lambda: by_autohc(kernel()), lambda: by_aten(at()), name)


def _plus16_ok(inp, m1, m2, beta, alpha) -> bool:
    """addmm in bf16: the pair served and inp a bf16 Linear's bias (one row; ATen rejects an
    inp of another dtype, and keeps doing so)."""
    return (_serve16(m1, m2) and _real(beta, alpha) and tensor_ok(inp, dtype=torch.bfloat16)
            and inp.dim() in (1, 2) and inp.shape[-1] == m2.shape[1] and inp.numel() == m2.shape[1])


# ---- prepared routes (prepared.py): a functional mm or addmm met before runs the route its first
# call left, ATen's kernel or autohc's kernel bound to the problem, instead of the whole path.

def _aten_route(name: str):
    aten = aten_out(f"{name}.out")
    if name == "mm":
        return lambda a, b: by_aten(aten(a, b, out=a.new_empty(0)))
    return lambda inp, m1, m2, beta, alpha: by_aten(aten(inp, m1, m2, beta=beta, alpha=alpha, out=m1.new_empty(0)))


def _bound_route(name: str, general, x, y, out, alpha, beta, bias):
    """A route that runs autohc's kernel bound to this problem (out: this call's result, for its
    strides), ATen's where the choice is ATen's, or None where each call decides."""
    try:
        run = prepared_gemm_into(x, y, out, float(alpha), float(beta), kernel_threads(), bias)
    except AtenFaster:
        return _aten_route(name)
    except fallback.FAILURES:
        return None                     # (the general path reports it, and goes to ATen)
    if run is None:
        return None
    M, N = out.shape
    if name == "mm":
        def mm(a, b):
            c = fresh_empty(M, N)
            try:
                run(a.data_ptr(), b.data_ptr(), c.data_ptr())
            except fallback.FAILURES:
                return general(a, b)
            return by_autohc(c)
        return mm

    def addmm(inp, m1, m2, beta, alpha):
        c = fresh_empty(M, N)
        try:                            # (the bias row of a routed addmm starts at inp's first element)
            run(m1.data_ptr(), m2.data_ptr(), c.data_ptr(), inp.data_ptr())
        except fallback.FAILURES:
            return general(inp, m1, m2, beta, alpha)
        return by_autohc(c)
    return addmm


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    key = ("mm", a.shape, a.stride(), a.dtype, b.shape, b.stride(), b.dtype, a.is_neg() or b.is_neg())
    run, stamp = prepared.route(key)
    if run is not None:
        return run(a, b)
    out = _mm_general(a, b)
    route = None
    if not _serve16(a, b):
        route = (_bound_route("mm", _mm_general, a, b, out, 1.0, 0.0, None) if _serve(a, b)
                 else _aten_route("mm"))
    prepared.remember(key, route, stamp)
    return out


def _addmm(inp: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    key = ("addmm", m1.shape, m1.stride(), m1.dtype, m2.shape, m2.stride(), m2.dtype, inp.shape, inp.stride(),
           inp.dtype, m1.is_neg() or m2.is_neg() or inp.is_neg(), beta, alpha)
    run, stamp = prepared.route(key)
    if run is not None:
        return run(inp, m1, m2, beta, alpha)
    out = _addmm_general(inp, m1, m2, beta, alpha)
    route = None
    if not _plus16_ok(inp, m1, m2, beta, alpha):
        if not _plus_ok(_serve(m1, m2), inp, beta, alpha, lambda: _mm_shape(m1, m2)):
            route = _aten_route("addmm")
        else:
            bias = _row_bias(out, inp, beta)
            if bias is not None or beta == 0:
                route = _bound_route("addmm", _addmm_general, m1, m2, out, alpha, beta, bias)
    prepared.remember(key, route, stamp)
    return out


def _mm_general(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if _serve16(a, b):
        return _gemm16("mm", torch.empty(_mm_shape(a, b), dtype=torch.bfloat16), a, b)
    served = _serve(a, b)
    return _gemm("mm", gemm_into, served, _result(served, lambda: _mm_shape(a, b), a), a, b)


def _addmm_general(inp: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, beta=1, alpha=1) -> torch.Tensor:
    if _plus16_ok(inp, m1, m2, beta, alpha):
        return _gemm16("addmm", torch.empty(_mm_shape(m1, m2), dtype=torch.bfloat16), m1, m2, inp, beta, alpha)
    served = _plus_ok(_serve(m1, m2), inp, beta, alpha, lambda: _mm_shape(m1, m2))
    return _gemm("addmm", gemm_into, served, _result(served, lambda: _mm_shape(m1, m2), m1),
                 m1, m2, inp, beta, alpha)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    served = _batched(a, b)
    return _gemm("bmm", bmm_into, served, _result(served, lambda: _bmm_shape(a, b), a), a, b)


def _baddbmm(inp, b1, b2, *, beta=1, alpha=1):
    served = _plus_ok(_batched(b1, b2), inp, beta, alpha, lambda: _bmm_shape(b1, b2))
    return _gemm("baddbmm", bmm_into, served, _result(served, lambda: _bmm_shape(b1, b2), b1),
                 b1, b2, inp, beta, alpha)


# ---- the `.out` forms: what torch.compile's inductor calls (extern_kernels.mm/addmm/bmm with
# a buffer of its own), so that compiled graphs run their GEMMs on autohc too. Served where
# the buffer fits; a call not served goes to ATen's own kernel (served.ATEN_OUT).

def _span(t: torch.Tensor) -> tuple[int, int]:
    return byte_offsets(t.shape, t.stride(), t.element_size())


def _bound_out_route(name: str, general, x, y, out, alpha, beta, bias, inp=None):
    """_bound_route for the `.out` forms (inductor's buffers): the same bound kernel, run where
    this call's out shares no storage and no byte with its inputs (as _fits and the kernel's own
    aliasing check ask); other calls take the general path."""
    try:
        run = prepared_gemm_into(x, y, out, float(alpha), float(beta), kernel_threads(), bias)
    except (AtenFaster, *fallback.FAILURES):
        return None
    if run is None:
        return None
    (xlo, xhi), (ylo, yhi), (clo, chi) = _span(x), _span(y), _span(out)
    ilo, ihi = _span(inp) if inp is not None else (0, 0)

    def apart(c_ptr: int, *inputs) -> bool:
        c0, c1 = c_ptr + clo, c_ptr + chi
        return all(p + hi <= c0 or c1 <= p + lo for p, lo, hi in inputs)

    if name == "mm":
        def mm(a, b, out):
            c_ptr, a_ptr, b_ptr = out.data_ptr(), a.data_ptr(), b.data_ptr()
            mem = out.untyped_storage().data_ptr()
            if (a.untyped_storage().data_ptr() == mem or b.untyped_storage().data_ptr() == mem
                    or not apart(c_ptr, (a_ptr, xlo, xhi), (b_ptr, ylo, yhi))):
                return general(a, b, out=out)
            try:
                run(a_ptr, b_ptr, c_ptr)
            except fallback.FAILURES:
                return general(a, b, out=out)
            return by_autohc(out)
        return mm

    def addmm(inp, m1, m2, beta, alpha, out):
        c_ptr, a_ptr, b_ptr, i_ptr = out.data_ptr(), m1.data_ptr(), m2.data_ptr(), inp.data_ptr()
        mem = out.untyped_storage().data_ptr()
        if (m1.untyped_storage().data_ptr() == mem or m2.untyped_storage().data_ptr() == mem
                or inp.untyped_storage().data_ptr() == mem
                or not apart(c_ptr, (a_ptr, xlo, xhi), (b_ptr, ylo, yhi), (i_ptr, ilo, ihi))):
            return general(inp, m1, m2, beta=beta, alpha=alpha, out=out)
        try:
            run(a_ptr, b_ptr, c_ptr, i_ptr)
        except fallback.FAILURES:
            return general(inp, m1, m2, beta=beta, alpha=alpha, out=out)
        return by_autohc(out)
    return addmm


def _mm_out(a, b, *, out):
    key = ("mm.out", a.shape, a.stride(), a.dtype, b.shape, b.stride(), b.dtype, out.shape, out.stride(),
           out.dtype, a.is_neg() or b.is_neg() or out.is_neg())
    run, stamp = prepared.route(key)
    if run is not None:
        return run(a, b, out)
    route = None            # (ATen's calls of the `.out` forms may hinge on addresses: not routed)
    if not _serve16(a, b) and _serve(a, b) and _fits(out, _mm_shape(a, b), a, b):
        route = _bound_out_route("mm", _mm_out_general, a, b, out, 1.0, 0.0, None)
    result = _mm_out_general(a, b, out=out)
    prepared.remember(key, route, stamp)
    return result


def _addmm_out(inp, m1, m2, *, beta=1, alpha=1, out):
    key = ("addmm.out", m1.shape, m1.stride(), m1.dtype, m2.shape, m2.stride(), m2.dtype, inp.shape,
           inp.stride(), inp.dtype, out.shape, out.stride(), out.dtype,
           m1.is_neg() or m2.is_neg() or inp.is_neg() or out.is_neg(), beta, alpha)
    run, stamp = prepared.route(key)
    if run is not None:
        return run(inp, m1, m2, beta, alpha, out)
    route = None
    if (not _plus16_ok(inp, m1, m2, beta, alpha)
            and _plus_ok(_serve(m1, m2), inp, beta, alpha, lambda: _mm_shape(m1, m2))
            and _fits(out, _mm_shape(m1, m2), m1, m2, inp)):
        bias = _row_bias(out, inp, beta)
        if bias is not None or beta == 0:
            route = _bound_out_route("addmm", _addmm_out_general, m1, m2, out, alpha, beta, bias, inp)
    result = _addmm_out_general(inp, m1, m2, beta=beta, alpha=alpha, out=out)
    prepared.remember(key, route, stamp)
    return result


def _mm_out_general(a, b, *, out):
    if _serve16(a, b) and _fits(out, _mm_shape(a, b), a, b, dtype=torch.bfloat16):
        return _gemm16("mm", out, a, b)
    return _gemm("mm", gemm_into, _serve(a, b) and _fits(out, _mm_shape(a, b), a, b), out, a, b)


def _addmm_out_general(inp, m1, m2, *, beta=1, alpha=1, out):
    if _plus16_ok(inp, m1, m2, beta, alpha) and _fits(out, _mm_shape(m1, m2), m1, m2, inp, dtype=torch.bfloat16):
        return _gemm16("addmm", out, m1, m2, inp, beta, alpha)
    served = (_plus_ok(_serve(m1, m2), inp, beta, alpha, lambda: _mm_shape(m1, m2))
              and _fits(out, _mm_shape(m1, m2), m1, m2, inp))
    return _gemm("addmm", gemm_into, served, out, m1, m2, inp, beta, alpha)


def _bmm_out(a, b, *, out):
    return _gemm("bmm", bmm_into, _batched(a, b) and _fits(out, _bmm_shape(a, b), a, b), out, a, b)


def _baddbmm_out(inp, b1, b2, *, beta=1, alpha=1, out):
    served = (_plus_ok(_batched(b1, b2), inp, beta, alpha, lambda: _bmm_shape(b1, b2))
              and _fits(out, _bmm_shape(b1, b2), b1, b2, inp))
    return _gemm("baddbmm", bmm_into, served, out, b1, b2, inp, beta, alpha)


# registered only where ATen's own kernels could be captured (a call not served needs them)
OUT_IMPLS = ({"mm.out": _mm_out, "addmm.out": _addmm_out, "bmm.out": _bmm_out,
              "baddbmm.out": _baddbmm_out} if all(ATEN_OUT.values()) else {})


def _aten_mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out := a @ b by ATen's own mm.out kernel (first-use tuning's ATen contender)."""
    aten_out("mm.out")(a, b, out=out)


def _positive(name: str, v) -> None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"autohc.install: {name} must be a positive int, got {v!r}")


def _default_threads(torch_threads: int) -> int:
    """torch's thread count, less the cores the CPU plan keeps for helper threads (where it
    could keep them: on a machine too small they share the compute cores)."""
    p = cpu_plan.current()
    return min(torch_threads, len(p.compute)) if (p.comm or p.memory) and not p.shared else torch_threads


def one_thread_hint(n: int) -> str:
    """What install() says, once per process, when it gives torch's own ops one thread."""
    return (f"autohc.install: torch's own ops run on 1 thread instead of {n} while installed, "
            "because torch's OpenMP workers spin for milliseconds after each op (libgomp's "
            "default) and would take the cores from autohc's kernels; torch.compile's code "
            "compiled meanwhile keeps 1 thread. AUTOHC_TEAM=pool chose autohc's own threads; "
            "unset it (the kernels then run on torch's threads), or set GOMP_SPINCOUNT=10000 "
            "before torch is imported, to keep all threads.")


def install(threads: int | None = None, torch_threads: int | str | None = "auto",
            first_use_tuning: bool = True, optimizers: bool = True) -> None:
    """Route torch's CPU float32 GEMMs and the fused operators to autohc kernels (tuned ones
    from the registry).

    threads: threads of autohc's kernels (default: torch.get_num_threads() at the first install,
        at most the CPU plan's compute cores: a core kept for AutoMem's or the all-reduce's
        helper thread, AUTOHC_MEMORY_CORES / AUTOHC_COMM_CORES, is not computed on).
    torch_threads: torch's own intra-op threads while installed; None leaves them. "auto"
        (default): leave them, since autohc's kernels run on torch's own OpenMP threads
        (AUTOHC_TEAM=omp, the default: runtime/omp.py). With AUTOHC_TEAM=pool (autohc's
        own threads) "auto" leaves them only where torch's OpenMP workers wait briefly after
        each op (GOMP_SPINCOUNT <= 100000 or OMP_WAIT_POLICY=PASSIVE set before torch was
        imported), else sets 1: with libgomp's default spin, torch's idle workers take the
        cores from the pool's. uninstall() restores the setting.
    first_use_tuning: race a few candidates from this CPU's per-microarchitecture table the
        first time a GEMM problem with no registry entry is met, and record the winner
        (tune/first_use.py; a few seconds per problem, the default kernel meanwhile). ATen's
        own kernel races too: a problem where it wins is left to ATen from then on.
        AUTOHC_FIRST_USE=0 turns it off whatever this says.
    optimizers: torch.optim.Adam and AdamW's default CPU step (one ATen pass per operation and
        parameter) runs as autohc's fused AdamW pass for the float32 tensors it takes
        (torch/optim.py); the same update up to float32 rounding order. False leaves torch's."""
    _positive("threads", threads)
    for name, flag in (("first_use_tuning", first_use_tuning), ("optimizers", optimizers)):
        if not isinstance(flag, bool):
            raise TypeError(f"autohc.install: {name} must be True or False, got {flag!r}")
    auto = torch_threads == "auto"
    if auto:    # one set of threads (AUTOHC_TEAM=omp), or torch's waiting briefly: leave them
        torch_threads = None if omp.team_kind() == "omp" or omp.torch_waits_briefly() else 1
    _positive("torch_threads", torch_threads)
    with _lock:
        if _override["lib"] is None:
            _state["torch_threads_before"] = torch.get_num_threads()
        _state["threads"] = threads or _state["threads"] or _default_threads(_state["torch_threads_before"])
        set_kernel_threads(_state["threads"])
        if torch_threads is not None:
            if auto and torch_threads == 1 < torch.get_num_threads() and not _state["told_one_thread"]:
                _state["told_one_thread"] = True
                warnings.warn(one_thread_hint(torch.get_num_threads()), RuntimeWarning, stacklevel=3)
            torch.set_num_threads(torch_threads)
        if _override["lib"] is None:
            _state["first_use_before"] = first_use.enabled()
        first_use.enable(first_use_tuning)
        if ATEN_OUT["mm.out"] is not None:      # races ATen's own kernel too (never this override)
            first_use.set_aten_runner(_aten_mm_into)
        prepared.forget()
        from . import optim
        (optim.serve_torch_adam if optimizers else optim.restore_torch_adam)()
        if _override["lib"] is not None:
            return
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            # torch warns once that a kernel is being overridden: that is the point here
            warnings.simplefilter("ignore")
            lib.impl("mm", _mm, "CPU")
            lib.impl("addmm", _addmm, "CPU")
            lib.impl("bmm", _bmm, "CPU")
            lib.impl("baddbmm", _baddbmm, "CPU")
            # the fused operators and attention (SDPA's CPU flash op), forward and backward
            for name, fn in {**ATEN_IMPLS, **ATTENTION_IMPLS, **OUT_IMPLS}.items():
                lib.impl(name, fn, "CPU")
            # under autocast to bf16: a Linear on its fp32 weight, no bf16 copy (autocast.py)
            from .autocast import AUTOCAST_IMPLS
            for name, fn in AUTOCAST_IMPLS.items():
                lib.impl(name, fn, "AutocastCPU")
        # torch.compile graphs: fc1 + GELU as one kernel, as in autohc's DiT (compile_pass.py)
        from . import compile_pass
        _state["pre_grad_pass_before"] = compile_pass.set_pass()
        _override["lib"] = lib


def uninstall() -> None:
    """Give the GEMMs and operators back to ATen and torch its thread count."""
    with _lock:
        lib, _override["lib"] = _override["lib"], None
        _state["threads"] = None
        prepared.forget()
        set_kernel_threads(None)
        if lib is not None:
            lib._destroy()
            from . import compile_pass, optim
            optim.restore_torch_adam()
            compile_pass.restore_pass(_state.pop("pre_grad_pass_before", None))
            first_use.set_aten_runner(None)
            first_use.enable(_state.get("first_use_before", False))
            torch.set_num_threads(_state["torch_threads_before"])


@contextlib.contextmanager
def installed(threads: int | None = None, torch_threads: int | str | None = "auto",
              first_use_tuning: bool = True, optimizers: bool = True):
    """`with autohc.installed(): ...` — installed inside the block, as before after it."""
    was = is_installed()
    install(threads, torch_threads, first_use_tuning, optimizers)
    try:
        yield
    finally:
        if not was:
            uninstall()
