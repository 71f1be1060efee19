"""DiT weights in the formats the ecosystem reads and writes, and autohc's own.

    autohc      a `ckpt-*.pt` of `autohc train` (or a run folder: its newest), or what
                `autohc convert --to autohc` writes: the same dict without optimizer state
    dit         a facebookresearch/DiT state dict: the released `DiT-XL-2-256x256.pt` (the EMA
                weights, plain) or a training checkpoint with `model`/`ema` keys; `.pt` or
                `.safetensors`
    diffusers   a `DiTTransformer2DModel` folder (`save_pretrained`), or a `DiTPipeline` folder
                with `transformer/` (and `vae/`, `scheduler/`) inside

autohc's model has the reference's parameter names, so `dit` is its state dict as is; diffusers
splits qkv into to_q/to_k/to_v and keeps a copy of the timestep and label embedders in every
block (`transformer_blocks.N.norm1.emb`). Files are loaded safely: `torch.load(weights_only=True)`
(plus argparse.Namespace, which the reference's training checkpoints hold as `args`) or
safetensors; a file that holds other pickled objects is refused, never unpickled.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import checkpoint
from .data import InputError
from .model import SIZES, sincos_2d


class CheckpointError(InputError):
    """A file or folder that is not a DiT checkpoint autohc can read, or not the model asked for."""


@dataclass
class Weights:
    """One DiT's weights in the reference's names, with what rebuilding the model takes."""
    arch: dict                          # as Trainer.arch: model, input_size, in_channels, ...
    model: dict                         # state dict (reference names)
    ema: dict | None = None             # EMA state dict, if the source had one
    step: int = 0
    source: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> dict:
        """The weights to sample from: the EMA's where there is one."""
        return self.ema if self.ema is not None else self.model


# ------------------------------------------------------------------------------------ reading

def read(path: str | Path) -> Weights:
    """Any supported checkpoint file or folder, or CheckpointError in one line."""
    p = Path(path)
    if p.is_dir():
        if (p / "config.json").is_file() or (p / "transformer" / "config.json").is_file():
            return _read_diffusers(p)
        if checkpoint.listing(p):
            return _from_autohc(*checkpoint.resolve(p))
        raise CheckpointError(f"{p}: a folder with neither a diffusers DiT (config.json) nor autohc "
                              "checkpoints (ckpt-*.pt)")
    if not p.is_file():
        raise CheckpointError(f"{p}: no such checkpoint file or folder")
    if p.suffix == ".safetensors":
        return _from_state_dict(_load_safetensors(p), p)
    state = _load_pt(p)
    if isinstance(state, dict) and state.get("format") == "autohc-dit-1":
        return _from_autohc(p, state)
    if isinstance(state, dict) and any(isinstance(state.get(k), dict) for k in ("model", "ema")):
        model = state.get("model") if isinstance(state.get("model"), dict) else state["ema"]
        w = _from_state_dict(model, p)
        if isinstance(state.get("ema"), dict):
            _check_same_keys(state["ema"], w.model, p, "ema")
            w.ema = state["ema"]
        return w
    if isinstance(state, dict):
        return _from_state_dict(state, p)
    raise CheckpointError(f"{p}: holds a {type(state).__name__}, not a DiT state dict")


def _load_pt(p: Path):
    import argparse
    import pickle
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if found:
            raise CheckpointError(f"{p}: holds a pickled Python object ({found.group(1)}), refused: only "
                                  "tensors and plain containers are loaded (torch.load weights_only=True)") from None
        why = re.search(r"WeightsUnpickler error: \s*(.+)", str(e))
        raise CheckpointError(f"{p}: not a loadable checkpoint ({why.group(1).strip() if why else 'UnpicklingError'})") from None
    except Exception as e:  # noqa: BLE001 - torch raises several types for torn/foreign files
        raise CheckpointError(checkpoint.unloadable(p, e)) from None


def _load_safetensors(p: Path) -> dict:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise CheckpointError(f"{p}: reading .safetensors needs safetensors: pip install safetensors") from None
    try:
        return load_file(str(p))
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{p}: not a loadable safetensors file ({type(e).__name__}: {e})") from None


def _from_autohc(path: Path, state: dict) -> Weights:
    return Weights(arch=dict(state["arch"]), model=state["model"], ema=state.get("ema"),
                   step=int(state.get("step", 0)), source=str(path))


