"""DiT model, diffusion, data, trainer (checkpoints, resume, kill -9), sampling, eval."""
import json
from pathlib import Path
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import autohc
from autohc.cli import main
from cli_errors import one_line_exit_2
from autohc.dit import DiT, checkpoint
from autohc.dit import data as datalib
from autohc.dit.diffusion import GaussianDiffusion
from autohc.dit.train import ResumeError, TrainConfig, Trainer


def tiny(**kw):
    args = dict(input_size=8, patch_size=2, in_channels=1, hidden_size=64, depth=2, num_heads=4,
                num_classes=10, learn_sigma=False)
    args.update(kw)
    return DiT(**args)


# ------------------------------------------------------------------------------ model

@pytest.mark.parametrize("name,count", [("DiT-S/2", 32_963_360), ("DiT-XL/2", 675_129_632)])
def test_reference_parameter_counts(name, count):
    with torch.device("meta"):          # counts only: no memory, no init cost
        m = DiT.from_name(name)         # 256px: 32x32x4 latents, learn_sigma, 1000 classes
    assert sum(p.numel() for p in m.parameters()) == count


def test_forward_shapes_any_channels_and_size():
    for c, size, sigma in ((4, 16, True), (13, 8, False), (1, 12, False)):
        m = tiny(in_channels=c, input_size=size, learn_sigma=sigma)
        x = torch.randn(3, c, size, size)
        out = m(x, torch.tensor([0, 10, 999]), torch.tensor([0, 1, 2]))
        assert out.shape == (3, 2 * c if sigma else c, size, size)


def test_adaln_zero_init_and_frozen_pos_embed():
    m = tiny()
    assert not m.pos_embed.requires_grad
    assert all(float(b.adaLN_modulation[-1].weight.detach().abs().sum()) == 0 for b in m.blocks)
    # zero-initialised final layer: the untrained model predicts exactly 0
    with torch.no_grad():
        out = m(torch.randn(2, 1, 8, 8), torch.tensor([1, 2]), torch.tensor([3, 4]))
    assert float(out.abs().max()) == 0.0


def test_bad_input_shape_is_a_clear_error():
    with pytest.raises(ValueError, match=r"x must be \(N, 1, 8, 8\)"):
        tiny()(torch.randn(2, 3, 8, 8), torch.tensor([1, 2]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="multiple of the patch"):
        tiny(input_size=7)


def _randomised(m):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)   # leave adaLN-Zero's zeros: exercise every path
    return m


def test_fused_blocks_match_plain_torch_forward_and_backward():
    m = _randomised(tiny(input_size=16, hidden_size=96, num_heads=3, learn_sigma=True)).eval()
    x = torch.randn(5, 1, 16, 16)
    t, y = torch.tensor([0, 5, 50, 500, 999]), torch.tensor([0, 3, 9, 10, 1])

    def run():
        m.zero_grad()
        out = m(x, t, y)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach().clone(), [p.grad.clone() for p in m.parameters() if p.requires_grad]

    ref, gref = run()
    with autohc.installed():
        got, g = run()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(g, gref):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_cfg_guidance_combines_conditional_and_null():
    m = _randomised(tiny()).eval()
    x, t, y = torch.randn(2, 1, 8, 8), torch.tensor([10, 20]), torch.tensor([1, 2])
    cond, uncond = m(x, t, y), m(x, t, torch.tensor([10, 10]))
    torch.testing.assert_close(m.forward_with_cfg(x, t, y, 3.0), uncond + 3.0 * (cond - uncond),
                               rtol=1e-4, atol=1e-5)


# -------------------------------------------------------------------------- diffusion

def test_schedule_matches_reference_formulas():
    d = GaussianDiffusion()
    betas = np.linspace(1e-4, 0.02, 1000)
    np.testing.assert_allclose(d.alphas_cumprod.numpy(), np.cumprod(1 - betas), rtol=1e-12)
    x0, noise = torch.randn(4, 1, 8, 8), torch.randn(4, 1, 8, 8)
    t = torch.tensor([0, 1, 500, 999])
    ac = torch.tensor(np.cumprod(1 - betas)[[0, 1, 500, 999]], dtype=torch.float32).view(-1, 1, 1, 1)
    torch.testing.assert_close(d.q_sample(x0, t, noise), ac.sqrt() * x0 + (1 - ac).sqrt() * noise)


