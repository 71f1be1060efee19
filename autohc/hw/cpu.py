"""What this CPU is: ISA flags, usable cores, caches and NUMA nodes, read from /proc and /sys.

The GEMM back-end is chosen from these features (`best_isa`), and the registry keys tuned
kernels by `CpuInfo.fingerprint`, so a result tuned on one machine is never used on another.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path

SYS_CPU = Path("/sys/devices/system/cpu")
SYS_NODE = Path("/sys/devices/system/node")


@dataclass(frozen=True)
class Cache:
    level: int
    kind: str          # Data, Instruction, Unified
    size_bytes: int
    shared_by: int     # logical CPUs sharing one instance


@dataclass(frozen=True)
class CpuInfo:
    arch: str
    vendor: str
    model: str
    flags: frozenset[str]
    cpus: tuple[int, ...]                      # logical CPUs this process may run on
    caches: tuple[Cache, ...] = ()
    numa_nodes: tuple[tuple[int, ...], ...] = ()  # CPUs of each node (only usable ones)
    family: int | None = None                  # x86 "cpu family" (AMD Zen 3/4: 25, Zen 5: 26)
    model_number: int | None = None            # x86 "model" (Intel Emerald Rapids: 207)
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def cores(self) -> int:
        return len(self.cpus)

    def has(self, *flags: str) -> bool:
        return all(f in self.flags for f in flags)

    def cache_size(self, level: int) -> int | None:
        for c in self.caches:
            if c.level == level and c.kind in ("Data", "Unified"):
                return c.size_bytes
        return None

    def isa_flags(self) -> list[str]:
        """The flags that matter for kernels (those the fingerprint covers), sorted."""
        return sorted(f for f in self.flags if f in _ISA_FLAGS)

    @functools.cached_property          # computed once: it is read on every GEMM call
    def fingerprint(self) -> str:
        """Stable id of the CPU model + what matters for kernels (ISA, cores, caches)."""
        isa = self.isa_flags()
        parts = [self.arch, self.vendor, self.model, ",".join(isa), str(self.cores),
                 ",".join(f"L{c.level}{c.kind[0]}{c.size_bytes}" for c in self.caches),
                 str(len(self.numa_nodes))]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


_ISA_FLAGS = {"sse2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq",
              "avx512_bf16", "amx_tile", "asimd", "sve", "sve2", "neon"}
BF16_ISA_ENV = "AUTOHC_BF16_ISA"    # names the bf16 GEMM back-end (one this CPU runs)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def parse_cpulist(text: str) -> tuple[int, ...]:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-")
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return tuple(out)


def _parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([KMG]?)", text.strip())
    if not m:
        return 0
    return int(m.group(1)) * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[m.group(2)]


def _proc_cpuinfo() -> tuple[str, str, set[str], int | None, int | None]:
    vendor = model = ""
    flags: set[str] = set()
    family = number = None
    text = _read(Path("/proc/cpuinfo")) or ""
    for line in text.splitlines():
        key, _, val = line.partition(":")
        key = key.strip().lower()
        if key in ("vendor_id", "cpu implementer") and not vendor:
            vendor = val.strip()
        elif key in ("model name", "cpu part") and not model:
            model = val.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(val.split())
        elif key == "cpu family" and family is None and val.strip().isdigit():
            family = int(val)
        elif key == "model" and number is None and val.strip().isdigit():
            number = int(val)
    return vendor, model, flags, family, number


def _caches(cpu: int) -> tuple[Cache, ...]:
    out = []
    base = SYS_CPU / f"cpu{cpu}" / "cache"
    for idx in sorted(base.glob("index*")):
        level, kind, size = (_read(idx / n) for n in ("level", "type", "size"))
        shared = _read(idx / "shared_cpu_list")
        if level and kind and size:
            out.append(Cache(int(level), kind, _parse_size(size),
                             len(parse_cpulist(shared)) if shared else 1))
    return tuple(out)


def _numa_nodes(usable: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    nodes = []
    for node in sorted(SYS_NODE.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        cpus = tuple(c for c in parse_cpulist(_read(node / "cpulist") or "") if c in usable)
        if cpus:
            nodes.append(cpus)
    return tuple(nodes) or (usable,)


@functools.lru_cache(maxsize=1)
def detect() -> CpuInfo:
    vendor, model, flags, family, number = _proc_cpuinfo()
    try:
        usable = tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        usable = tuple(range(os.cpu_count() or 1))
    return CpuInfo(arch=platform.machine(), vendor=vendor, model=model,
                   flags=frozenset(flags), cpus=usable,
                   caches=_caches(usable[0]) if usable else (),
                   numa_nodes=_numa_nodes(usable), family=family, model_number=number)


def best_isa(info: CpuInfo | None = None) -> str:
    """The fastest GEMM back-end this CPU runs: avx512, avx2 or portable."""
    info = info or detect()
    if info.arch in ("x86_64", "AMD64") and info.has("avx512f"):
        return "avx512"
    if info.arch in ("x86_64", "AMD64") and info.has("avx2", "fma"):
        return "avx2"
    return "portable"


def runnable_isas(info: CpuInfo | None = None) -> list[str]:
    """Every back-end this CPU can execute (fastest first)."""
    info = info or detect()
    out = []
    if info.arch in ("x86_64", "AMD64"):
        if info.has("avx512f"):
            out.append("avx512")
        if info.has("avx2", "fma"):
            out.append("avx2")
    out.append("portable")
    return out


def runnable_bf16_isas(info: CpuInfo | None = None) -> list[str]:
    """The bf16 GEMM back-ends (kernels/isa.py BF16_ISAS) this CPU executes, fastest first."""
    info = info or detect()
    out = []
    if info.arch in ("x86_64", "AMD64") and info.has("avx512f", "avx512bw", "avx512vl", "avx512_bf16"):
        if info.has("amx_tile", "amx_bf16"):
            out.append("amx")
        out.append("avx512bf16")
    return out


def bf16_isa(info: CpuInfo | None = None) -> tuple[str, str]:
    """(back-end, why) of the bf16 GEMMs: AMX tiles, else AVX512_BF16 dot products, else the
    fp32 back-end on operands widened to fp32 (correct everywhere, no faster than fp32).
    AUTOHC_BF16_ISA names another one this CPU runs (e.g. avx512bf16 on an AMX CPU)."""
    info = info or detect()
    runnable = runnable_bf16_isas(info)
    wanted = os.environ.get(BF16_ISA_ENV, "").strip()
    if wanted:
        if wanted not in runnable + runnable_isas(info):
            raise ValueError(f"{BF16_ISA_ENV}={wanted!r}: this CPU runs "
                             f"{', '.join(runnable + runnable_isas(info))}")
        return wanted, f"set by {BF16_ISA_ENV}"
    if "amx" in runnable:
        return "amx", "AMX-BF16 tiles (tdpbf16ps)"
    if "avx512bf16" in runnable:
        return "avx512bf16", "AVX512_BF16 dot products (vdpbf16ps); no AMX on this CPU"
    isa = best_isa(info)
    return isa, (f"no AVX512_BF16 or AMX on this CPU: bf16 operands are widened to fp32 and run "
                 f"on the {isa} fp32 kernels (correct, not faster than fp32)")
