"""A DiT user's workflow: images -> VAE latents (autohc encode) -> train / fine-tune (--init)
-> samples decoded by the VAE; checkpoints converted between autohc, facebookresearch/DiT and
diffusers; bad inputs are one line and exit 2. A tiny random-weight diffusers AutoencoderKL and
generated class images stand in for sd-vae-ft-ema and ImageNet (no downloads)."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="the latent workflow needs diffusers: pip install -e '.[latent]'")

from autohc.cli import main                                     # noqa: E402
from cli_errors import one_line_exit_2                          # noqa: E402
from autohc.dit import convert, encode                          # noqa: E402
from autohc.dit import data as datalib                          # noqa: E402
from autohc.dit import vae as vaelib                            # noqa: E402
from autohc.dit.model import DiT                                # noqa: E402
from autohc.dit.train import TrainConfig, Trainer, build_model  # noqa: E402

CLASSES = ["bar", "circle", "square"]


def _images(root, sizes):
    """Class folders of generated RGB images (a bright stripe whose row and colour is the class)."""
    from PIL import Image
    rng = np.random.default_rng(0)
    for k, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for i, (h, w) in enumerate(sizes):
            a = (rng.random((h, w, 3)) * 60).astype(np.uint8)
            a[h // 5 + k * 3:h // 5 + k * 3 + 3, 2:w - 2, k] = 250
            Image.fromarray(a).save(root / name / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny VAE (16 px -> 4 x 8 x 8), 16 px class images, their latents and a short latent run."""
    root = tmp_path_factory.mktemp("latent")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                                  up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16),
                                  layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=16)
    vae.save_pretrained(root / "vae")
    imgs = _images(root / "imgs", [(16, 16)] * 5)
    lat = root / "lat"
    assert main(["encode", "--data", f"folder:{imgs}", "--vae", str(root / "vae"), "--out", str(lat),
                 "--batch", "4", "--no-progress", "--precision", "fp32"]) == 0     # compared with fp32 below
    run = root / "run"
    assert main(["train", "--model", "DiT-Ti/2", "--data", f"latents:{lat}", "--steps", "3", "--batch", "6",
                 "--out", str(run), "--no-progress", "--samples-per-class", "1", "--sample-steps", "2"]) == 0
    return {"root": root, "vae": root / "vae", "imgs": imgs, "lat": lat, "run": run}


def _mapped_from(address):
    """The file whose mapping holds this address (Linux /proc/self/maps), or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(v, 16) for v in parts[0].split("-"))
            if lo <= address < hi:
                return parts[5] if len(parts) > 5 else None
    return None


def _randomised(m):
    """Every weight random (adaLN-Zero starts blocks as the identity: a weak test otherwise)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return m


# ------------------------------------------------------------------------------ encode