def test_respaced_chain_keeps_each_kept_steps_alphas_cumprod():
    """DDPM on fewer steps (the reference's SpacedDiffusion): the kept timesteps run evenly
    from 0 to 999, the new betas join them so every kept step keeps its alphas_cumprod, and
    on all 1000 steps the chain is the original one."""
    d = GaussianDiffusion()
    full, kept = d.respaced(1000)
    assert kept == list(range(1000))
    np.testing.assert_allclose(full.betas.numpy(), d.betas.numpy(), rtol=1e-9)
    np.testing.assert_allclose(full.posterior_variance.numpy(), d.posterior_variance.numpy(), rtol=1e-9)
    for n in (250, 7, 2, 1):
        spaced, kept = d.respaced(n)
        assert len(set(kept)) == n == spaced.num_timesteps and kept == sorted(kept)
        assert kept[0] == 0 and (n == 1 or kept[-1] == 999)
        np.testing.assert_allclose(spaced.alphas_cumprod.numpy(), d.alphas_cumprod[kept].numpy(), rtol=1e-12)
    assert d.respaced(250)[1][:4] == [0, 4, 8, 12]      # stride 999/249 = 4.012
    # the chain is the constructor's on those betas: the same schedule from them directly
    again = GaussianDiffusion(betas=d.respaced(7)[0].betas)
    np.testing.assert_array_equal(again.alphas_cumprod.numpy(), d.respaced(7)[0].alphas_cumprod.numpy())
    for bad in (torch.zeros(0, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float64)):
        with pytest.raises(ValueError, match="1-D tensor of at least one step"):
            GaussianDiffusion(betas=bad)


@pytest.mark.parametrize("sampler,steps", [("ddim", 50), ("ddim", 7), ("ddpm", 1000), ("ddpm", 250),
                                           ("ddpm", 1)])
def test_samplers_reach_the_data_point_with_an_exact_noise_oracle(sampler, steps):
    d = GaussianDiffusion()
    target = torch.rand(3, 1, 8, 8) * 1.6 - 0.8

    def oracle(x, t):   # the exact epsilon for a data distribution that is one point
        ac = d.alphas_cumprod[t].float().view(-1, 1, 1, 1)
        return (x - ac.sqrt() * target) / (1 - ac).sqrt()

    out = d.sample(oracle, target.shape, sampler=sampler, steps=steps,
                   generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out, target, rtol=0, atol=1e-3)


# ------------------------------------------------------------------------------- data

def test_digits_data():
    ds = datalib.load("digits")
    assert ds.x.shape == (1797, 1, 8, 8) and ds.num_classes == 10
    assert float(ds.x.min()) == -1.0 and float(ds.x.max()) == 1.0


def test_npy_data_and_its_errors(tmp_path):
    x = (np.random.rand(6, 2, 4, 4) * 255).astype(np.uint8)
    np.save(tmp_path / "a.npy", x)
    np.save(tmp_path / "a.labels.npy", np.array([0, 1, 2, 0, 1, 2]))
    ds = datalib.load(f"npy:{tmp_path / 'a.npy'}")
    assert ds.x.shape == (6, 2, 4, 4) and ds.num_classes == 3 and ds.images
    np.save(tmp_path / "lat.npy", np.random.randn(3, 4, 4, 4).astype(np.float32))
    np.save(tmp_path / "lat.labels.npy", np.array([0, 0, 1]))
    assert not datalib.load(f"npy:{tmp_path / 'lat.npy'}").images
    np.save(tmp_path / "b.npy", x)
    with pytest.raises(datalib.DataError, match="b.labels.npy: missing label file"):
        datalib.load(f"npy:{tmp_path / 'b.npy'}")
    np.save(tmp_path / "c.npy", x[:, 0])
    np.save(tmp_path / "c.labels.npy", np.zeros(6, np.int64))
    with pytest.raises(datalib.DataError, match=r"c.npy: shape \(6, 4, 4\)"):
        datalib.load(f"npy:{tmp_path / 'c.npy'}")
    np.save(tmp_path / "d.npy", x)
    np.save(tmp_path / "d.labels.npy", np.zeros(5, np.int64))
    with pytest.raises(datalib.DataError, match="d.labels.npy"):
        datalib.load(f"npy:{tmp_path / 'd.npy'}")
    (tmp_path / "e.npy").write_bytes(b"not numpy")
    np.save(tmp_path / "e.labels.npy", np.zeros(6, np.int64))
    with pytest.raises(datalib.DataError, match="e.npy: not a .npy array"):
        datalib.load(f"npy:{tmp_path / 'e.npy'}")


