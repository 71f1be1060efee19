"""Compiled GEMM kernels: one per validated parameter set, bound to the process's worker
pool, and the choice of parameters for a problem (registry hit, else the default)."""
from __future__ import annotations

import contextlib
import functools
import threading

from ...build import EMULATED_TILE_FLAGS, Library, build
from ...hw import cpu
from ...runtime import plan, pool
from .codegen import gemm_cdef, render_gemm, render_gemm_objects
from ..isa import BF16_ISAS, GEMM_ISAS
from .params import GemmParams, default_params


class KernelError(RuntimeError):
    """A kernel could not run (out of memory, threads, or an ISA this CPU lacks)."""


def _library(params: GemmParams, emulate_tiles: bool) -> Library:
    """The compiled library that serves `params` (and every parameter set that differs from it
    only in INSTANCE_FIELDS), built on first use and bound to the worker pool once."""
    key = (params.library_symbol, emulate_tiles)
    with _kernels_lock:
        lock = _building.setdefault(key, threading.Lock())
    with lock:
        library = _libraries.get(key)
        if library is None:
            source = render_gemm(params, emulate_tiles)
            meta = {"op": "gemm", "params": params.library_dict()}
            if emulate_tiles:
                meta["emulated_tiles"] = True
            flags = tuple(GEMM_ISAS[params.isa].cflags) + (EMULATED_TILE_FLAGS if emulate_tiles else ())
            library = build(source, gemm_cdef(params, source), flags, meta=meta,
                            objects=tuple(render_gemm_objects(params, emulate_tiles).values()))
            fn = params.library_symbol
            if getattr(library.lib, f"{fn}_isa_supported")():
                pool.bind(library, fn)      # threads come from the one worker pool
            _libraries[key] = library
        return library


