"""/readyz says whether the worker reaches PostgreSQL: 503 from the first failed contact of any
path (claims, listener, heartbeat, scrape) until one succeeds again, whatever the runner's state."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from sokratos_worker.config import Settings
from sokratos_worker.daemon import build_worker
from sokratos_worker.runner import State
from sokratos_worker.store.connection import Database
from tests.support.daemon import daemon_env, start_daemon, wait_until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 12.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return -1, str(exc)


def _database_up(text: str) -> str | None:
    for line in text.splitlines():
        if line.startswith("sokratos_database_up "):
            return line.split()[1]
    return None


def test_a_failed_contact_makes_the_worker_not_ready_in_any_state(database_url: str) -> None:
    """The runner in "no backend" claims nothing, so it never learns of an outage itself."""
    database = Database(database_url, size=1)
    try:
        worker = build_worker(Settings(), database, lambda _ctx: {}, None, None)
        assert worker._ready()
        worker.runner.state = State.NO_BACKEND
        worker.database_contact.failed()  # the listener lost its connection, say
        assert not worker._ready()
        worker.database_contact.succeeded()  # it listens again
        assert worker._ready()
        worker.runner.state = State.WAITING_FOR_DATABASE
        assert not worker._ready()  # its claims still fail (the pool is exhausted, say)
    finally:
        database.close()


@pytest.mark.subprocess
@pytest.mark.slow
def test_readyz_is_503_while_the_database_is_down(
    database_url: str, tmp_path: Path, restart_postgres: Callable[[float], None]
) -> None:
    """An idle runner claims again only at its next heartbeat (300 s here): the listener's lost
    connection and the scrape's failure must make /readyz 503 by themselves."""
    port = _free_port()
    env = daemon_env(
        database_url,
        tmp_path,
        SOKRATOS_METRICS_ADDR=f"127.0.0.1:{port}",
        SOKRATOS_HEARTBEAT_INTERVAL="300s",
    )
    log = tmp_path / "daemon.log"
    proc = start_daemon(env, log)
    base = f"http://127.0.0.1:{port}"
    outage: threading.Thread | None = None
    try:
        assert wait_until(lambda: _get(base + "/readyz")[0] == 200, timeout=60), log.read_text()[
            -3000:
        ]
        assert wait_until(lambda: "worker_started" in log.read_text(), timeout=30)
        outage = threading.Thread(target=restart_postgres, args=(40.0,), daemon=True)
        outage.start()
        time.sleep(2.0)  # the server is stopping / stopped
        seen_down_metric = False
        ready_codes: list[int] = []
        deadline = time.monotonic() + 25.0
        while time.monotonic() < deadline:
            status, text = _get(base + "/metrics")
            if status == 200 and _database_up(text) in ("0", "0.0"):
                seen_down_metric = True
            code, _ = _get(base + "/readyz")
            ready_codes.append(code)
            if seen_down_metric and code == 503:
                break
            time.sleep(0.5)
        assert seen_down_metric, "the scrape never noticed the outage: test set-up problem"
        # While the process itself reports the database down, it must not answer ready.
        assert 503 in ready_codes, (
            f"/readyz answered {sorted(set(ready_codes))} for 25 s of a PostgreSQL outage"
            " while /metrics said sokratos_database_up 0"
        )
    finally:
        if outage is not None:
            outage.join(90)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(40)
            except Exception:
                proc.kill()
