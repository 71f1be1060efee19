"""Typed, validated parameters of the fused attention kernel (templates/ops/attention.c.j2)."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from ...hw import cpu
from .. import archs
from ..family import ParamError
from ..isa import BF16_ISAS, GEMM_ISAS, ISAS

KERNEL = "attention"        # one source holds the forward and the backward pass


@dataclass(frozen=True)
class AttentionParams:
    isa: str = "avx2"
    vl: int = 8                 # fp32 lanes per vector
    block_q: int = 64           # query rows per block (one thread's S block is block_q x block_k)
    block_k: int = 256          # keys per block (the online softmax rescales once per block)
    # the backward pass's sums over queries (dV, dK) keep the head dim in the lanes:
    mr: int = 4                 # rows (keys) per row-major product micro-tile
    dc: int = 3                 # head-dim vectors per row-major product micro-tile
    # queries in the lanes (Sᵀ = K Qᵀ, Oᵀ = Vᵀ Pᵀ; dPᵀ, dQᵀ in the backward pass):
    qv: int = 2                 # query vectors per micro-tile (block_q: a multiple of qv * vl)
    fk: int = 6                 # keys per score micro-tile
    fd: int = 6                 # head-dim rows per product micro-tile
    prefetch: int = 1           # 1: the next task's rows are prefetched into L2 during this one
    threads: int = 0            # most threads a call splits over: 0 = all it is given
    # bf16: q, k, v and the outputs in bfloat16, every sum fp32; isa avx512bf16 runs the score
    # and queries-in-lanes product tiles on vdpbf16ps, isa amx every product on AMX-BF16 tiles
    # (block_q, block_k multiples of 32; the vector tiles above are then unused), the fp32 ISAs
    # widen the inputs instead
    dtype: str = "fp32"

    def validate(self) -> "AttentionParams":
        for name in ("vl", "block_q", "block_k", "mr", "dc", "qv", "fk", "fd", "prefetch", "threads"):
            if type(getattr(self, name)) is not int:
                raise ParamError(f"{name}={getattr(self, name)!r}: an int")
        if self.dtype not in ("fp32", "bf16"):
            raise ParamError(f"dtype={self.dtype!r}: 'fp32' or 'bf16'")
        isas = ISAS if self.dtype == "fp32" else {**ISAS, **BF16_ISAS}
        if self.isa not in isas:
            raise ParamError(f"isa={self.isa!r}: {self.dtype} attention runs on one of {tuple(isas)}")
        spec = isas[self.isa]
        if self.vl not in spec.vector_lanes:
            raise ParamError(f"vl={self.vl}: {self.isa} takes one of {spec.vector_lanes}")
        if not 1 <= self.mr <= 16 or not 1 <= self.dc <= 15:
            raise ParamError(f"mr={self.mr}, dc={self.dc}: mr in [1, 16], dc in [1, 15]")
        # accumulators + the loaded row must fit the vector registers, or the tile spills
        if not 1 <= self.qv <= 8 or not 1 <= self.fk <= 15 or not 1 <= self.fd <= 15:
            raise ParamError(f"qv={self.qv}, fk={self.fk}, fd={self.fd}: qv in [1, 8], fk and fd in [1, 15]")
        registers = 32 if self.amx else spec.registers      # (amx's counts its 8 tiles)
        for name, tile in (("mr*dc", self.mr * self.dc + self.dc),
                           ("fk*qv", self.fk * self.qv + self.qv), ("fd*qv", self.fd * self.qv + self.qv)):
            if tile > registers:
                raise ParamError(f"{name} tile needs {tile} vector registers; {self.isa} has {registers}")
        if not 1 <= self.block_q <= 1024:
            raise ParamError(f"block_q={self.block_q}: an int in [1, 1024]")
        if self.block_q % (self.qv * self.vl):
            raise ParamError(f"block_q={self.block_q}: a multiple of qv*vl = {self.qv * self.vl}")
        if not 1 <= self.block_k <= 8192:
            raise ParamError(f"block_k={self.block_k}: an int in [1, 8192]")
        if self.dot and self.block_k % 2:
            raise ParamError(f"block_k={self.block_k}: even on {self.isa} (keys go in pairs)")
        if self.amx and (self.block_q % 32 or self.block_k % 32):
            raise ParamError(f"block_q={self.block_q}, block_k={self.block_k}: multiples of 32 on amx "
                             "(16 pairs, one tile's K)")
        if self.prefetch not in (0, 1):
            raise ParamError(f"prefetch={self.prefetch}: 0 or 1")
        if not 0 <= self.threads <= 1024:
            raise ParamError(f"threads={self.threads}: an int in [0, 1024] (0: all)")
        return self

    @property
    def dot(self) -> bool:
        """The bf16 dot-product tiles (vdpbf16ps) run; else fp32 tiles."""
        return self.dtype == "bf16" and self.isa in BF16_ISAS

    @property
    def amx(self) -> bool:
        """Every product on AMX-BF16 tiles (tdpbf16ps); the vector code around them is
        AVX512_BF16's."""
        return self.dtype == "bf16" and self.isa == "amx"

    @property
    def cflags(self) -> tuple[str, ...]:
        return GEMM_ISAS[self.isa].cflags

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "AttentionParams":
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ParamError(f"unknown attention parameter(s): {sorted(unknown)}")
        return cls(**d).validate()

    def symbol(self) -> str:
        """C prefix of the kernel's functions: unique per parameter set."""
        return (f"autohc_attn_{self.isa}_v{self.vl}_q{self.block_q}_k{self.block_k}_m{self.mr}"
                f"_d{self.dc}_qv{self.qv}_fk{self.fk}_fd{self.fd}_p{self.prefetch}_t{self.threads}"
                + ("_bf16" if self.dtype == "bf16" else ""))


@functools.lru_cache(maxsize=None)
def default_attention(isa: str | None = None) -> AttentionParams:
    """Parameters that work before any tuning: the per-microarchitecture table's entry for
    `isa` (this CPU's best ISA when none is named)."""
    isa = isa or cpu.best_isa()
    return AttentionParams(isa=isa, **archs.attention_default(isa)).validate()


def bf16_attention(params: AttentionParams, isa: str) -> AttentionParams:
    """The bf16 kernel of an fp32 parameter set (tuned or default: the same blocks and tiles)
    on `isa`: avx512bf16 for the dot-product tiles, or an fp32 ISA (the inputs widened)."""
    return dataclasses.replace(params, dtype="bf16", isa=isa).validate()
