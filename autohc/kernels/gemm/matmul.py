"""`autohc.matmul`: GEMM on generated kernels, for torch tensors and numpy arrays.

    C := alpha * A @ B + beta * C

A and B may be any strided 2-D float32 views (transposes are read in place as layouts: NN,
NT = X @ W.T, TN = dY.T @ X), C needs one unit stride (a column-major C is computed as
C.T = B.T @ A.T). torch CPU tensors and numpy arrays are both taken.

bf16: torch.bfloat16 tensors, or float32 ones with compute="bf16" (rounded to bf16 while
packing), multiply in bf16 and accumulate in fp32 on this CPU's bf16 back-end (cpu.bf16_isa);
C is float32, or bfloat16 where `out` is: written by the bf16 back-ends' own store (the
last K panel rounds into it; fp32 partial sums of earlier panels in a per-thread workspace),
elsewhere rounded once from an fp32 C.
"""
from __future__ import annotations

import dataclasses

import numbers
import threading

import numpy as np

from ...hw import cpu
from ...runtime import cftp
from ...tune import registry
from .family import m_bucket
from .kernel import KernelError, default_kernel_params, get_kernel, tiles_emulated
from ..isa import BF16_ISAS
from .params import MAX_THREADS, GemmParams

try:  # torch is a dependency, but keep numpy-only use possible
    import torch
except ImportError:  # pragma: no cover
    torch = None


# Called with (layout, M, K, N, threads, dtype, c_fp32, w_fp32) of a Linear problem the registry
# has no entry for (c_fp32: bf16 products into an fp32 C, as autocast's weight gradients; w_fp32:
# a bf16 product whose B is a float32 weight, as autocast's forward and dX); answers (the
# parameters to run or None for the default, settled): settled where that answer holds for the
# rest of the process (the problem's tuning ended or was skipped), so that it can be remembered.
# Set by tune/first_use.enable().
_registry_miss_hook = None

# The choice of every problem met, for the registry state and hook it was made under: this runs
# on every GEMM call, and choosing again cost about 3 us (an AMX Xeon), a tenth of a call's
# overhead. Cleared when the registry file changes (registry.memo() is then a new dict), the hook
# changes, or forget_choices() is called.
_choices: dict = {"registry": None, "hook": None, "params": {}, "forgotten": 0}
MAX_CHOICES = 4096


def set_registry_miss_hook(hook) -> None:
    global _registry_miss_hook
    _registry_miss_hook = hook
    forget_choices()


def forget_choices() -> None:
    """Choose again on each problem's next call (first-use tuning forgot its tunings)."""
    _choices["registry"] = None
    _choices["forgotten"] += 1


def choices_stamp() -> tuple:
    """What every problem's choice was made under: the registry's state, the first-use hook and
    the count of forget_choices() calls. A choice derived from (a prepared call) holds while
    this is the same (`is` on its first two)."""
    return registry.memo(), _registry_miss_hook, _choices["forgotten"]


def tuned_params(m: int, k: int, n: int, sa, sb, threads: int, dtype: str = "fp32",
                 c_fp32: bool = False) -> GemmParams:
    """The registry's configuration for this problem on this CPU, else (first-use tuning's
    pick, when it is on, or) the default one; with CFTP on (runtime/cftp.py), its thread
    geometry splits N across the clusters."""
    return cftp.geometry(_choice(m, k, n, sa, sb, threads, dtype, c_fp32)[0])


class AtenFaster(Exception):
    """Raised by the override's entry points (gemm_into, gemm_bf16_into, bmm_into) before they
    write anything, where first-use tuning timed ATen's own kernel faster on the problem (its
    registry entry, of this M's bucket, says so): the caller runs ATen's instead."""


def _override_params(A: "_Operand", B: "_Operand", threads: int, dtype: str,
                     c_fp32: bool = False, aten_wins: bool = True, w_fp32: bool = False) -> GemmParams:
    """tuned_params for the torch override, or AtenFaster where aten_wins (one choice per call:
    it runs on every GEMM)."""
    params, aten = _choice(A.shape[0], A.shape[1], B.shape[1], A.strides, B.strides, threads, dtype,
                           c_fp32, w_fp32)
    if aten and aten_wins:
        raise AtenFaster(f"{A.shape[0]}x{A.shape[1]}x{B.shape[1]} {dtype}")
    return cftp.geometry(params)


