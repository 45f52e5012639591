"""`run --once` whose email check waits on a lock in the database (a migration, a transaction
left open) neither ignores a stop signal nor holds the drain for ever.

Found by a reader (2026-12-06): the email phase waited for its thread without a bound; the
check's connection has the worker's timeouts off, so a lock held on email_checkpoints kept
the process running after SIGTERM (until SIGKILL), and without a signal kept the timer unit
active with nothing drained.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

from tests.support.daemon import daemon_env, start_daemon, wait_until
from tests.support.db import enqueue_many
from tests.support.ports import unused_port

pytestmark = [pytest.mark.subprocess, pytest.mark.postgres]


def _env(database_url: str, tmp_path: Path, **extra: str) -> dict[str, str]:
    account = {"name": "a", "host": "127.0.0.1", "port": unused_port(), "security": "none",
               "username": "alice", "password": "secret"}
    return daemon_env(
        database_url, tmp_path, SOKRATOS_EMAIL_ACCOUNTS=json.dumps([account]), **extra
    )


@contextmanager
def _email_checkpoints_locked(database_url: str) -> Iterator[None]:
    with psycopg.connect(database_url) as locker:
        locker.execute("LOCK TABLE email_checkpoints IN ACCESS EXCLUSIVE MODE")
        yield
        locker.rollback()


def _check_waits_on_the_lock(db: psycopg.Connection) -> bool:
    rows = db.execute(
        "SELECT query FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
    ).fetchall()
    return any("email_checkpoints" in r[0] for r in rows)


def _events(log: Path) -> list[str]:
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    return [str(line.get("event")) for line in lines]


def test_a_stop_signal_ends_run_once_while_its_email_check_waits_on_a_lock(
    database_url: str, db: psycopg.Connection, tmp_path: Path
) -> None:
    """SIGTERM: the check is given up after the stop's wait (5 s), the process exits 0."""
    log = tmp_path / "worker.log"
    with _email_checkpoints_locked(database_url):
        proc = start_daemon(_env(database_url, tmp_path), log, "--once")
        try:
            assert wait_until(lambda: _check_waits_on_the_lock(db), timeout=60), log.read_text()
            proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            code = proc.wait(60)
            took = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert code == 0, log.read_text()[-3000:]
    assert took < 30, took  # the stop's own 5 s wait, not the lock's (held for ever)
    events = _events(log)
    assert "email_check_abandoned" in events and "signal_received" in events, events


def test_without_a_signal_the_drain_goes_on_after_the_checks_deadline(
    database_url: str, db: psycopg.Connection, tmp_path: Path
) -> None:
    """No signal: after the account's deadline (+5 s) the email check is left and the items
    ready are drained; the process exits on its own."""
    enqueue_many(db, 3)
    log = tmp_path / "worker.log"
    env = _env(database_url, tmp_path, SOKRATOS_EMAIL_CHECK_DEADLINE="2s")
    with _email_checkpoints_locked(database_url):
        proc = start_daemon(env, log, "--once")
        try:
            code = proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert code == 0, log.read_text()[-3000:]
    assert "email_check_abandoned" in _events(log)
    assert db.execute("SELECT count(*) FROM pending_triage").fetchone() == (0,)
    assert db.execute("SELECT count(*) FROM work_outcomes").fetchone() == (3,)