def _check_same_keys(a: dict, b: dict, p: Path, what: str) -> None:
    if set(a) != set(b):
        raise CheckpointError(f"{p}: its {what} weights have other keys than its model weights")


def _count_blocks(sd: dict, prefix: str, leaf: str) -> int:
    n = 0
    while f"{prefix}{n}.{leaf}" in sd:
        n += 1
    return n


def model_name(depth: int, hidden: int, patch: int, where: str) -> str:
    """DiT-{size}/{patch} of a (depth, hidden) pair, or one clear error."""
    for size, (d, h, _) in SIZES.items():
        if (d, h) == (depth, hidden):
            return f"DiT-{size}/{patch}"
    known = ", ".join(f"{s} ({d} x {h})" for s, (d, h, _) in SIZES.items())
    raise CheckpointError(f"{where}: depth {depth} x hidden {hidden} is no DiT size autohc knows ({known})")


def infer_arch(sd: dict, where: str) -> dict:
    """The arch of a reference-named state dict, from its tensors' shapes."""
    need = ("x_embedder.proj.weight", "final_layer.linear.weight", "y_embedder.embedding_table.weight",
            "pos_embed")
    missing = [k for k in need if k not in sd]
    if missing:
        raise CheckpointError(f"{where}: not a DiT state dict (no {', '.join(missing)})")
    w = sd["x_embedder.proj.weight"]
    if w.dim() != 4 or w.shape[2] != w.shape[3]:
        raise CheckpointError(f"{where}: x_embedder.proj.weight has shape {tuple(w.shape)}, not a patch conv")
    hidden, channels, patch = w.shape[0], w.shape[1], w.shape[2]
    depth = _count_blocks(sd, "blocks.", "attn.qkv.weight")
    tokens = sd["pos_embed"].shape[1]
    grid = round(tokens ** 0.5)
    if grid * grid != tokens:
        raise CheckpointError(f"{where}: pos_embed has {tokens} positions, not a square grid")
    out = sd["final_layer.linear.weight"].shape[0] // (patch * patch)
    rows = sd["y_embedder.embedding_table.weight"].shape[0]
    return {"model": model_name(depth, hidden, patch, where), "input_size": grid * patch,
            "in_channels": channels, "num_classes": rows - 1, "class_dropout": 0.1,
            # 4 channels: latents (the reference's); 1 or 3: a pixel-space model such as autohc's digits
            "learn_sigma": out == 2 * channels, "images": channels in (1, 3), "data": "converted"}


def _from_state_dict(sd: dict, p: Path) -> Weights:
    if not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{p}: not a DiT state dict (values that are not tensors)")
    return Weights(arch=infer_arch(sd, str(p)), model=sd, source=str(p))


# ----------------------------------------------------------------------------- diffusers names

