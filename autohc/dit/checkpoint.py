"""Checkpoints that a kill -9 at any moment cannot break.

Each is written to a temporary file in the same folder, flushed and fsync'ed, then renamed
over its final name (`ckpt-<step>.pt`, atomic on POSIX) and the folder fsync'ed; only then are
older ones beyond `keep` deleted. A reader takes the newest checkpoint that loads and warns
about (and skips) any that does not.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import torch

PATTERN = re.compile(r"^ckpt-(\d{8})\.pt$")


def path_for(folder: Path, step: int) -> Path:
    return Path(folder) / f"ckpt-{step:08d}.pt"


def listing(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of the checkpoints in folder, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := PATTERN.match(p.name))]
    return sorted(found)


def save(state: dict, folder: Path, step: int, keep: int = 3) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = path_for(folder, step)
    tmp = folder / f".{final.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)            # the rename itself reaches the disk
    finally:
        os.close(fd)
    for _, old in listing(folder)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    for stale in folder.glob(".ckpt-*.pt.tmp-*"):       # left by a killed writer
        if not stale.name.endswith(f"-{os.getpid()}"):
            stale.unlink(missing_ok=True)
    return final


def load(path: Path) -> dict:
    """One checkpoint file (weights_only: loading never runs code from the file)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises several types for a torn/foreign file
        raise ValueError(f"{path}: not a loadable autohc checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or state.get("format") != "autohc-dit-1":
        raise ValueError(f"{path}: not an autohc DiT checkpoint")
    return state


def latest(folder: Path) -> tuple[Path, dict] | None:
    """The newest checkpoint in folder that loads, or None."""
    for _, p in reversed(listing(folder)):
        try:
            return p, load(p)
        except ValueError as e:
            print(f"autohc: warning: skipping {e}", file=sys.stderr)
    return None


def resolve(path: str | Path) -> tuple[Path, dict]:
    """A checkpoint file, or the newest loadable one in a folder (a run's --out)."""
    p = Path(path)
    if p.is_dir():
        found = latest(p)
        if found is None:
            raise ValueError(f"{p}: no loadable checkpoint (ckpt-*.pt) in this folder")
        return found
    if not p.is_file():
        raise ValueError(f"{p}: no such checkpoint file or folder")
    return p, load(p)
