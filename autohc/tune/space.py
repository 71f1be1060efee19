"""A search space from search_spaces/<op>.yaml, turned into Optuna suggestions (define-by-run).

The tuner knows no parameter names: it reads them from the YAML. Values are categorical;
`sets: [a, b]` splits "AxB" into two parameters, `multiple_of: p` rounds up to a multiple of
parameter p. The thread geometry "JCxICxJR" (jc_ways, ic_ways, jr_ways) is every factorisation of the threads.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import yaml

from ..datafiles import data_dir

from ..kernels import archs
from ..kernels.gemm.params import GemmParams, default_params
from ..kernels.isa import GEMM_ISAS


def spaces_dir() -> Path:
    return data_dir("search_spaces", "gemm.yaml")


@functools.lru_cache(maxsize=None)
def load_space(op: str = "gemm") -> dict:
    path = spaces_dir() / f"{op}.yaml"
    if not path.is_file():
        raise ValueError(f"no search space for op {op!r} ({path} missing)")
    space = yaml.safe_load(path.read_text())
    if not isinstance(space, dict) or space.get("op") != op:
        raise ValueError(f"{path}: not a search space for {op!r}")
    return space


def geometries(threads: int) -> list[str]:
    """'JCxICxJR' for every jc_ways * ic_ways * jr_ways == threads."""
    out = []
    for c in range(1, threads + 1):
        if threads % c:
            continue
        rest = threads // c
        for tm in range(1, rest + 1):
            if rest % tm == 0:
                out.append(f"{c}x{tm}x{rest // tm}")
    return out


def isa_entries(space: dict, isa: str) -> dict:
    if isa not in GEMM_ISAS:
        raise ValueError(f"unknown isa {isa!r}")
    entries = dict(space.get("common", {}))
    entries.update((space.get("isa") or {}).get(isa, {}))
    entries.pop("starts", None)
    return entries


def starting_points(params: GemmParams, isa: str, op: str = "gemm") -> list[dict]:
    """Trial values of the default, of this CPU's candidates in the per-microarchitecture
    table (configs/<arch>.yaml) and of the search space's `starts` (overrides of the default)."""
    base = as_suggestions(params, isa, op)
    out = [base]
    if op == "gemm":
        for c in archs.gemm_candidates(isa):
            p = dataclasses.replace(params, **c).validate()
            out.append(as_suggestions(p, isa, op))
    starts = ((load_space(op).get("isa") or {}).get(isa) or {}).get("starts") or []
    for s in starts:
        unknown = set(s) - set(base)
        if unknown:
            raise ValueError(f"search space {op}/{isa}: start {s} names unknown parameters {unknown}")
        out.append({**base, **s})
    unique = []
    for v in out:
        if v not in unique:
            unique.append(v)
    return unique


def suggest_params(trial, isa: str, threads: int, op: str = "gemm") -> GemmParams:
    """One candidate: every YAML parameter suggested by the trial, then validated
    (ParamError for a combination the ISA cannot run)."""
    values = default_params(isa, threads).to_dict()
    rounding = {}
    for name, spec in isa_entries(load_space(op), isa).items():
        choice = trial.suggest_categorical(name, list(spec["values"]))
        if "sets" in spec:
            parts = [int(x) for x in str(choice).split("x")]
            values.update(zip(spec["sets"], parts))
        else:
            values[name] = choice
        if "multiple_of" in spec:
            rounding[name] = spec["multiple_of"]
    for name, base in rounding.items():
        values[name] = max(values[base], math.ceil(values[name] / values[base]) * values[base])
    geo = trial.suggest_categorical("geometry", geometries(threads))
    values["jc_ways"], values["ic_ways"], values["jr_ways"] = (int(x) for x in geo.split("x"))
    return GemmParams(**values).validate()


def as_suggestions(params: GemmParams, isa: str, op: str = "gemm") -> dict:
    """The trial values that reproduce `params` (to enqueue the default configuration)."""
    p = dataclasses.asdict(params)     # (to_dict leaves out fields at their old defaults)
    out = {}
    for name, spec in isa_entries(load_space(op), isa).items():
        if "sets" in spec:
            out[name] = "x".join(str(p[s]) for s in spec["sets"])
        else:
            out[name] = p[name]
    out["geometry"] = f"{p['jc_ways']}x{p['ic_ways']}x{p['jr_ways']}"
    return out
