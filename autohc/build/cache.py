"""Build C source into a Python extension (cffi) inside a content-addressed cache.

Key = sha256(source, cdef, flags, compiler version, Python ABI, cffi version): the same kernel
is compiled once per machine and reused by every later process. Each cache entry holds the
shared library and `record.json` with its sha256; a library whose hash does not match its
record is never loaded (loading a library is running code): it is rebuilt. One process at a
time builds an entry (a file lock), the others wait and load its library; files are written to
a temporary name and renamed into place, so that no process ever reads a torn file.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import cffi

OPT_FLAGS = ("-O3", "-fPIC", "-fno-strict-aliasing", "-std=gnu11")
# Appended for kernels whose AMX tiles run in C (tests only, never timed): -O2 keeps -O3's
# floating-point semantics (FMA contraction, no reassociation) and compiles in about half the time
EMULATED_TILE_FLAGS = ("-O2",)
# AUTOHC_SANITIZE=address: every kernel built with AddressSanitizer (its own cache key), for
# checking the kernels' bounds under the tests (docs/kernels.md, "Correctness")
SANITIZE_FLAGS = {"address": ("-fsanitize=address", "-fno-omit-frame-pointer", "-g")}


class BuildError(RuntimeError):
    """The compiler rejected generated code (a bug in a template or its parameters)."""


class CompilerNotFoundError(BuildError):
    """No C compiler: autohc cannot build kernels on this machine."""


class CacheDirError(NotADirectoryError):
    """The kernel cache's path names something other than a directory."""


def cache_dir() -> Path:
    """$AUTOHC_CACHE_DIR, else $XDG_CACHE_HOME/autohc, else ~/.cache/autohc (created on first
    write). A path that names a file is a one-line error, not a failure deep in a build."""
    if os.environ.get("AUTOHC_CACHE_DIR"):
        path, named = Path(os.environ["AUTOHC_CACHE_DIR"]).expanduser(), "AUTOHC_CACHE_DIR"
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        path = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "autohc"
        named = "XDG_CACHE_HOME" if xdg else "the home directory's .cache"
    if path.exists() and not path.is_dir():
        raise CacheDirError(f"autohc's kernel cache {path} (from {named}) is a file, not a "
                            "directory: point AUTOHC_CACHE_DIR at a directory (it is created if missing)")
    return path


def compiler() -> str:
    cc = os.environ.get("CC", "gcc").split()[0]
    path = shutil.which(cc)
    if path is None:
        raise CompilerNotFoundError(
            f"autohc needs a C compiler to build kernels and found no '{cc}' on PATH: "
            "install gcc (Debian/Ubuntu: apt-get install gcc; Fedora/RHEL: dnf install gcc; "
            "macOS: xcode-select --install) or set CC to one")
    return path


