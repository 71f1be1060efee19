"""Shared test setup: one kernel cache per test session (kernels compile once, ~1 s each)."""
import os
import tempfile

import pytest

# Set before autohc builds anything; tests that need their own cache use a subprocess.
_SESSION_CACHE = tempfile.mkdtemp(prefix="autohc-test-cache-")
os.environ["AUTOHC_CACHE_DIR"] = _SESSION_CACHE
# install() tunes each new GEMM problem on first use (seconds each): off for the suite, on in
# the tests of that feature (tests/test_first_use.py)
os.environ["AUTOHC_FIRST_USE"] = "0"


@pytest.fixture(scope="session")
def session_cache_dir():
    return _SESSION_CACHE
