"""Autotuning: Optuna searches the YAML search space against measured time."""
from .space import geometries, load_space, suggest_params
from .tuner import StorageError, TuneResult, WrongResult, open_storage, tune_problem

__all__ = ["geometries", "load_space", "suggest_params", "StorageError", "TuneResult",
           "WrongResult", "open_storage", "tune_problem"]
