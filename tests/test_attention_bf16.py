"""bf16 fused attention (templates/ops/attention.c.j2, dtype bf16): q, k, v and the outputs
bfloat16, the log-sum-exp and every sum fp32. Checked against float64 math on the same bf16
inputs. Tolerances, stated: the outputs are rounded to bf16 once (2^-8 of a value), and on
the dot-product back-end P and dS are rounded to bf16 before their products (2^-9 each,
averaging out over the keys): |err| <= 1e-2 |ref| + 8e-3 max|ref| + 1e-5 per tensor
(the last for gradients that are zero in exact arithmetic, one key); the
log-sum-exp sees only fp32 sums over the head dim (1e-5). Every back-end this CPU runs is
checked (AMX tiles, AVX512_BF16 dot products, and the fp32 ISAs on widened inputs); the AMX
one also with its tiles emulated in C wherever AVX512_BF16 runs, and both are compiled
everywhere."""
from __future__ import annotations

import dataclasses
import math
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

import autohc
from autohc.hw import cpu
from autohc.kernels.attention import AttentionParams, default_attention
from autohc.kernels.attention.codegen import render_attention
from autohc.kernels.attention.params import bf16_attention
from autohc.kernels.family import ParamError
from autohc.kernels.gemm.kernel import tile_emulation
from autohc.torch import attention as A
from autohc.torch.threads import set_kernel_threads

DOT = "avx512bf16" in cpu.runnable_bf16_isas()     # (AMX's softmax and packs need it too)
RUNNABLE = ([i for i in ("amx", "avx512bf16") if DOT and i in cpu.runnable_bf16_isas()]
            + cpu.runnable_isas()[:2])
SHAPES = [(256, 256, 64, None), (37, 53, 72, -0.3), (1, 5, 7, None), (300, 301, 33, 0.05), (64, 1, 80, None)]


def params(isa: str) -> AttentionParams:
    base = "avx2" if isa == "avx2" else "avx512" if isa in ("avx512bf16", "amx") else isa
    return bf16_attention(default_attention(base), isa)


def inputs(B, H, L, S, D, seed):
    """q a strided view of a qkv tensor (as DiT makes it), k contiguous, v (B, S, H, D) in
    memory: three layouts at once; dO bf16."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, L, 3, H, D, generator=g).bfloat16().permute(2, 0, 3, 1, 4)[0]
    k = torch.randn(B, H, S, D, generator=g).bfloat16()
    v = torch.randn(B, S, H, D, generator=g).bfloat16().transpose(1, 2)
    return q, k, v, torch.randn(B, H, L, D, generator=g).bfloat16()


def reference(q, k, v, grad, scale):
    """out, lse, dq, dk, dv in float64 from the bf16 inputs."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    s = (q @ k.transpose(-2, -1)) * scale
    out = torch.softmax(s, -1) @ v
    out.backward(grad.double())
    return out.detach(), torch.logsumexp(s, -1).detach(), q.grad, k.grad, v.grad


def close(got, want):
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=8e-3 * want.abs().max().item() + 1e-5)


def check_against_float64(p: AttentionParams, B, H, L, S, D, scale):
    q, k, v, grad = inputs(B, H, L, S, D, seed=L + S + D)
    with A.forced_params(p):
        out, lse = A.forward_kernel(q, k, v, scale)
        dq, dk, dv = A.backward_kernel(grad, q, k, v, out, lse, scale)
    ro, rl, rq, rk, rv = reference(q, k, v, grad, A._scale(scale, D))
    assert lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), rl, rtol=1e-5, atol=1e-5 * math.sqrt(D))
    for got, want in ((out, ro), (dq, rq), (dk, rk), (dv, rv)):
        close(got, want)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("L,S,D,scale", SHAPES)
def test_forward_and_backward_match_float64(isa, L, S, D, scale):
    check_against_float64(params(isa), 2, 3, L, S, D, scale)


@pytest.mark.skipif(not DOT, reason="the AMX kernel's vector code needs AVX512_BF16")
@pytest.mark.parametrize("L,S,D,scale", [(37, 53, 72, -0.3), (1, 5, 7, None), (70, 33, 16, None)])
def test_amx_with_emulated_tiles_matches_float64(L, S, D, scale):
    """The AMX kernel with its tile instructions run in C (gemm/amx_emulated.h.j2, which
    records what a CPU would fault on): ragged keys, queries and head dims, blocks of keys
    and queries past one tile (block_q 32, block_k 32: the online softmax over several
    blocks)."""
    with tile_emulation():
        check_against_float64(params("amx"), 1, 2, L, S, D, scale)
        check_against_float64(dataclasses.replace(params("amx"), block_q=32, qv=2, block_k=32), 1, 1, 70, 75, 40, None)