def _choice(m: int, k: int, n: int, sa, sb, threads: int, dtype: str,
            c_fp32: bool = False, w_fp32: bool = False) -> tuple[GemmParams, bool]:
    state, hook = registry.memo(), _registry_miss_hook
    if _choices["registry"] is not state or _choices["hook"] is not hook:
        _choices.update(registry=state, hook=hook, params={})
    key = _choice_key(m, k, n, sa, sb, threads, dtype, c_fp32, w_fp32)
    choice = _choices["params"].get(key)
    if choice is None:
        params, aten, settled = _chosen_params(m, k, n, sa, sb, threads, dtype, hook, c_fp32, w_fp32)
        choice = (params, aten)
        if settled:
            if len(_choices["params"]) >= MAX_CHOICES:     # (shapes that keep changing)
                _choices["params"] = {}
            _choices["params"][key] = choice
    return choice


def _choice_key(m: int, k: int, n: int, sa, sb, threads: int, dtype: str, c_fp32: bool,
                w_fp32: bool = False) -> tuple:
    return (registry.layout_of(sa[0], sa[1], sb[0], sb[1]), m, k, n, threads, dtype, c_fp32, w_fp32)


def _chosen_params(m: int, k: int, n: int, sa, sb, threads: int, dtype: str,
                   hook, c_fp32: bool = False, w_fp32: bool = False) -> tuple[GemmParams, bool, bool]:
    """The parameters, whether ATen runs the problem instead, and whether the two hold until
    the registry or the hook changes."""
    layout = registry.layout_of(sa[0], sa[1], sb[0], sb[1])
    if layout is not None:              # (no registry file: lookup answers None)
        M, K, N = registry.linear_dims(layout, m, k, n)
        hit = registry.lookup("gemm", layout, K, N, M, threads, dtype=dtype)
        if (hit is not None and not outdated_default(hit, threads) and not _drops_skinny_paths(hit[0], M, threads)
                and (hook is None or not (_aten_raced_without_the_cast(hit, c_fp32, w_fp32)
                                          or _raced_for_a_shorter_job(hit, hook)))):
            entry = hit[1]              # (ATen's win holds for its own M bucket only)
            aten = bool(entry.get("aten_faster")) and m_bucket(entry.get("M", 0)) == m_bucket(M)
            return hit[0], aten, True
        if hook is not None:
            chosen, settled = hook(layout, M, K, N, threads, dtype, c_fp32, w_fp32)
            return chosen or default_kernel_params(threads, dtype=dtype), False, settled
    return default_kernel_params(threads, dtype=dtype), False, True


def _drops_skinny_paths(params: GemmParams, M: int, threads: int) -> bool:
    """An entry of a larger M (the nearest bucket) built without the skinny paths that this M
    would take in the default kernel (skinny_m: tuned large-M entries and first-use candidates
    leave them out): the default runs instead of the packed path on a few rows."""
    return params.skinny_m < M <= default_kernel_params(threads, dtype=params.dtype).skinny_m


def _aten_raced_without_the_cast(hit, c_fp32: bool, w_fp32: bool = False) -> bool:
    """A first-use entry that gave ATen a bf16 problem raced without a cast that this call's
    way back to ATen adds: into an fp32 C (c_fp32, autocast's weight gradient) by a race from
    before races knew the caller's C (no `c_fp32` field), or from an fp32 weight (w_fp32, the
    bf16 copy autocast's forward and dX take each call) by a race on a bf16 B (no `w_fp32`
    field, or false). The problem is raced again where first-use tuning is on (and the new
    entry says what it timed); with it off the entry stands."""
    params, entry = hit
    if not (params.dtype == "bf16" and entry.get("source") == "first-use" and entry.get("aten_faster")):
        return False
    return (c_fp32 and "c_fp32" not in entry) or (w_fp32 and not entry.get("w_fp32"))


def _raced_for_a_shorter_job(hit, hook) -> bool:
    """A first-use entry raced without its candidates for a job too short to pay for them (its
    `calls_ahead`), met where the hook would race them now (a longer job, or one of unknown
    length: tune/first_use.py's expect_calls): raced again."""
    return "calls_ahead" in hit[1] and getattr(hook, "races_candidates", lambda: False)()


def outdated_default(hit, threads: int) -> bool:
    """A first-use entry that kept the default of its day (`default_kept`; older entries: the
    winner's figure equal to the default's), where today's default is another configuration:
    tuned again on first use, not pinned to an earlier release's default."""
    params, entry = hit
    if entry.get("source") != "first-use":
        return False
    kept = entry.get("default_kept", entry.get("gflops") == entry.get("default_gflops"))
    return bool(kept) and params != default_kernel_params(threads, dtype=params.dtype)


# ----------------------------------------------------------------------------- operands

