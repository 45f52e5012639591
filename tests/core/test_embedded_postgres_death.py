"""The embedded PostgreSQL's postmaster dies under a running daemon (kill -9, the OOM killer).

Nothing ever started it again: the daemon waited for the database for ever, its hint naming a
SOKRATOS_DATABASE_URL that is not even set. Now it logs ``embedded_postgres_died`` once and
exits 75, so that systemd's Restart=on-failure starts it again, which starts the server
(crash recovery); the items in flight are left to their leases and every item is done once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import psycopg
import pytest

from tests.support.daemon import start_daemon, wait_until
from tests.support.db import count, enqueue_many
from tests.support.operator import cli_env

EXIT_BOUND_S = 60.0  # generous: the stop's budgets (grace, releases) come first


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A data directory with a short path (the server's socket lives in it)."""
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="pgd-"))
    try:
        yield path
    finally:
        _stop_leftover(path / "data" / "postgres")
        subprocess.run(["rm", "-rf", str(path)], check=False)


def _events(log_path: Path) -> list[dict[str, object]]:
    events = []
    for line in log_path.read_text("utf-8", errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            events.append(json.loads(line))
    return events


def _named(log_path: Path, name: str) -> list[dict[str, object]]:
    return [e for e in _events(log_path) if e.get("event") == name]


def _started(log_path: Path) -> bool:
    return bool(_named(log_path, "worker_started"))


def _postmaster_pid(pgdata: Path) -> int:
    return int((pgdata / "postmaster.pid").read_text("utf-8").splitlines()[0])


def _server_pids(pgdata: Path) -> list[int]:
    found = subprocess.run(
        ["pgrep", "-f", f"postgres -D {pgdata}"], capture_output=True, text=True, check=False
    )
    return [int(pid) for pid in found.stdout.split()]


def _stop_leftover(pgdata: Path) -> None:
    for pid in _server_pids(pgdata):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)
    wait_until(lambda: not _server_pids(pgdata), timeout=20, interval=0.1)


def _connect(pgdata: Path) -> psycopg.Connection:
    return psycopg.connect(host=str(pgdata), user="postgres", dbname="postgres", autocommit=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.parametrize("sharing", [1, 2], ids=["one-daemon", "two-daemons-sharing-it"])
def test_a_killed_postmaster_stops_the_daemon_with_75_and_the_next_start_drains_all(
    short_dir: Path, sharing: int
) -> None:
    env = cli_env(
        short_dir,
        SOKRATOS_LOG_LEVEL="info",
        SOKRATOS_CONCURRENCY="4",
        SOKRATOS_LEASE="3s",
        SOKRATOS_RETRY_BASE="100ms",
        SOKRATOS_RETRY_MAX="200ms",
        SOKRATOS_HEARTBEAT_INTERVAL="1s",
        SOKRATOS_SHUTDOWN_GRACE="3s",
        SOKRATOS_STARTUP_TIMEOUT="60s",
    )
    pgdata = short_dir / "data" / "postgres"
    logs = [short_dir / f"first-{i}.log" for i in range(sharing)]
    second_log = short_dir / "second.log"
    n = 80  # 0.5 s each, 4 or 8 at a time: still draining when the server is killed
    firsts: list[subprocess.Popen[bytes]] = []
    try:
        for log_path in logs:  # one after the other: the next attaches to the running server
            firsts.append(start_daemon(env, log_path))
            started = wait_until(partial(_started, log_path), timeout=120)
            assert started, log_path.read_text()[-2000:]
        with _connect(pgdata) as conn:
            enqueue_many(conn, n, behaviour="sleep:0.5")
            # Some done, some in flight: the death comes mid-drain.
            assert wait_until(
                lambda: count(conn, "SELECT count(*) FROM work_outcomes") >= 4, timeout=60
            )
        postmaster = _postmaster_pid(pgdata)
        os.kill(postmaster, signal.SIGKILL)
        for first, log_path in zip(firsts, logs, strict=True):
            try:
                code = first.wait(timeout=EXIT_BOUND_S)
            except subprocess.TimeoutExpired:
                pytest.fail(
                    f"the daemon still runs {EXIT_BOUND_S:g} s after its postmaster was"
                    f" killed; log tail: {log_path.read_text()[-1500:]}"
                )
            assert code == 75, (code, log_path.read_text()[-2000:])
            died = _named(log_path, "embedded_postgres_died")
            assert len(died) == 1, (died, log_path.read_text()[-2000:])
            assert died[0]["pid"] == postmaster and died[0]["level"] == "error", died
            assert "service manager restarts it" in str(died[0]["hint"]), died
            assert "Traceback" not in log_path.read_text(), log_path.read_text()[-3000:]
        # The settles of the items in flight met it away: the hint names the embedded server.
        away = [event for log_path in logs for event in _named(log_path, "waiting_for_database")]
        assert away, "\n".join(p.read_text()[-2000:] for p in logs)
        for event in away:
            assert "SOKRATOS_DATABASE_URL" not in str(event["hint"]), event
            assert f"embedded PostgreSQL in {pgdata}" in str(event["hint"]), event
    finally:
        for first in firsts:
            if first.poll() is None:
                first.kill()
                first.wait(timeout=10)

    second = start_daemon(env, second_log)
    try:
        started = wait_until(partial(_started, second_log), timeout=120)
        assert started, second_log.read_text()[-2000:]
        with _connect(pgdata) as conn:
            # Items the first left in flight run again once their leases run out.
            assert wait_until(
                lambda: count(conn, "SELECT count(*) FROM work_outcomes") >= n,
                timeout=120,
                interval=0.2,
            ), (count(conn, "SELECT count(*) FROM work_outcomes"), second_log.read_text()[-2000:])
            time.sleep(1.0)  # (an item done twice would show now)
            done = count(conn, "SELECT count(*) FROM work_outcomes")
            distinct = count(conn, "SELECT count(DISTINCT item_id) FROM work_outcomes")
            saved = count(conn, "SELECT count(*) FROM work_outcomes WHERE outcome = 'saved'")
            memories = count(conn, "SELECT count(*) FROM memories")
            origins = count(conn, "SELECT count(DISTINCT origin) FROM memories")
        print(f"\n{n} items in, {done} outcomes ({distinct} items), {memories} memories")
        assert (done, distinct, saved, memories, origins) == (n, n, n, n, n), second_log.read_text()[
            -2000:
        ]
    finally:
        _stop(second)
    assert second.returncode == 0, second_log.read_text()[-2000:]
    assert not _named(second_log, "embedded_postgres_died")
