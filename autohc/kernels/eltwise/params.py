"""Typed, validated parameters of the element-wise operator kernels (templates/ops) and the
knobs each kernel's template really uses."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from ...hw import cpu
from .. import archs
from ..family import ParamError
from ..isa import ISAS

# kernel -> the template knobs its code depends on. `unroll` shapes only the streaming
# element-wise loop; the row kernels keep a row in L1 and have no unrolled loop; AdamW
# updates in place (its lines are read anyway), so streaming stores buy it nothing.
KERNELS: dict[str, tuple[str, ...]] = {
    "gelu_tanh_fwd": ("vl", "unroll", "stream_stores", "threads"),
    "gelu_tanh_bwd": ("vl", "unroll", "stream_stores", "threads"),
    "silu_fwd": ("vl", "unroll", "stream_stores", "threads"),
    "silu_bwd": ("vl", "unroll", "stream_stores", "threads"),
    "tanh_fwd": ("vl", "unroll", "stream_stores", "threads"),
    "ln_mod_fwd": ("vl", "stream_stores", "threads"),
    "ln_mod_bwd": ("vl", "stream_stores", "threads"),
    "softmax_fwd": ("vl", "stream_stores", "threads"),
    "softmax_bwd": ("vl", "stream_stores", "threads"),
    "gated_residual": ("vl", "stream_stores", "threads"),
    "gated_residual_bwd": ("vl", "threads"),
    # (the gated residual's out is read back for its LayerNorm: never streamed)
    "gres_ln_mod_fwd": ("vl", "threads"),
    "gres_ln_mod_bwd": ("vl", "stream_stores", "threads"),
    "adamw": ("vl", "threads"),
}
OUTPUTS = {"gelu_tanh_fwd": "y", "gelu_tanh_bwd": "dx", "silu_fwd": "y", "silu_bwd": "dx",
           "ln_mod_fwd": "y", "ln_mod_bwd": "dx", "gated_residual": "out", "gated_residual_bwd": "dy",
           "gres_ln_mod_fwd": "h", "gres_ln_mod_bwd": "dx"}
# bf16 forms (torch autocast's tensors): kernel -> its arrays that are bfloat16 (the rest fp32).
# GELU / SiLU read and write bf16; LayerNorm + modulate reads the fp32 residual stream and the
# bf16 adaLN scale / shift and writes the bf16 input of the next GEMM; the gated residual adds
# a bf16 GEMM output to the fp32 stream.
BF16_ARRAYS: dict[str, tuple[str, ...]] = {
    "gelu_tanh_fwd_bf16": ("x", "y"),
    "gelu_tanh_bwd_bf16": ("g", "x", "dx"),
    "silu_fwd_bf16": ("x", "y"),
    "silu_bwd_bf16": ("g", "x", "dx"),
    "ln_mod_fwd_bf16": ("scale", "y"),
    "ln_mod_bwd_bf16": ("dy", "scale"),
    "gated_residual_bf16": ("y",),
    "gated_residual_bwd_bf16": ("y",),
    "gres_ln_mod_fwd_bf16": ("y", "gate", "scale", "h"),
    "gres_ln_mod_bwd_bf16": ("dh", "scale", "y", "dy"),
}
# the same knobs, less streaming stores where the result is bf16 (they stream float32 only)
KERNELS.update({k: tuple(n for n in KERNELS[k.removesuffix("_bf16")]
                         if n != "stream_stores" or OUTPUTS[k.removesuffix("_bf16")] not in arrays)
                for k, arrays in BF16_ARRAYS.items()})


def c_types(kernel: str) -> dict[str, str]:
    """The C element type of each of `kernel`'s bf16 arrays (the template types the rest float)."""
    return dict.fromkeys(BF16_ARRAYS.get(kernel, ()), "uint16_t")
LEGACY_NAMES = {"nt": "stream_stores"}       # registries of earlier releases


@dataclass(frozen=True)
class EltwiseParams:
    isa: str = "avx2"
    vl: int = 8                 # fp32 lanes per vector
    unroll: int = 2             # vectors per loop iteration
    stream_stores: bool = False  # non-temporal stores for results of 8 MB and more per call
    threads: int = 0            # most threads a call splits over: 0 = all it is given

    def validate(self) -> "EltwiseParams":
        if self.isa not in ISAS:
            raise ParamError(f"isa={self.isa!r}: one of {tuple(ISAS)}")
        if type(self.vl) is not int or self.vl not in (4, 8, 16):
            raise ParamError(f"vl={self.vl!r}: one of (4, 8, 16)")
        if type(self.unroll) is not int or not 1 <= self.unroll <= 8:
            raise ParamError(f"unroll={self.unroll!r}: an int in [1, 8]")
        if type(self.stream_stores) is not bool:
            raise ParamError(f"stream_stores={self.stream_stores!r}: true or false")
        if type(self.threads) is not int or not 0 <= self.threads <= 1024:
            raise ParamError(f"threads={self.threads!r}: an int in [0, 1024] (0: all)")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EltwiseParams":
        d = {LEGACY_NAMES.get(k, k): v for k, v in d.items()}
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ParamError(f"unknown element-wise parameter(s): {sorted(unknown)}")
        return cls(**d).validate()

    def for_kernel(self, kernel: str) -> "EltwiseParams":
        """These parameters with the knobs `kernel` does not use at their defaults, so that
        parameter sets rendering the same C are one library."""
        if kernel not in KERNELS:
            raise ParamError(f"unknown element-wise kernel {kernel!r}; one of {', '.join(KERNELS)}")
        base = EltwiseParams(isa=self.isa)
        return dataclasses.replace(self, **{k: getattr(base, k) for k in ("unroll", "stream_stores", "threads")
                                            if k not in KERNELS[kernel]})

    def symbol(self, kernel: str) -> str:
        """C prefix of one kernel's functions: unique per kernel and parameter set."""
        return (f"autohc_ew_{kernel}_{self.isa}_v{self.vl}_u{self.unroll}_t{self.threads}"
                + ("_s" if self.stream_stores else ""))


@functools.lru_cache(maxsize=None)
def default_eltwise(isa: str | None = None) -> EltwiseParams:
    """Parameters that work before any tuning: the per-microarchitecture table's entry for
    `isa` (this CPU's best ISA when none is named), plain stores, every thread given."""
    isa = isa or cpu.best_isa()
    return EltwiseParams(isa=isa, **archs.eltwise_default(isa)).validate()
