"""One process's wall clock stepped while it runs: libfaketime, for the clock-step tests.

The process gets ``LD_PRELOAD`` of libfaketime with its offset read from a file the test
rewrites (``+0``, then ``-3600``); ``time.monotonic`` and PostgreSQL's ``now()`` stay real,
as they do when NTP steps a host's clock.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest

SHIM = Path(__file__).parent / "faketime_shim"


def libfaketime() -> str:
    """The multi-threaded libfaketime; skipped without it locally, a failure in CI."""
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1"))
    if not found:
        message = "libfaketime is not installed (apt-get install faketime)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found[0]


def stepped_env(env: dict[str, str], offset_file: Path) -> dict[str, str]:
    """``env`` with the wall clock at ``offset_file``'s offset (written ``+0`` here)."""
    offset_file.write_text("+0\n")
    return {
        **env,
        "LD_PRELOAD": libfaketime(),
        "FAKETIME_TIMESTAMP_FILE": str(offset_file),
        "FAKETIME_NO_CACHE": "1",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        # (a sitecustomize working around libfaketime's broken sleep in CPython 3.11)
        "PYTHONPATH": os.pathsep.join(p for p in (str(SHIM), env.get("PYTHONPATH")) if p),
    }
