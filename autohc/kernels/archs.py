"""Kernel defaults per microarchitecture: the table in configs/<arch>.yaml (as BLIS keeps
config/<arch>), the entry this CPU matches, and what it gives each kernel family.

An entry names what the CPU must report (`match`: vendor, x86 family, model ranges, flags that
must be there or not, an L3 larger than some size; or a list of such sets, any of which will
do), the entry it starts from (`inherits`: its back-ends and operators, each one this entry
names replacing the inherited one whole), and per back-end the GEMM
default, the candidates that the tuner starts from and first-use tuning races, and the
element-wise and attention defaults. The most specific matching entry wins; `generic` matches
every CPU. A back-end an entry does not list comes from `generic`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..datafiles import data_dir

from ..hw import cpu
from .family import ParamError
from .isa import BF16_ISAS

MATCH_KEYS = ("vendor", "family", "models", "flags", "without", "l3_over_mib")
ENTRY_KEYS = {"name", "title", "match", "inherits", "gemm", "eltwise", "attention"}
GEMM_KEYS = {"default", "candidates", "source", "derive_blocks", "own_ways_up_to"}


@dataclass(frozen=True)
class Arch:
    name: str
    title: str
    match: dict
    gemm: dict = field(default_factory=dict)      # isa -> {default, candidates, source, ...}
    eltwise: dict = field(default_factory=dict)   # isa -> EltwiseParams fields
    attention: dict = field(default_factory=dict)  # isa -> AttentionParams fields

    @property
    def alternatives(self) -> list[dict]:
        """The match sets, any of which selects this entry."""
        return list(self.match) if isinstance(self.match, list) else [self.match]

    @staticmethod
    def _holds(m: dict, info: cpu.CpuInfo) -> bool:
        if "vendor" in m and info.vendor != m["vendor"]:
            return False
        if "family" in m and info.family != m["family"]:
            return False
        if "models" in m and not any(lo <= (info.model_number if info.model_number is not None else -1) <= hi
                                     for lo, hi in m["models"]):
            return False
        if not info.has(*m.get("flags", ())):
            return False
        # (a KVM guest may report a made-up model; the L3 it reports can still tell CPU lines apart)
        if "l3_over_mib" in m and not (info.cache_size(3) or 0) > m["l3_over_mib"] << 20:
            return False
        return not any(f in info.flags for f in m.get("without", ()))

    def matches(self, info: cpu.CpuInfo) -> bool:
        return self.specificity_for(info) >= 0

    def specificity_for(self, info: cpu.CpuInfo) -> int:
        """Keys of the most specific match set that holds for this CPU (-1: none holds)."""
        return max((sum(k in m for k in MATCH_KEYS) for m in self.alternatives if self._holds(m, info)),
                   default=-1)


def configs_dir() -> Path:
    return data_dir("configs", "generic.yaml")


def _check(path: Path, d) -> Arch:
    if not isinstance(d, dict) or set(d) - ENTRY_KEYS or "name" not in d or "match" not in d:
        raise ValueError(f"{path}: an arch entry needs name and match, and only {sorted(ENTRY_KEYS)}")
    sets = d["match"] if isinstance(d["match"], list) else [d["match"]]
    if not sets or any(not isinstance(m, dict) or set(m) - set(MATCH_KEYS) for m in sets):
        raise ValueError(f"{path}: match is a set of {MATCH_KEYS}, or a list of such sets")
    if any(not isinstance(m.get("l3_over_mib", 0), int) for m in sets):
        raise ValueError(f"{path}: l3_over_mib is a whole number of MiB")
    if not isinstance(d.get("inherits", ""), str):
        raise ValueError(f"{path}: inherits names one entry")
    for isa, g in (d.get("gemm") or {}).items():
        if not isinstance(g, dict) or "default" not in g or set(g) - GEMM_KEYS:
            raise ValueError(f"{path}: gemm.{isa} needs a default and takes only {sorted(GEMM_KEYS)}")
    return Arch(d["name"], d.get("title", d["name"]), d["match"], d.get("gemm") or {},
                d.get("eltwise") or {}, d.get("attention") or {})


@functools.lru_cache(maxsize=None)
def table() -> tuple[Arch, ...]:
    raw = {}
    for path in sorted(configs_dir().glob("*.yaml")):
        d = yaml.safe_load(path.read_text())
        _check(path, d)
        if d["name"] != path.stem:
            raise ValueError(f"{path}: name {d['name']!r} differs from the file name")
        raw[d["name"]] = (path, d)
    out = []
    for name, (path, d) in raw.items():
        parent = d.get("inherits")
        if parent is not None:
            if parent not in raw or raw[parent][1].get("inherits"):
                raise ValueError(f"{path}: inherits {parent!r}, which is no entry or inherits in turn (one level only)")
            base = raw[parent][1]
            d = {**d, **{k: {**(base.get(k) or {}), **(d.get(k) or {})} for k in ("gemm", "eltwise", "attention")}}
        out.append(_check(path, d))
    return tuple(out)


def by_name(name: str) -> Arch:
    for a in table():
        if a.name == name:
            return a
    raise ValueError(f"no arch entry {name!r}; one of {', '.join(a.name for a in table())}")


def select(info: cpu.CpuInfo | None = None) -> Arch:
    """The most specific entry this CPU matches (generic when none other does)."""
    info = info or cpu.detect()
    score, best = max(((a.specificity_for(info), a) for a in table()), key=lambda x: x[0])
    return best if score >= 0 else by_name("generic")


def _gemm_entry(isa: str, arch: Arch) -> tuple[Arch, dict]:
    if isa in arch.gemm:
        return arch, arch.gemm[isa]
    generic = by_name("generic")
    if isa not in generic.gemm:
        raise ParamError(f"no GEMM default for back-end {isa!r}")
    return generic, generic.gemm[isa]


def derived_blocks(default: dict, info: cpu.CpuInfo) -> dict:
    """kc, mc from the caches (the B micro-panel nr x kc in half of L1d, the A block mc x kc in
    half of L2), clamped to what has been measured to work; the default's where unknown."""
    out = dict(default)
    l1, l2 = info.cache_size(1), info.cache_size(2)
    nr, mr = default["nr"], default["mr"]
    if l1:
        out["kc"] = _snap("kc", max(128, min(512, (l1 // 2) // (4 * nr))), 1)
    if l2:
        out["mc"] = _snap("mc", max(4 * mr, min(480, (l2 // 2) // (4 * out["kc"]))), mr)
    return out


@functools.lru_cache(maxsize=None)
def _space_values(name: str) -> tuple[int, ...]:
    """The GEMM search space's values of `name` (tune.space reads the same file for the tuner;
    kernels/ does not import tune/)."""
    space = yaml.safe_load((data_dir("search_spaces", "gemm.yaml") / "gemm.yaml").read_text())
    return tuple(sorted(space["common"][name]["values"]))


def _snap(name: str, value: int, multiple: int) -> int:
    """The largest of the search space's values for `name` (a multiple of `multiple`) that is at
    most `value`: a derived default the tuner can express, so its race starts from it."""
    allowed = [v for v in _space_values(name) if v % multiple == 0]
    return max((v for v in allowed if v <= value), default=allowed[0])


def gemm_default(isa: str, arch: Arch | None = None, info: cpu.CpuInfo | None = None) -> dict:
    """GemmParams fields (without threads) of the default for `isa` on `arch` (this CPU's)."""
    info = info or cpu.detect()
    _, entry = _gemm_entry(isa, arch or select(info))
    values = dict(entry["default"])
    if entry.get("derive_blocks") and isa not in BF16_ISAS:   # (the L1 rule counts floats)
        values = derived_blocks(values, info)
    return values


def gemm_own_ways_up_to(isa: str, arch: Arch | None = None) -> int:
    """Clusters of at most this many threads run every thread as its own JC way (no packed
    panel shared, no waits between threads; params.thread_geometry); 0: never."""
    _, entry = _gemm_entry(isa, arch or select())
    n = entry.get("own_ways_up_to", 0)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"gemm.{isa}.own_ways_up_to={n!r}: a thread count (0: never)")
    return n


def gemm_candidates(isa: str, arch: Arch | None = None) -> list[dict]:
    """Overrides of the default that the tuner starts from and first-use tuning races."""
    _, entry = _gemm_entry(isa, arch or select())
    return [dict(c) for c in entry.get("candidates") or ()]


def eltwise_default(isa: str, arch: Arch | None = None) -> dict:
    arch = arch or select()
    return dict(arch.eltwise.get(isa) or by_name("generic").eltwise.get(isa) or {})


def attention_default(isa: str, arch: Arch | None = None) -> dict:
    arch = arch or select()
    return dict(arch.attention.get(isa) or by_name("generic").attention.get(isa) or {})


def describe(info: cpu.CpuInfo | None = None) -> dict:
    """What `autohc info` shows: the entry chosen and its GEMM default's source."""
    info = info or cpu.detect()
    arch = select(info)
    isa = cpu.best_isa(info)
    src, entry = _gemm_entry(isa, arch)
    return {"arch": arch.name, "title": arch.title, "isa": isa,
            "gemm_default": gemm_default(isa, arch, info), "source": " ".join(str(entry.get("source", "")).split()),
            "from": src.name}
