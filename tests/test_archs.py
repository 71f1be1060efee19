"""The per-microarchitecture table (configs/<arch>.yaml): recorded CPU descriptions select the
right entry, every entry's defaults and candidates are valid and searchable."""
import dataclasses

import pytest

from autohc.hw.cpu import Cache, CpuInfo
from autohc.kernels import archs
from autohc.kernels.gemm.params import GemmParams, default_params
from autohc.kernels.isa import BF16_ISAS
from autohc.tune.space import as_suggestions, isa_entries, load_space

AVX2 = {"sse2", "avx", "avx2", "fma"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
L32K = (Cache(1, "Data", 32 << 10, 1), Cache(2, "Unified", 1 << 20, 1))


def L3(mib):
    """L1d, L2 per core and a shared L3 of `mib` MiB."""
    return (Cache(1, "Data", 48 << 10, 1), Cache(2, "Unified", 2 << 20, 1), Cache(3, "Unified", mib << 20, 2))


def _cpu(vendor, family, model, name, flags, caches=L32K, arch="x86_64"):
    return CpuInfo(arch=arch, vendor=vendor, model=name, flags=frozenset(flags), cpus=(0, 1),
                   caches=caches, numa_nodes=((0, 1),), family=family, model_number=model)


# (what /proc/cpuinfo of real machines says, the entry it must select)
RECORDED = [
    (_cpu("AuthenticAMD", 25, 1, "AMD EPYC 7763 64-Core Processor", AVX2), "zen3"),
    (_cpu("AuthenticAMD", 25, 33, "AMD Ryzen 9 5950X 16-Core Processor", AVX2), "zen3"),
    (_cpu("AuthenticAMD", 25, 17, "AMD EPYC 9654 96-Core Processor", AVX512), "zen4"),
    (_cpu("AuthenticAMD", 25, 97, "AMD Ryzen 9 7950X 16-Core Processor", AVX512), "zen4"),
    (_cpu("AuthenticAMD", 26, 2, "AMD EPYC 9755 128-Core Processor", AVX512), "zen5"),
    (_cpu("GenuineIntel", 6, 85, "Intel(R) Xeon(R) Gold 6148 CPU @ 2.40GHz", AVX512), "skx"),
    (_cpu("GenuineIntel", 6, 106, "Intel(R) Xeon(R) Platinum 8380 CPU @ 2.30GHz", AVX512), "skx"),
    (_cpu("GenuineIntel", 6, 143, "Intel(R) Xeon(R) Platinum 8480+", AVX512 | {"amx_tile"}), "spr"),
    (_cpu("GenuineIntel", 6, 207, "Intel(R) Xeon(R) Processor", AVX512 | {"amx_tile"}), "spr"),
    # KVM guests of AMX Xeons that report model 167 (Rocket Lake's number, no AMX): the L3 tells
    # a Granite Rapids (480 MiB, a Xeon 6972P's) from a Sapphire or Emerald Rapids (<= 320 MiB)
    (_cpu("GenuineIntel", 6, 167, "Intel(R) Xeon(R) Processor", AVX512 | {"amx_tile"}), "spr"),
    (_cpu("GenuineIntel", 6, 167, "Intel(R) Xeon(R) Processor", AVX512 | {"amx_tile"}, caches=L3(480)), "gnr"),
    (_cpu("GenuineIntel", 6, 167, "Intel(R) Xeon(R) Processor", AVX512 | {"amx_tile"}, caches=L3(320)), "spr"),
    (_cpu("GenuineIntel", 6, 207, "Intel(R) Xeon(R) Platinum 8592+", AVX512 | {"amx_tile"}, caches=L3(320)), "spr"),
    (_cpu("GenuineIntel", 6, 173, "Intel(R) Xeon(R) 6972P", AVX512 | {"amx_tile"}, caches=L3(480)), "gnr"),
    (_cpu("GenuineIntel", 6, 173, "Intel(R) Xeon(R) 6517P", AVX512 | {"amx_tile"}, caches=L3(72)), "gnr"),
    # an L3 that large without tiles is no Granite Rapids guest
    (_cpu("GenuineIntel", 6, 167, "Intel(R) Xeon(R) Processor", AVX512, caches=L3(480)), "generic"),
    (_cpu("GenuineIntel", 6, 167, "11th Gen Intel(R) Core(TM) i9-11900K", AVX512), "generic"),
    # a Sapphire Rapids guest whose hypervisor hides AMX: its model still says spr
    (_cpu("GenuineIntel", 6, 143, "Intel(R) Xeon(R) Platinum 8480+ (AMX hidden)", AVX512), "spr"),
    (_cpu("GenuineIntel", 6, 63, "Intel(R) Xeon(R) CPU E5-2680 v3 @ 2.50GHz", AVX2), "haswell"),
    (_cpu("GenuineIntel", 6, 151, "12th Gen Intel(R) Core(TM) i9-12900K", AVX2), "haswell"),
    # unknown: a future AMD family, an Intel AVX-512 model nobody listed, an Arm server
    (_cpu("AuthenticAMD", 27, 0, "AMD EPYC (future)", AVX512), "generic"),
    (_cpu("GenuineIntel", 6, 250, "Intel(R) Xeon(R) (future)", AVX512), "generic"),
    (_cpu("0x41", None, None, "Neoverse-V2", {"asimd", "sve"}, arch="aarch64"), "generic"),
]


@pytest.mark.parametrize("info,name", RECORDED, ids=[r[0].model for r in RECORDED])
def test_recorded_cpus_select_their_entry(info, name):
    assert archs.select(info).name == name


def test_zen4_without_avx512_flags_is_not_zen4():
    """A hypervisor that hides AVX-512 from a Zen 4 guest: not the AVX-512 entry."""
    info = _cpu("AuthenticAMD", 25, 17, "AMD EPYC 9654 (AVX-512 masked)", AVX2)
    assert archs.select(info).name != "zen4"


def test_every_entry_gives_valid_defaults_and_searchable_candidates():
    space = load_space("gemm")
    for arch in archs.table():
        for isa in arch.gemm:
            d = default_params(isa, 2, arch.name)
            own = archs.gemm_own_ways_up_to(isa, arch) >= 2
            # one node: the threads split M sharing B, or each is its own way where the entry says
            assert (d.jc_ways, d.ic_ways, d.jr_ways) == ((2, 1, 1) if own else (1, 2, 1))
            entries = isa_entries(space, isa)
            for p in [d] + [dataclasses.replace(d, **c).validate()
                            for c in archs.gemm_candidates(isa, arch)]:
                sugg = as_suggestions(p, isa)
                off = {k: v for k, v in sugg.items() if k in entries and v not in entries[k]["values"]}
                assert not off, f"{arch.name}/{isa}: {off} not in search_spaces/gemm.yaml"
            assert arch.gemm[isa].get("source"), f"{arch.name}/{isa} says nowhere where it comes from"


@pytest.mark.parametrize("l1_kb,l2_kb", [(32, 256), (32, 1024), (48, 1024), (48, 2048), (64, 512), (80, 4096)])
def test_blocks_derived_from_caches_lie_in_the_search_space(l1_kb, l2_kb):
    """generic derives kc and mc from the caches; the tuner must be able to express them
    (48 KB L1d + 1 MB L2, a Zen 5, once gave mc 336, which the space does not hold)."""
    space = load_space("gemm")
    caches = (Cache(1, "Data", l1_kb << 10, 1), Cache(2, "Unified", l2_kb << 20 >> 10, 1))
    info = _cpu("Unknown", None, None, "some CPU", AVX512, caches=caches)
    for isa in ("avx512", "avx2"):
        d = archs.gemm_default(isa, archs.by_name("generic"), info)
        entries = isa_entries(space, isa)
        assert d["kc"] in entries["kc"]["values"] and d["mc"] in entries["mc"]["values"], d
        assert d["mc"] % d["mr"] == 0 and d["kc"] * d["nr"] * 4 <= (l1_kb << 10)  # B micro-panel in L1
        GemmParams(isa=isa, **d).validate()


def test_entries_differ_where_the_published_configurations_do():
    zen3 = default_params("avx2", 1, "zen3")
    haswell = default_params("avx2", 1, "haswell")
    assert (zen3.mr, zen3.nr) == (haswell.mr, haswell.nr) == (6, 16)
    assert (zen3.mc, haswell.mc) == (144, 168)       # BLIS zen vs haswell MC
    assert default_params("avx512", 1, "skx").nc == 3072


def test_generic_blocks_follow_the_caches():
    small = _cpu("X", None, None, "x", AVX512, caches=(Cache(1, "Data", 32 << 10, 1), Cache(2, "Unified", 1 << 20, 1)))
    big = _cpu("X", None, None, "x", AVX512, caches=(Cache(1, "Data", 64 << 10, 1), Cache(2, "Unified", 2 << 20, 1)))
    g = archs.by_name("generic")
    a, b = archs.gemm_default("avx512", g, small), archs.gemm_default("avx512", g, big)
    assert a["kc"] < b["kc"] and a["nr"] * a["kc"] * 4 <= (32 << 10) // 2
    GemmParams(isa="avx512", **a).validate()
    GemmParams(isa="avx512", **b).validate()


def test_default_params_takes_this_cpus_entry_and_rejects_unknown_names():
    assert default_params("avx512", 1) == default_params("avx512", 1, archs.select().name) \
        or "avx512" not in archs.select().gemm
    with pytest.raises(ValueError, match="no arch entry"):
        default_params("avx2", 1, "pentium")


@pytest.mark.parametrize("threads,clusters,geometry", [
    (1, 1, (1, 1, 1)), (2, 1, (1, 2, 1)), (4, 1, (1, 4, 1)), (8, 1, (1, 4, 2)), (32, 1, (1, 8, 4)),
    (2, 2, (2, 1, 1)), (8, 2, (2, 4, 1)), (6, 4, (1, 3, 2))])
def test_default_geometry_splits_n_by_node_and_m_within_one(threads, clusters, geometry):
    """Clusters (NUMA nodes) own N slices; a node's threads share B and split M, then N by
    JR; a thread count the clusters do not divide runs as one cluster."""
    from autohc.kernels.gemm.params import thread_geometry
    assert thread_geometry(threads, clusters) == geometry
    d = default_params("avx2", threads, "haswell", clusters=clusters)
    assert (d.jc_ways, d.ic_ways, d.jr_ways) == geometry and d.threads == threads


@pytest.mark.parametrize("threads,clusters,up_to,geometry", [
    (1, 1, 2, (1, 1, 1)), (2, 1, 2, (2, 1, 1)), (4, 1, 2, (1, 4, 1)), (4, 2, 2, (4, 1, 1)),
    (8, 2, 2, (2, 4, 1)), (4, 1, 4, (4, 1, 1)), (2, 1, 0, (1, 2, 1))])
def test_own_ways_make_every_thread_of_a_small_cluster_its_own_way(threads, clusters, up_to, geometry):
    """An entry's own_ways_up_to: clusters of at most that many threads give every thread its
    own JC way; larger clusters share B panels as before."""
    from autohc.kernels.gemm.params import thread_geometry
    assert thread_geometry(threads, clusters, up_to) == geometry


@pytest.mark.parametrize("threads,clusters,up_to,depth", [
    (1, 1, 0, 1), (2, 1, 2, 1), (4, 2, 2, 1), (2, 1, 0, 2), (8, 2, 2, 2), (4, 1, 2, 2)])
def test_default_panel_ring_is_single_where_a_jc_way_has_one_thread(threads, clusters, up_to, depth,
                                                                     monkeypatch):
    """The B panel ring: two buffers where a JC way's threads share its panels (one packs
    ahead while the others compute), one where a way is a single thread (nothing to overlap);
    an entry that names a depth keeps it."""
    from autohc.kernels.gemm.params import panel_ring_depth, thread_geometry
    geo = thread_geometry(threads, clusters, up_to)
    assert panel_ring_depth(*geo) == depth
    monkeypatch.setattr(archs, "gemm_own_ways_up_to", lambda isa, arch=None: up_to)
    d = default_params("avx2", threads, "haswell", clusters=clusters)
    assert (d.jc_ways, d.ic_ways, d.jr_ways) == geo and d.depth == depth
    named = dataclasses.replace(archs.by_name("haswell"), gemm={
        "avx2": {**archs.by_name("haswell").gemm["avx2"],
                 "default": {**archs.by_name("haswell").gemm["avx2"]["default"], "depth": 3}}})
    monkeypatch.setattr(archs, "by_name", lambda name: named)
    assert default_params("avx2", threads, "haswell", clusters=clusters).depth == 3


def test_own_ways_up_to_comes_from_the_entry_and_is_checked():
    zen5 = archs.by_name("zen5")
    assert archs.gemm_own_ways_up_to("avx512", zen5) == 2
    assert archs.gemm_own_ways_up_to("avx512bf16", zen5) == 0      # not given: never
    d = default_params("avx512", 2, "zen5")
    assert (d.jc_ways, d.ic_ways, d.jr_ways) == (2, 1, 1)
    bad = dataclasses.replace(zen5, gemm={**zen5.gemm, "avx512": {**zen5.gemm["avx512"], "own_ways_up_to": "2"}})
    with pytest.raises(ValueError, match="own_ways_up_to"):
        archs.gemm_own_ways_up_to("avx512", bad)


def test_default_kernel_params_count_the_nodes_the_team_spans(monkeypatch):
    from autohc.hw import cpu
    from autohc.kernels.gemm import kernel
    from autohc.runtime import plan
    two_nodes = dataclasses.replace(cpu.detect(), cpus=(0, 1, 2, 3), numa_nodes=((0, 1), (2, 3)))
    monkeypatch.setattr(cpu, "detect", lambda: two_nodes)
    monkeypatch.setattr(plan, "current", lambda: plan.make_plan(two_nodes, 0, 0))
    kernel.default_kernel_params.cache_clear()
    try:
        assert kernel.team_nodes(2) == 1 and kernel.team_nodes(4) == 2
        p = kernel.default_kernel_params(4, "avx2")
        assert (p.jc_ways, p.ic_ways, p.jr_ways) == (2, 2, 1)
        p = kernel.default_kernel_params(2, "avx2")
        assert (p.jc_ways, p.ic_ways, p.jr_ways) == (1, 2, 1)
    finally:
        kernel.default_kernel_params.cache_clear()


def test_every_register_tile_of_the_search_space_is_a_valid_kernel():
    """A tile the tuner can suggest must validate on its back-end (the amx section's 48x16
    once could not: mr was capped at 32, a vector ISA's bound, and every trial of it was
    pruned); the register bound itself is the back-end's (tests of ParamError elsewhere)."""
    space = load_space("gemm")
    for isa, section in space["isa"].items():
        dtype = "bf16" if isa in BF16_ISAS else "fp32"
        d = default_params(isa, 1, "generic", dtype=dtype)
        for tile in section["tile"]["values"]:
            mr, nr = (int(x) for x in tile.split("x"))
            vl = d.vl if nr % d.vl == 0 else 8           # (portable: its 8-lane tiles)
            dataclasses.replace(d, mr=mr, nr=nr, vl=vl, mc=mr * 8, nc=nr * 8).validate()


def test_an_entry_inherits_what_it_does_not_name():
    """gnr names only the amx GEMM back-end: spr's others, its element-wise and attention
    defaults come with it, and its own amx entry replaces spr's whole."""
    gnr, spr = archs.by_name("gnr"), archs.by_name("spr")
    assert gnr.gemm["avx512"] == spr.gemm["avx512"] and gnr.gemm["avx512bf16"] == spr.gemm["avx512bf16"]
    assert gnr.eltwise == spr.eltwise and gnr.attention == spr.attention
    assert gnr.gemm["amx"] != spr.gemm["amx"] and gnr.gemm["amx"]["default"]["sink_every"] == 8
    assert "sink_every" not in spr.gemm["amx"]["default"]


@pytest.mark.parametrize("bad,says", [
    ({"name": "x", "match": {"l3_over_mib": "big"}}, "whole number of MiB"),
    ({"name": "x", "match": {"family": 6}, "inherits": ["spr"]}, "inherits names one entry"),
])
def test_malformed_match_or_inherits_is_refused(tmp_path, bad, says):
    with pytest.raises(ValueError, match=says):
        archs._check(tmp_path / "x.yaml", bad)


def test_inheriting_an_unknown_entry_is_refused(tmp_path, monkeypatch):
    import shutil
    for f in archs.configs_dir().glob("*.yaml"):
        shutil.copy(f, tmp_path)
    (tmp_path / "odd.yaml").write_text("name: odd\ninherits: nosuch\nmatch: {family: 99}\n")
    monkeypatch.setattr(archs, "configs_dir", lambda: tmp_path)
    archs.table.cache_clear()
    try:
        with pytest.raises(ValueError, match="inherits 'nosuch'"):
            archs.table()
    finally:
        archs.table.cache_clear()
