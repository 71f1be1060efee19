"""`autohc bench ops`: each generated operator on DiT-XL/2-sized tensors (8 images: 2048 x 1152
tokens x hidden, 2048 x 4608 MLP activations, 8 x 16 x 256 x 256 attention scores) against
torch eager; fused attention forward and backward at DiT-XL/2 (16 heads of 72) and DiT-S/2
(6 heads of 64) shapes against torch's CPU flash attention (what
F.scaled_dot_product_attention runs), with GFLOP/s; and autohc.optim.AdamW against
torch.optim.AdamW (fused=True and foreach=True) over the 675M parameters of DiT-XL/2. dtype
bf16: the operators and attention with the dtypes torch.autocast gives them, on both sides.

The autohc and torch versions of an op are timed by the one protocol (bench/timing.py:
interleaved, warmed up, samples of 20 ms and more, medians with their spread), each call
producing a fresh output as in training. Effective GB/s counts the bytes an op
must move at least (inputs read once, outputs written once); % of bandwidth relates it to a
copy (read + write) measured in the same run with the same threads.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..torch import ops
from . import timing

XL_PARAMS = 675_129_632


@dataclass
class OpRow:
    name: str
    shape: str
    ms: float
    torch_ms: float
    speedup: float
    gbps: float
    pct_bandwidth: float
    torch_gbps: float
    baseline: str           # what torch_ms measured
    spread_pct: float = 0.0  # autohc's spread (IQR / median, %)
    gflops: float | None = None         # compute-bound ops (attention): autohc's GFLOP/s
    torch_gflops: float | None = None


def copy_bandwidth_gbps(mbytes: int = 512) -> float:
    """Best of 5 copies of `mbytes` with torch at the current thread count (read + write)."""
    src = torch.ones(mbytes << 18)
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * src.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def _modulate_ref(x, scale, shift):
    return F.layer_norm(x, x.shape[-1:], eps=1e-6) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def grad_fn(fn, *inputs):
    """A callable running only the backward of fn(*inputs) (graph built once, retained)."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    y = fn(*leaves)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))   # same for both sides
    return lambda: torch.autograd.grad(y, leaves, g, retain_graph=True)


def _activation_cases(big, dbig, shape: str):
    """GELU (tanh) and SiLU, forward and backward, on activations `big` (upstream gradient
    `dbig`) of either dtype: the bytes follow its element size."""
    n = big.numel() * big.element_size()
    return [
        ("gelu_tanh", shape, 2 * n, lambda: ops.gelu_tanh(big), lambda: F.gelu(big, approximate="tanh")),
        ("gelu_tanh_backward", shape, 3 * n, lambda: ops.gelu_tanh_backward(dbig, big),
         lambda: torch.ops.aten.gelu_backward(dbig, big, approximate="tanh")),
        ("silu", shape, 2 * n, lambda: ops.silu(big), lambda: F.silu(big)),
        ("silu_backward", shape, 3 * n, lambda: ops.silu_backward(dbig, big),
         lambda: torch.ops.aten.silu_backward(dbig, big)),
    ]


def op_cases(images: int = 8):
    """(name, shape, bytes moved, autohc callable, torch callable) per operator."""
    T, D, H, heads = 256, 1152, 4608, 16
    M = images * T
    g = torch.Generator().manual_seed(0)
    big = torch.randn(M, H, generator=g)
    dbig = torch.randn(M, H, generator=g)
    x = torch.randn(images, T, D, generator=g)
    y = torch.randn(images, T, D, generator=g)
    scale, shift, gate = (torch.randn(images, D, generator=g) * 0.1 for _ in range(3))
    att = torch.randn(images, heads, T, T, generator=g)
    p_att = torch.softmax(att, -1)
    datt = torch.randn_like(att)
    n_x, n_att = x.numel() * 4, att.numel() * 4
    shp_big, shp_x = f"{M}x{H}", f"{images}x{T}x{D}"
    shp_att = f"{images}x{heads}x{T}x{T}"
    return _activation_cases(big, dbig, shp_big) + [
        ("layernorm_modulate", shp_x, 2 * n_x, lambda: ops.layernorm_modulate(x, scale, shift),
         lambda: _modulate_ref(x, scale, shift)),
        ("layernorm_modulate_backward", shp_x, 3 * n_x,
         grad_fn(ops.layernorm_modulate, x, scale, shift), grad_fn(_modulate_ref, x, scale, shift)),
        ("softmax", shp_att, 2 * n_att, lambda: ops.softmax(att), lambda: torch.softmax(att, -1)),
        ("softmax_backward", shp_att, 3 * n_att, lambda: ops.softmax_backward(datt, p_att),
         lambda: torch._softmax_backward_data(datt, p_att, -1, torch.float32)),
        ("gated_residual", shp_x, 3 * n_x, lambda: ops.gated_residual(x, y, gate),
         lambda: x + gate.unsqueeze(1) * y),
    ]