def byte_offsets(shape, strides, itemsize: int) -> tuple[int, int]:
    """The bytes [lo, hi) that elements of `shape` at element `strides` occupy, as offsets from
    the first element's address ((0, 0) when there are none)."""
    lo = hi = 0                         # (one plain loop: every GEMM operand's check, per call)
    for n, s in zip(shape, strides):
        if n == 0:
            return 0, 0
        e = (n - 1) * s
        if e < 0:
            lo += e
        else:
            hi += e
    return itemsize * lo, itemsize * (hi + 1)


def _disjoint(spans, ap: int, bp: int, cp: int) -> bool:
    """Whether C at address cp shares no byte with A at ap nor B at bp, spans being the three's
    byte_offsets (a prepared route's check, per call, without building operands)."""
    (a0, a1), (b0, b1), (c0, c1) = spans
    return not ((ap + a0 < cp + c1 and cp + c0 < ap + a1) or (bp + b0 < cp + c1 and cp + c0 < bp + b1))


class _Operand:
    """A 2-D float32 (or bfloat16) operand seen as (address, shape, element strides)."""
    __slots__ = ("obj", "ptr", "shape", "strides", "itemsize", "f32")

    def __init__(self, obj, ptr, shape, strides, itemsize: int = 4):
        self.obj, self.ptr, self.shape, self.strides = obj, ptr, shape, strides
        self.itemsize, self.f32 = itemsize, itemsize == 4

    def nbytes_span(self) -> tuple[int, int]:
        """The addresses [first, past the last) of the bytes its elements occupy."""
        lo, hi = byte_offsets(self.shape, self.strides, self.itemsize)
        return self.ptr + lo, self.ptr + hi

    def overlaps(self, span: tuple[int, int]) -> bool:
        """Whether any of its bytes lies in `span` (another operand's nbytes_span())."""
        (a0, a1), (b0, b1) = self.nbytes_span(), span
        return a0 < b1 and b0 < a1


def _kind(x) -> str:
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    if isinstance(x, np.ndarray):
        return "numpy"
    raise TypeError(f"autohc.matmul takes torch.Tensor or numpy.ndarray, not {type(x).__name__}")


def _operand(x, name: str, kind: str) -> _Operand:
    if _kind(x) != kind:
        raise TypeError(f"autohc.matmul: {name} is a {_kind(x)} array but the others are {kind}; "
                        "do not mix torch and numpy")
    if x.ndim != 2:
        raise ValueError(f"autohc.matmul: {name} must be 2-D, got {x.ndim}-D shape {tuple(x.shape)}")
    if kind == "torch":
        if x.device.type != "cpu":
            raise TypeError(f"autohc.matmul: {name} is on {x.device}; only CPU tensors")
        if x.layout != torch.strided:
            raise TypeError(f"autohc.matmul: {name} has layout {x.layout}; only dense (strided)")
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"autohc.matmul: {name} is {x.dtype}; only torch.float32 and torch.bfloat16")
        if x.requires_grad and torch.is_grad_enabled():
            raise TypeError(f"autohc.matmul: {name} requires grad and autohc.matmul does not "
                            "record autograd; call it under torch.no_grad() or use torch.matmul "
                            "with autohc.install()")
        return operand_raw(x, kind)
    if x.dtype != np.float32:
        raise TypeError(f"autohc.matmul: {name} is {x.dtype}; only float32")
    if not x.flags.aligned or any(s % 4 for s in x.strides):
        raise ValueError(f"autohc.matmul: {name} is not aligned to 4-byte floats; "
                         "pass np.ascontiguousarray(...) of it")
    return operand_raw(x, kind)


def _scalar(v, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"autohc.matmul: {name} must be a real number, got {v!r}")
    return float(v)


def _copy(x, kind: str):
    return x.clone() if kind == "torch" else x.copy()


def _apart(kind, a, b, A: "_Operand", B: "_Operand", C: "_Operand") -> tuple:
    """A and B, each read from a copy where it aliases the output C, so the result is
    still a @ b."""
    c = C.nbytes_span()
    if A.overlaps(c):
        A = operand_raw(_copy(a, kind), kind)
    if B.overlaps(c):
        B = operand_raw(_copy(b, kind), kind)
    return A, B


