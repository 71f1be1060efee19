"""`autohc bench ops`: compares like with like, and its JSON has the documented rows."""
import json

import torch

from autohc.bench.ops import attention_cases, bf16_op_cases, op_cases
from autohc.cli import main


def test_each_case_computes_what_its_torch_baseline_computes():
    for name, shape, nbytes, mine, theirs in op_cases(images=1):
        a, b = mine(), theirs()
        a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
        assert len(a) == len(b), name
        for u, v in zip(a, b):
            torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-5, msg=name)
        assert nbytes > 0 and "x" in shape


def test_bf16_cases_compute_what_torch_under_autocast_computes():
    """Same dtypes as torch's autocast results; values within bf16's rounding (the fused forms
    keep products in fp32 that autocast rounds to bf16 first)."""
    cases = bf16_op_cases(images=1)
    assert len({c[0] for c in cases}) == len(cases) == 8
    for name, shape, nbytes, mine, theirs in cases:
        a, b = mine(), theirs()
        a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
        assert len(a) == len(b), name
        for u, v in zip(a, b):
            assert u.dtype == v.dtype, name
            big = max(1.0, v.float().abs().max().item())     # sums over 256 tokens: to their size
            torch.testing.assert_close(u.float(), v.float(), rtol=2e-2, atol=2e-2 * big, msg=name)
        assert nbytes > 0


def test_attention_cases_compute_what_torch_flash_attention_computes():
    cases = attention_cases(images=1)
    assert [c[0] for c in cases] == ["attention", "attention_backward", "attention_s2", "attention_backward_s2"]
    for name, shape, nbytes, flops, mine, theirs in cases:
        a, b = mine(), theirs()
        for u, v in zip(a, b):
            torch.testing.assert_close(u, v.reshape(u.shape), rtol=1e-4, atol=1e-5, msg=name)
        assert flops > 0 and nbytes > 0


def test_bench_ops_json(capsys):
    assert main(["bench", "ops", "--images", "1", "--repeats", "1", "--adamw-params", "100000",
                 "--ops", "gelu_tanh", "layernorm_modulate_backward", "attention_s2",
                 "attention_backward_s2", "adamw", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert [w["name"] for w in r["rows"]] == ["gelu_tanh", "layernorm_modulate_backward", "attention_s2",
                                              "attention_backward_s2", "adamw"]
    assert all(w["gflops"] > 0 for w in r["rows"] if w["name"].startswith("attention"))
    for w in r["rows"]:
        assert {"name", "ms", "torch_ms", "speedup", "gbps"} <= w.keys()
        assert w["ms"] > 0 and w["torch_ms"] > 0 and abs(w["speedup"] - w["torch_ms"] / w["ms"]) < 1e-9
    assert set(r["adamw_ms"]) == {"autohc", "torch_fused", "torch_foreach"}


def test_bench_ops_unknown_name_is_one_line(capsys):
    assert main(["bench", "ops", "--ops", "nope", "--adamw-params", "0"]) == 1
    assert "unknown op ['nope']" in capsys.readouterr().err


def test_bench_ops_bf16_times_attention_against_torchs_bf16(capsys):
    """--dtype bf16: the attention rows with bf16 q, k, v on both sides (what each computes
    agrees within bf16's rounding), the fused ops' bf16 rows, no AdamW row."""
    import torch
    for name, shape, nbytes, flops, mine, theirs in attention_cases(images=1, dtype=torch.bfloat16)[2:]:
        for u, v in zip(mine(), theirs()):
            assert u.dtype == v.dtype
            torch.testing.assert_close(u.float(), v.float().reshape(u.shape), rtol=2e-2, atol=2e-2, msg=name)
    assert main(["bench", "ops", "--dtype", "bf16", "--images", "1", "--repeats", "1",
                 "--ops", "gated_residual", "attention_s2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["dtype"] == "bf16" and [w["name"] for w in r["rows"]] == ["gated_residual", "attention_s2"]
    assert [w["baseline"] for w in r["rows"]] == ["torch eager (bf16)", "torch flash attention (bf16)"]
    assert r["adamw_ms"] is None