def _autocast(fn):
    """fn run under torch.autocast to bf16 (the fused ops' bf16 forms, and torch's, as a
    DiT under autocast runs them)."""
    def run(*a):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn(*a)
    return run


def _modulate_ref_bf16(x, scale, shift):
    """torch under autocast: LayerNorm in fp32, modulated by bf16 scale / shift, rounded to the
    bf16 input of the next GEMM (the Linear's autocast cast)."""
    return _modulate_ref(x, scale, shift).to(torch.bfloat16)


def bf16_op_cases(images: int = 8):
    """op_cases as torch.autocast runs them in DiT-XL/2: GELU / SiLU on bf16 tensors, LayerNorm
    + modulate of the fp32 stream with bf16 scale / shift to the bf16 GEMM input, the gated
    residual adding a bf16 GEMM output to the fp32 stream; forward and backward."""
    T, D, H = 256, 1152, 4608
    M = images * T
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    big, dbig = (torch.randn(M, H, generator=g).to(bf) for _ in range(2))
    x = torch.randn(images, T, D, generator=g)
    y = torch.randn(images, T, D, generator=g).to(bf)
    scale, shift, gate = ((torch.randn(images, D, generator=g) * 0.1).to(bf) for _ in range(3))
    n_x = x.numel()
    shp_big, shp_x = f"{M}x{H}", f"{images}x{T}x{D}"
    ln, ln_ref = _autocast(ops.layernorm_modulate), _autocast(_modulate_ref_bf16)
    return _activation_cases(big, dbig, shp_big) + [
        # x fp32 in, y bf16 out; backward: dy bf16 and x in, dx fp32 out
        ("layernorm_modulate", shp_x, 6 * n_x, lambda: ln(x, scale, shift), lambda: ln_ref(x, scale, shift)),
        ("layernorm_modulate_backward", shp_x, 10 * n_x, grad_fn(ln, x, scale, shift),
         grad_fn(ln_ref, x, scale, shift)),
        # x fp32 + gate * y (bf16) -> fp32; backward: g fp32 in, dy bf16 out (dx is g)
        ("gated_residual", shp_x, 10 * n_x, lambda: ops.gated_residual(x, y, gate),
         lambda: x + gate.unsqueeze(1) * y),
        ("gated_residual_backward", shp_x, 8 * n_x, grad_fn(ops.gated_residual, x, y, gate),
         grad_fn(lambda a, b, c: a + c.unsqueeze(1) * b, x, y, gate)),
    ]


ATTENTION_SHAPES = {"": (16, 72), "_s2": (6, 64)}     # DiT-XL/2, DiT-S/2: heads, head dim


