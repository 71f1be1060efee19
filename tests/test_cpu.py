from autohc.hw import cpu
from autohc.hw.cpu import Cache, CpuInfo, parse_cpulist


def test_parse_cpulist():
    assert parse_cpulist("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpulist("") == ()
    assert parse_cpulist("5") == (5,)


def test_detect_this_machine():
    info = cpu.detect()
    assert info.cores >= 1 and info.cpus
    assert info.numa_nodes and set(sum(info.numa_nodes, ())) <= set(info.cpus)
    assert len(info.fingerprint) == 16
    assert cpu.best_isa(info) == cpu.runnable_isas(info)[0]
    assert "portable" in cpu.runnable_isas(info)


def fake(flags, arch="x86_64", nodes=((0, 1),)):
    return CpuInfo(arch=arch, vendor="v", model="m", flags=frozenset(flags),
                   cpus=tuple(sorted(sum(nodes, ()))), caches=(Cache(1, "Data", 32768, 1),),
                   numa_nodes=nodes)


def test_isa_choice():
    assert cpu.best_isa(fake({"avx2", "fma", "avx512f"})) == "avx512"
    assert cpu.best_isa(fake({"avx2", "fma"})) == "avx2"
    assert cpu.best_isa(fake({"avx2"})) == "portable"          # no FMA
    assert cpu.best_isa(fake({"asimd"}, arch="aarch64")) == "portable"


def test_fingerprint_changes_with_isa():
    assert fake({"avx2", "fma"}).fingerprint != fake({"avx2", "fma", "avx512f"}).fingerprint
    assert fake({"avx2", "fma"}).fingerprint == fake({"avx2", "fma", "ht"}).fingerprint
