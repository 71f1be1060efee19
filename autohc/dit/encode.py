"""`autohc encode`: a folder of class images -> a latent data set, once, as fast-DiT's
extract_features.py does, read back by `--data latents:DIR`.

DIR holds
    latents.npy   float32 (N, C, h, w), scaled latents (what the DiT trains on), filled in
                  order and memory-mapped: the data set is never in memory, here or in training
    labels.npy    int64 (N,)
    meta.json     format, class names, the VAE, its scaling factor, image size, flip, seed, a
                  fingerprint of the inputs, the precision the VAE ran in (fp32, or bf16: its
                  encoder forward under torch.autocast; the latents are fp32 either way), and
                  `done`: the rows written so far

Images are center-cropped and resized as the reference (ADM's center_crop_arr: halve with a
box filter while the short side is >= twice the size, bicubic to the size, crop the middle);
`--flip` adds a horizontally flipped copy of every image (rows n..2n-1). Each image's
posterior draw has its own seed (vae.encode), so a run that was stopped and started again
(`done` rows kept) gives the same file as one that was not; a resume in another precision
(a meta.json without one is from fp32) is refused. `data.latents` reads it back.
A stop signal (`stop`, runtime/preempt.StopSignals) ends the run after the batch in flight
(its rows and `done` written); the summary's "stopped_by" names the signal.
Under torchrun, mpirun or srun (a process group) the ranks share the batches round-robin and
write one file, the same as one process's (encode_folder); a resume may use another world size.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from . import precision as precisionlib, vae as vaelib
from .data import LATENTS_FORMAT as FORMAT, DataError, InputError, class_files


def center_crop(im, size: int):
    """A PIL image cropped to its centered size x size square, resized as the reference does."""
    from PIL import Image
    while min(im.size) >= 2 * size:
        im = im.resize(tuple(x // 2 for x in im.size), resample=Image.BOX)
    scale = size / min(im.size)
    im = im.resize(tuple(round(x * scale) for x in im.size), resample=Image.BICUBIC)
    left, top = (im.size[0] - size) // 2, (im.size[1] - size) // 2
    return im.crop((left, top, left + size, top + size))


def _scan(files: list[tuple[Path, int]], image_size: int | None, factor: int) -> int:
    """The side every image will have; reads headers only. Mixed or non-square sizes need
    --image-size; the side must be a multiple of the VAE's downsampling."""
    from PIL import Image, UnidentifiedImageError
    sizes = {}
    for f, _ in files:
        try:
            with Image.open(f) as im:
                sizes.setdefault(im.size, f)
        except (UnidentifiedImageError, OSError) as e:
            raise InputError(f"{f}: not a readable image ({type(e).__name__})") from None
    if image_size is None:
        if len(sizes) > 1 or any(w != h for w, h in sizes):
            (a, fa), (b, fb) = (list(sizes.items()) * 2)[:2]
            what = f"{fa} is {a[0]}x{a[1]}, {fb} is {b[0]}x{b[1]}" if len(sizes) > 1 else f"{fa} is {a[0]}x{a[1]}"
            raise InputError(f"images of mixed or non-square sizes ({what}): pass --image-size N "
                             "to center-crop and resize them")
        image_size = next(iter(sizes))[0]
    if image_size % factor:
        raise InputError(f"image size {image_size} is not a multiple of the VAE's downsampling "
                         f"factor {factor}: pass --image-size N with N a multiple of {factor}")
    return image_size


def _fingerprint(files: list[tuple[Path, int]]) -> str:
    h = hashlib.sha256()
    for f, label in files:
        st = f.stat()
        h.update(f"{f}\0{label}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _vae_ref(spec: str) -> str:
    """What the data set records of --vae: an absolute folder, or the hub id as given."""
    p = Path(spec)
    return str(p.resolve()) if p.exists() else spec


class Elsewhere(InputError):
    """Another rank's error (or, on rank 0, the one it names): every rank stops with exit 2,
    rank 0 alone says why."""


def _gather(obj) -> list:
    """obj of every rank, in rank order (this process's alone outside a process group). Over
    MPI under an MPI launcher: a gloo worker thread that drops a Python tensor of
    all_gather_object while the interpreter exits aborts the process (seen under mpirun)."""
    import torch.distributed as tdist
    from ..runtime import dist
    if not tdist.is_initialized() or tdist.get_world_size() == 1:
        return [obj]
    if dist.comm_over_mpi():
        from mpi4py import MPI
        return MPI.COMM_WORLD.allgather(obj)
    out = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, obj)
    return out


def _place() -> tuple[int, int]:
    import torch.distributed as tdist
    return (tdist.get_rank(), tdist.get_world_size()) if tdist.is_initialized() else (0, 1)


