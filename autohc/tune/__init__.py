"""Tuning: space (search_spaces/*.yaml -> Optuna suggestions), pipeline (render -> build ->
verify -> time), verify (the correctness gate), gemm and ops (the two families' searches),
registry (the best per CPU), result, export and report."""
from .result import TuneResult
from .space import geometries, load_space, suggest_params

__all__ = ["geometries", "load_space", "suggest_params", "StorageError", "TuneResult",
           "WrongResult", "open_storage", "tune_problem"]


def __getattr__(name):              # the tuner (torch, optuna) loads only when used
    if name in ("StorageError", "WrongResult", "open_storage", "tune_problem"):
        from . import gemm
        return getattr(gemm, name)
    raise AttributeError(f"module 'autohc.tune' has no attribute {name!r}")