class GemmKernel:
    """One verified GEMM configuration: an instance (its blocks and thread ways) of the compiled
    library of its register tile, loop order and the rest. emulate_tiles (isa amx): its tile
    instructions run in C, for tests on CPUs without AMX (`tile_emulation`)."""

    def __init__(self, params: GemmParams, emulate_tiles: bool = False):
        self.params = params.validate()
        self.library: Library = _library(self.params, emulate_tiles)
        fn = params.library_symbol
        lib = self.library.lib
        self._tile_fault = getattr(lib, f"{fn}_tile_fault", None)   # (emulated tiles only)
        self._gemm = getattr(lib, f"{fn}_gemm")
        self._gemm_bias = getattr(lib, f"{fn}_gemm_bias")
        self._gemm_batched = getattr(lib, f"{fn}_gemm_batched")
        # bf16 back-ends write a bf16 C themselves (the others: the caller rounds an fp32 C)
        self._gemm_bf16c = getattr(lib, f"{fn}_gemm_bf16c", None)
        self.writes_bf16 = self._gemm_bf16c is not None
        # ... and read a B packed whole once on their packed path (A_OUTER), where it is given
        self._gemm_bf16c_pb = getattr(lib, f"{fn}_gemm_bf16c_pb", None)
        self._gemm_bf16c_act = getattr(lib, f"{fn}_gemm_bf16c_act", None)     # (epilogue kernels)
        self._pack_b_whole = getattr(lib, f"{fn}_pack_b_whole", None)
        self._packed_b_elems = getattr(lib, f"{fn}_packed_b_elems", None)
        self.reads_packed_b = self._gemm_bf16c_pb is not None and params.a_outer
        self._ffi = self.library.ffi
        self._bf16 = params.dtype == "bf16"    # A, B: void * and their element types said
        self._in_t = "void *" if self._bf16 else "float *"
        self._skinny_unit = getattr(lib, f"{fn}_skinny_unit")
        self._trim = getattr(lib, f"{fn}_trim")
        self.runnable = bool(getattr(lib, f"{fn}_isa_supported")())
        # (the library's functions take it first; it lives as long as the process, as the kernel).
        # None where this CPU lacks the ISA: the library's code, its instances' included, may use it
        self._h = getattr(lib, f"{fn}_new")(*params.instance_args()) if self.runnable else None
        if self._h is not None and self._h == self._ffi.NULL:
            raise KernelError(f"{params.symbol}: no memory for a kernel instance")

    def trim(self) -> None:
        """Free this kernel's packed buffers (after a call in flight); its next call allocates
        them again. For kernels that may not run again soon: a tuner's timed trials."""
        if self._h is not None:
            self._trim(self._h)

    def skinny_unit(self) -> str | None:
        """What this bf16 kernel's skinny paths (M <= skinny_m) run on here: "dot" (vdpbf16ps)
        or "fma" (fp32 FMAs on widened bf16; params.skinny_unit "auto" probes the two once
        per process), or "tile" (AMX, for a bf16 W and M <= 16; the probed unit otherwise);
        None where it has none (fp32 kernels, skinny_m 0) or cannot run."""
        if not self.runnable:
            return None
        return {1: "dot", 2: "fma", 3: "tile"}.get(self._skinny_unit())

    def run(self, M: int, N: int, K: int, alpha: float, a_ptr: int, rsa: int, csa: int,
            b_ptr: int, rsb: int, csb: int, beta: float, c_ptr: int, ldc: int,
            bias_ptr: int | None = None, in_f32: int = 0) -> None:
        """Raw call on addresses and element strides (no checks beyond the ISA). `bias_ptr`:
        the address of N contiguous floats; C := alpha AB + beta * bias in every row, C not
        read. None: C := alpha AB + beta C. bf16 kernels: A and B hold bf16 elements, or fp32
        ones where `in_f32` has bit 0 (A) or bit 1 (B) set; C is fp32."""
        if not self.runnable:
            raise KernelError(f"this CPU cannot run the {self.params.isa} back-end")
        f = self._ffi
        a, b, c = f.cast(self._in_t, a_ptr), f.cast(self._in_t, b_ptr), f.cast("float *", c_ptr)
        tail = (in_f32,) if self._bf16 else ()
        if bias_ptr is None:
            rc = self._gemm(self._h, M, N, K, alpha, a, rsa, csa, b, rsb, csb, beta, c, ldc, *tail)
        else:
            rc = self._gemm_bias(self._h, M, N, K, alpha, a, rsa, csa, b, rsb, csb, beta,
                                 f.cast("float *", bias_ptr), c, ldc, *tail)
        self._check(rc)

    def bound(self, M: int, N: int, K: int, alpha: float, rsa: int, csa: int, rsb: int, csb: int,
              beta: float, ldc: int, with_bias: bool, in_f32: int = 0):
        """`run` with everything but the addresses fixed: a function of (a_ptr, b_ptr, c_ptr,
        bias_ptr) for a problem that is met again and again (a prepared call: the torch
        override's hot path). bias_ptr is read only where with_bias."""
        if not self.runnable:
            raise KernelError(f"this CPU cannot run the {self.params.isa} back-end")
        cast, in_t, check, h = self._ffi.cast, self._in_t, self._check, self._h
        tail = (in_f32,) if self._bf16 else ()
        if with_bias:
            fn = self._gemm_bias

            def run(a_ptr: int, b_ptr: int, c_ptr: int, bias_ptr: int) -> None:
                check(fn(h, M, N, K, alpha, cast(in_t, a_ptr), rsa, csa, cast(in_t, b_ptr), rsb, csb, beta,
                         cast("float *", bias_ptr), cast("float *", c_ptr), ldc, *tail))
        else:
            fn = self._gemm

            def run(a_ptr: int, b_ptr: int, c_ptr: int, bias_ptr: int = 0) -> None:
                check(fn(h, M, N, K, alpha, cast(in_t, a_ptr), rsa, csa, cast(in_t, b_ptr), rsb, csb, beta,
                         cast("float *", c_ptr), ldc, *tail))
        return run

    def run_bf16c(self, M: int, N: int, K: int, alpha: float, a_ptr: int, rsa: int, csa: int,
                  b_ptr: int, rsb: int, csb: int, beta: float, bias_ptr: int | None, ws_ptr: int | None,
                  cb_ptr: int, ldc: int, in_f32: int = 0) -> None:
        """Cb := bf16(alpha AB + beta * bias) (no bias: alpha AB), Cb M x N bf16 at cb_ptr with
        leading dimension ldc, not read. ws_ptr: an fp32 M x N workspace with the same ldc, needed
        (written) where K > kc, M <= skinny_m, K == 0 or alpha == 0 (`needs_workspace`); else
        it may be None. Only where `writes_bf16`."""
        if not self.runnable:
            raise KernelError(f"this CPU cannot run the {self.params.isa} back-end")
        f = self._ffi
        self._check(self._gemm_bf16c(self._h, M, N, K, alpha, f.cast("void *", a_ptr), rsa, csa, f.cast("void *", b_ptr),
                                rsb, csb, beta, f.NULL if bias_ptr is None else f.cast("float *", bias_ptr),
                                f.NULL if ws_ptr is None else f.cast("float *", ws_ptr),
                                f.cast("uint16_t *", cb_ptr), ldc, in_f32))

    @property
    def packed_b_layout(self) -> tuple:
        """What a B packed whole depends on (the back-end's panel layout and its NR): kernels
        of the same layout read each other's packed B."""
        return (self.params.isa, self.params.nr)

    def pack_b_whole(self, K: int, N: int, b_ptr: int, rsb: int, csb: int, in_f32: int, out_ptr: int) -> None:
        """op(B) (K x N at b_ptr, element strides; fp32 where in_f32 has bit 1, else bf16) packed
        whole into packed_b_elems(K, N) bf16 elements at out_ptr, on this thread. Only where
        `reads_packed_b`."""
        f = self._ffi
        self._pack_b_whole(K, N, f.cast("void *", b_ptr), rsb, csb, in_f32, f.cast("uint16_t *", out_ptr))

    def packed_b_elems(self, K: int, N: int) -> int:
        """bf16 elements of op(B) (K x N) packed whole."""
        return self._packed_b_elems(K, N)

    def run_bf16c_packed(self, M: int, N: int, K: int, alpha: float, a_ptr: int, rsa: int, csa: int,
                         b_ptr: int, rsb: int, csb: int, bpk_ptr: int, beta: float, bias_ptr: int | None,
                         ws_ptr: int | None, cb_ptr: int, ldc: int, in_f32: int = 0) -> None:
        """run_bf16c with op(B) also packed whole at bpk_ptr (pack_b_whole of the same B in this
        packed_b_layout): the packed path reads it instead of packing B; the same bits."""
        if not self.runnable:
            raise KernelError(f"this CPU cannot run the {self.params.isa} back-end")
        f = self._ffi
        self._check(self._gemm_bf16c_pb(self._h, M, N, K, alpha, f.cast("void *", a_ptr), rsa, csa, f.cast("void *", b_ptr),
                                   rsb, csb, f.cast("uint16_t *", bpk_ptr), beta,
                                   f.NULL if bias_ptr is None else f.cast("float *", bias_ptr),
                                   f.NULL if ws_ptr is None else f.cast("float *", ws_ptr),
                                   f.cast("uint16_t *", cb_ptr), ldc, in_f32))

    def run_bf16c_act(self, M: int, N: int, K: int, alpha: float, a_ptr: int, rsa: int, csa: int,
                      b_ptr: int, rsb: int, csb: int, bpk_ptr: int | None, beta: float, bias_ptr: int | None,
                      ws_ptr: int | None, cb_ptr: int, ldc: int, hoff: int, in_f32: int = 0) -> None:
        """run_bf16c(_packed) of a kernel with an epilogue (params.epilogue): Cb gets the epilogue
        of the result, rounded once to bf16. gelu_tanh: where hoff is not 0, Cb + hoff elements
        (the same ldc) get the result itself too; gelu_tanh_bwd: GELU's pre-activation is read
        from Cb + hoff (0: Cb's own values)."""
        if not self.runnable:
            raise KernelError(f"this CPU cannot run the {self.params.isa} back-end")
        f = self._ffi
        self._check(self._gemm_bf16c_act(self._h, M, N, K, alpha, f.cast("void *", a_ptr), rsa, csa, f.cast("void *", b_ptr),
                                         rsb, csb, f.NULL if bpk_ptr is None else f.cast("uint16_t *", bpk_ptr), beta,
                                         f.NULL if bias_ptr is None else f.cast("float *", bias_ptr),
                                         f.NULL if ws_ptr is None else f.cast("float *", ws_ptr),
                                         f.cast("uint16_t *", cb_ptr), ldc, hoff, in_f32))

    def needs_workspace(self, M: int, K: int, alpha: float) -> bool:
        """Whether run_bf16c writes fp32 partial sums to its workspace for this problem."""
        p = self.params
        return K > p.kc or M <= p.skinny_m or K == 0 or alpha == 0.0

    def run_batched(self, batch: int, sa: int, sb: int, sc: int, M: int, N: int, K: int,
                    alpha: float, a_ptr: int, rsa: int, csa: int, b_ptr: int, rsb: int, csb: int,
                    beta: float, c_ptr: int, ldc: int, in_f32: int = 0) -> None:
        """`run` on `batch` matrices i at a_ptr + i*sa elements (b, c likewise), in one C call."""
        if not self.runnable:
            raise KernelError(f"this CPU cannot run the {self.params.isa} back-end")
        f = self._ffi
        tail = (in_f32,) if self._bf16 else ()
        self._check(self._gemm_batched(self._h, batch, sa, sb, sc, M, N, K, alpha, f.cast(self._in_t, a_ptr), rsa, csa,
                                  f.cast(self._in_t, b_ptr), rsb, csb, beta, f.cast("float *", c_ptr), ldc,
                                  *tail))

    def _check(self, rc: int) -> None:
        if self._tile_fault is not None:
            fault = self._tile_fault()
            if fault != self._ffi.NULL:
                raise KernelError(f"{self.params.symbol}: emulated AMX fault: "
                                  f"{self._ffi.string(fault).decode()}")
        _check(rc)


