"""Shared test setup: one kernel cache per test session (kernels compile once, ~1 s each)."""
import os
import tempfile

import pytest

# Set before autohc builds anything; tests that need their own cache use a subprocess.
_SESSION_CACHE = tempfile.mkdtemp(prefix="autohc-test-cache-")
os.environ["AUTOHC_CACHE_DIR"] = _SESSION_CACHE


@pytest.fixture(scope="session")
def session_cache_dir():
    return _SESSION_CACHE
