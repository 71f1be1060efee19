"""The Jinja2 environment over templates/ (StrictUndefined: a missing parameter is an error)."""
from __future__ import annotations

import functools
import os
from pathlib import Path

import jinja2

from ..datafiles import data_dir


def templates_dir() -> Path:
    """$AUTOHC_TEMPLATES_DIR (template development), else templates/ of a source checkout,
    else the copy installed inside the package."""
    if os.environ.get("AUTOHC_TEMPLATES_DIR"):
        return Path(os.environ["AUTOHC_TEMPLATES_DIR"])
    return data_dir("templates", "gemm/gemm.c.j2")


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,       # a missing parameter is an error, not ""
        keep_trailing_newline=True,
        autoescape=False,
    )