@functools.lru_cache(maxsize=8)
def compiler_version(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise CompilerNotFoundError(f"cannot run the C compiler {cc}: {e}") from e
    return out.stdout.splitlines()[0] if out.stdout else cc


@dataclass
class Library:
    """A loaded, hash-verified kernel library: call functions on `.lib`, make data with `.ffi`."""
    key: str
    path: Path
    sha256: str
    ffi: object
    lib: object


_loaded: dict[str, Library] = {}
_lock = threading.Lock()
_key_locks: dict[str, threading.Lock] = {}


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def unwritable(text: str, want_dir: bool) -> str | None:
    """Why an output path cannot be written (None: it can), checked before any work: no part of
    it that exists may be a file where a folder is needed (or, for a file, the path itself a
    folder), and the nearest folder that exists must be writable. Nothing is created here."""
    if not text:
        return "expected a path, got ''"
    p = Path(text).expanduser()
    if p.exists():
        if want_dir and not p.is_dir():
            return f"{text!r} is a file, not a folder"
        if not want_dir and p.is_dir():
            return f"{text!r} is a folder, not a file"
    probe = (p if want_dir else p.parent).absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return f"{text!r}: {str(probe)!r} is a file, not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{text!r}: cannot write into {str(probe)!r}"
    return None


def atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def source_key(source: str, cdef: str, flags: tuple[str, ...]) -> str:
    """Hash of what is compiled, independent of the compiler: the flags with OPT_FLAGS (read at
    each call), so that a build at one optimisation level never serves another."""
    h = hashlib.sha256()
    for part in (source, cdef, " ".join((*OPT_FLAGS, *flags)), sys.implementation.cache_tag,
                 sysconfig.get_config_var("EXT_SUFFIX") or "", cffi.__version__):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def build_key(source: str, cdef: str, flags: tuple[str, ...], cc: str) -> str:
    """The cache key: what is compiled and the compiler that compiles it."""
    h = hashlib.sha256(source_key(source, cdef, flags).encode())
    h.update(compiler_version(cc).encode())
    return h.hexdigest()


def _entry_without_compiler(skey: str) -> tuple[Path, str] | None:
    """With no compiler here, any verified build of the same source will do."""
    for rec in sorted((cache_dir() / "kernels").glob("*/record.json")):
        try:
            record = json.loads(rec.read_text())
            if record.get("source_key") == skey:
                return rec.parent, record["key"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def _module_name(key: str) -> str:
    return f"_autohc_{key[:24]}"


def _import(module: str, path: Path):
    loader = importlib.machinery.ExtensionFileLoader(module, str(path))
    spec = importlib.util.spec_from_file_location(module, str(path), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _verified_file(entry: Path, key: str, use: str) -> tuple[Path, str] | None:
    """The file `entry`'s record names and its sha256, if the record is sound, belongs to
    `key` and the file's hash matches it; else None (with a warning where something is wrong
    rather than missing). `use`: what would be done with it ("loading", "linking")."""
    record_path = entry / "record.json"
    if not record_path.exists():
        return None
    try:
        record = json.loads(record_path.read_text())
        path = entry / record["file"]
        expected = record["sha256"]
        if record["key"] != key or Path(record["file"]).name != record["file"]:
            raise ValueError("record does not belong to this entry")
    except (OSError, ValueError, KeyError, TypeError) as e:
        warnings.warn(f"autohc: ignoring corrupt cache record {record_path} ({e}); rebuilding",
                      RuntimeWarning, stacklevel=4)
        return None
    if not path.exists():
        return None
    actual = _sha256_file(path)
    if actual != expected:
        warnings.warn(f"autohc: {path} does not match its recorded sha256 "
                      f"(got {actual[:12]}, want {expected[:12]}); not {use} it, rebuilding",
                      RuntimeWarning, stacklevel=4)
        return None
    return path, actual


def _load_verified(entry: Path, key: str) -> Library | None:
    """The cached library of `key` if its record is sound and its hash matches, else None."""
    found = _verified_file(entry, key, "loading")
    if found is None:
        return None
    lib_path, digest = found
    mod = _import(_module_name(key), lib_path)
    return Library(key, lib_path, digest, mod.ffi, mod.lib)


# how long a process waits for another one's build of the same kernel before building it beside
# it, as without the lock: builds take seconds, so a holder past this is stopped (a suspended
# batch job, ^Z) or hung, and must not hold up every job that shares the cache
BUILD_LOCK_WAIT_S = 120.0


@contextlib.contextmanager
def _one_builder(entry: Path):
    """Held while a process builds `entry`: another process that needs the same kernel at the
    same time (the ranks of a job started on an empty cache, the suite's workers) waits here,
    then loads what the first one built, instead of compiling it again beside it. flock: the
    operating system drops the lock of a process that dies, so a killed build never holds up
    the next. Where the filesystem offers no locks, or the holder keeps it past
    BUILD_LOCK_WAIT_S, this process builds on its own (the atomic renames keep that safe).
    Yields whether another process held the lock: only then may the entry have changed since
    this one looked (so only then is it looked at, and hashed, again)."""
    try:
        f = open(entry / ".build.lock", "a")
    except OSError:
        f = None
    waited = False
    try:
        deadline = time.monotonic() + BUILD_LOCK_WAIT_S
        while f is not None:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = True
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            except OSError:
                break
        yield waited
    finally:
        if f is not None:
            f.close()                   # (releases the lock)


def _object(source: str, flags: tuple[str, ...], cc: str) -> Path:
    """`source` compiled to an object file (with the library's flags) for libraries to link:
    cached once per machine as libraries are (content key, sha256 record, atomic rename), so
    the code many kernels share is compiled once."""
    key = build_key(source, "", flags, cc)
    entry = cache_dir() / "objects" / key[:32]
    with _lock:
        key_lock = _key_locks.setdefault("object:" + key, threading.Lock())
    with key_lock:
        found = _verified_file(entry, key, "linking")       # (linking it runs its code)
        if found is not None:
            return found[0]
        entry.mkdir(parents=True, exist_ok=True)
        with _one_builder(entry) as waited:
            found = _verified_file(entry, key, "linking") if waited else None    # (built meanwhile?)
            return found[0] if found else _object_built(source, flags, cc, key, entry)


def _object_built(source: str, flags: tuple[str, ...], cc: str, key: str, entry: Path) -> Path:
    """_object's build, under the entry's builder lock."""
    with tempfile.TemporaryDirectory(dir=entry, prefix=".build-") as tmp:
        t0 = time.perf_counter()
        c_file, obj = Path(tmp) / "object.c", Path(tmp) / "object.o"
        c_file.write_text(source)
        cmd = [cc, *OPT_FLAGS, *flags, "-c", "-o", str(obj), str(c_file)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"compiling object {key[:12]} failed:\n$ {' '.join(cmd)}\n{proc.stderr.strip()[-4000:]}")
        _keep(entry, obj, lambda digest: f"object.{digest[:16]}.o", source, {"key": key},
              _record_tail(flags, cc, t0))
    found = _verified_file(entry, key, "linking")
    if found is None:
        raise BuildError(f"object {key[:12]} was built but cannot be verified in {entry}")
    return found[0]


def _record_tail(flags: tuple[str, ...], cc: str, t0: float) -> dict:
    return {"flags": list(flags), "compiler": compiler_version(cc), "built_at": time.time(),
            "build_seconds": round(time.perf_counter() - t0, 3)}


def _keep(entry: Path, built: Path, final_name: Callable[[str], str], source: str, head: dict,
          tail: dict) -> None:
    """A finished build into its entry: the file under a name from its sha256 (a concurrent
    builder's file is never overwritten), its source beside it, and last the record that names
    the file (`head`, the file and its sha256, `tail`), so that no record names a missing file."""
    digest = _sha256_file(built)
    final = entry / final_name(digest)
    os.replace(built, final)
    (entry / "source.c").exists() or atomic_write_text(entry / "source.c", source)
    atomic_write_text(entry / "record.json", json.dumps({**head, "file": final.name, "sha256": digest, **tail},
                                                        indent=1))


def _compile(source: str, cdef: str, flags: tuple[str, ...], cc: str, key: str, workdir: Path) -> Path:
    """The library's own source (with cffi's wrapper) compiled to an object in `workdir`."""
    module = _module_name(key)
    ffi = cffi.FFI()
    ffi.cdef(cdef)
    # compiler_verbose=False: cffi would print 'generating ...'. (Not by swapping sys.stdout
    # around the call: that is the process's, and two threads building at once, as first-use
    # tuning does, left it pointing at one build's buffer, every later print lost.)
    ffi.set_source(module, source, compiler_verbose=False)
    c_file = workdir / f"{module}.c"
    ffi.emit_c_code(str(c_file))
    out = workdir / f"{module}.o"
    cmd = [cc, *OPT_FLAGS, *flags, "-c", f"-I{sysconfig.get_paths()['include']}", "-o", str(out), str(c_file)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        err = proc.stderr.strip()
        if "Python.h: No such file" in err:
            raise BuildError("autohc cannot find Python.h: install the Python development "
                             "headers (Debian/Ubuntu: apt-get install python3-dev)")
        raise BuildError(f"compiling kernel {key[:12]} failed:\n$ {' '.join(cmd)}\n{err[-4000:]}")
    return out


def _link(main: Path, objects: tuple[Path, ...], flags: tuple[str, ...], cc: str, key: str) -> Path:
    """The Python extension of `main` (from _compile) and the cached objects it links."""
    out = main.with_name(main.stem + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    cmd = [cc, *OPT_FLAGS, *flags, "-shared", "-o", str(out), str(main), *map(str, objects), "-lpthread"]
    if sys.platform == "darwin":
        cmd[1:1] = ["-undefined", "dynamic_lookup"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"linking kernel {key[:12]} failed:\n$ {' '.join(cmd)}\n{proc.stderr.strip()[-4000:]}")
    return out


def sanitize_flags() -> tuple[str, ...]:
    """The flags AUTOHC_SANITIZE asks for (none where it is unset). A sanitized library loads
    only into a process whose sanitizer runtime came first, so that is checked here, before a
    build, with the command that gives it."""
    name = os.environ.get("AUTOHC_SANITIZE", "")
    if not name:
        return ()
    if name not in SANITIZE_FLAGS:
        raise BuildError(f"AUTOHC_SANITIZE={name!r}: the one sanitizer autohc builds with is "
                         f"{' or '.join(map(repr, SANITIZE_FLAGS))} (or leave it unset)")
    try:
        with open("/proc/self/maps") as maps:
            loaded = "libasan" in maps.read()
    except OSError:             # (no /proc: the loader's own error says it)
        loaded = True
    if not loaded:
        raise BuildError("AUTOHC_SANITIZE=address needs AddressSanitizer's runtime loaded first: "
                         "run with LD_PRELOAD=$(gcc -print-file-name=libasan.so) "
                         "ASAN_OPTIONS=detect_leaks=0")
    return SANITIZE_FLAGS[name]


def _library_built(source: str, cdef: str, flags: tuple[str, ...], cc: str, key: str, skey: str,
                   entry: Path, objects: tuple[str, ...], meta: dict | None) -> Library:
    """build()'s compile, under the entry's builder lock. Its linked objects compile beside its
    own source."""
    with tempfile.TemporaryDirectory(dir=entry, prefix=".build-") as tmp:
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(max(1, len(objects))) as pool:
            pending = [pool.submit(_object, o, flags, cc) for o in objects]
            main = _compile(source, cdef, flags, cc, key, Path(tmp))
            linked = tuple(f.result() for f in pending)
        so = _link(main, linked, flags, cc, key)
        _keep(entry, so, lambda digest: f"{so.stem}.{digest[:16]}{''.join(so.suffixes[-1:])}", source,
              {"key": key, "source_key": skey},
              {**_record_tail(flags, cc, t0), **({"objects": [o.parent.name for o in linked]} if linked else {}),
               **(meta or {})})
    lib = _load_verified(entry, key)
    if lib is None:
        raise BuildError(f"kernel {key[:12]} was built but cannot be verified in {entry}")
    return lib


def build(source: str, cdef: str, flags: tuple[str, ...] = (), *, meta: dict | None = None,
          objects: tuple[str, ...] = ()) -> Library:
    """Compile (or fetch from the cache) and load a verified library. Thread- and process-safe.
    objects: more C sources, each compiled once into a cached object (_object) and linked in."""
    flags, objects = tuple(flags) + sanitize_flags(), tuple(objects)
    # the key covers the linked sources too
    keyed = source + "".join(f"\0linked object:\0{o}" for o in objects)
    skey = source_key(keyed, cdef, flags)
    cc_path = shutil.which(os.environ.get("CC", "gcc").split()[0])
    found = None if cc_path else _entry_without_compiler(skey)
    if found:
        entry, key = found
    else:
        key = build_key(keyed, cdef, flags, compiler())
        entry = cache_dir() / "kernels" / key[:32]
    with _lock:
        if key in _loaded:
            return _loaded[key]
        key_lock = _key_locks.setdefault(key, threading.Lock())
    # one build per key at a time, and none holds up another key's (a kernel compiling on a
    # background thread for first-use tuning must not stall the caller's other kernels)
    with key_lock:
        if key in _loaded:
            return _loaded[key]
        lib = _load_verified(entry, key)
        if lib is None:
            cc_path = compiler()     # only now is a compiler needed
            entry.mkdir(parents=True, exist_ok=True)
            with _one_builder(entry) as waited:
                lib = ((_load_verified(entry, key) if waited else None)     # (built meanwhile?)
                       or _library_built(source, cdef, flags, cc_path, key, skey, entry, objects, meta))
        with _lock:
            _loaded[key] = lib
        return lib


def cache_entries() -> list[dict]:
    """Records of every cached library (for `autohc cache list`)."""
    out = []
    for rec in sorted((cache_dir() / "kernels").glob("*/record.json")):
        try:
            out.append({"entry": str(rec.parent), **json.loads(rec.read_text())})
        except (OSError, ValueError):
            out.append({"entry": str(rec.parent), "corrupt": True})
    return out