def _png(path, size=(8, 8), mode="RGB"):
    from PIL import Image
    Image.fromarray((np.random.rand(size[1], size[0], 3) * 255).astype(np.uint8)).convert(mode).save(path)


def test_folder_data_and_its_errors(tmp_path):
    for c in ("cat", "dog"):
        (tmp_path / c).mkdir()
        for i in range(3):
            _png(tmp_path / c / f"{i}.png")
    ds = datalib.load(f"folder:{tmp_path}")
    assert ds.x.shape == (6, 3, 8, 8) and ds.y.tolist() == [0, 0, 0, 1, 1, 1]
    _png(tmp_path / "dog" / "big.png", size=(16, 16))
    with pytest.raises(datalib.DataError, match="big.png: size 16x16, expected 8x8"):
        datalib.load(f"folder:{tmp_path}")
    assert datalib.load(f"folder:{tmp_path}", image_size=4).x.shape == (7, 3, 4, 4)
    (tmp_path / "dog" / "broken.png").write_bytes(b"\x89PNG garbage")
    with pytest.raises(datalib.DataError, match="broken.png: not a readable image"):
        datalib.load(f"folder:{tmp_path}", image_size=4)
    with pytest.raises(datalib.DataError, match="expected digits, synthetic"):
        datalib.load("imagenet")


def test_batches_are_sharded_and_resumable():
    """Ranks take slices of the one global batch: together they see what one process sees."""
    ds = datalib.synthetic(4, 1, 10, 3, 0)
    one = datalib.Batches(ds, 4, seed=1)
    a = datalib.Batches(ds, 4, seed=1, rank=0, world=2)
    b = datalib.Batches(ds, 4, seed=1, rank=1, world=2)
    for _ in range(5):                      # across an epoch's end (10 samples, batch 4)
        whole, (xa, ya), (xb, yb) = one.next(), a.next(), b.next()
        assert torch.equal(torch.cat([xa, xb]), whole[0]) and torch.equal(torch.cat([ya, yb]), whole[1])
    s = a.state_dict()
    expect = [a.next()[1].tolist() for _ in range(4)]
    c = datalib.Batches(ds, 4, seed=1, rank=0, world=2)
    c.load_state_dict(s)
    assert [c.next()[1].tolist() for _ in range(4)] == expect
    with pytest.raises(ValueError, match="does not split evenly over 3 ranks"):
        datalib.Batches(ds, 4, seed=1, rank=0, world=3)


# ---------------------------------------------------------------------------- trainer

def cfg(out, steps, **kw):
    args = dict(model="DiT-Ti/8", data="digits", steps=steps, batch=16, out=str(out), lr=1e-3,
                ckpt_every=3, keep=2)
    args.update(kw)
    return TrainConfig(**args)


def test_a_few_training_steps_on_digits_learn(tmp_path):
    with autohc.installed():
        tr = Trainer(cfg(tmp_path, 20, ckpt_every=5, model="DiT-Ti/2", batch=32))
        r = tr.run(progress=False)
    assert r["steps"] == 20 and len(tr.losses) == 20
    assert np.mean(tr.losses[-5:]) < 0.6 * np.mean(tr.losses[:5])      # it learns (0.3 here)
    assert [s for s, _ in checkpoint.listing(tmp_path)] == [15, 20]     # keep=2 of 4
    assert (tmp_path / "losses.csv").read_text().count("\n") == 21


