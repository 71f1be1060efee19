"""Parameter validation, strict rendering, and that every back-end compiles (AVX-512 even
where it cannot run)."""
import dataclasses
import shutil
import subprocess

import jinja2
import pytest

from autohc.kernels.gemm.codegen import gemm_cdef, render_gemm, render_gemm_objects
from autohc.kernels.gemm.params import GemmParams, ParamError, default_params
from autohc.kernels.isa import ISAS
from autohc.kernels.render import environment


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_defaults_are_valid(isa, threads):
    p = default_params(isa, threads)
    assert p.threads == threads
    assert p.validate() is p


@pytest.mark.parametrize("change, message", [
    (dict(isa="sse9"), "isa"),
    (dict(mr=0), "mr=0"),
    (dict(mr=7.0), "must be an int"),
    (dict(kc="256"), "must be an int"),
    (dict(kc=True), "must be an int"),
    (dict(nr=12), "multiple of the vector length"),
    (dict(mr=8), "vector registers"),           # 8x16 on AVX2: 8*2+2+1 = 19 > 16
    (dict(mc=100), "multiple of mr"),
    (dict(nc=4004), "multiple of nr"),
    (dict(k_unroll=3), "k_unroll"),
    (dict(depth=4), "depth"),
    (dict(jc_ways=64, ic_ways=8, jr_ways=8), "threads"),
    (dict(vl=16), "vectors hold"),
    (dict(prefetch_c=1), "prefetch_c"),
    (dict(kc=4096, nc=65536), "256 MiB"),
    (dict(kc=4096, nc=12288, a_outer=True), "256 MiB"),   # a_outer's B buffer is 1.5 nc + nr wide
    (dict(a_outer=1), "a_outer"),
    (dict(a_outer=True, own_rows=1), "own_rows"),
    (dict(own_rows_by_k=True), "own_rows_by_k"),
    (dict(own_rows_b_kib=1024), "own_rows_b_kib"),
    (dict(own_rows_b_kib=-1), "own_rows_b_kib"),
])
def test_invalid_params_rejected(change, message):
    p = dataclasses.replace(default_params("avx2"), **change)
    with pytest.raises(ParamError, match=message):
        p.validate()
    with pytest.raises(ParamError):
        render_gemm(p)


def test_from_dict_rejects_unknown_keys():
    d = default_params("avx2").to_dict()
    assert GemmParams.from_dict(d) == default_params("avx2")
    with pytest.raises(ParamError, match="unknown"):
        GemmParams.from_dict({**d, "evil": "); system(\"rm -rf /\"); //"})


def test_strict_undefined():
    tmpl = environment().get_template("gemm/gemm.c.j2")
    with pytest.raises(jinja2.UndefinedError):
        tmpl.render(isa="avx2")     # every other parameter missing


def test_render_is_deterministic_and_names_symbols():
    p = default_params("avx2", 2)
    src = render_gemm(p)
    assert src == render_gemm(p)
    assert f"int {p.library_symbol}_gemm(void *h, " in src and f"{p.library_symbol}_new(" in src
    assert p.symbol.startswith("autohc_g") and p.symbol[8:].isalnum()
    assert p.library_symbol.startswith("autohc_gl") and p.library_symbol[9:].isalnum()
    # the blocks and thread ways are an instance's: one library for all of them ...
    q = dataclasses.replace(p, kc=128, mc=96, nc=512, jc_ways=1, ic_ways=1, jr_ways=2, depth=3).validate()
    assert q.symbol != p.symbol and q.library_symbol == p.library_symbol and render_gemm(q) == src
    # ... but not for the rest, and an exported kernel has its own, without the instance argument
    r = dataclasses.replace(p, k_unroll=2)
    assert r.library_symbol != p.library_symbol and render_gemm(r) != src
    fixed = render_gemm(p, fixed=True)
    assert f"int {p.symbol}_gemm(int64_t M, " in fixed and "_new(" not in fixed
    assert render_gemm(q, fixed=True) != fixed


def test_register_tile_is_fully_unrolled():
    p = default_params("avx512")
    src = render_gemm(p)
    nv = p.nr // p.vl
    # one FMA per accumulator per unrolled k step, plus the remainder loop
    assert src.count("V_FMA_ACC(c") == p.mr * nv * (p.k_unroll + 1)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
@pytest.mark.parametrize("isa", list(ISAS))
def test_every_backend_compiles_standalone(isa, tmp_path):
    """The rendered C builds without Python (what `autohc export` ships), AVX-512 included
    on machines that cannot run it."""
    p = default_params(isa, 2)
    for fixed in (False, True):         # the library (instances of blocks and ways), the exported kernel
        sources = [render_gemm(p, fixed=fixed), *render_gemm_objects(p).values()]  # (+ the skinny paths' object)
        for j, src in enumerate(sources):
            (tmp_path / f"{isa}{fixed}_{j}.c").write_text(src)
        cmd = ["gcc", "-O3", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared", "-Wl,--no-undefined",
               *ISAS[isa].cflags, *(str(tmp_path / f"{isa}{fixed}_{j}.c") for j in range(len(sources))),
               "-o", str(tmp_path / f"{isa}{fixed}.so"), "-lpthread"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


def test_cdef_matches_rendered_functions():
    p = default_params("portable")
    src = render_gemm(p)
    for line in gemm_cdef(p).splitlines():
        if line.startswith("int "):
            name = line.split("(")[0].split()[-1]
            assert f"int {name}(" in src
