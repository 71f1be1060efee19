"""Where autohc's data files are: the folder of a source checkout (templates/, search_spaces/,
configs/), else its copy installed inside the package (autohc/_templates, ...)."""
from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def data_dir(name: str, marker: str) -> Path:
    """The checkout's `name`/ or the installed `_name`/, whichever holds `marker`."""
    for candidate in (PACKAGE.parent / name, PACKAGE / f"_{name}"):
        if (candidate / marker).is_file():
            return candidate
    raise FileNotFoundError(f"autohc {name}/ not found (no {marker}; broken install?)")