@pytest.mark.parametrize("use_autohc,automem", [(True, None), (False, None), (True, "file")])
def test_resume_is_bit_identical(tmp_path, monkeypatch, use_autohc, automem):
    """... with AutoMem's file tier on the resumed half too (every saved tensor offloaded)."""
    import contextlib
    monkeypatch.setenv("AUTOHC_AUTOMEM_MIN_KB", "1")
    ctx = autohc.installed if use_autohc else contextlib.nullcontext
    with ctx():
        full = Trainer(cfg(tmp_path / "full", 8, autohc=use_autohc))
        full.run(progress=False)
        part = Trainer(cfg(tmp_path / "part", 4, autohc=use_autohc, automem=automem))  # ckpt at 3, 4
        part.run(progress=False)
        (tmp_path / "part" / "ckpt-00000004.pt").unlink()                # continue from step 3
        more = Trainer(cfg(tmp_path / "part", 8, autohc=use_autohc, automem=automem, extra={"resume": True}))
        assert more.step == 3
        more.run(progress=False)
    assert more.losses == full.losses                                    # exact, not close
    if automem:
        assert more.automem.stats["offloaded"] > 0
    a, b = checkpoint.latest(tmp_path / "full")[1], checkpoint.latest(tmp_path / "part")[1]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_resume_refuses_another_setup(tmp_path):
    Trainer(cfg(tmp_path, 3)).run(progress=False)
    with pytest.raises(ValueError, match="earlier run: pass --resume"):
        Trainer(cfg(tmp_path, 6))               # would mix two runs' checkpoints
    with pytest.raises(ResumeError, match="trained with --model 'DiT-Ti/8' \\(this command: 'DiT-Ti/4'\\)"):
        Trainer(cfg(tmp_path, 6, model="DiT-Ti/4", extra={"resume": True}))
    with pytest.raises(ResumeError, match="--lr 0.001 \\(this command: 0.0001\\), --seed 0 \\(this command: 5\\)"):
        Trainer(cfg(tmp_path, 6, lr=1e-4, seed=5, extra={"resume": "auto"}))
    with pytest.raises(ResumeError, match="--resume never: .* is not empty"):
        Trainer(cfg(tmp_path, 6, extra={"resume": "never"}))
    (tmp_path / "new").mkdir()
    assert Trainer(cfg(tmp_path / "new", 6, extra={"resume": "never"})).step == 0     # an empty folder
    more = Trainer(cfg(tmp_path, 6, ckpt_every=5, extra={"resume": "auto"}))    # --steps and --ckpt-every may change
    assert more.step == 3 and more.resumed_from.name == "ckpt-00000003.pt"


def test_torn_checkpoint_is_skipped_with_a_warning(tmp_path, capsys):
    Trainer(cfg(tmp_path, 3)).run(progress=False)
    (tmp_path / "ckpt-00000009.pt").write_bytes(b"torn")
    path, state = checkpoint.latest(tmp_path)
    assert path.name == "ckpt-00000003.pt" and state["step"] == 3
    assert "skipping" in capsys.readouterr().err


KILL_SCRIPT = """
import sys, autohc
from autohc.dit.train import TrainConfig, Trainer
autohc.install()
Trainer(TrainConfig(model="DiT-Ti/8", data="digits", steps=10000, batch=8, out=sys.argv[1],
                    ckpt_every=1, keep=2, automem=sys.argv[2] or None,
                    extra={"resume": True})).run(progress=False)
"""


@pytest.mark.parametrize("automem", ["", "file"])
def test_kill_9_never_leaves_an_unloadable_checkpoint(tmp_path, automem):
    script = tmp_path / "train.py"
    script.write_text(KILL_SCRIPT)
    rng = np.random.default_rng(0)
    out = tmp_path / "run"
    env = {**os.environ, "AUTOHC_AUTOMEM_MIN_KB": "1"}   # offload every saved tensor of 1 KiB+
    for i in range(3):                      # each round resumes what the last one saved
        before = max((s for s, _ in checkpoint.listing(out)), default=0)
        p = subprocess.Popen([sys.executable, str(script), str(out), automem], stderr=subprocess.PIPE, env=env)
        deadline = time.time() + 60         # wait until this run (resumed) has saved a step
        while max((s for s, _ in checkpoint.listing(out)), default=0) <= before and time.time() < deadline:
            assert p.poll() is None, p.stderr.read().decode()[-2000:]
            time.sleep(0.05)
        time.sleep(float(rng.uniform(0.0, 0.5)))        # somewhere inside a step or a save
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        p.stderr.close()
        for _, ck in checkpoint.listing(out):           # every complete name loads
            assert checkpoint.load(ck)["format"] == "autohc-dit-1"
    path, state = checkpoint.latest(out)
    assert state["step"] >= 3 and len(state["losses"]) == state["step"]   # 3 runs, each resumed and saved