def attention_cases(images: int = 8, dtype: torch.dtype = torch.float32):
    """(name, shape, bytes, flops, autohc callable, torch callable): forward and backward of
    attention over q, k, v viewed in one qkv tensor as DiT makes them, against torch's CPU
    flash-attention op and its backward, both in `dtype`."""
    from ..torch import attention
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    T = 256
    out = []
    for suffix, (heads, hd) in ATTENTION_SHAPES.items():
        g = torch.Generator().manual_seed(2)
        qkv = torch.randn(images, T, 3, heads, hd, generator=g).to(dtype).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        grad = torch.randn(images, heads, T, hd, generator=g).to(dtype)
        o, lse = attention.forward_kernel(q, k, v, None)
        o_t, lse_t = flash(q, k, v)
        n = q.numel() * q.element_size()
        fwd_flops = 4 * images * heads * T * T * hd
        shape = f"{images}x{heads}x{T}x{hd}"
        out.append((f"attention{suffix}", shape, 4 * n, fwd_flops,
                    lambda q=q, k=k, v=v: attention.forward_kernel(q, k, v, None),
                    lambda q=q, k=k, v=v: flash(q, k, v)))
        out.append((f"attention_backward{suffix}", shape, 8 * n, 5 * fwd_flops // 2,
                    lambda a=(grad, q, k, v, o, lse): attention.backward_kernel(*a, None),
                    lambda a=(grad, q, k, v, o_t, lse_t): flash_backward(*a, 0.0, False)))
    return out


def adamw_params(n: int) -> list[torch.Tensor]:
    """DiT-XL/2's parameter tensors for n = its count, else tensors of up to 1152 x 4608."""
    if n == XL_PARAMS:
        from ..dit import DiT
        with torch.device("meta"):
            shapes = [p.shape for p in DiT.from_name("DiT-XL/2").parameters()]
    else:
        chunk = 1152 * 4608
        shapes = [(chunk,)] * (n // chunk) + ([(n % chunk,)] if n % chunk else [])
    params = []
    for s in shapes:
        p = torch.empty(s).uniform_(-0.05, 0.05)
        p.grad = torch.empty(s).uniform_(-1e-3, 1e-3)
        params.append(p)
    return params


def bench_adamw(n: int = XL_PARAMS, repeats: int = 3, progress=None) -> tuple[OpRow, dict]:
    """autohc AdamW vs torch fused / foreach on n parameters, one optimizer at a time (the
    three states would not fit together at 675M); 28 bytes per parameter moved."""
    from ..torch.optim import AdamW
    say = progress or (lambda m: None)
    params = adamw_params(n)
    makers = {"autohc": lambda: AdamW(params, lr=1e-4, weight_decay=0.0),
              "torch_fused": lambda: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=True),
              "torch_foreach": lambda: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, foreach=True)}
    times = {name: [] for name in makers}
    # one at a time (three states would not fit together), in two rounds of opposite order:
    # whichever runs first right after the parameters were made measured up to 1.4x slower
    # (Zen 5, 675M), so that neither side gets that slot alone
    for order in (list(makers), list(makers)[::-1]):
        for name in order:
            opt = makers[name]()
            opt.step()                  # allocates and first-touches the state
            t = timing.interleaved({name: opt.step}, samples=repeats, warmup=0, min_sample_s=0.0)
            times[name] += t[name].samples
            del opt
    ms = {}
    for name, ts in times.items():
        s = timing.summarize(ts)
        ms[name] = 1e3 * s.median
        say(f"  adamw {name}: {ms[name]:.1f} ms (spread {s.spread_pct:.0f}%)")
    best = min(("torch_fused", "torch_foreach"), key=ms.get)
    nbytes = 28 * n
    row = OpRow("adamw", f"{n / 1e6:.1f}M params", ms["autohc"], ms[best], ms[best] / ms["autohc"],
                nbytes / ms["autohc"] / 1e6, 0.0, nbytes / ms[best] / 1e6, best)
    return row, ms


EMA_DECAY = 0.9999


