"""What `autohc train --data SPEC` may say, without torch: the command line refuses a malformed
SPEC before anything loads; data.load reads it the same way."""
from __future__ import annotations

# kind -> whether it takes an argument after the colon
KINDS = {"digits": False, "synthetic": False, "folder": True, "npy": True, "latents": True}
FORMS = "digits, synthetic, folder:PATH, npy:PATH or latents:DIR"


def parse(spec: str) -> tuple[str, str]:
    """(kind, argument) of SPEC, or ValueError saying what it may be."""
    kind, _, arg = spec.partition(":")
    if kind in KINDS and bool(arg) == KINDS[kind]:
        return kind, arg
    raise ValueError(f"--data {spec!r}: expected {FORMS}")
