"""Training precision (autohc/dit/precision.py, `autohc train --precision`): which precision
runs and why, bf16 mixed precision with fp32 master weights, resume bit-identical."""
import json
import os
import subprocess
import sys

import pytest
import torch

import autohc
from autohc.dit import checkpoint, precision
from autohc.dit.train import TrainConfig, Trainer
from autohc.hw import cpu


def _cfg(out, steps, **kw):
    args = dict(model="DiT-Ti/8", data="digits", steps=steps, batch=16, out=str(out), lr=1e-3,
                ckpt_every=3, keep=2, precision="bf16")
    args.update(kw)
    return TrainConfig(**args)


def test_auto_picks_bf16_only_on_bf16_hardware(monkeypatch):
    monkeypatch.setattr(cpu, "bf16_isa", lambda info=None: ("avx2", "no AVX512_BF16 or AMX on this CPU: widened"))
    p, why = precision.resolve("auto")
    assert p == "fp32" and "no AVX512_BF16 or AMX" in why
    p, why = precision.resolve("bf16")           # still runs, and says it is emulated
    assert p == "bf16" and "though no AVX512_BF16" in why
    monkeypatch.setattr(cpu, "bf16_isa", lambda info=None: ("avx512bf16", "AVX512_BF16 dot products"))
    assert precision.resolve("auto") == ("bf16", "auto: AVX512_BF16 dot products")
    monkeypatch.setattr(cpu, "bf16_isa", lambda info=None: ("amx", "AMX-BF16 tiles"))
    assert precision.resolve("auto")[0] == "bf16"
    assert precision.resolve("fp32")[0] == "fp32"
    with pytest.raises(ValueError, match="--precision 'fp16': expected one of fp32, bf16, auto"):
        precision.resolve("fp16")


def test_bf16_trains_with_fp32_master_weights_and_resumes_bit_identically(tmp_path):
    """The forward in bf16 (the GEMMs see bf16), weights, gradients, AdamW moments and EMA in
    fp32; 6 steps in one go = 3 + --resume 3, exactly; and the losses are not fp32's."""
    seen = []

    def spy(mod, inputs, output):
        seen.append(output.dtype)
    with autohc.installed():
        full = Trainer(_cfg(tmp_path / "full", 6))
        hook = next(m for m in full.model.modules() if isinstance(m, torch.nn.Linear)).register_forward_hook(spy)
        full.run(progress=False)
        hook.remove()
        part = Trainer(_cfg(tmp_path / "part", 3))
        part.run(progress=False)
        more = Trainer(_cfg(tmp_path / "part", 6, extra={"resume": True}))
        assert more.step == 3
        more.run(progress=False)
        fp32 = Trainer(_cfg(tmp_path / "fp32", 6, precision="fp32"))
        fp32.run(progress=False)
    assert set(seen) == {torch.bfloat16}                        # autocast reached the Linears
    assert more.losses == full.losses                           # exact, not close
    assert full.losses != fp32.losses
    assert max(abs(a - b) / b for a, b in zip(full.losses, fp32.losses)) < 0.05   # same run, bf16 sums
    s = checkpoint.latest(tmp_path / "full")[1]
    assert all(v.dtype == torch.float32 for v in s["model"].values() if v.is_floating_point())
    assert all(v.dtype == torch.float32 for v in s["ema"].values() if v.is_floating_point())
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in full.model.parameters())
    assert s["config"]["precision"] == "bf16"


def test_cli_says_which_precision_and_why(tmp_path):
    env = {**os.environ, "COLUMNS": "120"}
    r = subprocess.run([sys.executable, "-m", "autohc.cli", "train", "--model", "DiT-Ti/8", "--steps", "2",
                        "--batch", "8", "--precision", "auto", "--samples-per-class", "0", "--json",
                        "--no-progress", "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    want, why = precision.resolve("auto")
    assert f"autohc: precision {want}: {why}" in r.stderr
    assert json.loads(r.stdout)["precision"] == want
    r = subprocess.run([sys.executable, "-m", "autohc.cli", "train", "--precision", "fp8",
                        "--out", str(tmp_path / "bad")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--precision" in r.stderr and not (tmp_path / "bad").exists()


def test_bench_step_bf16_modes_run_under_autocast():
    """`bench step --precision bf16`: the -bf16 modes train under autocast, each compared with
    stock autocast's losses, with autohc-bf16's speedups and % of the bf16 peak reported."""
    from autohc.bench.step import bench_step, mode_parts
    assert mode_parts("autohc-bf16+compile") == ("autohc+compile", "bf16")
    assert mode_parts("compiled") == ("compiled", "fp32")
    r = bench_step("DiT-Ti/8", 2, image_size=16, steps=3, warmup=1,
                   modes=["stock", "stock-bf16", "autohc-bf16"])
    assert r["max_loss_rel_diff_bf16"] < 2e-2 and r["max_loss_rel_diff"] == 0.0
    assert r["losses"]["stock-bf16"] != r["losses"]["stock"]       # autocast did change the math
    assert set(r["bf16_speedups"]) == {"autohc-bf16 vs stock-bf16", "autohc-bf16 vs stock"}
    assert all(v > 0 for v in r["bf16_speedups"].values())
    if cpu.bf16_isa()[0] in ("amx", "avx512bf16"):
        assert set(r["pct_bf16_peak"]) == {"stock-bf16", "autohc-bf16"}
    else:
        assert r["pct_bf16_peak"] is None


def test_train_defaults_to_auto_and_help_says_so(capsys):
    from autohc.cli import build_parser
    args = build_parser().parse_args(["train"])
    assert args.precision == "auto"
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["train", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--precision {fp32,bf16,auto}" in text and "auto (default): bf16 where the CPU" in text
    assert "runs fp32 and the log says so" in text


def test_resume_compares_the_precision_that_ran(tmp_path, monkeypatch):
    """A run started with --precision fp32 (the old default) continues under auto where auto
    is fp32; where auto is bf16 it is refused naming --precision (resolved, and that it came
    from auto); a checkpoint from before --precision counts as fp32."""
    monkeypatch.setattr(cpu, "bf16_isa", lambda info=None: ("avx2", "no AVX512_BF16 or AMX on this CPU"))
    run = tmp_path / "run"
    Trainer(_cfg(run, 2, precision="fp32", autohc=False, ckpt_every=2)).run(progress=False)
    more = Trainer(_cfg(run, 3, precision="auto", autohc=False, extra={"resume": True}))
    assert more.step == 2 and more.precision == "fp32" and more.precision_why.startswith("auto: no AVX512_BF16")
    monkeypatch.setattr(cpu, "bf16_isa", lambda info=None: ("avx512bf16", "AVX512_BF16 dot products"))
    from autohc.dit.train import ResumeError
    with pytest.raises(ResumeError, match=r"--precision 'fp32' \(this command: 'bf16' from --precision auto\)"):
        Trainer(_cfg(run, 3, precision="auto", autohc=False, extra={"resume": True}))
    path, state = checkpoint.latest(run)            # as written before --precision existed
    del state["config"]["precision"], state["precision"]
    torch.save(state, path)
    with pytest.raises(ResumeError, match="--precision 'fp32'"):
        Trainer(_cfg(run, 3, precision="bf16", autohc=False, extra={"resume": True}))
    assert Trainer(_cfg(run, 3, precision="fp32", autohc=False, extra={"resume": True})).step == 2
