"""Training data for `autohc train --data SPEC`, as float32 (N, C, H, W) in [-1, 1] (images)
or as given (latents), with int64 labels.

    digits          scikit-learn's bundled 8x8 digits (1797 images, 10 classes; no download)
    folder:PATH     one subfolder per class, images inside (PNG/JPEG/...); all the same size
                    unless --image-size resizes them
    npy:PATH        PATH.npy holds N x C x H x W (uint8 images -> [-1, 1]; float as given,
                    e.g. latents), labels in the sibling PATH-without-.npy + '.labels.npy'
    synthetic       random images and labels (benchmarks); --image-size, --channels
    latents:DIR     a latent data set written by `autohc encode` (memory-mapped, never read
                    whole; the VAE and class names come with it)

Batches come from a seeded, per-epoch permutation, sharded by rank (rank::world), so a
position (epoch, index) is all a checkpoint needs to continue the stream exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import data_spec

LATENTS_FORMAT = "autohc-latents-1"      # meta.json of an `autohc encode` folder (dit/encode.py)
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}


class InputError(ValueError):
    """A file or folder given on the command line that is not what it should be (a VAE, a
    checkpoint, a latent data set): one line naming it, exit code 2, nothing written."""


class DataError(InputError):
    """A data input the trainer cannot use (`--data`); the message names the file."""


@dataclass
class Dataset:
    x: torch.Tensor             # (N, C, H, W) float32
    y: torch.Tensor             # (N,) int64
    num_classes: int
    name: str
    images: bool = True         # values in [-1, 1] (clip when sampling)
    latent: dict | None = None  # latents of a VAE: its spec, scaling factor, image size, class names

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.x.shape[1:])


def load(spec: str, *, image_size: int | None = None, channels: int = 3, num: int = 4096,
         num_classes: int = 10, seed: int = 0) -> Dataset:
    try:
        kind, arg = data_spec.parse(spec)
    except ValueError as e:
        raise DataError(str(e)) from None
    if kind == "digits":
        return digits()
    if kind == "synthetic":
        return synthetic(image_size or 32, channels, num, num_classes, seed)
    if kind == "folder":
        return folder(Path(arg), image_size)
    if kind == "npy":
        return npy(Path(arg))
    return latents(Path(arg))


def digits() -> Dataset:
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.from_numpy(d.images.astype(np.float32)).unsqueeze(1) / 8.0 - 1.0   # 0..16 -> [-1, 1]
    return Dataset(x, torch.from_numpy(d.target.astype(np.int64)), 10, "digits")


def synthetic(size: int, channels: int, num: int, num_classes: int, seed: int) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand((num, channels, size, size), generator=g) * 2 - 1
    y = torch.randint(0, num_classes, (num,), generator=g)
    return Dataset(x, y, num_classes, "synthetic")


def class_files(root: Path) -> tuple[list[str], list[tuple[Path, int]]]:
    """(class names, [(image file, label)]) of a folder with one subfolder per class, sorted."""
    if not root.is_dir():
        raise DataError(f"{root}: not a directory (folder:PATH wants one subfolder per class)")
    classes = sorted(p for p in root.iterdir() if p.is_dir())
    if not classes:
        raise DataError(f"{root}: no class subfolders")
    files = [(f, i) for i, c in enumerate(classes) for f in sorted(c.iterdir())
             if f.suffix.lower() in IMAGE_SUFFIXES]
    if not files:
        raise DataError(f"{root}: no images in its class subfolders")
    return [c.name for c in classes], files


def folder(root: Path, image_size: int | None) -> Dataset:
    from PIL import Image, UnidentifiedImageError
    classes, files = class_files(root)
    xs, ys, mode, size = [], [], None, None
    for f, label in files:
        try:
            with Image.open(f) as im:
                im.load()
                mode = mode or ("L" if im.mode in ("L", "1", "I;16") else "RGB")
                im = im.convert(mode)
                if image_size:
                    im = im.resize((image_size, image_size), Image.BICUBIC)
        except (UnidentifiedImageError, OSError) as e:
            raise DataError(f"{f}: not a readable image ({type(e).__name__})") from None
        size = size or im.size
        if im.size != size or im.size[0] != im.size[1]:
            raise DataError(f"{f}: size {im.size[0]}x{im.size[1]}, expected {size[0]}x{size[1]} square "
                            "(pass --image-size N to resize)")
        a = np.asarray(im, dtype=np.uint8)
        xs.append(a[None] if a.ndim == 2 else a.transpose(2, 0, 1))
        ys.append(label)
    x = torch.from_numpy(np.stack(xs)).float() / 127.5 - 1.0
    return Dataset(x, torch.tensor(ys, dtype=torch.int64), len(classes), f"folder:{root}")


def labels_path(path: Path) -> Path:
    return path.with_name(path.name[:-4] + ".labels.npy") if path.name.endswith(".npy") else path.with_name(path.name + ".labels.npy")


def npy(path: Path) -> Dataset:
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    lpath = labels_path(path)
    if not lpath.is_file():
        raise DataError(f"{lpath}: missing label file for {path} (N int labels)")
    try:
        a = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise DataError(f"{path}: not a .npy array ({e})") from None
    try:
        lab = np.load(lpath, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise DataError(f"{lpath}: not a .npy array ({e})") from None
    if a.ndim != 4 or a.shape[2] != a.shape[3] or a.shape[0] == 0:
        raise DataError(f"{path}: shape {a.shape}, expected N x C x H x W with H == W and N > 0")
    if lab.shape != (a.shape[0],) or not np.issubdtype(lab.dtype, np.integer) or lab.min() < 0:
        raise DataError(f"{lpath}: shape {lab.shape} dtype {lab.dtype}, expected {a.shape[0]} "
                        "non-negative int labels")
    if a.dtype == np.uint8:
        x, images = torch.from_numpy(a).float() / 127.5 - 1.0, True
    elif np.issubdtype(a.dtype, np.floating):
        x, images = torch.from_numpy(a.astype(np.float32)), False
    else:
        raise DataError(f"{path}: dtype {a.dtype}, expected uint8 images or float arrays")
    if not torch.isfinite(x).all():
        raise DataError(f"{path}: holds NaN or Inf")
    y = torch.from_numpy(lab.astype(np.int64))
    return Dataset(x, y, int(y.max()) + 1, f"npy:{path}", images)


def latents(folder: Path) -> Dataset:
    """An `autohc encode` folder: latents memory-mapped copy-on-write (pages read as batches
    need them), labels, and what sampling needs to decode them."""
    meta = read_latents_meta(folder)
    try:
        x = np.load(folder / "latents.npy", mmap_mode="c")
        y = np.load(folder / "labels.npy", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise InputError(f"latents:{folder}: unreadable latents.npy or labels.npy ({e})") from None
    if x.dtype != np.float32 or list(x.shape) != meta["shape"] or y.shape != (x.shape[0],):
        raise InputError(f"latents:{folder}: latents {x.dtype} {x.shape} / labels {y.shape} do not "
                         f"match meta.json's shape {meta['shape']}")
    latent = {k: meta[k] for k in ("vae", "scaling_factor", "image_size", "classes")}
    return Dataset(torch.from_numpy(x), torch.from_numpy(y.astype(np.int64)), len(meta["classes"]),
                   f"latents:{folder.resolve()}", images=False, latent=latent)


def read_latents_meta(folder: Path) -> dict:
    """meta.json of a finished encode, or one clear error."""
    import json
    meta_path = folder / "meta.json"
    if not folder.is_dir():
        raise InputError(f"latents:{folder}: no such folder (autohc encode writes one)")
    if not meta_path.is_file():
        raise InputError(f"latents:{folder}: no meta.json: not a folder written by autohc encode")
    try:
        meta = json.loads(meta_path.read_text())
    except (ValueError, OSError) as e:
        raise InputError(f"{meta_path}: unreadable ({type(e).__name__})") from None
    if meta.get("format") != LATENTS_FORMAT:
        raise InputError(f"{meta_path}: format {meta.get('format')!r}, expected {LATENTS_FORMAT!r}")
    if not meta.get("complete"):
        raise InputError(f"latents:{folder}: the encode stopped at image {meta.get('done', 0)}: run the "
                         "same autohc encode command again to finish it")
    return meta


class Batches:
    """Endless global batches of a dataset: each epoch a permutation from (seed, epoch), cut
    into batches of `batch` (a batch may run across an epoch's end); `next` gives this rank's
    slice of the global batch (rank r of w: rows r*batch/w up to (r+1)*batch/w). So w ranks
    see exactly the samples one process would, whatever w is (a resume may change it)."""

    def __init__(self, data: Dataset, batch: int, *, seed: int = 0, rank: int = 0, world: int = 1):
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if batch % world:
            raise ValueError(f"the global batch {batch} does not split evenly over {world} ranks")
        self.data, self.batch, self.seed, self.rank, self.world = data, batch, seed, rank, world
        self.epoch, self.pos = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(len(self.data.y), generator=g)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, s: dict) -> None:
        self.epoch, self.pos = int(s["epoch"]), int(s["pos"])
        self._order = self._epoch_order()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        idx = []
        while len(idx) < self.batch:
            if self.pos >= len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._epoch_order()
                if len(self._order) == 0:
                    raise DataError(f"{self.data.name}: no samples")
            take = self._order[self.pos:self.pos + self.batch - len(idx)]
            idx.extend(take.tolist())
            self.pos += len(take)
        share = self.batch // self.world
        i = torch.tensor(idx[self.rank * share:(self.rank + 1) * share])
        return self.data.x[i], self.data.y[i]
