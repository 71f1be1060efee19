"""Measured results as data: a bench's JSON saved with what it was measured on.

`autohc bench gemm|step|ops ... --save [DIR]` and `autohc train ... --save [DIR]` write

    DIR/<cpu fingerprint>/<YYYY-MM-DD>-<bench>-<args>.json

(DIR: results/ of the current directory by default), one object:

    {"schema": 1, "bench": "gemm", "date": "2026-11-25", "command": "autohc bench gemm ...",
     "code_version": "5ac1043", "torch": "2.13.0", "threads": 2, "cpu": {...},
     "registry_entries_at_start": 0, "env": {...}, "result": <the bench's own JSON>}

The file is written atomically (a temporary file renamed over it), so a reader never sees half
of one. `autohc report --results` renders the tables of docs/results.md and the README from
these files (autohc/bench/results_md.py); nothing else writes a speed figure there.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

SCHEMA = 1
DEFAULT_DIR = "results"
REPO = Path(__file__).resolve().parents[2]
# environment variables that change what a bench measures (the cache folder's path does not)
_ENV_PREFIXES = ("AUTOHC_", "OMP_", "GOMP_", "OPENBLAS_", "MKL_")
_ENV_SKIP = {"AUTOHC_CACHE_DIR"}


def code_version(repo: Path = REPO) -> str:
    """`git describe --always` of the checkout the package runs from, `+dirty` when its code
    (autohc/, templates/, configs/, search_spaces/) differs from that commit; the package's
    version where it is not a git checkout."""
    try:
        head = subprocess.run(["git", "-C", str(repo), "describe", "--always"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "diff", "--quiet", "HEAD", "--", "autohc",
                                "templates", "configs", "search_spaces"], timeout=10).returncode != 0
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        from importlib.metadata import PackageNotFoundError, version
        try:
            return "autohc " + version("autohc")
        except PackageNotFoundError:
            return "unknown"


def cpu_record() -> dict:
    """What the figures were measured on: the CPU as `autohc info` names it (no timing)."""
    from ..hw import cpu
    from ..kernels import archs
    info = cpu.detect()
    return {"model": info.model, "vendor": info.vendor, "arch": info.arch,
            "family": info.family, "model_number": info.model_number,
            "fingerprint": info.fingerprint, "microarch": archs.describe(info)["arch"],
            "isa": cpu.best_isa(info), "bf16_isa": cpu.bf16_isa(info)[0],
            "flags": info.isa_flags(), "cores": info.cores}


def _slug(words: list[str]) -> str:
    """The arguments after the bench's name as a short file-name part: --model dit-xl
    --threads 1 2 -> model-dit-xl-threads-1-2 (the output switches left out)."""
    keep = [w for w in words if w not in ("--json", "--markdown", "--save", "--no-progress")]
    text = re.sub(r"[^A-Za-z0-9.+]+", "-", " ".join(keep)).strip("-").lower()
    if len(text) > 60:              # cut, with a hash of the rest: other arguments, other file
        import hashlib
        text = text[:50].rstrip("-") + "-" + hashlib.sha256(text.encode()).hexdigest()[:8]
    return text or "default"


@dataclass
class Recorder:
    """Started before a bench runs (the registry's size then says whether it ran fresh), saves
    its result after."""
    bench: str
    argv: list[str]
    folder: Path
    registry_entries_at_start: int

    def save(self, result, threads: int | None = None, when: _dt.date | None = None) -> Path:
        import torch
        info = cpu_record()
        date = (when or _dt.datetime.now(_dt.timezone.utc).date()).isoformat()
        words = self.argv[self.argv.index(self.bench) + 1:] if self.bench in self.argv else self.argv
        # drop --save and the folder given to it: the command is what reproduces the figure
        shown = _without_save(self.argv)
        record = {"schema": SCHEMA, "bench": self.bench, "date": date,
                  "command": "autohc " + shlex.join(shown), "code_version": code_version(),
                  "torch": torch.__version__.split("+")[0], "threads": threads, "cpu": info,
                  "registry_entries_at_start": self.registry_entries_at_start,
                  "env": {k: v for k, v in sorted(os.environ.items())
                          if k.startswith(_ENV_PREFIXES) and k not in _ENV_SKIP},
                  "result": result}
        path = self.folder / info["fingerprint"] / f"{date}-{self.bench}-{_slug(_without_save(words))}.json"
        write_atomic(path, json.dumps(record, indent=1, sort_keys=True) + "\n")
        return path


def _without_save(words: list[str]) -> list[str]:
    out, skip = [], False
    for w in words:
        if skip and not w.startswith("-"):
            skip = False
            continue
        skip = False
        if w == "--save":
            skip = True
            continue
        if w.startswith("--save="):
            continue
        out.append(w)
    return out


def recorder(bench: str, args) -> Recorder | None:
    """A Recorder when the command was given --save, else None."""
    folder = getattr(args, "save", None)
    if folder is None:
        return None
    from ..build import unwritable
    from ..hw import cpu
    from ..tune import registry
    argv = list(getattr(args, "argv", None) or [])
    mine = Path(folder) / cpu.detect().fingerprint
    # where save() writes, checked now (an error before the run, not after it) but made only
    # by save(): a run that fails leaves no empty folder
    why = unwritable(str(mine), want_dir=True)
    if why:
        raise ValueError(f"--save {folder}: {why}")
    return Recorder(bench, argv, Path(folder), len(registry.entries_for_this_cpu()))


def write_atomic(path: Path, text: str) -> None:
    from ..build.cache import atomic_write_text
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text)


def load(folder: Path | str = DEFAULT_DIR) -> list[dict]:
    """Every saved result under folder, each with its path (relative to folder) as `file`,
    in a fixed order (CPU, date, file name)."""
    root = Path(folder)
    out = []
    for p in sorted(root.glob("*/*.json")):
        try:
            r = json.loads(p.read_text())
        except ValueError as e:
            raise ValueError(f"{p}: not an autohc result ({e})") from None
        if not isinstance(r, dict) or r.get("schema") != SCHEMA:
            raise ValueError(f"{p}: not an autohc result (schema "
                             f"{r.get('schema') if isinstance(r, dict) else None!r})")
        r["file"] = p.relative_to(root).as_posix()
        out.append(r)
    return sorted(out, key=lambda r: (r["cpu"]["fingerprint"], r["date"], r["file"]))


def add_save_argument(p) -> None:
    """--save [DIR] of a command whose JSON can be kept as a result."""
    from ..cli.argtypes import output_dir
    p.add_argument("--save", nargs="?", const=DEFAULT_DIR, default=None, metavar="DIR", type=output_dir,
                   help=f"also save the result as JSON under DIR/<cpu fingerprint>/ with the CPU, "
                        f"code version and command (default DIR: {DEFAULT_DIR}/); "
                        f"`autohc report --results` renders the docs' tables from these files")
