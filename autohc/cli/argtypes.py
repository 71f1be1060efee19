"""argparse value types shared by the command-line modules: a bad value is one clear line."""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn


def _number(cast, text: str, ok, want: str):
    try:
        v = cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
    if not ok(v):
        raise argparse.ArgumentTypeError(f"expected {want}, got {v}")
    return v


def positive_int(text: str) -> int:
    return _number(int, text, lambda v: v >= 1, "an integer >= 1")


def positive_float(text: str) -> float:
    return _number(float, text, lambda v: v > 0 and v != float("inf"), "a positive number")


def unit_interval(text: str) -> float:
    return _number(float, text, lambda v: 0 <= v < 1, "a number in [0, 1)")


def sampling_steps(text: str) -> int:
    """Diffusion sampling steps: DiT's chain has 1000 timesteps."""
    return _number(int, text, lambda v: 1 <= v <= 1000, "an integer in [1, 1000]")


def non_negative_int(text: str) -> int:
    return _number(int, text, lambda v: v >= 0, "an integer >= 0")


def non_negative_float(text: str) -> float:
    return _number(float, text, lambda v: 0 <= v < float("inf"), "a number >= 0")


def automem_tier(text: str) -> str:
    """An AutoMem tier as `--automem` takes it: file, file:DIR (a folder it can write in), bf16,
    numa or numa:NODE (whether this machine has that node is said when training starts)."""
    name, colon, arg = text.partition(":")
    if name == "file" and colon:
        return "file:" + _writable_place(arg, want_dir=True)
    if text in ("file", "bf16", "numa") or (name == "numa" and arg.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"expected file, file:DIR, bf16, numa or numa:NODE, got {text!r}")


def open_fraction(text: str) -> float:
    return _number(float, text, lambda v: 0 < v < 1, "a number between 0 and 1")


def thread_count(text: str) -> int:
    """Threads of a kernel: the bound GemmParams enforces (kernels/gemm/params.py)."""
    from ..kernels.gemm.params import MAX_THREADS
    return _number(int, text, lambda v: 1 <= v <= MAX_THREADS, f"an integer in [1, {MAX_THREADS}]")


def command_error(command: str, message: str) -> NoReturn:
    """A bad value found after parsing, said as `autohc <command>`'s own parser says one:
    one line, exit 2, pointing at that command's --help rather than the top level's."""
    sys.stderr.write(f"autohc {command}: error: {message} (see autohc {command} --help)\n")
    raise SystemExit(2)


def recheck(command: str, option: str, value, kind):
    """`value`, as the parser gave it, through the type `kind`; refused as the parser would."""
    if value is None:
        return None
    try:
        return kind(str(value))
    except argparse.ArgumentTypeError as e:
        command_error(command, f"argument {option}: {e}")


def _writable_place(text: str, want_dir: bool) -> str:
    """The output path `text`, checked before any work (build.unwritable); the command
    creates it."""
    from ..build import unwritable
    why = unwritable(text, want_dir)
    if why:
        raise argparse.ArgumentTypeError(why)
    return text


def output_dir(text: str) -> str:
    """A folder a command writes into (created if missing)."""
    return _writable_place(text, want_dir=True)


def output_file(text: str) -> str:
    """A file a command writes (its folder created if missing)."""
    return _writable_place(text, want_dir=False)


def data_spec(text: str) -> str:
    """`autohc train --data`: a SPEC of a known form (the files it names are read later)."""
    from ..dit.data_spec import FORMS, parse
    try:
        parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {FORMS}, got {text!r}") from None
    return text


def checkpoint_path(text: str) -> str:
    """A checkpoint file or a run folder that exists (what is in it is read later)."""
    from pathlib import Path
    if not Path(text).expanduser().exists():
        raise argparse.ArgumentTypeError(f"{text}: no such checkpoint file or folder")
    return text


def signal_name(text: str) -> int:
    """A signal by name or number (TERM, USR1, SIGUSR2, 10)."""
    from ..runtime.preempt import parse_signal
    try:
        return int(parse_signal(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