def to_diffusers(sd: dict, depth: int) -> dict:
    """Reference names -> DiTTransformer2DModel names (embedders copied into every block)."""
    out = {"pos_embed.proj.weight": sd["x_embedder.proj.weight"], "pos_embed.proj.bias": sd["x_embedder.proj.bias"],
           "proj_out_1.weight": sd["final_layer.adaLN_modulation.1.weight"],
           "proj_out_1.bias": sd["final_layer.adaLN_modulation.1.bias"],
           "proj_out_2.weight": sd["final_layer.linear.weight"], "proj_out_2.bias": sd["final_layer.linear.bias"]}
    for i in range(depth):
        d, r = f"transformer_blocks.{i}.", f"blocks.{i}."
        emb = d + "norm1.emb."
        for a, b in (("timestep_embedder.linear_1", "t_embedder.mlp.0"),
                     ("timestep_embedder.linear_2", "t_embedder.mlp.2")):
            for k in ("weight", "bias"):
                out[f"{emb}{a}.{k}"] = sd[f"{b}.{k}"]
        out[emb + "class_embedder.embedding_table.weight"] = sd["y_embedder.embedding_table.weight"]
        for k in ("weight", "bias"):
            out[f"{d}norm1.linear.{k}"] = sd[f"{r}adaLN_modulation.1.{k}"]
            q, kk, v = sd[f"{r}attn.qkv.{k}"].chunk(3, dim=0)
            out[f"{d}attn1.to_q.{k}"], out[f"{d}attn1.to_k.{k}"], out[f"{d}attn1.to_v.{k}"] = q, kk, v
            out[f"{d}attn1.to_out.0.{k}"] = sd[f"{r}attn.proj.{k}"]
            out[f"{d}ff.net.0.proj.{k}"] = sd[f"{r}mlp.fc1.{k}"]
            out[f"{d}ff.net.2.{k}"] = sd[f"{r}mlp.fc2.{k}"]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def from_diffusers(sd: dict, grid: int, where: str) -> tuple[dict, list[str]]:
    """DiTTransformer2DModel names -> reference names, and notes (embedders that differ between
    blocks: block 0's, which diffusers' final layer uses, are taken)."""
    depth = _count_blocks(sd, "transformer_blocks.", "attn1.to_q.weight")
    notes = []
    try:
        out = {"x_embedder.proj.weight": sd["pos_embed.proj.weight"], "x_embedder.proj.bias": sd["pos_embed.proj.bias"],
               "final_layer.adaLN_modulation.1.weight": sd["proj_out_1.weight"],
               "final_layer.adaLN_modulation.1.bias": sd["proj_out_1.bias"],
               "final_layer.linear.weight": sd["proj_out_2.weight"], "final_layer.linear.bias": sd["proj_out_2.bias"]}
        emb = "transformer_blocks.0.norm1.emb."
        for a, b in (("timestep_embedder.linear_1", "t_embedder.mlp.0"),
                     ("timestep_embedder.linear_2", "t_embedder.mlp.2")):
            for k in ("weight", "bias"):
                out[f"{b}.{k}"] = sd[f"{emb}{a}.{k}"]
        out["y_embedder.embedding_table.weight"] = sd[emb + "class_embedder.embedding_table.weight"]
        for i in range(depth):
            d, r = f"transformer_blocks.{i}.", f"blocks.{i}."
            for k in ("weight", "bias"):
                out[f"{r}adaLN_modulation.1.{k}"] = sd[f"{d}norm1.linear.{k}"]
                out[f"{r}attn.qkv.{k}"] = torch.cat([sd[f"{d}attn1.to_{x}.{k}"] for x in "qkv"], dim=0)
                out[f"{r}attn.proj.{k}"] = sd[f"{d}attn1.to_out.0.{k}"]
                out[f"{r}mlp.fc1.{k}"] = sd[f"{d}ff.net.0.proj.{k}"]
                out[f"{r}mlp.fc2.{k}"] = sd[f"{d}ff.net.2.{k}"]
            if i and any(not torch.equal(sd[f"{d}norm1.emb.{k}"], sd[f"{emb}{k}"])
                         for k in ("timestep_embedder.linear_1.weight", "class_embedder.embedding_table.weight")):
                notes.append(f"block {i}'s timestep/label embedder differs from block 0's; block 0's taken")
    except KeyError as e:
        raise CheckpointError(f"{where}: not a DiTTransformer2DModel state dict (no {e.args[0]})") from None
    out["pos_embed"] = torch.from_numpy(sincos_2d(out["x_embedder.proj.weight"].shape[0], grid)).float().unsqueeze(0)
    return {k: v.detach().clone().contiguous() for k, v in out.items()}, notes


def diffusers_config(arch: dict) -> dict:
    from .model import config as model_config
    c = model_config(arch["model"])
    return {"num_attention_heads": c.heads, "attention_head_dim": c.hidden // c.heads,
            "in_channels": arch["in_channels"],
            "out_channels": arch["in_channels"] * (2 if arch["learn_sigma"] else 1),
            "num_layers": c.depth, "sample_size": arch["input_size"], "patch_size": c.patch,
            "num_embeds_ada_norm": arch["num_classes"], "activation_fn": "gelu-approximate",
            "norm_type": "ada_norm_zero", "norm_elementwise_affine": False,
            # the reference's LayerNorms all use eps 1e-6; diffusers' default for the MLP's is 1e-5
            "norm_eps": 1e-6, "attention_bias": True}


