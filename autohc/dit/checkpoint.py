"""Checkpoints that a kill -9 at any moment cannot break.

Each is written to a temporary file in the same folder, flushed and fsync'ed, then renamed
over its final name (`ckpt-<step>.pt`, atomic on POSIX) and the folder fsync'ed; only then are
older ones beyond `keep` deleted. A reader takes the newest checkpoint that loads and warns
about (and skips) any that does not.

A checkpoint that cannot be written (no space, a quota, a file-size limit, permissions, an I/O
error) raises WriteError, one line naming the path, the bytes it needs and the bytes free;
nothing of it is left behind and the previous checkpoints are untouched. A folder with less
free space than the checkpoint needs is refused before anything is written.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import torch

from ..runtime import preempt
from .data import InputError

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


class WriteError(InputError):
    """A checkpoint that could not be written; the previous ones stay as they were."""


def state_bytes(obj) -> int:
    """The tensor bytes in a (nested) state: about what torch.save writes."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def free_bytes(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _write_error(final: Path, why: str, need: int) -> WriteError:
    free = free_bytes(final.parent)
    room = f"needs about {_gb(need)}, {_gb(free)} free there" if free is not None else f"needs about {_gb(need)}"
    prev = listing(final.parent)
    keep = f"; the previous checkpoint {prev[-1][1]} stays loadable" if prev else ""
    return WriteError(f"cannot write checkpoint {final}: {why} ({room}){keep}")


class _Writer:
    """The file torch.save writes through: every byte written or the OSError kept, since
    torch.save reports a failed write only as "unexpected pos" (a RuntimeError)."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                done += self.f.write(view[done:])
        except OSError as e:
            self.error = e
            raise
        return done

    def flush(self) -> None:
        self.f.flush()


def _reason(e: BaseException) -> str:
    """The system's words for a failed write (No space left on device, File too large, ...)."""
    if isinstance(e, OSError) and e.errno is not None:
        return os.strerror(e.errno)
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def save(state: dict, folder: Path, step: int, keep: int = 3) -> Path:
    folder = Path(folder)
    final = path_for(folder, step)
    need = state_bytes(state)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _write_error(final, _reason(e), need) from None
    free = free_bytes(folder)
    if free is not None and free < need:            # refused before a byte is written
        raise _write_error(final, "not enough free space", need)
    tmp = folder / f".{final.name}.tmp-{os.getpid()}"
    writer = None
    try:
        with preempt.writing(tmp), open(tmp, "wb", buffering=0) as f:
            writer = _Writer(f)
            torch.save(state, writer)
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except (OSError, RuntimeError) as e:
        raise _write_error(final, _reason(writer.error if writer and writer.error else e), need) from None
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


def unloadable(path: Path, e: Exception, what: str = "checkpoint") -> str:
    """One line on why torch.load refused `path` (its own words for a foreign file can be a
    bare "EOFError" or "101", so an empty file is named as such)."""
    try:
        if path.stat().st_size == 0:
            return f"{path}: an empty file, not a {what}"
    except OSError:
        pass
    said = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
    why = type(e).__name__ + (f": {said}" if said and said != type(e).__name__ else "")
    return f"{path}: not a loadable {what} (torch.load: {why})"


def load(path: Path) -> dict:
    """One checkpoint file (weights_only: loading never runs code from the file)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises several types for a torn/foreign file
        raise InputError(unloadable(path, e, "autohc checkpoint")) from None
    if not isinstance(state, dict) or state.get("format") != "autohc-dit-1":
        raise InputError(f"{path}: not an autohc DiT checkpoint")
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
            raise InputError(f"{p}: no loadable checkpoint (ckpt-*.pt) in this folder")
        return found
    if not p.is_file():
        raise InputError(f"{p}: no such checkpoint file or folder")
    return p, load(p)