def matmul(a, b, *, out=None, alpha=1.0, beta=0.0, threads=None, params: GemmParams | None = None,
           compute: str | None = None):
    """C = alpha * a @ b + beta * out, for 2-D CPU torch tensors or numpy arrays.

    - a: (M, K), b: (K, N), any strides (a transposed view is a layout, not a copy); float32,
      or torch.bfloat16 (computed in bf16).
    - out: optional (M, N) result, written in place and returned; needed if beta != 0.
      float32, or bfloat16 for a bf16 product; default: bfloat16 where a and b both are
      (as torch.matmul), else float32.
    - compute: "fp32" or "bf16" (bf16 products, fp32 accumulation: float32 inputs are rounded
      to bf16 while packing); default "bf16" where an input is bfloat16, else "fp32".
    - threads: GEMM threads (default: every CPU this process may use).
    - params: run this kernel configuration (its dtype must be the compute's) instead of the
      registry's or the default one for `threads`.
    Raises TypeError / ValueError for what it does not handle, before writing anything.
    """
    kind = _kind(a)
    A, B = _operand(a, "a", kind), _operand(b, "b", kind)
    alpha, beta = _scalar(alpha, "alpha"), _scalar(beta, "beta")
    any_bf16 = not (A.f32 and B.f32)
    if compute is None:
        compute = "bf16" if any_bf16 else "fp32"
    if compute not in ("fp32", "bf16"):
        raise ValueError(f"autohc.matmul: compute must be 'fp32' or 'bf16', got {compute!r}")
    if compute == "fp32" and any_bf16:
        raise TypeError("autohc.matmul: bfloat16 inputs compute in bf16; pass compute='bf16' "
                        "or convert them to float32")
    M, K = A.shape
    K2, N = B.shape
    if K != K2:
        raise ValueError(f"autohc.matmul: shapes {A.shape} and {B.shape} do not multiply "
                         f"(a has {K} columns, b has {K2} rows)")
    if params is not None:
        if not isinstance(params, GemmParams):
            raise TypeError(f"autohc.matmul: params must be a GemmParams, not {type(params).__name__}")
        _validated(params)
        if params.dtype != compute:
            raise ValueError(f"autohc.matmul: params compute in {params.dtype}, not {compute}")
        if threads is not None and threads != params.threads:
            raise ValueError(f"autohc.matmul: threads={threads} but params run {params.threads}")
    else:
        if threads is None:
            threads = cpu.detect().cores
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
            raise ValueError(f"autohc.matmul: threads must be an int in [1, {MAX_THREADS}], "
                             f"got {threads!r}")

    if out is None:
        if beta != 0.0:
            raise ValueError("autohc.matmul: beta != 0 needs out= (the C to accumulate into)")
        if kind == "torch":
            both_bf16 = not A.f32 and not B.f32
            out = torch.empty((M, N), dtype=torch.bfloat16 if both_bf16 else torch.float32)
        else:
            out = np.empty((M, N), np.float32)
    C = _operand(out, "out", kind)
    if C.shape != (M, N):
        raise ValueError(f"autohc.matmul: out has shape {C.shape}, expected {(M, N)}")
    if not C.f32 and compute != "bf16":
        raise TypeError("autohc.matmul: a bfloat16 out takes a bf16 product (compute='bf16')")
    if M == 0 or N == 0:
        return out
    if (M > 1 and C.strides[0] == 0) or (N > 1 and C.strides[1] == 0):
        raise ValueError("autohc.matmul: out has a zero stride (an expanded view); "
                         "several results would land on one element")
    if not C.f32:
        if beta == 0.0 and _run_bf16c(kind, a, b, A, B, C, alpha, threads, params):
            return out
        # elsewhere the kernels write fp32 C: accumulate into an fp32 copy, round once into out
        acc = out.float() if beta != 0.0 else torch.empty((M, N), dtype=torch.float32)
        _run(kind, a, b, acc, A, B, operand_raw(acc), alpha, beta, threads, params, dtype=compute)
        out.copy_(acc)
        return out
    return _run(kind, a, b, out, A, B, C, alpha, beta, threads, params, dtype=compute)


_checked: dict = {}     # id -> GemmParams validated already, held so that the id stays its own


def _validated(params: GemmParams) -> GemmParams:
    """params.validate(), once per object (frozen): a benchmark passes the same one to every
    call, and validating took about 10 us."""
    if _checked.get(id(params)) is not params:
        params.validate()
        if len(_checked) >= 64:
            _checked.clear()
        _checked[id(params)] = params
    return params


class _RouteInto:
    """gemm_into's prepared call for one problem (prepared_gemm_into's bound kernel) and the
    byte spans of A, B and C from their first elements, to refuse a call whose C overlaps."""
    __slots__ = ("run", "spans")

    def __init__(self, run, spans):
        self.run, self.spans = run, spans