def test_odd_strides_and_unaligned_rows():
    """An odd row stride (the pairs of a row straddle 32-bit words) takes the scalar pairing."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(3, 1, 2, 40, 19, generator=g).bfloat16()
    q, k, v = base[..., 1:].unbind(0)           # D 18, row stride 19, rows start unaligned
    grad = torch.randn(1, 2, 40, 18, generator=g).bfloat16()
    out, lse = A.forward_kernel(q, k, v, None)
    dq, dk, dv = A.backward_kernel(grad, q, k, v, out, lse, None)
    ro, _, rq, rk, rv = reference(q, k, v, grad, A._scale(None, 18))
    for got, want in ((out, ro), (dq, rq), (dk, rk), (dv, rv)):
        close(got, want)


def test_every_thread_count_gives_the_same_bits():
    q, k, v, grad = inputs(3, 5, 100, 100, 72, seed=4)
    results = []
    try:
        for n in (1, 2):
            set_kernel_threads(n)
            o = A.forward_kernel(q, k, v, None)
            results.append((*o, *A.backward_kernel(grad, q, k, v, *o, None)))
    finally:
        set_kernel_threads(None)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_opcheck_bf16_custom_ops():
    q, k, v, _ = inputs(2, 2, 9, 9, 8, seed=2)
    q, k, v = (t.contiguous().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.autohc.attention.default, (q, k, v, None))
    out, lse = torch.ops.autohc.attention(q, k, v, 0.25)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.library.opcheck(torch.ops.autohc.attention_backward.default,      # no double backward
                          (torch.randn_like(out), q, k, v, out, lse, 0.25),
                          test_utils=("test_schema", "test_faketensor"))


def test_sdpa_under_autocast_is_served_forward_and_backward():
    """The reference DiT's attention under torch.autocast: bf16 q, k, v from bf16 Linears reach
    the flash op; install() serves it and its backward, with stock autocast's results."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 40, 96, generator=g)
    lin = torch.nn.Linear(96, 3 * 96)

    def step():
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            q, k, v = lin(xi).reshape(2, 40, 3, 4, 24).permute(2, 0, 3, 1, 4).unbind(0)
            out = F.scaled_dot_product_attention(q, k, v)
        assert out.dtype == torch.bfloat16
        out.float().square().sum().backward()
        return out.float(), xi.grad

    stock = step()
    before = A.stats["autohc"]
    with autohc.installed():
        got = step()
    assert A.stats["autohc"] - before == 2
    for a, b in zip(got, stock):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


def test_mixed_dtypes_go_to_aten():
    q, k, v, _ = inputs(1, 2, 8, 8, 16, seed=5)
    assert A.served(q, k, v) and not A.served(q, k.float(), v)
    assert not A._backward_served(q, q, k, v, q, torch.zeros(1, 2, 8, dtype=torch.bfloat16))


def test_params_are_validated():
    with pytest.raises(ParamError, match="dtype"):
        AttentionParams(isa="avx512", vl=16, dtype="fp16").validate()
    with pytest.raises(ParamError, match="isa"):        # the dot tiles are bf16 only
        AttentionParams(isa="avx512bf16", vl=16).validate()
    with pytest.raises(ParamError, match="even"):
        AttentionParams(isa="avx512bf16", vl=16, dtype="bf16", block_k=255).validate()
    with pytest.raises(ParamError, match="multiples of 32"):
        AttentionParams(isa="amx", vl=16, dtype="bf16", block_q=48, qv=1).validate()
    assert params("amx").amx and params("amx").dot and not params("avx512bf16").amx
    p = params("avx512bf16")
    assert p.dot and p.symbol().endswith("_bf16") and p.symbol() != default_attention("avx512").symbol()
    assert not params("avx512").dot


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
@pytest.mark.parametrize("isa", ["amx", "amx-emulated", "avx512bf16", "avx512", "avx2", "fp32"])
def test_bf16_attention_compiles_standalone(isa, tmp_path):
    """Every warning an error; the AMX and dot-product back-ends build on CPUs that cannot run
    them (and the fp32 source, which shares the template)."""
    p = default_attention("avx512") if isa == "fp32" else params(isa.split("-")[0])
    src = render_attention(p, emulate_tiles=isa == "amx-emulated")
    assert ("_mm512_dpbf16_ps" in src) == (isa in ("avx512bf16", "amx", "amx-emulated"))  # (amx: unused)
    assert ("_tile_dpbf16ps(" in src) == isa.startswith("amx")
    c = tmp_path / f"{isa}.c"
    c.write_text(src)
    cmd = ["gcc", "-O3", "-std=gnu11", "-fno-strict-aliasing", "-Wall", "-Wextra", "-Werror", "-fPIC",
           "-shared", *p.cflags, str(c), "-o", str(tmp_path / f"{isa}.so"), "-lm"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
