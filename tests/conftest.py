"""Shared test setup: one kernel cache per test session (kernels compile once, ~1 s each)."""
import os
import tempfile

import pytest

# Set before autohc builds anything; tests that need their own cache use a subprocess.
_SESSION_CACHE = tempfile.mkdtemp(prefix="autohc-test-cache-")
os.environ["AUTOHC_CACHE_DIR"] = _SESSION_CACHE
# pytest-xdist (-n 2): the workers of one run share the compiled kernels and objects (the
# cache is process-safe) and keep their own registries
if os.environ.get("PYTEST_XDIST_TESTRUNUID"):
    _SHARED = os.path.join(tempfile.gettempdir(), f"autohc-test-kernels-{os.environ['PYTEST_XDIST_TESTRUNUID']}")
    for _sub in ("kernels", "objects"):
        os.makedirs(os.path.join(_SHARED, _sub), exist_ok=True)
        os.symlink(os.path.join(_SHARED, _sub), os.path.join(_SESSION_CACHE, _sub))
# install() tunes each new GEMM problem on first use (seconds each): off for the suite, on in
# the tests of that feature (tests/test_first_use.py)
os.environ["AUTOHC_FIRST_USE"] = "0"


@pytest.fixture(scope="session")
def session_cache_dir():
    return _SESSION_CACHE
