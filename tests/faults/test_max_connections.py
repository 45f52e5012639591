"""Other clients take every connection the server allows (max_connections) while the worker
runs, and before it starts: the worker waits and says why, nothing is lost, doubled or
dead-lettered, and it carries on once connections come free (hunt, 2026-12-07: held). The
worker's role is the least-privilege one of sql/roles.sql: a superuser would use the slots
the server reserves."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from sokratos_worker.store.migrations import apply_migrations
from tests.faults.support import assert_exactly_once, cli, log_events, report, stop, tail
from tests.support.daemon import ROOT, daemon_env, start_daemon, wait_until
from tests.support.db import count, enqueue_many
from tests.support.tmpfs import PrivateServer, can_mount

pytestmark = [pytest.mark.faults, pytest.mark.subprocess, pytest.mark.slow]

ITEMS = 200
MAX_CONNECTIONS = 20


@pytest.fixture
def server(pg_server: str) -> Iterator[PrivateServer]:
    # (pg_server: the shared server's start creates the OS user a private server runs as)
    if not can_mount():  # (the server runs as the embedded wheel's user: root starts it)
        pytest.skip("a private server here needs root")
    base = Path(tempfile.mkdtemp(prefix="sw-mc-", dir="/tmp"))
    base.chmod(0o755)
    own = PrivateServer(base / "pg", base / "wal")
    try:
        own.init()
        try:
            started = own.start(
                f"max_connections={MAX_CONNECTIONS}", "superuser_reserved_connections=3"
            )
            assert started.returncode == 0, started.stderr
            yield own
        finally:
            own.stop("immediate")  # (also when a start timed out with the server up)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _outcomes(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        return count(conn, "SELECT count(*) FROM work_outcomes")


def _hog(url: str) -> list[psycopg.Connection]:
    """Every connection a non-superuser may still open."""
    held: list[psycopg.Connection] = []
    for _ in range(MAX_CONNECTIONS):
        try:
            held.append(psycopg.connect(url, autocommit=True, connect_timeout=3))
        except psycopg.OperationalError:
            break
    return held


@pytest.mark.timeout(240)
def test_max_connections_taken_by_other_clients(server: PrivateServer, tmp_path: Path) -> None:
    with psycopg.connect(server.url(), autocommit=True) as conn:
        conn.execute("CREATE DATABASE work")
    admin = server.url("work")
    apply_migrations(admin)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute((ROOT / "sql" / "roles.sql").read_text("utf-8"))
        conn.execute("CREATE ROLE other LOGIN")
        keys = [("pending_triage", i) for i in enqueue_many(conn, ITEMS, behaviour="sleep:0.25")]
    worker_url = f"host={server.socket_dir} user=sokratos_worker dbname=work"
    other_url = f"host={server.socket_dir} user=other dbname=work"
    log = tmp_path / "worker.log"
    env = daemon_env(
        worker_url,
        tmp_path,
        SOKRATOS_CONCURRENCY="4",
        SOKRATOS_MIGRATE_ON_START="false",
        SOKRATOS_STARTUP_TIMEOUT="60s",
    )
    # Before it starts: every connection taken.
    held = _hog(other_url)
    proc = start_daemon(env, log)
    try:
        assert wait_until(
            lambda: any(e.get("event") == "waiting_for_database" for e in log_events(log)),
            timeout=60,
        ), tail(log)
        time.sleep(4.0)
        assert proc.poll() is None, tail(log)  # it waits (SOKRATOS_STARTUP_TIMEOUT)
        for c in held[:8]:
            c.close()
        held = held[8:]
        assert wait_until(lambda: _outcomes(admin) >= 40, timeout=60), tail(log)
        # While it runs: the rest taken, then the worker's sessions ended (as a failover or
        # an operator's pg_terminate_backend would), and the slots they freed taken too.
        held += _hog(other_url)
        with psycopg.connect(server.url("work"), autocommit=True) as su:
            ended = su.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE usename = 'sokratos_worker'"
            ).fetchone()
            taken = []
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                taken += _hog(other_url)
            held += taken
        assert ended is not None and ended[0] > 0
        time.sleep(8.0)
        status = cli(env, "status")
        for c in held:
            c.close()
        freed = time.monotonic()
        assert wait_until(lambda: _outcomes(admin) >= ITEMS, timeout=120), tail(log)
        recover = time.monotonic() - freed
        assert proc.poll() is None, tail(log)
    finally:
        for c in held:
            c.close()
        code = stop(proc)
    assert code == 0, tail(log)
    with psycopg.connect(admin, autocommit=True) as db:
        fig = assert_exactly_once(db, keys)
        failed = count(db, "SELECT count(*) FROM failed_operations")
        attempts = dict(
            db.execute("SELECT attempts, count(*) FROM work_outcomes GROUP BY 1").fetchall()
        )
    assert failed == 0, tail(log)
    assert fig.by_outcome == {"saved": ITEMS}, fig
    # `status` says why it cannot look (the server's refusal), and exits 0 (contract §1).
    assert status.returncode == 0, status
    assert "remaining connection slots are reserved" in status.stdout, status.stdout
    report("max_connections_taken_at_start_and_while_running", fig, recover, attempts=attempts)
