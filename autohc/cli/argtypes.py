"""argparse value types shared by the command-line modules: a bad value is one clear line."""
from __future__ import annotations

import argparse


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


def non_negative_int(text: str) -> int:
    return _number(int, text, lambda v: v >= 0, "an integer >= 0")