def _read_diffusers(p: Path) -> Weights:
    from .vae import diffusers_module
    diffusers = diffusers_module()
    folder = p / "transformer" if (p / "transformer" / "config.json").is_file() else p
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{folder / 'config.json'}: unreadable ({type(e).__name__})") from None
    if cfg.get("_class_name") != "DiTTransformer2DModel":
        raise CheckpointError(f"{folder}: a diffusers {cfg.get('_class_name')!r}, not a DiTTransformer2DModel")
    try:
        model = diffusers.DiTTransformer2DModel.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"{folder}: not a loadable DiTTransformer2DModel ({type(e).__name__}: {first[:160]})") from None
    c = model.config
    grid = c.sample_size // c.patch_size
    sd, notes = from_diffusers(model.state_dict(), grid, str(folder))
    arch = infer_arch(sd, str(folder))
    sidecar = folder / "autohc.json"            # what autohc wrote beside diffusers' config
    if sidecar.is_file():
        arch.update(json.loads(sidecar.read_text()).get("arch", {}))
    elif (p / "vae" / "config.json").is_file():
        from .vae import load
        vae = load(p)
        arch["latent"] = {"vae": str(p.resolve()), "scaling_factor": float(vae.config.scaling_factor),
                          "image_size": c.sample_size * 2 ** (len(vae.config.block_out_channels) - 1),
                          "classes": [str(i) for i in range(arch["num_classes"])]}
    return Weights(arch=arch, model=sd, source=str(p), notes=notes)


# ------------------------------------------------------------------------------------ writing

def _atomic_file(path: Path, write) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_autohc(w: Weights, path: Path) -> Path:
    """An autohc checkpoint without optimizer state: for sample/eval and `train --init`."""
    state = {"format": "autohc-dit-1", "arch": w.arch, "step": w.step, "model": w.model,
             "ema": w.best, "converted_from": w.source}
    return _atomic_file(Path(path), lambda t: torch.save(state, t))


def write_dit(w: Weights, path: Path) -> Path:
    """A plain reference state dict (the EMA's weights, as the released checkpoints), which
    facebookresearch/DiT's sample.py loads; .safetensors by the suffix."""
    sd = {k: v.detach().contiguous() for k, v in w.best.items()}
    if Path(path).suffix == ".safetensors":
        from safetensors.torch import save_file
        return _atomic_file(Path(path), lambda t: save_file(sd, str(t)))
    return _atomic_file(Path(path), lambda t: torch.save(sd, t))


def write_diffusers(w: Weights, out: Path, vae_spec: str | None = None) -> Path:
    """A DiTTransformer2DModel folder; with a VAE (given, or the one the model was trained on),
    a whole DiTPipeline folder (transformer/, vae/, scheduler/: DDPM with DiT's linear
    schedule). Written beside, then renamed into place."""
    from .vae import diffusers_module, load as load_vae
    diffusers = diffusers_module()
    out = Path(out)
    if out.exists():
        raise CheckpointError(f"{out}: exists; pass a new folder")
    arch = dict(w.arch)
    sd = dict(w.best)
    rows = sd["y_embedder.embedding_table.weight"]
    if rows.shape[0] == arch["num_classes"]:
        # diffusers' label table always has the null class (dropout 0.1 built in): a zero row
        sd["y_embedder.embedding_table.weight"] = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
        w.notes.append("the model had no null class (class dropout 0): a zero row added for diffusers")
    model = diffusers.DiTTransformer2DModel(**diffusers_config(arch))
    c = model_config_depth(arch)
    missing, unexpected = model.load_state_dict(to_diffusers(sd, c), strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{w.source}: does not map onto DiTTransformer2DModel (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]})")
    vae_spec = vae_spec or (arch.get("latent") or {}).get("vae")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if vae_spec:
            vae = load_vae(vae_spec)
            sched = diffusers.DDPMScheduler(num_train_timesteps=1000, beta_start=1e-4, beta_end=0.02,
                                            beta_schedule="linear", variance_type="fixed_small",
                                            clip_sample=False, timestep_spacing="linspace")
            diffusers.DiTPipeline(transformer=model, vae=vae, scheduler=sched).save_pretrained(str(tmp))
            meta_dir = tmp / "transformer"
        else:
            model.save_pretrained(str(tmp))
            meta_dir = tmp
        (meta_dir / "autohc.json").write_text(json.dumps({"arch": arch, "source": w.source}, indent=1))
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def model_config_depth(arch: dict) -> int:
    from .model import config as model_config
    return model_config(arch["model"]).depth


def write(w: Weights, fmt: str, out: str | Path, *, vae: str | None = None) -> Path:
    if fmt == "autohc":
        return write_autohc(w, Path(out))
    if fmt == "dit":
        return write_dit(w, Path(out))
    if fmt == "diffusers":
        return write_diffusers(w, Path(out), vae)
    raise ValueError(f"unknown format {fmt!r}: autohc, dit or diffusers")


def warn(notes: list[str]) -> None:
    for n in notes:
        print(f"autohc: note: {n}", file=sys.stderr)