def test_encode_writes_the_vaes_scaled_latents_in_class_order(world):
    meta = json.loads((world["lat"] / "meta.json").read_text())
    assert meta["complete"] and meta["classes"] == CLASSES and meta["image_size"] == 16
    assert meta["scaling_factor"] == pytest.approx(0.18215) and meta["vae"] == str(world["vae"].resolve())
    ds = datalib.load(f"latents:{world['lat']}")
    assert ds.shape == (4, 8, 8) and len(ds.y) == 15 and ds.num_classes == 3 and not ds.images
    assert ds.y.tolist() == [0] * 5 + [1] * 5 + [2] * 5
    assert _mapped_from(ds.x.data_ptr()) == str((world["lat"] / "latents.npy").resolve())   # not read in
    # the same numbers as the VAE called directly on those images, with the same draws
    vae = vaelib.load(world["vae"])
    from PIL import Image
    x = torch.stack([torch.from_numpy(np.asarray(Image.open(world["imgs"] / c / f"{i}.png").convert("RGB"),
                                                 dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1
                     for c in CLASSES for i in range(5)])
    want = vaelib.encode(vae, x, list(range(15)))
    torch.testing.assert_close(ds.x, want, atol=1e-5, rtol=1e-5)
    direct = vae.encode(x).latent_dist
    assert float((ds.x / 0.18215 - direct.mean).abs().max()) < 6 * float(direct.std.max())


def test_encode_crops_flips_and_resumes_to_the_same_file(world, tmp_path, monkeypatch):
    imgs = _images(tmp_path / "imgs", [(20, 24), (30, 18), (16, 16)])     # mixed: --image-size crops
    args = dict(image_size=16, flip=True, batch=2, seed=3)
    whole = encode.encode_folder(imgs, str(world["vae"]), tmp_path / "whole", **args, progress=False)
    assert whole["images"] == 18 and whole["new_images"] == 18 and whole["images_per_s"] > 0
    real = encode._load_batch
    calls = []

    def stop_after_two(part, size, mode):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(part, size, mode)
    monkeypatch.setattr(encode, "_load_batch", stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        encode.encode_folder(imgs, str(world["vae"]), tmp_path / "part", **args, progress=False)
    meta = json.loads((tmp_path / "part" / "meta.json").read_text())
    assert meta["done"] == 4 and not meta["complete"]
    with pytest.raises(datalib.InputError, match="stopped at image 4"):
        datalib.load(f"latents:{tmp_path / 'part'}")
    monkeypatch.setattr(encode, "_load_batch", real)
    again = encode.encode_folder(imgs, str(world["vae"]), tmp_path / "part", **args, progress=False)
    assert again["new_images"] == 10                       # 5 images left, and their flips
    a, b = (np.load(tmp_path / d / "latents.npy") for d in ("whole", "part"))
    assert np.array_equal(a, b)
    # rows n.. are the flipped images' latents
    vae = vaelib.load(world["vae"])
    x = encode._load_batch([(imgs / "bar" / "0.png", 0)], 16, "RGB")
    torch.testing.assert_close(torch.from_numpy(a[9:10]), vaelib.encode(vae, x.flip(-1), [3 * 1_000_003 + 9]),
                               atol=1e-5, rtol=1e-5)
    assert encode.encode_folder(imgs, str(world["vae"]), tmp_path / "part", **args,
                                progress=False)["new_images"] == 0


def test_encode_stopped_while_making_its_files_starts_again_with_the_same_command(world, tmp_path, monkeypatch):
    """A failure between labels.npy and meta.json (e.g. no memory for latents.npy) leaves a
    folder the same command makes again, not one it refuses; another folder is still refused."""
    imgs = _images(tmp_path / "imgs", [(16, 16), (16, 16)])
    args = dict(image_size=16, flip=False, batch=2, seed=0, progress=False)
    real = np.lib.format.open_memmap

    def no_memory(*a, **kw):
        raise MemoryError("Cannot allocate memory")
    monkeypatch.setattr(np.lib.format, "open_memmap", no_memory)
    with pytest.raises(MemoryError):
        encode.encode_folder(imgs, str(world["vae"]), tmp_path / "out", **args)
    assert (tmp_path / "out" / "labels.npy").exists() and not (tmp_path / "out" / "meta.json").exists()
    monkeypatch.setattr(np.lib.format, "open_memmap", real)
    done = encode.encode_folder(imgs, str(world["vae"]), tmp_path / "out", **args)
    assert done["new_images"] == done["images"] == 6
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(datalib.InputError, match="not an encode's folder"):
        encode.encode_folder(imgs, str(world["vae"]), tmp_path / "other", **args)


def test_encode_in_bf16_is_close_to_fp32_and_recorded(world, tmp_path, monkeypatch, capsys):
    """--precision bf16 (widened to fp32 on a CPU without bf16 hardware, still bf16 numbers):
    the encoder's convolutions see bf16 under autocast, the latents are fp32 on disk, within
    1 % (relative, Frobenius) of fp32's (2.9e-3 measured with this VAE), and meta.json says bf16."""
    seen, real_load = set(), vaelib.load

    def spied(spec):
        vae = real_load(spec)
        conv = next(m for m in vae.encoder.modules() if isinstance(m, torch.nn.Conv2d))
        conv.register_forward_hook(lambda mod, i, o: seen.add(o.dtype))
        return vae
    monkeypatch.setattr(vaelib, "load", spied)
    out = tmp_path / "bf16"
    capsys.readouterr()
    assert main(["encode", "--data", f"folder:{world['imgs']}", "--vae", str(world["vae"]), "--out", str(out),
                 "--batch", "4", "--no-progress", "--precision", "bf16"]) == 0
    assert "the VAE in bf16 (asked for (--precision bf16)" in capsys.readouterr().out
    assert seen == {torch.bfloat16}
    meta = json.loads((out / "meta.json").read_text())
    assert meta["precision"] == "bf16" and meta["complete"]
    assert json.loads((world["lat"] / "meta.json").read_text())["precision"] == "fp32"
    fp32, bf16 = np.load(world["lat"] / "latents.npy"), np.load(out / "latents.npy")
    assert bf16.dtype == np.float32 and bf16.shape == fp32.shape
    rel = float(np.linalg.norm(bf16 - fp32) / np.linalg.norm(fp32))
    assert 0 < rel < 1e-2, rel
    assert datalib.load(f"latents:{out}").shape == (4, 8, 8)


def test_encode_resume_in_another_precision_is_refused_and_nothing_lost(world, tmp_path, monkeypatch, capsys):
    """A stopped fp32 encode: continuing it in bf16 is one line, exit 2, meta.json and the rows
    untouched; in fp32 it completes to the uninterrupted fp32 file. A meta.json written before
    --precision existed counts as fp32."""
    import signal
    from autohc.runtime import preempt
    cmd = ["encode", "--data", f"folder:{world['imgs']}", "--vae", str(world["vae"]), "--batch", "4",
           "--no-progress", "--out", str(tmp_path / "part")]
    real, calls = encode._load_batch, []

    def signalled(part, size, mode):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(part, size, mode)
    monkeypatch.setattr(encode, "_load_batch", signalled)
    assert main([*cmd, "--precision", "fp32"]) == preempt.EXIT_PREEMPTED
    monkeypatch.setattr(encode, "_load_batch", real)
    meta_path, lat_path = tmp_path / "part" / "meta.json", tmp_path / "part" / "latents.npy"
    meta, rows = meta_path.read_text(), lat_path.read_bytes()
    assert json.loads(meta)["done"] == 8
    err = one_line_exit_2(capsys, [*cmd, "--precision", "bf16"])
    assert err == (f"autohc: {tmp_path / 'part'} holds latents encoded in fp32 (this command: bf16): "
                   "pass --precision fp32 to continue it, or another --out"), err
    assert meta_path.read_text() == meta and lat_path.read_bytes() == rows
    old = json.loads(meta)
    del old["precision"]                                # as an encode before --precision wrote it
    meta_path.write_text(json.dumps(old))
    assert "encoded in fp32" in one_line_exit_2(capsys, [*cmd, "--precision", "bf16"])
    assert main([*cmd, "--precision", "fp32"]) == 0
    assert json.loads(meta_path.read_text())["precision"] == "fp32"
    assert np.array_equal(np.load(lat_path), np.load(world["lat"] / "latents.npy"))


def test_encode_help_names_precision(capsys):
    with pytest.raises(SystemExit) as e:
        main(["encode", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--precision {fp32,bf16,auto}" in out and "auto (default): bf16 where the CPU" in out


# ---------------------------------------------------------------- train and sample on latents

def test_latent_run_records_its_vae_and_samples_decode_to_images(world, tmp_path, capsys):
    from PIL import Image
    state = torch.load(world["run"] / "ckpt-00000003.pt", weights_only=True)
    assert state["arch"]["latent"]["vae"] == str(world["vae"].resolve())
    assert state["arch"]["latent"]["classes"] == CLASSES and state["arch"]["images"] is False
    cell = 2 + 16 * 4                                       # save_grid scales 16 px images x4
    assert Image.open(world["run"] / "samples.png").size == (cell + 2, 3 * cell + 2)
    out = tmp_path / "s.png"
    assert main(["sample", "--ckpt", str(world["run"]), "--classes", "0", "2", "--per-class", "2",
                 "--steps", "2", "--out", str(out)]) == 0
    im = Image.open(out)
    assert im.size == (2 * cell + 2, 2 * cell + 2) and im.mode == "RGB"
    # the VAE moved away: sampling says so in one line, and --vae points at it
    moved = tmp_path / "vae-moved"
    shutil.copytree(world["vae"], moved)
    ckpt = tmp_path / "c.pt"
    state["arch"]["latent"]["vae"] = str(tmp_path / "gone")
    torch.save(state, ckpt)
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(ckpt), "--per-class", "1", "--steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "pass --vae" in err
    assert main(["sample", "--ckpt", str(ckpt), "--per-class", "1", "--steps", "1", "--out", str(out),
                 "--vae", str(moved)]) == 0


# -------------------------------------------------------------------------- conversions

def _tiny_arch(**kw):
    a = {"model": "DiT-Ti/2", "input_size": 8, "in_channels": 4, "num_classes": 3, "class_dropout": 0.1,
         "learn_sigma": True, "images": False, "data": "test"}
    a.update(kw)
    return a


def _outputs(model):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 8, 8, generator=g)
    with torch.no_grad():
        return model.eval()(x, torch.tensor([0, 417, 999]), torch.tensor([0, 2, 3]))


@pytest.mark.parametrize("fmt,name", [("dit", "w.pt"), ("dit", "w.safetensors"), ("diffusers", "w-diffusers")])
def test_round_trips_give_identical_outputs(tmp_path, fmt, name):
    torch.manual_seed(0)
    m = _randomised(build_model(_tiny_arch()))
    src = convert.write(convert.Weights(arch=_tiny_arch(), model=m.state_dict(), source="test"),
                        "autohc", tmp_path / "a.pt")
    assert main(["convert", str(src), str(tmp_path / name), "--to", fmt]) == 0
    assert main(["convert", str(tmp_path / name), str(tmp_path / "back.pt"), "--to", "autohc"]) == 0
    w = convert.read(tmp_path / "back.pt")
    assert w.arch["model"] == "DiT-Ti/2" and w.arch["num_classes"] == 3 and w.arch["learn_sigma"]
    back = build_model(w.arch)
    back.load_state_dict(w.best)
    assert float((_outputs(back) - _outputs(m)).abs().max()) <= 1e-6
    for k, v in m.state_dict().items():
        assert torch.equal(w.best[k], v), k


def test_reference_training_checkpoint_with_args_and_ema_loads(tmp_path):
    """facebookresearch/DiT's train.py saves {"model", "ema", "opt", "args": Namespace}."""
    import argparse
    m = _randomised(build_model(_tiny_arch()))
    ema = {k: v + 1 for k, v in m.state_dict().items()}
    torch.save({"model": m.state_dict(), "ema": ema, "opt": {"state": {}, "param_groups": []},
                "args": argparse.Namespace(model="DiT-Ti/2", image_size=64)}, tmp_path / "0001000.pt")
    w = convert.read(tmp_path / "0001000.pt")
    assert torch.equal(w.model["pos_embed"], m.state_dict()["pos_embed"])
    assert torch.equal(w.best["final_layer.linear.bias"], ema["final_layer.linear.bias"])


def test_diffusers_model_and_pipeline_against_autohc(world, tmp_path):
    """The converted DiTTransformer2DModel computes what autohc's model computes except for one
    difference of diffusers' DiT: its timestep embedding's frequencies are 10000^(-i/127)
    (Timesteps(downscale_freq_shift=1)) where the reference's are 10000^(-i/128). With that
    set to the reference's, a DiTPipeline (DDPM on 25 of the 1000 steps, no guidance) draws
    the image `autohc sample --sampler ddpm --steps 25` draws from the same seed: both walk the
    reference's respaced chain (the converted scheduler spaces its steps by "linspace")."""
    from autohc.dit.sample import decode_latents, generate, load_model
    out = tmp_path / "pipe"
    assert main(["convert", str(world["run"]), str(out), "--to", "diffusers"]) == 0
    pipe = diffusers.DiTPipeline.from_pretrained(str(out))
    model, arch, _ = load_model(world["run"])
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3, 700]), torch.tensor([1, 2])
    with torch.no_grad():
        ours = model(x, t, y)
        theirs = pipe.transformer(x, timestep=t, class_labels=y).sample
        assert float((ours - theirs).abs().max()) > 1e-4           # the frequency difference
        for block in pipe.transformer.transformer_blocks:
            block.norm1.emb.time_proj.downscale_freq_shift = 0
        theirs = pipe.transformer(x, timestep=t, class_labels=y).sample
    assert float((ours - theirs).abs().max()) <= 1e-5
    torch.manual_seed(11)
    img = pipe(class_labels=[0, 2], guidance_scale=1.0, num_inference_steps=25, output_type="pt").images
    lat, _ = generate(model, arch, [0, 2], per_class=1, sampler="ddpm", steps=25, cfg=1.0, seed=11)
    mine = (decode_latents(lat, arch) / 2 + 0.5).clamp(0, 1)
    assert img.shape == mine.shape == (2, 3, 16, 16)
    assert float((img - mine).abs().max()) <= 1e-4, float((img - mine).abs().max())   # 4e-6 seen


# ------------------------------------------------------------------------- fine-tuning

def test_init_from_a_reference_state_dict_reinitialises_other_classes(world, tmp_path, capsys):
    ref = tmp_path / "DiT-Ti-2.pt"
    assert main(["convert", str(world["run"]), str(ref), "--to", "dit"]) == 0
    sub = tmp_path / "two"
    for c in CLASSES[:2]:
        shutil.copytree(world["imgs"] / c, tmp_path / "imgs2" / c)
    assert main(["encode", "--data", f"folder:{tmp_path / 'imgs2'}", "--vae", str(world["vae"]),
                 "--out", str(sub), "--no-progress"]) == 0
    capsys.readouterr()
    cfg = TrainConfig(model=None, data=f"latents:{sub}", steps=2, batch=4, out=str(tmp_path / "ft"),
                      autohc=False, init=str(ref))
    tr = Trainer(cfg)
    err = capsys.readouterr().err
    assert "label table is re-initialised" in err and "3 classes there, 2 in the data" in err
    assert cfg.model == "DiT-Ti/2" and tr.arch["learn_sigma"] is False
    src = torch.load(ref, weights_only=True)
    for k, v in tr.model.state_dict().items():
        if k != "y_embedder.embedding_table.weight":
            assert torch.equal(v, src[k]), k
    assert tr.model.y_embedder.embedding_table.weight.shape == (3, 192)


@pytest.mark.xdist_group("net")           # torchrun's default port (tests/test_dist.py)
def test_finetune_under_data_parallel_resumes_bit_identically(world, tmp_path):
    """A converted checkpoint fine-tuned on 2 ranks (torchrun, autohc installed): 4 steps in one
    go, and 2 + 2 with --resume, give the same losses bit for bit."""
    ref = tmp_path / "ref.pt"
    assert main(["convert", str(world["run"]), str(ref), "--to", "dit"]) == 0
    torchrun = shutil.which("torchrun") or pytest.fail("torchrun not found (it ships with torch)")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    base = [torchrun, "--nproc-per-node", "2", "-m", "autohc.cli", "train", "--init", str(ref),
            "--data", f"latents:{world['lat']}", "--batch", "6", "--threads", "1", "--ckpt-every", "2",
            "--samples-per-class", "0", "--no-progress"]

    def run(out, steps, *extra):
        r = subprocess.run([*base, "--steps", str(steps), "--out", str(out), *extra], env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stderr
    err = run(tmp_path / "a", 4)
    assert "data parallel over 2 ranks" in err and "starting from" in err
    run(tmp_path / "b", 2)
    assert "resuming" in run(tmp_path / "b", 4, "--resume")
    la, lb = ((tmp_path / d / "losses.csv").read_text() for d in "ab")
    assert la == lb and len(la.splitlines()) == 5
    a, b = (torch.load(tmp_path / d / "ckpt-00000004.pt", weights_only=True)["model"] for d in "ab")
    assert all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- bad inputs

def test_bad_inputs_are_one_line_exit_2_nothing_written(world, tmp_path, capsys):
    vae, out = str(world["vae"]), tmp_path / "out"
    enc = ["encode", "--vae", vae, "--out", str(out)]
    assert "not a directory" in one_line_exit_2(capsys, [*enc, "--data", f"folder:{tmp_path / 'none'}"], out)
    mixed = _images(tmp_path / "mixed", [(16, 16), (20, 16)])
    assert "--image-size" in one_line_exit_2(capsys, [*enc, "--data", f"folder:{mixed}"], out)
    assert "AutoencoderKL" in one_line_exit_2(
        capsys, ["encode", "--data", f"folder:{world['imgs']}", "--vae", str(world["imgs"]), "--out", str(out)], out)
    assert "AutoencoderKL" in one_line_exit_2(
        capsys, ["encode", "--data", f"folder:{world['imgs']}", "--vae", str(tmp_path / "no-vae"), "--out", str(out)], out)
    (tmp_path / "pickled.pt").write_bytes(b"")
    torch.save({"w": torch.zeros(1), "evil": ValueError("x")}, tmp_path / "pickled.pt")
    (tmp_path / "torn.pt").write_bytes(b"\x80\x04not a checkpoint")
    dst = tmp_path / "dst.pt"
    assert "pickled Python object" in one_line_exit_2(
        capsys, ["convert", str(tmp_path / "pickled.pt"), str(dst), "--to", "autohc"], dst)
    assert "not a loadable checkpoint" in one_line_exit_2(
        capsys, ["convert", str(tmp_path / "torn.pt"), str(dst), "--to", "dit"], dst)
    torch.save({"a": torch.zeros(2)}, tmp_path / "other.pt")
    assert "not a DiT state dict" in one_line_exit_2(
        capsys, ["convert", str(tmp_path / "other.pt"), str(dst), "--to", "dit"], dst)
    under_a_file = tmp_path / "pickled.pt" / "dst.pt"        # OUT's folder is a file
    for to in ("autohc", "diffusers"):
        assert "is a file, not a folder" in one_line_exit_2(
            capsys, ["convert", str(world["run"]), str(under_a_file), "--to", to])
    assert "--vae is for --to diffusers" in one_line_exit_2(
        capsys, ["convert", str(world["run"]), str(dst), "--to", "dit", "--vae", vae], dst)
    run = tmp_path / "run"
    train = ["train", "--data", f"latents:{world['lat']}", "--out", str(run), "--no-progress", "--steps", "1"]
    assert "pickled Python object" in one_line_exit_2(capsys, [*train, "--init", str(tmp_path / "pickled.pt")], run)
    ref = tmp_path / "ref.pt"
    assert main(["convert", str(world["run"]), str(ref), "--to", "dit"]) == 0
    assert "not the --model DiT-S/2" in one_line_exit_2(capsys, [*train, "--init", str(ref), "--model", "DiT-S/2"], run)
    assert "the data is 1 x 8 x 8" in one_line_exit_2(
        capsys, ["train", "--data", "digits", "--out", str(run), "--init", str(ref), "--no-progress"], run)
    assert "no meta.json" in one_line_exit_2(
        capsys, ["train", "--data", f"latents:{world['imgs']}", "--out", str(run), "--no-progress"], run)


def test_encode_stops_on_a_signal_after_its_batch_and_the_same_command_continues(world, tmp_path, monkeypatch,
                                                                                   capsys):
    """SIGTERM (as a batch system sends it) arrives while the second batch loads: that batch
    is finished and written, then exit 75; the same command completes the same file."""
    import os
    import signal
    from autohc.runtime import preempt
    imgs = world["imgs"]
    cmd = ["encode", "--data", f"folder:{imgs}", "--vae", str(world["vae"]), "--batch", "4", "--no-progress"]
    assert main([*cmd, "--out", str(tmp_path / "whole")]) == 0
    real, calls = encode._load_batch, []

    def signalled(part, size, mode):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(part, size, mode)
    monkeypatch.setattr(encode, "_load_batch", signalled)
    capsys.readouterr()
    assert main([*cmd, "--out", str(tmp_path / "part")]) == preempt.EXIT_PREEMPTED
    err = capsys.readouterr().err
    assert "autohc encode: SIGTERM at image 8 of 15: stopped" in err, err
    assert json.loads((tmp_path / "part" / "meta.json").read_text())["done"] == 8 and len(calls) == 2
    monkeypatch.setattr(encode, "_load_batch", real)
    assert main([*cmd, "--out", str(tmp_path / "part")]) == 0
    a, b = (np.load(tmp_path / d / "latents.npy") for d in ("whole", "part"))
    assert np.array_equal(a, b)


# ------------------------------------------------------------- encode over ranks

_STOP_ON_RANK_1 = """import os, signal, sys
from autohc.dit import encode
real, calls = encode._load_batch, []
def signalled(*a):
    calls.append(1)
    if os.environ["RANK"] == "1" and len(calls) == 2:     # rank 1's second batch: round 1
        os.kill(os.getpid(), signal.SIGTERM)
    return real(*a)
encode._load_batch = signalled
from autohc.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _launch_env():
    """No launcher's variables of this process's own (tests/test_dist.py)."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("OMPI_", "PMI_", "SLURM_", "PMIX_")) and k not in ("RANK", "WORLD_SIZE")}


def _same_data_set(a, b):
    assert np.array_equal(np.load(a / "latents.npy"), np.load(b / "latents.npy"))
    assert np.array_equal(np.load(a / "labels.npy"), np.load(b / "labels.npy"))
    assert json.loads((a / "meta.json").read_text()) == json.loads((b / "meta.json").read_text())


def _one_process(argv):
    """main(argv) in this process, its torch thread count (--threads) put back after."""
    threads = torch.get_num_threads()
    try:
        return main(argv)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def wide(world, tmp_path_factory):
    """21 images (3 classes x 7), --batch 2: 11 batches, 6 for rank 0 and 5 for rank 1 of 2;
    their latents (and flips) by one process on one thread."""
    root = tmp_path_factory.mktemp("wide")
    imgs = _images(root / "imgs", [(16, 16)] * 7)
    cmd = ["encode", "--data", f"folder:{imgs}", "--vae", str(world["vae"]), "--batch", "2", "--flip",
           "--threads", "1", "--no-progress"]
    assert _one_process([*cmd, "--out", str(root / "one")]) == 0
    return {"cmd": cmd, "one": root / "one"}


def _torchrun(args, **kw):
    torchrun = shutil.which("torchrun") or pytest.fail("torchrun not found (it ships with torch)")
    return subprocess.run([torchrun, "--nproc-per-node", "2", *args], env=_launch_env(), capture_output=True,
                          text=True, timeout=300, **kw)


def _autohc_lines(err):
    return [line for line in err.splitlines() if line.startswith(("autohc:", "autohc encode"))]


@pytest.mark.xdist_group("net")
def test_encode_over_two_ranks_under_torchrun_is_one_processes_file(wide, tmp_path):
    out = tmp_path / "two"
    r = _torchrun(["-m", "autohc.cli", *wide["cmd"], "--out", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "42 images encoded" in r.stdout and "over 2 ranks (torchrun)" in r.stdout, r.stdout
    assert r.stdout.count("autohc:") == 1 and not _autohc_lines(r.stderr), r.stderr[-3000:]
    _same_data_set(wide["one"], out)
    # a bad input rank 0 finds (another encode's folder): every rank stops, one line
    r = _torchrun(["-m", "autohc.cli", *wide["cmd"], "--seed", "5", "--out", str(out)])
    assert r.returncode != 0
    assert _autohc_lines(r.stderr) == [f"autohc: {out} holds latents of another encode (differs in seed): "
                                       "pass another --out"], r.stderr[-3000:]
    _same_data_set(wide["one"], out)


@pytest.mark.xdist_group("net")
def test_encode_stopped_on_one_rank_stops_all_and_one_process_finishes(wide, tmp_path):
    """SIGTERM reaches rank 1 alone, in round 1: both ranks finish that round (batches 2 and 3,
    images 0..7 written), exit 75; one process then completes the same file."""
    script = tmp_path / "stop_on_rank_1.py"
    script.write_text(_STOP_ON_RANK_1)
    out = tmp_path / "part"
    r = _torchrun([str(script), *wide["cmd"], "--out", str(out)], cwd=os.getcwd())
    assert r.returncode != 0
    assert _autohc_lines(r.stderr) == [f"autohc encode: SIGTERM at image 8 of 21: stopped, the rows so far kept "
                                       f"in {out}; the same command continues (exit 75)"], r.stderr[-3000:]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["done"] == 8 and not meta["complete"]
    assert _one_process([*wide["cmd"], "--out", str(out)]) == 0
    _same_data_set(wide["one"], out)


@pytest.mark.xdist_group("net")
def test_encode_stopped_in_one_process_finishes_under_mpirun(wide, tmp_path, monkeypatch):
    import signal
    mpirun = shutil.which("mpirun") or pytest.skip("mpirun not found (Open MPI or MPICH)")
    out = tmp_path / "part"
    calls = iter(range(1, 100))                             # SIGTERM while the third batch loads
    monkeypatch.setattr(encode, "_load_batch", lambda *a, real=encode._load_batch: (
        next(calls) == 3 and os.kill(os.getpid(), signal.SIGTERM), real(*a))[1])
    assert _one_process([*wide["cmd"], "--out", str(out)]) == 75
    assert json.loads((out / "meta.json").read_text())["done"] == 6
    r = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, "-m",
                        "autohc.cli", *wide["cmd"], "--out", str(out)], env=_launch_env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert f"autohc encode: resuming {out} at image 6 of 21" in r.stderr
    assert "30 images encoded" in r.stdout and "over 2 ranks (openmpi)" in r.stdout, r.stdout
    _same_data_set(wide["one"], out)