def _check(rc: int) -> None:
    if rc:
        raise KernelError({-1: "out of memory for packed panels",
                           -2: "the worker pool cannot start threads",
                           -3: "kernel not bound to the worker pool"}.get(rc, f"error {rc}"))


_kernels: dict[tuple[GemmParams, bool], GemmKernel] = {}
_libraries: dict[tuple[str, bool], Library] = {}
_kernels_lock = threading.Lock()
_building: dict[tuple, threading.Lock] = {}         # (a kernel's key, or a library's)
_emulating_tiles = False


@contextlib.contextmanager
def tile_emulation():
    """Inside: kernels of the amx back-end (GEMM and attention) are the ones whose tile
    instructions run in C (GemmKernel's emulate_tiles, the attention library's), so tests run
    the AMX code on any CPU with AVX512_BF16.
    Process-wide; for tests only (emulated tiles are thousands of times slower)."""
    global _emulating_tiles
    before, _emulating_tiles = _emulating_tiles, True
    try:
        yield
    finally:
        _emulating_tiles = before


def tiles_emulated() -> bool:
    """Whether tile_emulation() is on (the attention kernels' amx back-end reads it too)."""
    return _emulating_tiles


def get_kernel(params: GemmParams) -> GemmKernel:
    """The compiled kernel of `params`, built on first use. A build holds only its own
    parameters' lock, so a kernel compiling on a background thread (first-use tuning) never
    holds up a GEMM of another, already built kernel."""
    key = (params, _emulating_tiles and params.isa == "amx")
    k = _kernels.get(key)
    if k is not None:
        return k
    with _kernels_lock:
        lock = _building.setdefault(key, threading.Lock())
    with lock:
        k = _kernels.get(key)
        if k is None:
            k = _kernels[key] = GemmKernel(params, emulate_tiles=key[1])
        return k


