"""Autotuning: Optuna searches the YAML search space against measured time."""
from .result import TuneResult
from .space import geometries, load_space, suggest_params

__all__ = ["geometries", "load_space", "suggest_params", "StorageError", "TuneResult",
           "WrongResult", "open_storage", "tune_problem"]


def __getattr__(name):              # the tuner (torch, optuna) loads only when used
    if name in ("StorageError", "WrongResult", "open_storage", "tune_problem"):
        from . import tuner
        return getattr(tuner, name)
    raise AttributeError(f"module 'autohc.tune' has no attribute {name!r}")