# ------------------------------------------------------------------ sampling, CLI, eval

def test_train_cli_sample_and_eval(tmp_path, capsys, monkeypatch):
    from autohc.tune import first_use
    told, expect = [], first_use.expect_calls          # what each command tells first-use tuning

    def told_calls(calls):
        told.append(calls)
        return expect(calls)
    monkeypatch.setattr(first_use, "expect_calls", told_calls)
    out = tmp_path / "run"
    assert main(["train", "--model", "DiT-Ti/8", "--data", "digits", "--steps", "4", "--batch", "8",
                 "--out", str(out), "--ckpt-every", "2", "--no-progress", "--samples-per-class", "2",
                 "--sample-steps", "3", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 4 and summary["gflops"] > 0 and summary["peak_rss_gb"] > 0
    from PIL import Image
    assert Image.open(out / "samples.png").size[1] > Image.open(out / "samples.png").size[0]  # 10 rows x 2
    assert (out / "losses.png").stat().st_size > 0
    grid = tmp_path / "g.png"
    assert main(["sample", "--ckpt", str(out), "--classes", "3", "7", "--per-class", "5",
                 "--steps", "2", "--cfg", "3", "--out", str(grid)]) == 0
    w, h = Image.open(grid).size
    assert w > 2 * h                                     # 2 rows of 5
    assert told == [4 * 12, 2 * 12]                     # steps, then sampling steps, x DiT-Ti's 12 blocks
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(out), "--classes", "12", "--out", str(grid)]) == 2
    assert "out of range" in capsys.readouterr().err
    ddpm = tmp_path / "ddpm.png"                         # DDPM on 3 of the 1000 steps
    assert main(["sample", "--ckpt", str(out), "--classes", "1", "--per-class", "2", "--sampler", "ddpm",
                 "--steps", "3", "--out", str(ddpm)]) == 0 and ddpm.stat().st_size > 0
    with pytest.raises(SystemExit):
        main(["sample", "--ckpt", str(out), "--steps", "1001", "--out", str(tmp_path / "no.png")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "expected an integer in [1, 1000], got 1001" in err and not (tmp_path / "no.png").exists()
    assert main(["eval", "--ckpt", str(out), "--per-class", "3", "--sample-steps", "2", "--json"]) == 0
    assert told[-1] == 2 * 12
    r = json.loads(capsys.readouterr().out)
    assert r["samples"] == 30 and 0 <= r["class_match"] <= 1 and r["frechet"] > 0
    _bad_inputs_of_sample_eval_compare_train(out, tmp_path, capsys)


def _bad_inputs_of_sample_eval_compare_train(run, tmp_path, capsys):
    """Each a one-line error, exit 2, said before any sampling or training, nothing written."""
    png, saved = tmp_path / "bad.png", tmp_path / "saved"
    empty, text = tmp_path / "empty.pt", tmp_path / "text.pt"
    empty.write_bytes(b"")
    text.write_text("not a checkpoint\n")
    assert "GiB available" in one_line_exit_2(
        capsys, ["sample", "--ckpt", str(run), "--per-class", "999999999", "--out", str(png)], png)
    assert "GiB available" in one_line_exit_2(
        capsys, ["eval", "--ckpt", str(run), "--per-class", "99999999999"])
    # a pixel model with a --vae that cannot load: refused before the samples are drawn
    assert "AutoencoderKL" in one_line_exit_2(
        capsys, ["sample", "--ckpt", str(run), "--vae", str(tmp_path / "no-vae"), "--out", str(png)], png)
    assert "an empty file" in one_line_exit_2(capsys, ["eval", "--ckpt", str(empty)])
    assert "not a loadable" in one_line_exit_2(capsys, ["sample", "--ckpt", str(text), "--out", str(png)], png)
    assert "two run folders" in one_line_exit_2(capsys, ["compare", str(run), "--save", str(saved)], saved)
    assert "expected digits" in one_line_exit_2(
        capsys, ["train", "--data", "bogus", "--out", str(tmp_path / "r"), "--save", str(saved)], saved)
    assert "no such checkpoint" in one_line_exit_2(
        capsys, ["compare", str(run), str(tmp_path / "none"), "--save", str(saved)], saved)
    assert "not a loadable" in one_line_exit_2(capsys, ["compare", str(run), str(text)])
    new = tmp_path / "new-run"
    train = ["train", "--model", "DiT-Ti/8", "--steps", "1", "--out", str(new), "--no-progress"]
    assert "not a directory" in one_line_exit_2(capsys, [*train, "--data", f"folder:{tmp_path / 'none'}"], new)
    assert "expected digits" in one_line_exit_2(capsys, [*train, "--data", "bogus"], new)
    assert "--image-size" in one_line_exit_2(capsys, [*train, "--data", "digits", "--image-size", "16"], new)
    assert "--channels" in one_line_exit_2(capsys, [*train, "--data", "digits", "--channels", "1"], new)
    assert "--automem TIER" in one_line_exit_2(capsys, [*train, "--data", "digits", "--automem-state"], new)
    (tmp_path / "a-file").write_text("")
    for bad in (["--weight-decay", "-1"], ["--weight-decay", "nan"], ["--automem", "ssd"],
                ["--automem", f"file:{tmp_path / 'a-file' / 'x'}"], ["--automem", "numa:x"]):
        with pytest.raises(SystemExit) as e:
            main([*train, "--data", "digits", *bad])
        assert e.value.code == 2 and not new.exists(), bad
        assert f"argument {bad[0]}" in capsys.readouterr().err


def test_compare_runs_fp32_vs_bf16(tmp_path, capsys):
    """autohc compare: both runs' setup and losses from their checkpoints, each sampled and
    scored, a plot in the last run's folder, a saved record; bad input is one line."""
    runs = []
    for prec in ("fp32", "bf16"):
        out = tmp_path / prec
        assert main(["train", "--model", "DiT-Ti/8", "--data", "digits", "--steps", "4", "--batch", "8",
                     "--out", str(out), "--no-progress", "--samples-per-class", "0",
                     "--precision", prec, "--no-first-use-tuning"]) == 0
        runs.append(str(out))
    capsys.readouterr()
    assert main(["compare", *runs, "--per-class", "2", "--sample-steps", "2", "--json",
                 "--save", str(tmp_path / "res")]) == 0
    r = json.loads(capsys.readouterr().out)
    assert [w["precision"] for w in r["runs"]] == ["fp32", "bf16"]
    assert all(w["steps"] == 4 and w["samples"] == 20 and w["seed"] == 0 for w in r["runs"])
    assert {"final_loss_rel_diff", "frechet_rel_diff"} <= set(r["runs"][1])
    assert Path(r["plot"]) == tmp_path / "bf16" / "compare.png" and Path(r["plot"]).stat().st_size > 0
    assert r["common_steps"] == 4 and r["smoothed_loss_max_rel_diff"] < 0.5   # same seed, same data
    saved = list((tmp_path / "res").rglob("*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["bench"] == "compare"
    from autohc.bench.results import load
    from autohc.bench.results_md import readme_fidelity, summaries
    rec = load(tmp_path / "res")
    assert "| bf16 |" in readme_fidelity(rec) and "class match" in summaries(rec[0])[0][1]
    assert main(["compare", runs[0]]) == 2
    assert "two run folders" in capsys.readouterr().err
    assert "nothing" in one_line_exit_2(capsys, ["compare", runs[0], str(tmp_path / "nothing")])


def test_generate_shapes():
    from autohc.dit.sample import generate
    arch = {"in_channels": 3, "input_size": 8, "num_classes": 5, "class_dropout": 0.1, "images": True}
    m = _randomised(tiny(in_channels=3, num_classes=5)).eval()
    x, y = generate(m, arch, [4, 0], per_class=3, steps=2, cfg=2.0)
    assert x.shape == (6, 3, 8, 8) and y.tolist() == [4, 4, 4, 0, 0, 0]
    assert float(x.abs().max()) <= 1.0


def test_cli_bad_data_is_one_line(tmp_path, capsys):
    assert main(["train", "--data", f"npy:{tmp_path / 'none.npy'}", "--out", str(tmp_path),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "none.npy: no such file" in err
    assert "no such checkpoint" in one_line_exit_2(capsys, ["sample", "--ckpt", str(tmp_path / "nothing")])


def test_eval_metric_separates_real_from_noise():
    from autohc.dit.evaluate import evaluate_digits
    from sklearn.datasets import load_digits
    d = load_digits()
    real = evaluate_digits(d.images[:300, None] / 8.0 - 1, d.target[:300])
    noise = evaluate_digits(np.random.default_rng(0).uniform(-1, 1, (300, 1, 8, 8)), d.target[:300])
    assert real["class_match"] > 0.95 and noise["class_match"] < 0.3
    assert real["frechet"] < 0.2 * noise["frechet"]


def test_bench_step_modes_on_the_command_line_are_the_benchmarks():
    from autohc.bench.step import MODES
    from autohc.cli.dit import STEP_MODES
    assert STEP_MODES == MODES


def test_bench_sample_modes_on_the_command_line_are_the_benchmarks():
    from autohc.bench.sample import MODES
    from autohc.cli.dit import SAMPLE_MODES
    assert SAMPLE_MODES == MODES


def test_bench_step_autohc_under_compile(monkeypatch):
    """autohc+compile: inductor's compiled step with its GEMMs on autohc, the stock losses."""
    from autohc.bench.step import bench_step
    from autohc.dit import model
    from autohc.torch import served
    # two blocks, not twelve: inductor's compile time grows with the blocks it traces, and what
    # is checked (GEMMs on autohc, stock losses) holds per block. A name of its own, because
    # bench.step.step_flops_by_class caches its counts by model name.
    monkeypatch.setitem(model.MODELS, "DiT-Ti2/8", model.DiTConfig(2, 192, 3, 8))
    before = served.stats["autohc"]
    r = bench_step("DiT-Ti2/8", 2, image_size=16, steps=2, warmup=1, modes=["stock", "autohc+compile"])
    assert served.stats["autohc"] > before
    assert r["autohc_compile_s"] > 0 and r["autohc_compile_speedup_vs_stock"] > 0
    assert r["max_loss_rel_diff"] < 1e-3


def test_profile_counts_the_ops_inside_an_optimizer_step_as_the_optimizers():
    from types import SimpleNamespace as Event
    from autohc.bench.step import event_class
    step = Event(name="Optimizer.step#AdamW.step", cpu_parent=None)
    assert event_class(Event(name="aten::lerp_", cpu_parent=Event(name="aten::foo", cpu_parent=step))) == "optimizer"
    assert event_class(Event(name="aten::lerp_", cpu_parent=None)) == "elementwise"
    assert event_class(Event(name="aten::mm", cpu_parent=None)) == "gemm"


def test_bench_step_stock_vs_autohc():
    from autohc.bench.step import bench_step
    r = bench_step("DiT-Ti/8", 2, image_size=16, steps=3, warmup=1, modes=["stock", "autohc"],
                   profile=True)
    assert r["stock_s"] > 0 and r["autohc_s"] > 0 and r["compiled_s"] is None
    for mode in ("stock", "autohc"):        # --profile: shares of a step that add up
        share = r["profile"][mode]["share"]
        assert set(share) == {"gemm", "attention", "elementwise", "optimizer", "copies", "other"}
        assert share["gemm"] > 0 and share["attention"] > 0 and share["optimizer"] > 0
        assert abs(sum(share.values()) - 1) < 0.05
        secs, rate = r["profile"][mode]["seconds"], r["profile"][mode]["gflops"]
        assert abs(sum(secs.values()) - r["profile"][mode]["wall_s"]) < 0.05 * r["profile"][mode]["wall_s"]
        assert rate["gemm"] > 0 and rate["attention"] > 0      # flops over their own time
    assert r["speedup_vs_stock"] > 0 and r["max_loss_rel_diff"] < 1e-3
    assert len(r["losses"]["autohc"]) == 3
    # autohc's step against the time inside its kernels' teams (stock has no teams)
    k = r["kernel_teams"]
    assert set(k) == {"autohc"} and k["autohc"]["outside_s"] >= 0
    assert k["autohc"]["in_teams_s"] <= r["step_s"]["autohc"] * 1.05
    if torch.get_num_threads() > 1:             # (one thread runs every kernel without a team)
        assert k["autohc"]["jobs_per_step"] > 0 and k["autohc"]["in_teams_s"] > 0
    # GEMMs and attention of DiT-Ti/8 at 16 px: 4 tokens; the count must at least hold the
    # block GEMMs: 12 hidden^2 multiply-adds per token (qkv, proj, fc1, fc2), three passes
    # (forward, dX, dW) of 2 flops each
    tokens, hidden, depth = 2 * 4, 192, 12
    assert r["step_gflop"] * 1e9 >= 3 * 2 * 12 * hidden ** 2 * tokens * depth
    assert 0 < r["pct_peak"]["autohc"] < 100 and r["gflops"]["stock"] > 0
    assert r["copy_gbps"]["before"] > 0 and r["copy_gbps"]["after"] > 0   # the machine's state
    # each mode's % of peak against the probes around its own steps (interleaved here: one pair)
    peaks = r["peak_gflops_by_mode"]
    assert set(peaks) == {"stock", "autohc"} and peaks["stock"] == peaks["autohc"] == r["peak_gflops"]
    for m, t in r["step_s"].items():
        # (pct_peak rounds to 0.1 and step_gflop to 0.01: 0.3 of DiT-Ti/8 is 0.295 to 0.305)
        want = 100 * r["step_gflop"] / t / peaks[m]
        assert abs(r["pct_peak"][m] - want) < 0.051 + want * (0.0051 / r["step_gflop"] + 0.001)
    # the floors beside the time: compute (flops over the unit's peak) and memory (48 B a parameter)
    f = r["floors"]
    from autohc.dit.model import DiT
    n = sum(p.numel() for p in DiT.from_name("DiT-Ti/8", input_size=16, in_channels=4, num_classes=1000)
            .parameters() if p.requires_grad)
    assert f["params"] == n and f["bytes_per_param"] == 48 and f["copy_gbps"] > 0
    assert f["memory_s"] == pytest.approx(n * 48 / f["copy_gbps"] / 1e9, rel=0.01)
    for m in ("stock", "autohc"):               # fp32 modes: the FMA peak probed around the steps
        assert f["compute_s"][m] == pytest.approx(r["step_gflop"] / peaks[m], rel=0.01, abs=1e-4)
        assert f["compute_s"][m] < r["step_s"][m]


def test_profile_classes_count_a_custom_ops_forward_in_its_autograd_node():
    """With autograd, a custom op's forward kernel runs inside the node torch's
    register_autograd makes ("GeneratedBackwardFor_<ns>_<op>_default"): its class is the op's,
    not "other"; the backward node itself only holds the backward op."""
    import autohc.torch.ops as ops
    from torch.profiler import ProfilerActivity, profile
    from autohc.bench.step import op_class
    assert op_class("GeneratedBackwardFor_autohc_gated_residual_default") == "elementwise"
    assert op_class("GeneratedBackwardFor_autohc_attention_qkv_default") == "attention"
    assert op_class("GeneratedBackwardFor_autohc_gated_residual_defaultBackward") is None
    # every block's adaLN Linear in one op: skinny GEMMs (the SiLU once before them)
    assert op_class("GeneratedBackwardFor_autohc_modulations_fp32w_default") == "gemm"
    x, y = torch.randn(2, 64, 96, requires_grad=True), torch.randn(2, 64, 96)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ops.gated_residual(x, y, torch.randn(2, 96)).sum().backward()
    names = {e.key for e in prof.key_averages()}
    assert "GeneratedBackwardFor_autohc_gated_residual_default" in names   # torch's naming holds