@functools.lru_cache(maxsize=None)
def default_kernel_params(threads: int, isa: str | None = None, dtype: str = "fp32") -> GemmParams:
    """The default on this CPU for `threads` team threads: one JC cluster per NUMA node that
    the team spans (team thread t runs on the plan's compute core t, cores ordered by node).
    dtype bf16: on this CPU's bf16 back-end (cpu.bf16_isa) unless `isa` names one."""
    if isa is None:
        isa = cpu.bf16_isa()[0] if dtype == "bf16" else cpu.best_isa()
    return default_params(isa, threads, clusters=team_nodes(threads), dtype=dtype)


# what each bf16 skinny unit computes on, in the words `autohc info` and `bench gemm` print
SKINNY_UNIT_WORDS = {"dot": "vdpbf16ps", "fma": "fp32 FMAs, bf16 widened",
                     "tile": "AMX tiles, W unpacked"}


def bf16_skinny_unit(isa: str, threads: int = 1) -> str | None:
    """What the bf16 skinny paths (M <= skinny_m: adaLN) of back-end `isa`'s default kernel
    run on here: "dot" or "fma" (the kernel's own probe), or "tile" (amx); None for a
    back-end without them (the widened fallback)."""
    if isa not in BF16_ISAS:
        return None
    p = default_kernel_params(threads, isa=isa, dtype="bf16")
    return get_kernel(p).skinny_unit() if p.skinny_m else None


def team_nodes(threads: int) -> int:
    """NUMA nodes holding the compute cores of a team of `threads` threads."""
    return plan.nodes_spanned(plan.current().compute[:threads])