def gemm_into(a, b, out, alpha: float, beta: float, threads: int, bias=None, dtype: str = "fp32"):
    """gemm_into_whole, by a prepared route where a call like this one made one (as
    gemm_bf16_into)."""
    routes = _routes_now()
    key = ("into", a.shape, a.stride(), a.dtype, b.shape, b.stride(), b.dtype, out.shape, out.stride(),
           out.dtype, alpha, beta, threads, None if bias is None else (bias.shape, bias.stride(), bias.dtype),
           dtype)
    route = routes.get(key)
    if route is not None:
        ap, bp, cp = a.data_ptr(), b.data_ptr(), out.data_ptr()
        if _disjoint(route.spans, ap, bp, cp):
            route.run(ap, bp, cp, 0 if bias is None or beta == 0.0 else bias.data_ptr())
            route_stats["hits"] += 1
            return out
    gemm_into_whole(a, b, out, alpha, beta, threads, bias, dtype)
    if route is None:
        run = prepared_gemm_into(a, b, out, alpha, beta, threads, bias, dtype)
        if run is not None:
            if len(routes) >= MAX_ROUTES:
                routes.clear()
            routes[key] = _RouteInto(run, tuple(byte_offsets(tuple(t.shape), tuple(t.stride()), t.element_size())
                                                for t in (a, b, out)))
    return out


def gemm_into_whole(a, b, out, alpha: float, beta: float, threads: int, bias=None, dtype: str = "fp32"):
    """out := alpha * a @ b + beta * out for float32 CPU tensors already checked by the caller
    (the torch override); the registry's configuration or the default one. With `bias` (a
    float32 tensor of out's row shape, any stride, not overlapping out): out := alpha * a @ b
    + beta * bias in every row, out not read (addmm's Linear bias, added by the kernel).
    dtype "bf16": bf16 products (bfloat16 or float32 a, b; float32 ones rounded while
    packing) into the float32 out (a weight's gradient under autocast)."""
    A, B = operand_raw(a), operand_raw(b)
    return _run("torch", a, b, out, A, B, operand_raw(out), alpha, beta, threads,
                _override_params(A, B, threads, dtype, c_fp32=dtype == "bf16"), bias, dtype)


def prepared_gemm_into(a, b, out, alpha: float, beta: float, threads: int, bias=None, dtype: str = "fp32"):
    """gemm_into's call on these operands made ready for others of the same shapes, strides,
    dtypes and scalars: a function of (a_ptr, b_ptr, out_ptr, bias_ptr) that runs only the kernel
    (GemmKernel.bound), or None where a call of this form is decided on each call as gemm_into
    decides it: C without a unit column stride, a bias that would be copied, operands that
    overlap out, or a choice that first-use tuning has not settled. Raises what gemm_into
    raises before it writes anything (AtenFaster, a kernel that cannot be built or run)."""
    A, B, C = operand_raw(a), operand_raw(b), operand_raw(out)
    M, K = A.shape
    N = B.shape[1]
    if beta == 0.0:
        bias = None
    if not (C.strides[1] == 1 or N == 1) or (bias is not None and not bias.is_contiguous()):
        return None
    span = C.nbytes_span()
    if A.overlaps(span) or B.overlaps(span):
        return None
    c_fp32 = dtype == "bf16"
    params = _override_params(A, B, threads, dtype, c_fp32=c_fp32)
    if _choice_key(M, K, N, A.strides, B.strides, threads, dtype, c_fp32) not in _choices["params"]:
        return None
    return get_kernel(params).bound(M, N, K, alpha, A.strides[0], A.strides[1], B.strides[0], B.strides[1],
                                    beta, C.strides[0] if M > 1 else max(N, 1), bias is not None,
                                    int(A.f32) | int(B.f32) << 1)


def bmm_into(a, b, out, alpha: float, beta: float, threads: int):
    """out[i] := alpha * a[i] @ b[i] + beta * out[i] for 3-D float32 CPU tensors checked by the
    caller (the torch override), out row-major per matrix and not overlapping a or b: one
    configuration (from matrix 0's problem) and one C call for the whole batch."""
    A, B = operand_raw(a[0]), operand_raw(b[0])
    M, K = A.shape
    N = B.shape[1]
    params = _override_params(A, B, threads, "fp32")
    get_kernel(params).run_batched(a.shape[0], a.stride(0), b.stride(0), out.stride(0), M, N, K,
                                   alpha, A.ptr, A.strides[0], A.strides[1], B.ptr, B.strides[0],
                                   B.strides[1], beta, out.data_ptr(), out.stride(1))
    return out