def _agree(rank: int, error: BaseException | None, errors: list) -> None:
    """Every rank raises when any rank failed: rank 0 its own error (or an Elsewhere naming the
    first rank that failed), the other ranks an Elsewhere (quiet)."""
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not bad:
        return
    if rank == 0 and error is not None:
        raise error
    r, text = bad[0]
    raise Elsewhere(text if r == 0 else f"rank {r} of {len(errors)}: {text}")


def encode_folder(root: str | Path, vae_spec: str, out: str | Path, *, image_size: int | None = None,
                  flip: bool = False, batch: int = 16, seed: int = 0, precision: str = "fp32",
                  log: Callable[[str], None] | None = None, progress: bool = True, stop=None) -> dict:
    """Encode root's class images into out (resuming a stopped run there); a summary.
    stop: a preempt.StopSignals looked at after each batch (each round, over ranks).
    precision: fp32, bf16 or auto (dit/precision.py resolve: bf16 where the CPU multiplies
    bf16 in hardware); the resolved one is a setting (meta.json "precision"), its reason the
    summary's "precision_why".

    In a process group (autohc encode under torchrun, mpirun, srun) the batches are fixed
    (batch k = files[k*B:(k+1)*B]) and drawn round-robin: in a round every rank encodes one
    batch (or none, at the end) into the shared latents.npy, then all join one collective
    (stop signals, errors) and rank 0 records `done`; the file is the same as one process's."""
    root, out = Path(root), Path(out)
    rank, world = _place()
    error, done = None, 0
    prec, why = precisionlib.resolve(precision)     # a bad value: ValueError, before any rank works
    try:
        settings, files, vae, size, mode, shape = _setup(root, vae_spec, image_size, flip, batch, seed, prec)
        if rank == 0:
            done = _open_out(out, settings, files, flip, shape, asked=precision)
    except Exception as e:          # noqa: BLE001 - one rank's error stops every rank (_agree)
        if world == 1:
            raise
        error, settings = e, None
    if world > 1:
        states = _gather((None if error is None else str(error), settings, done))
        _agree(rank, error, [e for e, _, _ in states])
        _agree(rank, None, [f"other inputs than rank 0's (differ in {', '.join(d)})" if d else None
                            for d in ([k for k in s if states[0][1].get(k) != s[k]] for _, s, _ in states)])
        done = states[0][2]
    n = len(files)
    rows = 2 * n if flip else n
    meta_path = out / "meta.json"
    if done >= n:
        return {**settings, "done": n, "images": rows, "new_images": 0, "seconds": 0.0,
                "images_per_s": 0.0, "out": str(out), "stopped_by": None, "precision_why": why}
    latents = np.load(out / "latents.npy", mmap_mode="r+")
    if done and log:
        log(f"autohc encode: resuming {out} at image {done} of {n}")
    t0, new, stopped_by = time.perf_counter(), 0, None
    tty = sys.stderr.isatty()
    batches = -(-n // batch)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
    with Progress(TextColumn("encode"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  TextColumn("{task.fields[rate]}"), disable=not (progress and tty),
                  console=Console(stderr=True)) as bar:
        task = bar.add_task("encode", total=n, completed=done, rate="")
        for first in range(done // batch, batches, world):          # a round: one batch per rank
            k, error = first + rank, None
            if k < batches:
                try:
                    _encode_batch(vae, files, k * batch, batch, size, mode, seed, flip, latents, prec)
                except Exception as e:  # noqa: BLE001 - as above
                    if world == 1:
                        raise
                    error = e
            states = _gather((None if error is None else str(error), stop.requested if stop is not None else None))
            _agree(rank, error, [e for e, _ in states])
            before, done = done, min(n, (first + world) * batch)    # all rows below are on disk
            new += (done - before) * (2 if flip else 1)
            if rank == 0:
                _write_json(meta_path, {**settings, "done": done, "complete": done == n})
            rate = new / (time.perf_counter() - t0)
            bar.update(task, completed=done, rate=f"{rate:.1f} images/s")
            if log and not tty and progress and (done == n or done // batch // 10 > before // batch // 10):
                log(f"autohc encode: {done}/{n} images · {rate:.1f} images/s")
            stopped_by = next((s for _, s in states if s), None)
            if stopped_by and done < n:
                break
    dt = time.perf_counter() - t0
    return {**settings, "done": done, "images": rows, "new_images": new, "seconds": dt,
            "images_per_s": new / dt if dt else 0.0, "out": str(out),
            "stopped_by": stopped_by if done < n else None, "precision_why": why}


def _setup(root: Path, vae_spec: str, image_size, flip: bool, batch: int, seed: int, prec: str = "fp32"):
    """(settings, files, vae, image side, PIL mode, latents' shape); InputError for bad inputs."""
    if batch < 1:
        raise InputError(f"--batch must be >= 1, got {batch}")
    try:
        classes, files = class_files(root)
    except DataError as e:
        raise InputError(str(e)) from None
    vae = vaelib.load(vae_spec)
    factor = vaelib.downsampling(vae)
    size = _scan(files, image_size, factor)
    mode = "RGB" if vae.config.in_channels == 3 else "L" if vae.config.in_channels == 1 else None
    if mode is None:
        raise InputError(f"--vae {vae_spec}: {vae.config.in_channels} input channels; encode takes "
                         "1 (grey) or 3 (RGB)")
    n = len(files)
    shape = (2 * n if flip else n, vae.config.latent_channels, size // factor, size // factor)
    settings = {"format": FORMAT, "classes": classes, "vae": _vae_ref(vae_spec),
                "scaling_factor": vaelib.scaling_factor(vae), "image_size": size, "flip": flip,
                "seed": seed, "shape": list(shape), "inputs": _fingerprint(files), "source": str(root.resolve()),
                "precision": prec}
    return settings, files, vae, size, mode, shape


def _open_out(out: Path, settings: dict, files, flip: bool, shape, asked: str | None = None) -> int:
    """Checks out's meta.json against settings (rows done so far), or creates the folder:
    labels.npy, latents.npy (zeros) and meta.json with done 0. Rank 0's job. asked: the
    --precision given (auto), for the message of a precision that differs."""
    meta_path = out / "meta.json"
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        old.setdefault("precision", "fp32")         # written before --precision: the VAE ran fp32
        if old["precision"] != settings["precision"]:
            now = settings["precision"] + (f" from --precision {asked}" if asked and asked != settings["precision"] else "")
            raise InputError(f"{out} holds latents encoded in {old['precision']} (this command: {now}): "
                             f"pass --precision {old['precision']} to continue it, or another --out")
        diff = [k for k in settings if old.get(k) != settings[k]]
        if diff:
            raise InputError(f"{out} holds latents of another encode (differs in {', '.join(diff)}): "
                             "pass another --out")
        return int(old.get("done", 0))
    # (only these, with no meta.json: a creation that stopped part-way, made again)
    if out.exists() and any(f.name not in _CREATED for f in out.iterdir()):
        raise InputError(f"{out}: exists and is not an encode's folder: pass a new or empty --out")
    out.mkdir(parents=True, exist_ok=True)
    labels = np.array([label for _, label in files] * (2 if flip else 1), dtype=np.int64)
    np.save(out / ".labels.npy.tmp.npy", labels)
    os.replace(out / ".labels.npy.tmp.npy", out / "labels.npy")
    del labels
    np.lib.format.open_memmap(out / ".latents.npy.tmp.npy", mode="w+", dtype=np.float32, shape=shape).flush()
    os.replace(out / ".latents.npy.tmp.npy", out / "latents.npy")
    _write_json(meta_path, {**settings, "done": 0, "complete": False})
    return 0


# what _open_out writes before meta.json
_CREATED = frozenset({"labels.npy", "latents.npy", ".labels.npy.tmp.npy", ".latents.npy.tmp.npy"})


def _encode_batch(vae, files, start: int, batch: int, size: int, mode: str, seed: int, flip: bool,
                  latents, prec: str = "fp32") -> None:
    """Batch files[start:start+batch] (and its flips, rows n+...) into latents, flushed; the
    VAE in prec (resolved: fp32 or bf16)."""
    n = len(files)
    part = files[start:start + batch]
    x = _load_batch(part, size, mode)
    idx = list(range(start, start + len(part)))
    latents[start:start + len(part)] = vaelib.encode(vae, x, [seed * 1_000_003 + i for i in idx], prec).numpy()
    if flip:
        latents[n + start:n + start + len(part)] = vaelib.encode(
            vae, x.flip(-1), [seed * 1_000_003 + n + i for i in idx], prec).numpy()
    latents.flush()             # the rows reach the file before `done` says so


def _load_batch(part: list[tuple[Path, int]], size: int, mode: str) -> torch.Tensor:
    from PIL import Image, UnidentifiedImageError
    arrays = []
    for f, _ in part:
        try:
            with Image.open(f) as im:
                im = center_crop(im.convert(mode), size) if im.size != (size, size) else im.convert(mode)
                a = np.asarray(im, dtype=np.uint8)
        except (UnidentifiedImageError, OSError) as e:
            raise InputError(f"{f}: not a readable image ({type(e).__name__}); fix or remove it "
                             "and run the same command again (it resumes)") from None
        arrays.append(a[None] if a.ndim == 2 else a.transpose(2, 0, 1))
    return torch.from_numpy(np.stack(arrays)).float() / 127.5 - 1.0
