"""torch's OpenMP pool and autohc's worker pool on the same cores.

torch's libgomp workers spin after each parallel region (by default for about 300,000
iterations, i.e. milliseconds), and a spinning worker takes its core from the autohc team
that runs next. libgomp reads its wait policy once, when torch is imported, from
OMP_WAIT_POLICY and GOMP_SPINCOUNT. Measured on a DiT-S/2 training step (README, "Threads"):
with torch's pool at all cores and the default spin, autohc's step was 1.3x slower than with
torch's pool at one thread; with GOMP_SPINCOUNT=10000 (a spin of microseconds) torch's pool
at all cores was 5-10 % faster than at one thread; OMP_WAIT_POLICY=PASSIVE slowed stock torch
itself by 25-50 %.

So install() keeps torch's threads where torch's workers wait briefly, and otherwise sets
torch's pool to one thread while installed. The `autohc` commands that train or sample
(`train`, `sample`, `eval`) ask for the short spin before they import torch; a script can do
the same with `prefer_short_spin()` before `import torch`, or with the variable in its
environment. The spin helpers import nothing; the team runner below imports torch.
"""
from __future__ import annotations

import os
import sys

SHORT_SPIN = 10_000             # GOMP_SPINCOUNT autohc asks for: microseconds of spinning
BRIEF_SPIN_MAX = 100_000        # at most this many spins counts as waiting briefly


def prefer_short_spin() -> bool:
    """Set GOMP_SPINCOUNT to SHORT_SPIN if torch (so libgomp) is not loaded yet and the user
    chose no wait policy. Returns whether it was set."""
    if "torch" in sys.modules or "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return False
    os.environ["GOMP_SPINCOUNT"] = str(SHORT_SPIN)
    return True


def torch_waits_briefly() -> bool:
    """Whether torch's OpenMP workers sleep soon after a region: a passive wait policy or a
    spin count of at most BRIEF_SPIN_MAX in the environment (read by libgomp at torch's
    import; set before it, as the shell or prefer_short_spin() does)."""
    if os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE":
        return True
    raw = os.environ.get("GOMP_SPINCOUNT", "").strip()
    try:
        return bool(raw) and int(raw) <= BRIEF_SPIN_MAX
    except ValueError:
        return False


# --- autohc's teams on torch's OpenMP threads (templates/runtime/omp_team.c.j2) -----------
#
# AUTOHC_TEAM chooses where a kernel's team of threads runs:
#   omp   (default) an OpenMP parallel region of torch's own libgomp: one set of worker threads
#         for torch's ops and autohc's kernels, so install() leaves torch all its threads and
#         nothing spins against anything (measured: docs/override.md, "Threads").
#   pool  autohc's own pthread pool (runtime/pool.py), as before; install() then gives torch's
#         ops one thread unless its workers wait briefly (the spin settings above).
TEAMS = ("omp", "pool")


def team_kind() -> str:
    """AUTOHC_TEAM, read each time (a bad value is one clear line)."""
    raw = os.environ.get("AUTOHC_TEAM", "").strip().lower() or "omp"
    if raw not in TEAMS:
        raise ValueError(f"AUTOHC_TEAM={raw!r}: expected one of {', '.join(TEAMS)}")
    return raw


_team: list = []                # the built library, once (a list: no global statement)


def team_library(fallback_address: int):
    """The OpenMP team runner, built once with -fopenmp after torch (so its libgomp) is
    loaded, its fallback set to `fallback_address` (autohc_pool_run) and its threads to the
    CPU plan's compute cores."""
    if not _team:
        import torch  # noqa: F401  (first: the loader then binds libgomp.so.1 to torch's)

        from ..build import build
        from ..kernels.family import exported_declarations
        from ..kernels.render import environment
        from . import plan
        src = environment().get_template("runtime/omp_team.c.j2").render()
        lib = build(src, exported_declarations(src), ("-fopenmp",), meta={"op": "runtime", "team": "omp"})
        cpus = list(plan.current().compute)
        lib.lib.autohc_omp_setup(lib.ffi.cast("void *", fallback_address),
                                 lib.ffi.new("int[]", cpus), len(cpus))
        _team.append(lib)
    return _team[0]


def team_run_address(fallback_address: int) -> int:
    lib = team_library(fallback_address)
    return int(lib.ffi.cast("uintptr_t", lib.ffi.addressof(lib.lib, "autohc_omp_run")))


def team_time() -> tuple[int, float]:
    """(whole-team jobs run on torch's OpenMP threads so far, their wall time in seconds): the
    time a step spent inside the kernels' teams (0, 0.0 where the runner was never built)."""
    if not _team:
        return 0, 0.0
    lib = _team[0]
    out = lib.ffi.new("uint64_t[2]")
    lib.lib.autohc_omp_team_time(out)
    return int(out[0]), out[1] / 1e9


def team_fallbacks() -> int:
    """Jobs the OpenMP runner handed to the pool (0 where it was never built)."""
    return int(_team[0].lib.autohc_omp_fallbacks()) if _team else 0
