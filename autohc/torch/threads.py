"""How many threads autohc's kernels use in this process: install()'s count while installed,
else torch's (torch.get_num_threads()). The dispatch sets it; the operators read it."""
from __future__ import annotations

import torch

_installed_threads: list[int | None] = [None]


def kernel_threads() -> int:
    return _installed_threads[0] or torch.get_num_threads()


def set_kernel_threads(n: int | None) -> None:
    _installed_threads[0] = n
