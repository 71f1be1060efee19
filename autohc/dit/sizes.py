"""The DiT sizes by name (the reference's table), without torch: the CLI's choices and `--help`
read it before any model is built."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DiTConfig:
    depth: int
    hidden: int
    heads: int
    patch: int


# name -> (depth, hidden, heads); each comes with patch 2, 4 and 8 (the reference's table).
# DiT-Ti is not in the reference: a 12 x 192 "tiny" size (as DeiT-Ti) for laptops and tests.
SIZES = {"Ti": (12, 192, 3), "S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16),
         "XL": (28, 1152, 16)}
MODELS = {f"DiT-{s}/{p}": DiTConfig(d, h, n, p) for s, (d, h, n) in SIZES.items() for p in (2, 4, 8)}


def config(name: str) -> DiTConfig:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; one of {', '.join(MODELS)}") from None