class _Route16:
    """gemm_bf16_into's decisions for one problem (shapes, strides, dtypes, scalars, epilogue):
    the kernel and its arguments but the addresses, taken by the calls like the one that made
    it (the same result: the same kernel on the same arguments). Where a call's C overlaps A
    or B, it takes the whole path (which reads a copy)."""
    __slots__ = ("aten", "kernel", "args", "ws", "spans", "act", "bias_f32")

    def __init__(self, aten, kernel, args, ws, spans, act, bias_f32):
        self.aten, self.kernel, self.args, self.ws = aten, kernel, args, ws
        self.spans, self.act, self.bias_f32 = spans, act, bias_f32

    def run(self, a, b, out, bias, packed_b, pre) -> bool:
        """True: done; False: this call overlaps (the caller takes the whole path)."""
        if self.aten:
            raise AtenFaster("a prepared problem ATen runs faster")
        ap, bp, cp = a.data_ptr(), b.data_ptr(), out.data_ptr()
        if not _disjoint(self.spans, ap, bp, cp):
            return False
        if bias is not None and not self.bias_f32:
            bias = bias.to(torch.float32).contiguous()
        k = self.kernel
        M, N, K, alpha, rsa, csa, rsb, csb, beta, ldc, in_f32 = self.args
        ws = _workspace(self.ws).data_ptr() if self.ws else None
        bpk = packed_b(k) if packed_b is not None and k.reads_packed_b else None
        bias_ptr = None if bias is None else bias.data_ptr()
        if self.act:
            k.run_bf16c_act(M, N, K, alpha, ap, rsa, csa, bp, rsb, csb, None if bpk is None else bpk.data_ptr(),
                            beta, bias_ptr, ws, cp, ldc, 0 if pre is None else (pre.data_ptr() - cp) // 2, in_f32)
        elif bpk is not None:
            k.run_bf16c_packed(M, N, K, alpha, ap, rsa, csa, bp, rsb, csb, bpk.data_ptr(), beta, bias_ptr, ws,
                               cp, ldc, in_f32)
        else:
            k.run_bf16c(M, N, K, alpha, ap, rsa, csa, bp, rsb, csb, beta, bias_ptr, ws, cp, ldc, in_f32)
        return True


MAX_ROUTES = 4096                     # (shapes that keep changing: the table starts again)
_routes: dict = {"stamp": None, "routes": {}}
route_stats = {"hits": 0}               # calls a route ran (tests)


def _route16_key(a, b, out, alpha, threads, bias, beta, packed_b, epilogue, pre) -> tuple:
    return (a.shape, a.stride(), a.dtype, b.shape, b.stride(), b.dtype, out.shape, out.stride(), out.dtype,
            alpha, threads, None if bias is None else (bias.shape, bias.stride(), bias.dtype), beta,
            packed_b is not None, epilogue, None if pre is None else (pre.shape, pre.stride(), pre.dtype))


def _routes_now() -> dict:
    """The routes made under what holds now (the choices' stamp, CFTP's clusters, AMX tile
    emulation); a change of any empties the table."""
    stamp = (*choices_stamp(), cftp.clusters(), tiles_emulated())
    held = _routes["stamp"]
    if held is None or held[0] is not stamp[0] or held[1:] != stamp[1:]:
        _routes["stamp"], _routes["routes"] = stamp, {}
    return _routes["routes"]


def gemm_bf16_into(a, b, out, alpha: float, threads: int, bias=None, beta: float = 1.0,
                   packed_b=None, epilogue: str = "none", pre=None) -> bool:
    """gemm_bf16_into_whole, by a prepared route where a call like this one made one (one
    lookup instead of the choice, the checks and the kernel's lookup: a training step makes
    hundreds of these calls, each after a kernel has pushed the interpreter's data out of the
    caches)."""
    routes = _routes_now()
    key = _route16_key(a, b, out, alpha, threads, bias, beta, packed_b, epilogue, pre)
    route = routes.get(key)
    if route is not None and route.run(a, b, out, bias, packed_b, pre):
        route_stats["hits"] += 1
        return True
    made = []
    try:
        return gemm_bf16_into_whole(a, b, out, alpha, threads, bias, beta, packed_b, epilogue, pre, made)
    finally:        # (a route also where the kernel or ATen's win raised: the next call does as this one)
        if made and route is None:
            made[0].bias_f32 = bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
            if len(routes) >= MAX_ROUTES:
                routes.clear()
            routes[key] = made[0]


def gemm_bf16_into_whole(a, b, out, alpha: float, threads: int, bias=None, beta: float = 1.0,
                         packed_b=None, epilogue: str = "none", pre=None, made=None) -> bool:
    """out := bf16(alpha * a @ b [+ beta * bias in every row]) for bfloat16 (or float32) CPU tensors
    a, b checked by the caller (the torch override), out bfloat16 (M, N); bias: a float32 or
    bfloat16 tensor of out's row shape. Written by the bf16 kernel itself (its last K panel
    rounds into out): True. KernelError, nothing written, where this CPU's bf16 back-end cannot
    do that or out has no unit column stride: the caller's fallback computes another way.
    packed_b: called with the kernel that runs, where it reads a B packed whole
    (`reads_packed_b`): that kernel's packing of b (a bf16 tensor of packed_b_elems, e.g.
    autohc.frozen's, made once), or None to pack b as usual. epilogue "gelu_tanh": out :=
    bf16(GELU(alpha a @ b + beta bias)), by the problem's kernel with GELU in its store (built
    without the skinny paths, which have no epilogue: a small M takes the packed path); pre:
    None, or a bfloat16 tensor laid out as out (its strides) that gets bf16(alpha a @ b + beta
    bias) as well, the pre-activation GELU's backward reads. epilogue "gelu_tanh_bwd": out :=
    bf16(GELU'(pre) * (alpha a @ b + beta bias)), pre (required, laid out as out; out itself
    allowed) GELU's bf16 pre-activation: fc2's input gradient and GELU's backward in one
    kernel."""
    A, B = operand_raw(a), operand_raw(b)
    w_fp32 = B.f32 and not A.f32        # (a Linear's fp32 weight, which ATen's way back casts)
    # (an ATen win raced on the plain product does not hold with an epilogue: ATen would add its pass)
    try:
        params = _override_params(A, B, threads, "bf16", aten_wins=epilogue == "none", w_fp32=w_fp32)
    except AtenFaster:
        if made is not None and _settled(A, B, threads, "bf16", w_fp32):
            made.append(_Route16(True, None, None, 0, None, False, False))
        raise
    settled = made is not None and _settled(A, B, threads, "bf16", w_fp32)
    if epilogue != "none":
        if params.isa not in BF16_ISAS:
            raise KernelError(f"epilogue {epilogue}: no bf16 store on the {params.isa} back-end")
        params = dataclasses.replace(params, epilogue=epilogue, skinny_m=0, skinny_unit="auto").validate()
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    hoff = 0
    if epilogue == "gelu_tanh_bwd" and pre is None:
        raise KernelError("epilogue gelu_tanh_bwd reads the pre-activation: pre is required")
    if pre is not None:
        if epilogue == "none" or pre.stride() != out.stride() or pre.shape != out.shape \
                or pre.dtype != torch.bfloat16:
            raise KernelError("pre: an epilogue's bf16 pre-activation, laid out as out")
        hoff = (pre.data_ptr() - out.data_ptr()) // 2
    if not _run_bf16c("torch", a, b, A, B, operand_raw(out), alpha, threads, params, bias, beta, packed_b, hoff,
                      made if settled else None):
        raise KernelError("this CPU's bf16 back-end has no bf16 store")
    return True


def _settled(A: "_Operand", B: "_Operand", threads: int, dtype: str, w_fp32: bool = False) -> bool:
    """Whether the problem's choice is settled (kept until the registry or the hook changes;
    not while first-use tuning is still racing it): only then may a route remember it."""
    key = _choice_key(A.shape[0], A.shape[1], B.shape[1], A.strides, B.strides, threads, dtype, False, w_fp32)
    return key in _choices["params"]


_ws = threading.local()


def _workspace(nfloats: int):
    """This thread's fp32 scratch of at least `nfloats` (grown, never shrunk): the partial
    sums of a bf16 C over K panels."""
    buf = getattr(_ws, "buf", None)
    if buf is None or buf.numel() < nfloats:
        buf = _ws.buf = torch.empty(nfloats, dtype=torch.float32)
    return buf


def _run_bf16c(kind, a, b, A, B, C, alpha, threads, params, bias=None, beta=1.0, packed_b=None,
               hoff: int = 0, made=None) -> bool:
    """C (bfloat16) := alpha * A @ B (+ bias) on the kernel's own bf16 store; False where it
    has none (fp32 back-ends, a C without unit column stride)."""
    M, K = A.shape
    N = B.shape[1]
    if kind != "torch" or not (C.strides[1] == 1 or N == 1):
        return False
    ldc = C.strides[0] if M > 1 else max(N, 1)
    if ldc < N:
        return False
    A0, B0 = A, B
    A, B = _apart(kind, a, b, A, B, C)
    if params is None:
        params = tuned_params(M, K, N, A.strides, B.strides, threads, "bf16")
    kernel = get_kernel(params)
    if not kernel.writes_bf16:
        return False
    nws = (M - 1) * ldc + N if kernel.needs_workspace(M, K, alpha) else 0
    ws = _workspace(nws).data_ptr() if nws else None
    bpk = packed_b(kernel) if packed_b is not None and kernel.reads_packed_b else None
    bias_ptr, in_f32 = None if bias is None else bias.data_ptr(), int(A.f32) | int(B.f32) << 1
    if made is not None and A is A0 and B is B0 and kernel.runnable:
        spans = tuple(byte_offsets(X.shape, X.strides, X.itemsize) for X in (A, B, C))
        made.append(_Route16(False, kernel, (M, N, K, alpha, A.strides[0], A.strides[1], B.strides[0],
                                             B.strides[1], beta, ldc, in_f32), nws, spans,
                             params.epilogue != "none", False))
    if params.epilogue != "none":       # (hoff: the pre-activation's offset from C, 0: none)
        kernel.run_bf16c_act(M, N, K, alpha, A.ptr, A.strides[0], A.strides[1], B.ptr, B.strides[0],
                             B.strides[1], None if bpk is None else bpk.data_ptr(), beta, bias_ptr, ws,
                             C.ptr, ldc, hoff, in_f32)
        return True
    if bpk is not None:
        kernel.run_bf16c_packed(M, N, K, alpha, A.ptr, A.strides[0], A.strides[1], B.ptr, B.strides[0],
                                B.strides[1], bpk.data_ptr(), beta, bias_ptr, ws, C.ptr, ldc, in_f32)
        return True
    kernel.run_bf16c(M, N, K, alpha, A.ptr, A.strides[0], A.strides[1], B.ptr, B.strides[0],
                     B.strides[1], beta, bias_ptr, ws, C.ptr, ldc, in_f32)
    return True


def operand_raw(t, kind: str = "torch") -> _Operand:
    """An operand the caller already validated (no dtype / autograd checks)."""
    if kind == "torch":
        return _Operand(t, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size())
    return _Operand(t, t.ctypes.data, tuple(t.shape), tuple(s // 4 for s in t.strides))


def _run(kind, a, b, out, A, B, C, alpha, beta, threads, params, bias=None, dtype="fp32"):
    M, K = A.shape
    N = B.shape[1]
    if bias is not None:
        if beta == 0.0:
            bias = None                         # beta * bias adds nothing
        elif C.strides[1] == 1 or N == 1:
            bias = bias.contiguous()            # the kernel reads N contiguous floats
        else:
            out.copy_(bias.expand(M, N))        # the kernel adds a bias only along C's rows
            bias = None
    A, B = _apart(kind, a, b, A, B, C)

    if params is None:
        params = tuned_params(M, K, N, A.strides, B.strides, threads, dtype,
                              c_fp32=dtype == "bf16")     # (an fp32 C: out, or a bf16 out's sums)
    kernel = get_kernel(params)
    in_f32 = int(A.f32) | int(B.f32) << 1      # (bf16 kernels: which inputs are fp32)
    if C.strides[1] == 1 or N == 1:
        kernel.run(M, N, K, alpha, A.ptr, A.strides[0], A.strides[1], B.ptr, B.strides[0],
                   B.strides[1], beta, C.ptr, C.strides[0] if M > 1 else max(N, 1),
                   None if bias is None else bias.data_ptr(), in_f32)
    elif C.strides[0] == 1 or M == 1:
        # column-major C: C^T (N x M, row-major) = B^T A^T, swapping the operands' strides
        kernel.run(N, M, K, alpha, B.ptr, B.strides[1], B.strides[0], A.ptr, A.strides[1],
                   A.strides[0], beta, C.ptr, C.strides[1], None, int(B.f32) | int(A.f32) << 1)
    else:
        # no unit stride at all: compute into a contiguous buffer and scatter
        tmp = _copy(out, kind) if beta != 0.0 else None
        if tmp is None:
            tmp = torch.empty((M, N), dtype=torch.float32) if kind == "torch" else np.empty((M, N), np.float32)
        elif kind == "torch":
            tmp = tmp.contiguous()
        else:
            tmp = np.ascontiguousarray(tmp)
        T = operand_raw(tmp, kind)
        kernel.run(M, N, K, alpha, A.ptr, A.strides[0], A.strides[1], B.ptr, B.strides[0],
                   B.strides[1], beta, T.ptr, N, None, in_f32)
        out[...] = tmp
    return out
