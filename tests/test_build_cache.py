"""The kernel cache: location, verification before load, corruption, races, no compiler.

Each scenario runs in a fresh Python process with its own cache directory, because a process
keeps the libraries it loaded (as Python keeps imported extension modules).
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autohc.build import cache_dir

# A small kernel, so that each scenario's processes spend their time in the cache's logic (what
# is tested here), not in gcc: every library goes through the same build() and load.
SCRIPT = textwrap.dedent("""
    import json, warnings
    from autohc.build import build, cache_entries
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        lib = build("int twice_plus(int x) { return 2 * x + 1; }", "int twice_plus(int x);", ())
        caught = [str(x.message) for x in w]
    print(json.dumps({"ok": lib.lib.twice_plus(20) == 41, "warnings": caught,
                      "entries": len([e for e in cache_entries() if e.get("op") != "runtime"])}))
""")


def run_kernel(cache: Path, **env_extra):
    env = {**os.environ, "AUTOHC_CACHE_DIR": str(cache), **env_extra}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    return proc


def ok(proc):
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def entries(cache: Path):
    """Records of the kernels (the worker pool's own library, built once, left out)."""
    return sorted(r for r in (cache / "kernels").glob("*/record.json")
                  if json.loads(r.read_text()).get("op") != "runtime")


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOHC_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("AUTOHC_CACHE_DIR")
    assert cache_dir() == tmp_path / "x" / "autohc"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "autohc"


def test_build_once_then_reuse(tmp_path):
    r1 = ok(run_kernel(tmp_path))
    assert r1["ok"] and r1["entries"] == 1 and not r1["warnings"]
    (rec,) = entries(tmp_path)
    first = json.loads(rec.read_text())
    lib = rec.parent / first["file"]
    mtime = lib.stat().st_mtime_ns
    r2 = ok(run_kernel(tmp_path))
    assert r2["ok"] and r2["entries"] == 1 and not r2["warnings"]
    assert lib.stat().st_mtime_ns == mtime          # reused, not rebuilt
    assert json.loads(rec.read_text())["sha256"] == first["sha256"]


def test_the_optimisation_level_is_part_of_the_key(monkeypatch):
    """A build at another level (bench/opt_level.py patches OPT_FLAGS) is another cache entry."""
    from autohc.build import cache
    key = cache.source_key("int f(void) { return 0; }", "int f(void);", ("-mavx2",))
    monkeypatch.setattr(cache, "OPT_FLAGS", tuple("-O2" if f == "-O3" else f for f in cache.OPT_FLAGS))
    assert cache.source_key("int f(void) { return 0; }", "int f(void);", ("-mavx2",)) != key


def test_tampered_library_is_not_loaded_but_rebuilt(tmp_path):
    ok(run_kernel(tmp_path))
    (rec,) = entries(tmp_path)
    record = json.loads(rec.read_text())
    lib = rec.parent / record["file"]
    # Replace the library with one that would crash the process if it were ever loaded.
    lib.write_bytes(b"\x7fELF not a real library" + os.urandom(64))
    r = ok(run_kernel(tmp_path))
    assert r["ok"]
    assert any("does not match its recorded sha256" in w for w in r["warnings"])
    new = json.loads(rec.read_text())
    assert (rec.parent / new["file"]).read_bytes()[:4] == b"\x7fELF"
    import hashlib
    assert hashlib.sha256((rec.parent / new["file"]).read_bytes()).hexdigest() == new["sha256"]


@pytest.mark.parametrize("corruption", ["garbage", "empty", "wrong-key", "path-escape"])
def test_corrupt_record_is_ignored_and_rebuilt(tmp_path, corruption):
    ok(run_kernel(tmp_path))
    (rec,) = entries(tmp_path)
    record = json.loads(rec.read_text())
    if corruption == "garbage":
        rec.write_text("{ this is not json")
    elif corruption == "empty":
        rec.write_text("")
    elif corruption == "wrong-key":
        rec.write_text(json.dumps({**record, "key": "0" * 64}))
    else:
        rec.write_text(json.dumps({**record, "file": "../../evil.so"}))
    r = ok(run_kernel(tmp_path))
    assert r["ok"]
    assert any("corrupt cache record" in w for w in r["warnings"])
    assert json.loads(rec.read_text())["key"] == record["key"]


def test_a_cache_path_that_is_a_file_is_a_one_line_error(tmp_path):
    """AUTOHC_CACHE_DIR naming a file: the library says so in one line, the CLI exits with it,
    and the file is left as it was."""
    f = tmp_path / "not-a-dir"
    f.write_text("keep me")
    proc = run_kernel(f)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "CacheDirError" in last and "AUTOHC_CACHE_DIR" in last and str(f) in last
    cli = subprocess.run([sys.executable, "-m", "autohc.cli", "cache", "list"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "AUTOHC_CACHE_DIR": str(f)})
    assert cli.returncode != 0 and "Traceback" not in cli.stderr
    assert "is a file, not a directory" in cli.stderr and len(cli.stderr.strip().splitlines()) == 1
    assert f.read_text() == "keep me"


def test_missing_compiler_one_line_error(tmp_path):
    proc = run_kernel(tmp_path, CC="autohc-no-such-compiler")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "CompilerNotFoundError" in last and "install gcc" in last
    assert not entries(tmp_path)                    # nothing half-written


def test_cached_kernel_needs_no_compiler(tmp_path):
    ok(run_kernel(tmp_path))
    r = ok(run_kernel(tmp_path, CC="autohc-no-such-compiler"))
    assert r["ok"]


def test_concurrent_builders_never_tear(tmp_path):
    """Four processes build the same kernel at once: all succeed, one valid entry remains."""
    env = {**os.environ, "AUTOHC_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1])["ok"]
    (rec,) = entries(tmp_path)
    record = json.loads(rec.read_text())
    import hashlib
    assert hashlib.sha256((rec.parent / record["file"]).read_bytes()).hexdigest() == record["sha256"]
    assert not list(rec.parent.glob(".build-*")) and not list(rec.parent.glob(".tmp-*"))
    assert ok(run_kernel(tmp_path))["warnings"] == []


def test_compile_error_is_reported(tmp_path, monkeypatch):
    from autohc.build import BuildError, build
    monkeypatch.setenv("AUTOHC_CACHE_DIR", str(tmp_path))
    with pytest.raises(BuildError, match="failed"):
        build("int f(void) { return syntax error; }", "int f(void);", ())
    assert not entries(tmp_path)


def test_builds_on_two_threads_leave_stdout_alone(tmp_path, monkeypatch, capsys):
    """Two kernels built at once on two threads (as first-use tuning builds its candidates):
    the process's stdout is the same object afterwards and the builds print nothing. cffi's
    emit is slowed so that the builds surely overlap; a sys.stdout swapped around it by each
    build was once left pointing at one build's buffer, and every later print was lost."""
    import threading

    import cffi

    from autohc.build import build
    monkeypatch.setenv("AUTOHC_CACHE_DIR", str(tmp_path))
    emit = cffi.FFI.emit_c_code
    both_in = threading.Barrier(2)

    def slow_emit(self, filename):
        both_in.wait(timeout=60)        # (both builds inside the emit at once)
        emit(self, filename)

    monkeypatch.setattr(cffi.FFI, "emit_c_code", slow_emit)
    before = sys.stdout
    libs = [None, None]

    def one(i):
        libs[i] = build(f"int f{i}(void) {{ return {i + 40}; }}", f"int f{i}(void);", ())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sys.stdout is before
    print("after the builds")
    assert capsys.readouterr().out == "after the builds\n"
    assert libs[0].lib.f0() == 40 and libs[1].lib.f1() == 41


def test_linked_objects_are_compiled_once_and_verified(tmp_path, monkeypatch):
    """A C source linked into libraries (the bf16 skinny paths' object) is compiled once per
    cache and linked into every library that lists it; a tampered object is never linked:
    it is compiled again."""
    import hashlib

    from autohc.build import build
    from autohc.kernels.family import exported_declarations
    monkeypatch.setenv("AUTOHC_CACHE_DIR", str(tmp_path))
    obj = '__attribute__((visibility("hidden"))) int obj_twice(int x) { return 2 * x; }\n'

    def lib(n):
        src = f"#define AUTOHC_API\nint obj_twice(int x);\nAUTOHC_API int plus_{n}(int x) {{ return obj_twice(x) + {n}; }}\n"
        return getattr(build(src, exported_declarations(src), (), objects=(obj,)).lib, f"plus_{n}")
    assert lib(1)(5) == 11
    (rec,) = (tmp_path / "objects").glob("*/record.json")
    first = json.loads(rec.read_text())
    assert lib(2)(5) == 12
    assert json.loads(rec.read_text()) == first          # linked again, not compiled again
    (rec.parent / first["file"]).write_bytes(b"\x7fELF not an object" + os.urandom(64))
    with pytest.warns(RuntimeWarning, match="does not match its recorded sha256"):
        assert lib(3)(5) == 13
    again = json.loads(rec.read_text())
    assert hashlib.sha256((rec.parent / again["file"]).read_bytes()).hexdigest() == again["sha256"]
    assert again["built_at"] > first["built_at"]


def test_sanitize_asks_for_its_runtime_or_a_known_name(tmp_path, monkeypatch):
    """AUTOHC_SANITIZE: an unknown name, or ASan without its runtime loaded first (this test
    process has none), is a one-line error before anything is built."""
    from autohc.build import BuildError, build
    from autohc.build.cache import sanitize_flags
    monkeypatch.setenv("AUTOHC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("AUTOHC_SANITIZE", raising=False)
    assert sanitize_flags() == ()
    for value, says in (("thread", "the one sanitizer"), ("address", "LD_PRELOAD=")):
        monkeypatch.setenv("AUTOHC_SANITIZE", value)
        with pytest.raises(BuildError, match=says) as err:
            build("int f(void) { return 1; }", "int f(void);", ())
        assert "\n" not in str(err.value)
    assert not entries(tmp_path)


ASAN_SCRIPT = textwrap.dedent("""
    import json, sys
    from autohc.build import build
    src = ("#include <stdlib.h>\\n"
           "int sum_first(int n) { int *p = malloc(16 * sizeof(int)); int s = 0;"
           " for (int i = 0; i < n; ++i) p[i] = i; for (int i = 0; i < n; ++i) s += p[i];"
           " free(p); return s; }\\n")
    lib = build(src, "int sum_first(int n);", ()).lib
    print(json.dumps({"in_bounds": lib.sum_first(16)}), flush=True)
    lib.sum_first(int(sys.argv[1]))      # past the 16 ints: ASan stops the process here
    print("not caught", flush=True)
""")


def test_sanitize_address_builds_kernels_that_asan_checks(tmp_path):
    """Under AUTOHC_SANITIZE=address, with ASan's runtime preloaded (the recipe in
    docs/kernels.md), a library's writes are checked: one past its buffer stops the process
    with ASan's report; within bounds it computes as before."""
    libasan = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True,
                             text=True).stdout.strip()
    if not os.path.isabs(libasan):
        pytest.skip("gcc has no libasan.so here")
    env = {**os.environ, "AUTOHC_CACHE_DIR": str(tmp_path), "AUTOHC_SANITIZE": "address",
           "LD_PRELOAD": libasan, "ASAN_OPTIONS": "detect_leaks=0"}
    proc = subprocess.run([sys.executable, "-c", ASAN_SCRIPT, "17"], env=env, capture_output=True,
                          text=True, timeout=300)
    first = json.loads(proc.stdout.splitlines()[0])
    assert first["in_bounds"] == sum(range(16))
    assert "heap-buffer-overflow" in proc.stderr and proc.returncode != 0
    assert "not caught" not in proc.stdout
    records = [json.loads(r.read_text()) for r in (tmp_path / "kernels").glob("*/record.json")]
    assert records and all("-fsanitize=address" in r["flags"] for r in records)


def _slow_compiler(tmp_path: Path, seconds: float) -> tuple[str, Path]:
    """A CC that logs each compile (`start <pid> <time> <args>`, `end <pid> <time>`) and sleeps
    `seconds` before running gcc, so that builds surely overlap."""
    log = tmp_path / "compiles.log"
    cc = tmp_path / "slow-cc"
    cc.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case " $* " in
          *" -c "*) echo "start $$ $(date +%s.%N) $*" >> {log}; sleep {seconds}; gcc "$@"; rc=$?
                    echo "end $$ $(date +%s.%N)" >> {log}; exit $rc;;
        esac
        exec gcc "$@"
        """))
    cc.chmod(0o755)
    return str(cc), log


def test_processes_building_one_kernel_compile_it_once(tmp_path):
    """Four processes that need the same kernels at once (the ranks of a job started on an
    empty cache): each kernel is compiled by one of them, the others wait for it and load it."""
    cc, log = _slow_compiler(tmp_path, 1.0)
    env = {**os.environ, "AUTOHC_CACHE_DIR": str(tmp_path / "cache"), "CC": cc}
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1])["ok"]
    sources = [line.split()[-1] for line in log.read_text().splitlines() if line.startswith("start")]
    modules = [Path(s).name for s in sources]
    assert modules and len(modules) == len(set(modules)), modules     # none compiled twice


def test_a_killed_builder_holds_up_no_one(tmp_path):
    """A process killed while it compiles leaves its kernel's lock behind it with the kernel
    (flock): the next process builds the kernel at once."""
    import signal
    import time
    cc, log = _slow_compiler(tmp_path, 120)
    cache = tmp_path / "cache"
    stuck = subprocess.Popen([sys.executable, "-c", SCRIPT], env={**os.environ, "AUTOHC_CACHE_DIR": str(cache),
                                                              "CC": cc},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not (log.exists() and "start" in log.read_text()):
            assert stuck.poll() is None and time.time() < deadline, "the first build never started"
            time.sleep(0.1)
        assert list(cache.glob("kernels/*/.build.lock"))       # (it holds a kernel's lock)
    finally:
        os.killpg(stuck.pid, signal.SIGKILL)
        stuck.wait(timeout=60)
    t0 = time.time()
    assert ok(run_kernel(cache))["ok"]
    assert time.time() - t0 < 100          # not held up until the killed build's sleep ended


def test_a_librarys_objects_compile_beside_its_own_source(tmp_path, monkeypatch):
    """A library's linked objects (the bf16 skinny paths) are compiled at the same time as the
    library's own source, not before it."""
    from autohc.build import build
    from autohc.kernels.family import exported_declarations
    cc, log = _slow_compiler(tmp_path, 1.0)
    monkeypatch.setenv("AUTOHC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", cc)
    obj = '__attribute__((visibility("hidden"))) int obj_thrice(int x) { return 3 * x; }\n'
    src = "#define AUTOHC_API\nint obj_thrice(int x);\nAUTOHC_API int plus_7(int x) { return obj_thrice(x) + 7; }\n"
    assert build(src, exported_declarations(src), (), objects=(obj,)).lib.plus_7(5) == 22
    spans = {}
    for line in log.read_text().splitlines():
        kind, pid, when = line.split()[:3]
        spans.setdefault(pid, {})[kind] = float(when)
    (a, b) = spans.values()
    assert a["start"] < b["end"] and b["start"] < a["end"], spans      # the two compiles overlap


def test_a_builder_that_holds_its_lock_too_long_is_not_waited_for(tmp_path, monkeypatch):
    """A process that keeps a kernel's lock (stopped: a suspended batch job) holds up the others
    for BUILD_LOCK_WAIT_S at most; then they build the kernel themselves."""
    import fcntl
    import time

    from autohc.build import build, cache
    monkeypatch.setenv("AUTOHC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cache, "BUILD_LOCK_WAIT_S", 1.0)
    src, cdef = "int held(void) { return 9; }", "int held(void);"
    key = cache.build_key(src, cdef, (), cache.compiler())
    entry = tmp_path / "kernels" / key[:32]
    entry.mkdir(parents=True)
    with open(entry / ".build.lock", "a") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)          # (another open file: it conflicts as a process would)
        t0 = time.monotonic()
        assert build(src, cdef, ()).lib.held() == 9
        waited = time.monotonic() - t0
    assert 1.0 <= waited < 60
