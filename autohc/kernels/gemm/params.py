"""Typed, validated GEMM template parameters and the default configuration per back-end.

Nothing reaches a template unless it went through `GemmParams.validate()`: every field is an
int or an enum member inside its allowed range, and the register tile fits the ISA's vector
registers. Free text never reaches generated C.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass


from .. import archs
from ..family import ParamError
from ..isa import BF16_ISAS, GEMM_ISAS, ISAS

# (low, high) inclusive for int fields; the allowed set for enum-like ones.
RANGES: dict[str, tuple[int, int]] = {
    "mr": (1, 64), "nr": (4, 128), "kc": (4, 4096), "mc": (1, 16384), "nc": (4, 65536),
    "jc_ways": (1, 256), "ic_ways": (1, 256), "jr_ways": (1, 256),
    "prefetch_a": (0, 32), "prefetch_b": (0, 32), "skinny_m": (0, 64), "kc_inner": (0, 4096),
    "sink_every": (0, 64), "stream_b_k": (0, 4096), "one_panel_k": (0, 8192), "own_rows_b_kib": (0, 65536),
    "a_direct_n": (0, 65536),
}
CHOICES: dict[str, tuple] = {
    "isa": tuple(GEMM_ISAS), "dtype": ("fp32", "bf16"), "k_unroll": (1, 2, 4, 8), "depth": (1, 2, 3),
    "prefetch_c": (False, True), "a_outer": (False, True), "own_rows": (False, True),
    "c_tiles": (False, True), "skinny_unit": ("auto", "dot", "fma", "tile"), "a_direct": (False, True),
    "defer_epilogue": (False, True), "prefetch_next_a": (False, True), "own_rows_by_k": (False, True),
    "epilogue": ("none", "gelu_tanh", "gelu_tanh_bwd"), "stream_c": (False, True),
}
# fields that to_dict leaves out at these values (each added later: fp32 sets before bf16, ...)
OMITTED_AT = {"dtype": "fp32", "c_tiles": False, "skinny_unit": "auto", "kc_inner": 0, "sink_every": 0,
              "a_direct": False, "defer_epilogue": False, "prefetch_next_a": False,
              "own_rows_by_k": False, "stream_b_k": 0, "one_panel_k": 0, "own_rows_b_kib": 0,
              "a_direct_n": 0, "epilogue": "none", "stream_c": False}
# names of earlier releases, still read from registries written by them
LEGACY_NAMES = {"clusters": "jc_ways", "tm": "ic_ways", "tn": "jr_ways"}
RETIRED = {"pin", "spin_us"}       # now the worker pool's (runtime/pool.py), not a kernel's
MAX_THREADS = 256
# fields a compiled kernel takes at run time (<prefix>_new in templates/gemm/gemm.c.j2): one
# library serves every value of them, so that tuning trials, thread counts and tests that differ
# only in blocks or thread split compile once
INSTANCE_FIELDS = ("kc", "mc", "nc", "jc_ways", "ic_ways", "jr_ways", "depth")
MAX_BUFFER_FLOATS = 1 << 26        # 256 MiB per packed buffer


@dataclass(frozen=True)
class GemmParams:
    isa: str = "avx2"
    vl: int = 8                     # fp32 lanes per vector (fixed by isa except portable)
    mr: int = 6                     # register tile rows
    nr: int = 16                    # register tile columns (multiple of vl)
    kc: int = 256                   # K per packed panel (B micro-panel stays in L1)
    mc: int = 144                   # M per packed A block (A block stays in L2)
    nc: int = 4096                  # N per packed B panel (stays in L2/L3)
    k_unroll: int = 4
    jc_ways: int = 1                # threads splitting N (BLIS's JC loop; the CFTP split)
    ic_ways: int = 1                # threads of a JC way splitting M (IC loop)
    jr_ways: int = 1                # threads of an IC way splitting B micro-panels (JR loop)
    depth: int = 2                  # B panel buffers: 1 single, 2 double, 3 triple buffering
    prefetch_a: int = 0             # software prefetch distance for A in k steps (0: off)
    prefetch_b: int = 0
    prefetch_c: bool = True         # touch the C tile before the k loop
    skinny_m: int = 16              # M up to this, NT layout: unpacked dot-product path (0: off)
    # True: BLIS's loop order (templates/gemm: A_OUTER): a large A block (mc, L3) outside,
    # small B panels (nc, L2) inside, ir outside jr; False: the B panel outside (nc, L3)
    a_outer: bool = False
    # a_outer only: the threads of a JC way take their own rows of A (each packing all of B)
    # where B is small beside A (threads * N <= M), instead of sharing the way's A blocks
    own_rows: bool = False
    # own_rows only, and only where K is short enough for an A micro-panel (MR x K) to stay
    # in 32 KB of L1, or takes several K panels; in between (K in one panel, past L1) the
    # way's threads share A blocks and split N, packing B once between them (measured on an
    # AMX Xeon at 2 threads: 1.01-1.09x own rows there, 0.84-0.98x below; gemm.c.j2)
    own_rows_by_k: bool = False
    # own_rows_by_k only (0: no bound): where K fits L1, own rows only while the B panel every
    # thread would pack (K x N bf16) is at most this many KiB; a larger one, packed whole by
    # each thread, no longer stays in L2 beside the rest (measured on an AMX Xeon at 2 threads:
    # shared A blocks 1.04-1.13x own rows past 1 MiB, 0.94-1.01x up to 864 KiB; gemm.c.j2)
    own_rows_b_kib: int = 0
    # "bf16": products of bf16 operands (bf16 inputs, or fp32 ones rounded to bf16 while
    # packing) accumulated in fp32, on vdpbf16ps (isa avx512bf16), AMX tiles (isa amx) or,
    # on any other back-end, the fp32 micro-kernel on operands widened back to fp32
    dtype: str = "fp32"
    # amx only: a whole C tile with alpha 1 and no bias is loaded into the accumulators
    # (beta 1) and stored from them with tile instructions, instead of through a stack copy
    # and a vector epilogue (templates/gemm/ukernel_amx.c.j2)
    c_tiles: bool = False
    # bf16 back-ends' skinny paths: "dot" vdpbf16ps, "fma" fp32 FMAs on bf16 widened to fp32,
    # "tile" (amx only) AMX tiles where W is bf16 and M <= 16, else as "auto"; "auto" the tiles
    # on amx, else (and for an fp32 W) whichever of dot and fma a probe of the two
    # instructions' throughput favours on this CPU (templates/gemm/skinny_bf16.c.j2)
    skinny_unit: str = "auto"
    # amx with a_outer only (0: off): each A micro-panel's K panel is taken kc_inner K at a
    # time across a group of B micro-panels, the fp32 sums of C kept between the steps in a
    # small per-thread buffer through the tiles, so that the A tiles (MR x kc_inner) come from
    # L1 and only the B tiles from L2 (templates/gemm/gemm.c.j2: sweep_rows_in_steps)
    kc_inner: int = 0
    # amx only (0: off; else a power of two): every sink_every K blocks of 32 the tile loop
    # stores an A tile into a stack line nobody reads. On the AMX Xeon a KVM guest reports as
    # model 167 a tile loop of many K blocks with no store in it made the C tile stores after
    # it cost about 700 cycles (36 blocks: about 20 % of the loop); a store every 8-12 blocks
    # took that away. A Xeon model 207 ran slower with it (templates/gemm/ukernel_amx.c.j2;
    # docs/history.md, "A store in the tile loop")
    sink_every: int = 0
    # amx or avx512bf16, with a_outer only: where A is bf16 with rows contiguous along K (NT,
    # NN) and K is a multiple of 32 (amx) or 2, the A tiles (amx) or the pairs that vdpbf16ps
    # broadcasts are loaded straight from A's rows and only a ragged last micro-panel is
    # packed, so A is not copied (templates/gemm)
    a_direct: bool = False
    # amx only: a whole micro-tile of bf16 C (no bias, beta 0) is rounded into C among the
    # next micro-tile's K blocks, 4 rows per block, instead of right after its tile stores, so
    # that the tile loop does not wait behind a whole epilogue at every micro-tile's end
    # (templates/gemm/ukernel_amx.c.j2; docs/history.md, stop 55)
    defer_epilogue: bool = False
    # amx only: while a row panel of C is swept, the next A micro-panel's lines go into L2
    # (prefetcht1, its rows shared out over the sweep's micro-tiles), as oneDNN's brgemm
    # kernel does, so that the next sweep's first tiles do not wait for A from L3
    prefetch_next_a: bool = False
    # amx with a_outer only (0: off): where the whole K is one panel of at most this many K,
    # the tile loop loads B's tiles by tileloaddt1 (not reused soon) and prefetches no A, so
    # that a sweep's stream of B micro-panels does not push A's micro-panel out of L1
    # (templates/gemm/ukernel_amx.c.j2; docs/history.md, stop 57)
    stream_b_k: int = 0
    # amx with a_outer only (0: off): where A's tiles come straight from its rows (a_direct;
    # without it this does nothing) and the whole K is at most this many K, K is one panel
    # even past kc, so that no fp32 partial sums of C are written and read back between
    # panels; B's chunks keep kc x nc's size (templates/gemm/gemm.c.j2; docs/history.md, stop 58)
    one_panel_k: int = 0
    # avx512bf16 with a_direct only (0: any N): A is read from its rows only where the way's N
    # is at most this; past it the pack is paid over many B micro-panels and a packed A
    # micro-panel streamed a little better (measured on a Zen 4: docs/history.md, stop 66)
    a_direct_n: int = 0
    # bf16 back-ends (amx, avx512bf16), without skinny paths: "gelu_tanh" applies GELU (tanh
    # form) to each fp32 result of a bf16 C before its one rounding, in the store (fc1 + bias +
    # GELU as one kernel; templates/common/gelu_bf16.c.j2); "gelu_tanh_bwd" multiplies each by
    # GELU's derivative at the pre-activation read from a bf16 tensor laid out as C (fc2's input
    # gradient and GELU's backward as one kernel). An fp32 C is written as it is.
    epilogue: str = "none"
    # amx with c_tiles only: where K is one panel and beta 0, a whole fp32 C tile goes from the accumulators
    # through a stack copy to C by non-temporal stores (no read for ownership of C's lines,
    # which a training step's weight gradients, read only by the optimizer, never need)
    # (templates/gemm/ukernel_amx.c.j2; docs/history.md, stop 86)
    stream_c: bool = False

    @property
    def threads(self) -> int:
        return self.jc_ways * self.ic_ways * self.jr_ways

    def without_skinny_paths(self) -> "GemmParams":
        """The same kernel for every M past skinny_m, built without the skinny paths (three
        quarters of a bf16 kernel's compile): first-use candidates and tuner trials."""
        return dataclasses.replace(self, skinny_m=0, skinny_unit="auto").validate()

    @property
    def own_ways(self) -> bool:
        """Every team thread is its own JC way (thread_geometry's own_ways_up_to split)."""
        return (self.jc_ways, self.ic_ways, self.jr_ways) == (self.threads, 1, 1)

    def validate(self) -> "GemmParams":
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in CHOICES:
                if v not in CHOICES[f.name] or type(v) is not type(CHOICES[f.name][0]):
                    raise ParamError(f"{f.name}={v!r}: must be one of {CHOICES[f.name]}")
            elif f.name in RANGES or f.name == "vl":
                if type(v) is not int:
                    raise ParamError(f"{f.name}={v!r}: must be an int")
                if f.name in RANGES:
                    lo, hi = RANGES[f.name]
                    if not lo <= v <= hi:
                        raise ParamError(f"{f.name}={v}: must be in [{lo}, {hi}]")
        spec = GEMM_ISAS[self.isa]
        if self.isa in BF16_ISAS and self.dtype != "bf16":
            raise ParamError(f"isa={self.isa} computes in bf16: needs dtype='bf16'")
        if self.dtype == "bf16" and self.skinny_m and self.isa not in BF16_ISAS:
            raise ParamError(f"skinny_m: bf16 widened to fp32 ({self.isa}) has no skinny path; must be 0")
        if self.vl not in spec.vector_lanes:
            raise ParamError(f"vl={self.vl}: {self.isa} vectors hold {spec.vector_lanes} floats")
        if self.nr % self.vl:
            raise ParamError(f"nr={self.nr} must be a multiple of the vector length {self.vl}")
        nv = self.nr // self.vl
        if self.isa == "amx":           # C tiles + A tiles + B tiles, 16 x 16 fp32 each
            if self.mr % 16:
                raise ParamError(f"mr={self.mr}: AMX tiles take 16 rows; must be a multiple of 16")
            tiles = (self.mr // 16) * nv + self.mr // 16 + nv
            if tiles > spec.registers:
                raise ParamError(f"mr x nr = {self.mr}x{self.nr} needs {tiles} tiles; AMX has 8")
            if self.kc % 32:
                raise ParamError(f"kc={self.kc}: AMX takes K in blocks of 32; must be a multiple of 32")
        elif self.c_tiles:
            raise ParamError(f"c_tiles: C through tile registers is for isa amx, not {self.isa}")
        if self.stream_c and not (self.isa == "amx" and self.c_tiles):
            raise ParamError(f"stream_c: non-temporal stores of whole C tiles are the amx back-end's, "
                             f"with c_tiles; not {self.isa}'s{'' if self.c_tiles else ' without c_tiles'}")
        if self.kc_inner:
            if self.isa != "amx" or not self.a_outer:
                raise ParamError(f"kc_inner={self.kc_inner}: K steps inside a panel are the amx "
                                 f"back-end's, with a_outer; must be 0")
            if self.kc_inner % 32 or self.kc_inner >= self.kc:
                raise ParamError(f"kc_inner={self.kc_inner}: must be a multiple of 32 below kc={self.kc}")
        if self.sink_every:
            if self.isa != "amx":
                raise ParamError(f"sink_every={self.sink_every}: a store in the tile loop is the amx "
                                 f"back-end's, not {self.isa}'s; must be 0")
            if self.sink_every & (self.sink_every - 1):
                raise ParamError(f"sink_every={self.sink_every}: must be a power of two")
        if self.a_direct and (self.isa not in ("amx", "avx512bf16") or not self.a_outer):
            raise ParamError(f"a_direct: A read from its own rows is the amx and avx512bf16 back-ends', "
                             f"with a_outer; not {self.isa}'s{'' if self.a_outer else ' without a_outer'}")
        if self.a_direct_n and (self.isa != "avx512bf16" or not self.a_direct):
            raise ParamError(f"a_direct_n={self.a_direct_n}: bounds the N where vdpbf16ps reads A from its rows; "
                             f"needs the avx512bf16 back-end with a_direct; must be 0")
        if self.own_rows_by_k and not (self.a_outer and self.own_rows):
            raise ParamError("own_rows_by_k: limits own rows by K; needs a_outer and own_rows")
        if self.own_rows_b_kib and not self.own_rows_by_k:
            raise ParamError(f"own_rows_b_kib={self.own_rows_b_kib}: bounds own_rows_by_k's short-K own rows "
                             f"by B's size; needs own_rows_by_k; must be 0")
        if self.defer_epilogue and self.isa != "amx":
            raise ParamError(f"defer_epilogue: rounding C among the next tile products is the amx "
                             f"back-end's, not {self.isa}'s")
        if self.prefetch_next_a and self.isa != "amx":
            raise ParamError(f"prefetch_next_a: the next A micro-panel's prefetch is the amx back-end's, "
                             f"not {self.isa}'s")
        if self.stream_b_k and (self.isa != "amx" or not self.a_outer):
            raise ParamError(f"stream_b_k={self.stream_b_k}: B's tiles by tileloaddt1 are the amx back-end's, "
                             f"with a_outer; not {self.isa}'s{'' if self.a_outer else ' without a_outer'}; must be 0")
        if self.one_panel_k and (self.isa != "amx" or not self.a_outer):
            raise ParamError(f"one_panel_k={self.one_panel_k}: one K panel past kc is the amx back-end's, with "
                             f"a_outer (where a_direct takes A's tiles from its rows); must be 0")
        if self.skinny_unit == "tile" and self.isa != "amx":
            raise ParamError(f"skinny_unit='tile': AMX tiles are the amx back-end's, not {self.isa}'s")
        if self.skinny_unit != "auto" and self.isa not in BF16_ISAS:
            raise ParamError(f"skinny_unit={self.skinny_unit!r}: the bf16 back-ends' skinny paths "
                             f"have it, not {self.isa}; must be 'auto'")
        if self.epilogue != "none" and (self.isa not in BF16_ISAS or self.skinny_m):
            raise ParamError(f"epilogue={self.epilogue!r}: in the bf16 store of the amx and avx512bf16 "
                             f"back-ends, without skinny paths (skinny_m 0); not {self.isa} with skinny_m={self.skinny_m}")
        if self.isa != "amx":
            regs = self.mr * nv + nv + 1    # accumulators + B vectors + the A broadcast
            if regs > spec.registers:
                raise ParamError(f"mr x nr = {self.mr}x{self.nr} needs {regs} vector registers; "
                                 f"{self.isa} has {spec.registers}")
            if self.isa == "avx512bf16" and self.kc % 2:
                raise ParamError(f"kc={self.kc}: vdpbf16ps takes K in pairs; must be even")
        if self.mc % self.mr:
            raise ParamError(f"mc={self.mc} must be a multiple of mr={self.mr}")
        if self.nc % self.nr:
            raise ParamError(f"nc={self.nc} must be a multiple of nr={self.nr}")
        if self.threads > MAX_THREADS:
            raise ParamError(f"jc_ways*ic_ways*jr_ways = {self.threads} threads; at most {MAX_THREADS}")
        b_cols = self.nc + self.nc // 2 + self.nr if self.a_outer else self.nc  # gemm.c.j2: B_COLS
        if self.buffer_k * b_cols > MAX_BUFFER_FLOATS or self.mc * self.buffer_k > MAX_BUFFER_FLOATS:
            raise ParamError("packed panel larger than 256 MiB: lower kc, one_panel_k, mc or nc")
        return self

    @property
    def buffer_k(self) -> int:
        """K that the panel buffers hold (gemm.c.j2's KC_MAX): kc, or one_panel_k rounded up to
        whole blocks of 32 where A's tiles come from its rows and it is past kc."""
        one = -(-self.one_panel_k // 32) * 32 if self.a_direct else 0
        return max(self.kc, one)

    def to_dict(self) -> dict:
        """The fields, less those added after the first release at their off values: a set
        keeps the key (cached kernels, registry entries) it had before each was added."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in OMITTED_AT or v != OMITTED_AT[k]}

    @classmethod
    def from_dict(cls, d: dict) -> "GemmParams":
        names = {f.name for f in dataclasses.fields(cls)}
        d = {LEGACY_NAMES.get(k, k): v for k, v in d.items() if k not in RETIRED}
        unknown = set(d) - names
        if unknown:
            raise ParamError(f"unknown GEMM parameter(s): {sorted(unknown)}")
        return cls(**d).validate()

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    @property
    def symbol(self) -> str:
        """C prefix of this kernel's functions: unique per parameter set, hex only (an
        exported kernel's, whose blocks and ways are its own)."""
        return "autohc_g" + self.key[:12]

    def library_dict(self) -> dict:
        """to_dict without the fields an instance gives at run time: what its library is
        compiled from."""
        return {k: v for k, v in self.to_dict().items() if k not in INSTANCE_FIELDS}

    @property
    def library_symbol(self) -> str:
        """C prefix of the functions of the library that serves this kernel (and every kernel
        that differs from it only in INSTANCE_FIELDS), hex only."""
        return "autohc_gl" + hashlib.sha256(json.dumps(self.library_dict(), sort_keys=True).encode()).hexdigest()[:12]

    def instance_args(self) -> tuple[int, ...]:
        """The arguments of the library's <prefix>_new for this kernel."""
        return tuple(getattr(self, k) for k in INSTANCE_FIELDS)


def thread_geometry(threads: int, clusters: int = 1, own_ways_up_to: int = 0) -> tuple[int, int, int]:
    """(jc_ways, ic_ways, jr_ways) of the default kernel on `threads` threads in `clusters` thread
    clusters (NUMA nodes): the clusters split N (CFTP: no packed data shared across nodes),
    and a cluster's threads share its packed B panels, splitting M first (DiT's M, the
    tokens, is the long side), with a JR split once a cluster has more than 4 threads (BLIS's
    2-D partition of the ways between M and N). Splitting N between threads that share a node
    makes each pack all of A: measured on an Intel Xeon model 207, 2 threads, DiT-S/2
    GEMMs (M 2048, K 384-1536, N 384-1536): 1 x 2 x 1 at 1.00-1.27x 2 x 1 x 1, DiT-XL/2
    GEMMs within 4 % either way. (In the a_outer loop order a way's threads share its A
    blocks and split its N slice instead, each packing its own B panels; with own_rows they
    take their own rows where threads * N <= M.)
    A cluster of at most `own_ways_up_to` threads (the arch entry's, configs/<arch>.yaml)
    makes every thread its own JC way instead: its own N slice, or its own rows where N < M
    (gemm.c.j2: rows_split), nothing shared and no wait between the threads."""
    if clusters < 1 or threads % clusters:
        clusters = 1
    tpc = threads // clusters
    if 1 < tpc <= own_ways_up_to:
        return threads, 1, 1
    ic = max(d for d in range(1, tpc + 1) if tpc % d == 0 and (d * d <= 4 * tpc or d == 1))
    return clusters, ic, tpc // ic


def panel_ring_depth(jc_ways: int, ic_ways: int, jr_ways: int) -> int:
    """B panel buffers (depth) of the default kernel in this thread geometry. Where JC ways
    share panels (ic_ways * jr_ways > 1), two: a thread packs its share of panel p + 1 while
    the others still compute panel p. A JC way of one thread (1 thread, or own ways) packs and
    computes in turn, so a second buffer overlaps nothing: it only packs each panel a whole
    panel's compute before its use and doubles the B footprint. Measured on a Zen 5 (family
    26 model 2), 2 threads in own ways, interleaved: DiT-XL/2's 1024 x 1152 x 4608 TN 464 vs
    443 GFLOP/s, 1024 x 1152 x 3456 NN 482-486 vs 464-473, 1152 x 1024 x 4608 TN 470-477 vs
    448-450; the others (K = 4608, N = 1152, DiT-S/2's) within 2 %."""
    return 2 if ic_ways * jr_ways > 1 else 1


def default_params(isa: str, threads: int = 1, arch: str | None = None, clusters: int = 1,
                   dtype: str = "fp32") -> GemmParams:
    """A configuration that works (and is fast) before any tuning: the per-microarchitecture
    table's entry for `isa` (configs/<arch>.yaml; `arch` names one, else this CPU's), on
    `threads` threads in `clusters` NUMA clusters (thread_geometry, with the entry's
    own_ways_up_to). dtype "bf16" on an fp32 back-end: its fp32 default, without the skinny
    path (bf16 widened while packing)."""
    if isa not in GEMM_ISAS:
        raise ParamError(f"unknown isa {isa!r}; one of {tuple(GEMM_ISAS)}")
    if dtype not in CHOICES["dtype"]:
        raise ParamError(f"dtype={dtype!r}: must be one of {CHOICES['dtype']}")
    if isa in BF16_ISAS:
        dtype = "bf16"              # (a bf16 back-end computes nothing else)
    if type(threads) is not int or not 1 <= threads <= MAX_THREADS:
        raise ParamError(f"threads={threads!r}: must be an int in [1, {MAX_THREADS}]")
    entry = archs.by_name(arch) if arch else None
    base = archs.gemm_default(isa, entry)
    jc, ic, jr = thread_geometry(threads, clusters, archs.gemm_own_ways_up_to(isa, entry))
    if dtype == "bf16":             # (the widened fallback has no skinny path)
        base = {**base, "dtype": "bf16", **({} if isa in BF16_ISAS else {"skinny_m": 0})}
    # (an arch entry that names a depth keeps it)
    return GemmParams(isa=isa, jc_ways=jc, ic_ways=ic, jr_ways=jr,
                      **{"depth": panel_ring_depth(jc, ic, jr), **base}).validate()
