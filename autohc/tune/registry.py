"""The registry: best kernel configuration per (CPU fingerprint, op, layout, K, N, M bucket, threads).

One JSON file (`<cache>/registry.json`), written atomically under a file lock so that several
tuners can record at once. Entries carry their CPU fingerprint and are re-validated on read:
a corrupt file, an entry for another CPU, or parameters this CPU cannot run are ignored with
a warning and never used. Lookup for an M never tuned takes the nearest M bucket (log scale).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import shutil
import threading
import time
import warnings
from pathlib import Path

from ..build import atomic_write_text, cache_dir
from ..hw import cpu
from ..kernels.attention.family import ATTENTION
from ..kernels.eltwise.family import ELTWISE
from ..kernels.gemm.family import GEMM, m_bucket
from ..kernels.gemm.params import GemmParams, ParamError

VERSION = 1
_lock = threading.Lock()
_memo: dict = {"path": None, "mtime": None, "data": None, "lookups": {}, "env": None,
         "checked": -1.0}
RECHECK_S = 0.5     # how often load() stats the file: operators look up on every call


def registry_path() -> Path:
    return Path(os.environ.get("AUTOHC_REGISTRY", cache_dir() / "registry.json"))


def entry_key(op: str, layout: str, K: int, N: int, M: int, threads: int, dtype: str = "fp32") -> str:
    """The key of a GEMM problem (the family's own, kernels/gemm/family.py)."""
    if op != GEMM.name:
        raise ValueError(f"no GEMM problem key for op {op!r}")
    return GEMM.problem_key(layout, K, N, M, threads, dtype)


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read(path: Path) -> dict:
    """The registry file's entries ({} if missing or corrupt, with a warning for corrupt)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != VERSION \
                or not isinstance(data.get("entries"), dict):
            raise ValueError("not an autohc registry")
        return data["entries"]
    except ValueError as e:
        warnings.warn(f"autohc: ignoring corrupt registry {path} ({e}); using default kernels",
                      RuntimeWarning, stacklevel=3)
        return {}


# os.environ's own bytes dict where CPython keeps one (POSIX): os.environ.get of a missing key costs
# about 1 us (a KeyError raised and caught), and load() runs on every operator call.
_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None
_ENV_KEYS = ("AUTOHC_REGISTRY", "AUTOHC_CACHE_DIR", "XDG_CACHE_HOME")
_ENV_BYTES = tuple(k.encode() for k in _ENV_KEYS)


_env_get, _env_names = ((_ENV_DATA.get, _ENV_BYTES) if isinstance(_ENV_DATA, dict)
                        else (os.environ.get, _ENV_KEYS))


def _env() -> tuple:
    """The variables that name the registry file, as they are now."""
    return (_env_get(_env_names[0]), _env_get(_env_names[1]), _env_get(_env_names[2]))


def load() -> dict:
    """All entries, memoised on the file's mtime; the file is stat'ed at most every RECHECK_S
    (a write from this process is seen at once; another process's within RECHECK_S)."""
    env = _env()
    now = time.monotonic()
    if env == _memo["env"] and now - _memo["checked"] < RECHECK_S:
        return _memo["data"]
    path = registry_path()
    try:
        mtime = path.stat().st_mtime_ns
    except FileNotFoundError:
        mtime = None
    with _lock:
        if _memo["path"] != path or _memo["mtime"] != mtime:
            _memo.update(path=path, mtime=mtime, data=_read(path) if mtime else {}, lookups={})
        _memo.update(env=env, checked=now)
        return _memo["data"]


def memo() -> dict:
    """A dict that lives as long as the registry's present state (a new one once the file
    changes): callers keep what they derive from the entries against its identity."""
    load()
    return _memo["lookups"]


def forget() -> None:
    """Make the next load() read the file's state (after this process changed it)."""
    _memo["checked"] = -1.0


def _valid(entry: dict, fingerprint: str) -> GemmParams | None:
    if entry.get("fingerprint") != fingerprint:
        warnings.warn(f"autohc: registry entry for CPU {entry.get('fingerprint')!r} ignored "
                      f"(this CPU is {fingerprint})", RuntimeWarning, stacklevel=4)
        return None
    try:
        params = GemmParams.from_dict(entry["params"])
    except (ParamError, KeyError, TypeError) as e:
        warnings.warn(f"autohc: invalid registry entry ignored ({e})", RuntimeWarning, stacklevel=4)
        return None
    if params.isa not in cpu.runnable_isas() + cpu.runnable_bf16_isas():
        warnings.warn(f"autohc: registry entry needs {params.isa}, which this CPU lacks; ignored",
                      RuntimeWarning, stacklevel=4)
        return None
    return params


def lookup(op: str, layout: str, K: int, N: int, M: int, threads: int,
           exact: bool = False, dtype: str = "fp32") -> tuple[GemmParams, dict] | None:
    """Tuned params for this problem on this CPU: the exact M bucket, else the nearest one.
    Answers are memoised until the registry file changes (this runs on every GEMM call)."""
    entries = load().get(cpu.detect().fingerprint, {})
    key = (op, layout, K, N, m_bucket(M), threads, exact, dtype)
    lookups = _memo["lookups"]
    if key not in lookups:
        lookups[key] = _lookup(entries, *key)
    return lookups[key]


def _lookup(entries: dict, op: str, layout: str, K: int, N: int, want: int, threads: int,
            exact: bool, dtype: str) -> tuple[GemmParams, dict] | None:
    prefix = f"{op}/{layout}/K{K}/N{N}/M"
    suffix = f"/t{threads}" + ("/bf16" if dtype == "bf16" else "")
    candidates = []
    for key, entry in entries.items():
        if key.startswith(prefix) and key.endswith(suffix):
            b = int(key[len(prefix):].split("/")[0])
            candidates.append((abs(math.log2(b) - math.log2(want)), b, key))
    if not candidates:
        return None
    dist, b, key = min(candidates)
    if exact and b != want:
        return None
    params = _valid(entries[key], cpu.detect().fingerprint)
    return (params, entries[key]) if params and params.dtype == dtype else None


def record(op: str, layout: str, K: int, N: int, M: int, threads: int, params: GemmParams,
           gflops: float, torch_gflops: float, **extra) -> dict:
    """Store (or replace) the best configuration of a problem for this CPU."""
    params.validate()
    info = cpu.detect()
    key = entry_key(op, layout, K, N, M, threads, params.dtype)
    entry = {"fingerprint": info.fingerprint, "cpu": info.model, "op": op, "layout": layout,
             "dtype": params.dtype,
             "K": K, "N": N, "M": M, "threads": threads, "params": params.to_dict(),
             "gflops": round(gflops, 2), "torch_gflops": round(torch_gflops, 2),
             "speedup_vs_torch": round(gflops / torch_gflops, 3) if torch_gflops else None,
             "recorded_at": time.time(), **extra}
    _store(key, entry)
    return entry


def entries_for_this_cpu(op: str | None = None) -> dict:
    """This CPU's entries, or only those of one op ("gemm", "eltwise")."""
    entries = load().get(cpu.detect().fingerprint, {})
    return {k: e for k, e in entries.items() if op is None or k.startswith(f"{op}/")}


# ------------------------- element-wise operators and attention (autohc tune --op NAME)

OP_FAMILIES = {f.name: f for f in (ELTWISE, ATTENTION)}


def op_key(op: str, kernel: str, threads: int) -> str:
    """The key of an operator kernel (its family's own: kernels/eltwise/family.py,
    kernels/attention/family.py)."""
    if op not in OP_FAMILIES:
        raise ValueError(f"no operator key for op {op!r}")
    return OP_FAMILIES[op].problem_key(kernel, threads)


def record_op(op: str, kernel: str, threads: int, params: dict, ms: float, torch_ms: float,
              **extra) -> dict:
    """Store the best parameters (a dict the op's own Params type validates) of a kernel."""
    info = cpu.detect()
    entry = {"fingerprint": info.fingerprint, "cpu": info.model, "op": op, "kernel": kernel,
             "threads": threads, "params": dict(params), "ms": round(ms, 4),
             "torch_ms": round(torch_ms, 4), "speedup_vs_torch": round(torch_ms / ms, 3) if ms else None,
             "recorded_at": time.time(), **extra}
    _store(op_key(op, kernel, threads), entry)
    return entry


def lookup_op(op: str, kernel: str, threads: int) -> dict | None:
    """The recorded entry of a kernel at this thread count on this CPU, or None (memoised
    until the registry file changes: this runs on every operator call)."""
    entries = load().get(cpu.detect().fingerprint, {})
    key = ("op", op, kernel, threads)
    lookups = _memo["lookups"]
    if key not in lookups:
        lookups[key] = entries.get(op_key(op, kernel, threads))
    return lookups[key]


def tuned_op_params(op: str, kernel: str, threads: int):
    """The recorded parameters of a kernel, parsed by its family's Params type, or None where
    none are recorded or they are invalid or not runnable here (ignored, as for GEMMs)."""
    entry = lookup_op(op, kernel, threads)
    if entry is None:
        return None
    try:
        p = OP_FAMILIES[op].params_type.from_dict(entry["params"])
    except (ParamError, TypeError):
        return None
    return p if p.isa in cpu.runnable_isas() else None


def _store(key: str, entry: dict) -> None:
    """Put one entry of this CPU into the file: locked, atomic, a corrupt file kept aside."""
    info = cpu.detect()
    path = registry_path()
    with _file_lock(path):
        try:
            text = path.read_text()
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("version") != VERSION:
                raise ValueError
        except FileNotFoundError:
            data = {"version": VERSION, "entries": {}}
        except ValueError:
            backup = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
            shutil.copyfile(path, backup)       # keep what was there; never lose it silently
            warnings.warn(f"autohc: corrupt registry {path} saved as {backup}; starting afresh",
                          RuntimeWarning, stacklevel=2)
            data = {"version": VERSION, "entries": {}}
        data["entries"].setdefault(info.fingerprint, {})[key] = entry
        atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True))
    forget()


def layout_of(rsa: int, csa: int, rsb: int, csb: int) -> str | None:
    """The training layout a stride pattern is (None: none of them)."""
    if csa == 1 and rsb == 1:
        return "NT"
    if csa == 1 and csb == 1:
        return "NN"
    if rsa == 1 and csb == 1:
        return "TN"
    return None


def linear_dims(layout: str, m: int, k: int, n: int) -> tuple[int, int, int]:
    """GEMM (m, k, n) of a layout -> the Linear's (M, K, N)."""
    return {"NT": (m, k, n), "NN": (m, n, k), "TN": (k, n, m)}[layout]
