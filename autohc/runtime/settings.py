"""The runtime's settings from the environment: a bad value is one clear line, never a guess."""
from __future__ import annotations

import os


def non_negative_int(name: str, default: int | None, what: str) -> int | None:
    """$name as an int >= 0 (`what` says what it counts), else `default` when unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        v = int(raw)
    except ValueError:
        v = -1
    if v < 0:
        raise ValueError(f"{name}={raw!r}: expected {what} >= 0")
    return v
