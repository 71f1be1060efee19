"""`autohc tune --op`: element-wise kernels tuned from search_spaces/eltwise.yaml, gated on
correctness, recorded in the registry and used by autohc.ops."""
import json
import math

import pytest
import torch

from autohc.hw import cpu
from autohc.torch import ops
from autohc.tune import registry
from autohc.cli import main
from autohc.tune import ops as op_tuner


@pytest.fixture
def reg(tmp_path, monkeypatch):
    path = tmp_path / "registry.json"
    monkeypatch.setenv("AUTOHC_REGISTRY", str(path))
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield path
    torch.set_num_threads(old)


def test_grid_comes_from_the_yaml():
    isa = cpu.best_isa()
    g = op_tuner.grid(isa, 4)
    assert {"vl", "unroll", "threads"} <= set(g) and 1 in g["unroll"] and len(g["vl"]) >= 2
    assert g["threads"] == [0, 1, 2]                     # all (0), or a part of the 4
    assert op_tuner.grid(isa, 1)["threads"] == [0]
    if isa in ("avx2", "avx512"):
        assert g["stream_stores"] == [False, True]


def test_tune_op_records_and_ops_use_it(reg):
    assert ops.params_for("silu_fwd") == ops.default_eltwise()
    r = op_tuner.tune_op("silu", 1, images=1, repeats=1)
    assert r["trials"] == math.prod(len(v) for v in op_tuner.grid(cpu.best_isa(), 1).values())
    entry = registry.lookup_op("eltwise", "silu_fwd", 1)
    assert entry["params"] == r["params"] and entry["ms"] > 0 and entry["torch_ms"] > 0
    assert ops.params_for("silu_fwd") == ops.EltwiseParams(**r["params"])
    x = torch.randn(300, 1000)
    torch.testing.assert_close(ops.silu(x), torch.nn.functional.silu(x), rtol=1e-5, atol=5e-6)
    assert registry.entries_for_this_cpu("gemm") == {}         # export/report see no GEMM here


def test_a_wrong_kernel_never_wins(reg, monkeypatch):
    def wrong(got, reference, what, agree=None):
        raise op_tuner.WrongResult(what)
    monkeypatch.setattr(op_tuner, "check_same", wrong)
    with pytest.raises(RuntimeError, match="no candidate passed the correctness check"):
        op_tuner.tune_op("gelu_tanh", 1, images=1, repeats=1)
    assert registry.lookup_op("eltwise", "gelu_tanh_fwd", 1) is None


def test_invalid_registry_entry_falls_back_to_default(reg):
    registry.record_op("eltwise", "gelu_tanh_fwd", 1, {"isa": cpu.best_isa(), "vl": 5, "unroll": 2}, 1.0, 1.0)
    assert ops.params_for("gelu_tanh_fwd") == ops.default_eltwise()