def bench_adamw_ema(n: int = XL_PARAMS, repeats: int = 3, progress=None) -> tuple[OpRow, dict]:
    """A trainer's optimizer step with its EMA update: autohc's AdamW with the EMA in its pass
    (step(ema_decay=d)) vs torch's fused AdamW followed by the EMA as one foreach lerp (the
    fastest torch form of the reference's per-parameter mul_/add_); 36 bytes per parameter
    moved (AdamW's 28, the EMA's read and write)."""
    from ..torch.optim import AdamW
    say = progress or (lambda m: None)
    params = adamw_params(n)
    emas = [p.detach().clone() for p in params]

    def mine():
        opt = AdamW(params, lr=1e-4, weight_decay=0.0)
        opt.attach_ema(zip(params, emas))
        return lambda: opt.step(ema_decay=EMA_DECAY)

    def torch_fused():
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=True)

        def step():
            opt.step()
            torch._foreach_lerp_(emas, params, 1 - EMA_DECAY)
        return step
    makers = {"autohc": mine, "torch_fused": torch_fused}
    times = {name: [] for name in makers}
    for order in (list(makers), list(makers)[::-1]):       # as bench_adamw: both orders
        for name in order:
            step = makers[name]()
            step()
            t = timing.interleaved({name: step}, samples=repeats, warmup=0, min_sample_s=0.0)
            times[name] += t[name].samples
            del step
    ms = {name: 1e3 * timing.summarize(ts).median for name, ts in times.items()}
    for name, v in ms.items():
        say(f"  adamw+ema {name}: {v:.1f} ms")
    nbytes = 36 * n
    row = OpRow("adamw+ema", f"{n / 1e6:.1f}M params", ms["autohc"], ms["torch_fused"],
                ms["torch_fused"] / ms["autohc"], nbytes / ms["autohc"] / 1e6, 0.0,
                nbytes / ms["torch_fused"] / 1e6, "torch fused AdamW + foreach lerp EMA")
    return row, ms


def bench_ops(images: int = 8, repeats: int = 9, adamw_params: int = XL_PARAMS,
              names: list[str] | None = None, progress=None, dtype: str = "fp32") -> dict:
    """dtype bf16: the fused operators and attention as torch.autocast runs them (bf16_op_cases;
    AdamW keeps fp32 master weights, so no bf16 row)."""
    say = progress or (lambda m: None)
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype {dtype!r}: fp32 or bf16")
    bf16 = dtype == "bf16"
    cases = [(*c[:3], None, *c[3:]) for c in (bf16_op_cases if bf16 else op_cases)(images)] \
        + attention_cases(images, torch.bfloat16 if bf16 else torch.float32)
    if bf16:
        adamw_params = 0
    unknown = set(names or ()) - {c[0] for c in cases} - {"adamw", "adamw+ema"}
    if unknown:
        raise ValueError(f"unknown op {sorted(unknown)}; one of {', '.join(c[0] for c in cases)}, "
                         "adamw, adamw+ema")
    bw = copy_bandwidth_gbps()
    say(f"copy bandwidth at {torch.get_num_threads()} threads: {bw:.1f} GB/s")
    rows = []
    for name, shape, nbytes, flops, mine, theirs in cases:
        if names and name not in names:
            continue
        tt = timing.interleaved({"autohc": mine, "torch": theirs}, samples=repeats)
        t = {k: v.median for k, v in tt.items()}
        gbps = nbytes / t["autohc"] / 1e9
        rows.append(OpRow(name, shape, 1e3 * t["autohc"], 1e3 * t["torch"], t["torch"] / t["autohc"],
                          gbps, 100 * gbps / bw, nbytes / t["torch"] / 1e9,
                          ("torch flash attention" if flops else "torch eager") + (" (bf16)" if bf16 else ""),
                          tt["autohc"].spread_pct,
                          flops / t["autohc"] / 1e9 if flops else None,
                          flops / t["torch"] / 1e9 if flops else None))
        rate = f" ({rows[-1].gflops:.0f} vs {rows[-1].torch_gflops:.0f} GFLOP/s)" if flops else ""
        say(f"  {name}: {rows[-1].ms:.2f} ms vs torch {rows[-1].torch_ms:.2f} ms{rate}")
    adamw = None
    if adamw_params and (not names or "adamw" in names):
        row, adamw = bench_adamw(adamw_params, progress=say)
        row.pct_bandwidth = 100 * row.gbps / bw
        rows.append(row)
    if adamw_params and (not names or "adamw+ema" in names):
        row, adamw_ema = bench_adamw_ema(adamw_params, progress=say)
        row.pct_bandwidth = 100 * row.gbps / bw
        rows.append(row)
        adamw = {**(adamw or {}), **{f"{k}+ema": v for k, v in adamw_ema.items()}}
    return {"threads": torch.get_num_threads(), "images": images, "bandwidth_gbps": bw, "dtype": dtype,
            "rows": [asdict(r) for r in rows], "adamw_ms": adamw}
