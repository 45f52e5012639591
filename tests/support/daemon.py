"""Start the real daemon (with scripted handlers) as a subprocess and wait for conditions."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def daemon_env(database_url: str, tmp_path: Path, **extra: str) -> dict[str, str]:
    """A minimal environment: the test database, a private data dir, fast timings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SOKRATOS_")}
    env.update(
        SOKRATOS_DATABASE_URL=database_url,
        SOKRATOS_DATA_DIR=str(tmp_path / "data"),
        SOKRATOS_LOG_FORMAT="json",
        SOKRATOS_CONCURRENCY="8",
        SOKRATOS_LEASE="3s",
        SOKRATOS_RETRY_BASE="100ms",
        SOKRATOS_RETRY_MAX="200ms",
        SOKRATOS_HEARTBEAT_INTERVAL="1s",
        SOKRATOS_SHUTDOWN_GRACE="10s",
        PYTHONPATH=str(ROOT),
    )
    env.update(extra)
    return env


def start_daemon(env: dict[str, str], log_path: Path, *args: str) -> subprocess.Popen[bytes]:
    """``sokratos-worker run`` with the scripted handlers; stderr goes to ``log_path``."""
    handle = log_path.open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.handlers", "run", *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=handle,
    )


def wait_until(condition: Callable[[], bool], *, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` passes (bounded loop)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()