def test_cli_tune_op(reg, capsys):
    assert main(["tune", "--op", "gated_residual", "--images", "1", "--threads", "1", "--dtype", "fp32", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["op"] == "gated_residual" and r["kernel"] == "gated_residual" and r["threads"] == 1
    assert main(["tune", "--op", "adamw", "--images", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("adamw: ") and " vl " in out and "-> registry" in out
    with pytest.raises(SystemExit) as e:
        main(["tune", "--op", "nope"])
    assert e.value.code == 2 and "unknown op nope" in capsys.readouterr().err


def test_tune_adamw_checks_each_candidate_from_the_same_state(reg):
    r = op_tuner.tune_op("adamw", 1, images=1, repeats=1)
    grid = op_tuner.grid(cpu.best_isa(), 1, "adamw")
    assert "stream_stores" not in grid and "unroll" not in grid and r["trials"] == math.prod(len(v) for v in grid.values())
    assert ops.params_for("adamw") == ops.EltwiseParams(**r["params"])
    from autohc.optim import AdamW                          # the tuned kernel steps as torch's
    p = torch.nn.Parameter(torch.randn(1000))
    q = torch.nn.Parameter(p.detach().clone())
    p.grad = q.grad = torch.randn(1000)
    AdamW([p]).step()
    torch.optim.AdamW([q]).step()
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=3e-7)


def test_tune_attention_records_and_sdpa_uses_it(reg):
    """`tune --op attention`: blocks and micro-tiles from search_spaces/attention.yaml, each
    candidate checked against torch's flash attention, the winner used by the next call."""
    from autohc.kernels.attention import AttentionParams, default_attention
    from autohc.torch import attention
    g = op_tuner.grid(cpu.best_isa(), 1, space="attention")
    assert {"block_q", "block_k", "mr", "dc", "qv", "fk", "fd"} <= set(g) and g["threads"] == [0]
    assert attention.params_for() == default_attention()
    r = op_tuner.tune_op("attention", 1, images=1, repeats=1, timeout=8)
    assert r["trials"] >= 1 and r["ms"] > 0 and r["torch_ms"] > 0
    entry = registry.lookup_op("attention", "attention", 1)
    assert entry["params"] == r["params"]
    assert attention.params_for() == AttentionParams(**r["params"])
    q, k, v = torch.randn(3, 2, 3, 40, 72).unbind(0)
    want = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[0]
    torch.testing.assert_close(attention.forward_kernel(q, k, v, None)[0], want, rtol=1e-4, atol=1e-5)


def test_a_wrong_attention_kernel_never_wins(reg, monkeypatch):
    def wrong(got, reference, what, agree=None):
        raise op_tuner.WrongResult(what)
    monkeypatch.setattr(op_tuner, "check_same", wrong)
    with pytest.raises(RuntimeError, match="no candidate passed the correctness check"):
        op_tuner.tune_op("attention", 1, images=1, repeats=1, timeout=5)
    assert registry.lookup_op("attention", "attention", 1) is None


def test_tune_bf16_forms_record_their_own_entries(reg, capsys):
    """--dtype bf16: the bf16 form of an op (and of attention) is tuned against torch under
    autocast, recorded as its own kernel, and picked up by the bf16 calls only."""
    from autohc.torch import attention
    r = op_tuner.tune_op("gelu_tanh", 1, images=1, repeats=1, dtype="bf16")
    assert r["kernel"] == "gelu_tanh_fwd_bf16"
    assert ops.params_for("gelu_tanh_fwd_bf16") == ops.EltwiseParams(**r["params"])
    assert registry.lookup_op("eltwise", "gelu_tanh_fwd", 1) is None          # fp32 untouched
    x = torch.randn(300, 1000).to(torch.bfloat16)
    torch.testing.assert_close(ops.gelu_tanh(x).float(), torch.nn.functional.gelu(x, approximate="tanh").float(),
                               rtol=1e-2, atol=1e-2)
    before = attention.params_for(torch.bfloat16)
    r = op_tuner.tune_op("attention", 1, images=1, repeats=1, timeout=5, dtype="bf16")
    assert r["kernel"] == "attention_bf16" and registry.lookup_op("attention", "attention", 1) is None
    p = attention.params_for(torch.bfloat16)
    assert p.dtype == "bf16" and p.isa == before.isa
    assert {k: getattr(p, k) for k in r["params"] if k != "isa"} == {k: v for k, v in r["params"].items() if k != "isa"}
    with pytest.raises(SystemExit) as e:
        main(["tune", "--op", "adamw", "--dtype", "bf16"])
    assert e.value.code == 2 and "unknown op adamw" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no bf16 form"):
        op_tuner.tune_op("softmax", 1, dtype="bf16")


def test_bf16_attention_space_prunes_combinations_it_cannot_build(reg, monkeypatch):
    """A grid point the bf16 attention cannot take (block_q not a multiple of qv*vl) is pruned
    like the fp32 ones, never an error out of the study (it was, once a trial reached it)."""
    from autohc.kernels.attention import default_attention
    d = default_attention(cpu.best_isa())
    space = {k: [getattr(d, k)] for k in op_tuner.grid(cpu.best_isa(), 1, space="attention")}
    space["block_q"] = [d.qv * d.vl // 2, d.qv * d.vl]          # the first one is invalid
    monkeypatch.setattr(op_tuner, "grid", lambda *a, **k: dict(space))
    r = op_tuner.tune_op("attention", 1, images=1, repeats=1, timeout=60, dtype="bf16")
    # one trial ran (the valid point); the final race keeps it or the bf16 default, never the pruned one
    assert r["kernel"] == "attention_bf16" and r["trials"] == 1
    assert r["params"]["block_q"] in (d.qv * d.vl, op_tuner._Target("attention", cpu.best_isa(), 1, True).default.block_q)
    assert r["params"]["block_q"] != d.qv * d.vl // 2


@pytest.mark.skipif(cpu.best_isa() != "avx512", reason="the amx kernel's vectors are AVX-512's")
def test_amx_attention_searches_only_what_its_tiles_read(monkeypatch):
    """On the amx back-end the products are tiles: the vector micro-tiles' knobs are held at
    the default's values, so a time-limited grid never spends trials on copies of one kernel."""
    from autohc.torch import attention
    monkeypatch.setattr(attention, "bf16_isa", lambda: ("amx", "test"))
    target = op_tuner._Target("attention", cpu.best_isa(), 2, bf16=True)
    assert target.default.amx
    assert len(target.space["block_q"]) > 1 and len(target.space["block_k"]) > 1
    for k, values in target.space.items():
        if k not in op_tuner.AMX_ATTENTION_KNOBS:
            assert values == [getattr(target.default, k)], k


def test_cli_tune_op_auto_tunes_what_training_runs_here(reg, capsys):
    """--dtype auto (the default): the bf16 form of an op that has one where `autohc train
    --precision auto` runs bf16, else fp32; an op without a bf16 form (AdamW) in fp32 either way
    (with --dtype bf16 it is an unknown op). The first line says which and why."""
    from autohc.dit.precision import resolve
    here, why = resolve("auto")
    assert main(["tune", "--op", "gated_residual", "adamw", "--images", "1", "--threads", "1", "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines()[0] == f"autohc tune: {here} ({why}; --dtype fp32 or bf16 to choose)"
    gres, adamw = (json.loads(line) for line in captured.out.splitlines())
    assert gres["kernel"] == ("gated_residual_bf16" if here == "bf16" else "gated_residual")
    assert adamw["kernel"] == "adamw"


def test_cli_tune_gemm_auto_takes_the_training_precision(reg, capsys, monkeypatch):
    """--dtype auto on a GEMM: the precision resolve("auto") gives (here made fp32, so that the
    suite compiles one small fp32 kernel on every CPU), said on the first line."""
    from autohc.dit import precision
    monkeypatch.setattr(precision, "resolve", lambda p, info=None: ("fp32", "auto: a test's CPU"))
    assert main(["tune", "--shape", "16x16", "--m", "16", "--layout", "NT", "--trials", "1",
                 "--threads", "1", "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines()[0] == "autohc tune: fp32 (auto: a test's CPU; --dtype fp32 or bf16 to choose)"
    params = json.loads(captured.out.splitlines()[-1])["params"]
    assert params.get("dtype", "fp32") == "fp32" and params["isa"] == cpu.best_isa()   # (bf16: amx, avx512bf16)
