"""PostgreSQL's WAL disk filling up under a running worker: the server PANICs (it cannot write
WAL), its crash recovery cannot finish either, and it stays down until space is freed and it is
started again. The worker waits it out and finishes the work, nothing lost or doubled; only
the items in flight at the crash may have used a second attempt (hunt, 2026-12-07: held)."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from sokratos_worker.store.migrations import apply_migrations
from tests.faults.support import assert_exactly_once, log_events, report, stop, tail
from tests.support.daemon import daemon_env, start_daemon, wait_until
from tests.support.db import count, enqueue_many
from tests.support.tmpfs import PrivateServer, can_mount, fill, small_tmpfs

pytestmark = [pytest.mark.faults, pytest.mark.subprocess, pytest.mark.slow]

ITEMS = 200


@pytest.fixture
def wal_on_tmpfs(pg_server: str) -> Iterator[tuple[PrivateServer, Path]]:
    # (pg_server: the shared server's start creates the OS user a private server runs as)
    if not can_mount():
        pytest.skip("mounting a tmpfs needs root")
    base = Path(tempfile.mkdtemp(prefix="sw-wal-", dir="/tmp"))
    base.chmod(0o755)
    try:
        with small_tmpfs(48) as mount:
            server = PrivateServer(base / "pg", mount / "wal")
            server.init()
            try:
                started = server.start()  # (a start timed out may have left it running)
                assert started.returncode == 0, started.stderr + server.log.read_text()
                yield server, mount
            finally:
                server.stop("immediate")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _outcomes(url: str) -> int:
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=2) as conn:
            return count(conn, "SELECT count(*) FROM work_outcomes")
    except psycopg.OperationalError:
        return -1


@pytest.mark.timeout(240)
def test_a_full_wal_disk_crashes_the_server_and_the_worker_waits_it_out(
    wal_on_tmpfs: tuple[PrivateServer, Path], tmp_path: Path
) -> None:
    server, mount = wal_on_tmpfs
    with psycopg.connect(server.url(), autocommit=True) as conn:
        conn.execute("CREATE DATABASE work")
    url = server.url("work")
    apply_migrations(url)
    with psycopg.connect(url, autocommit=True) as db:
        keys = [("pending_triage", i) for i in enqueue_many(db, ITEMS, behaviour="sleep:0.05")]
    log = tmp_path / "worker.log"
    env = daemon_env(url, tmp_path, SOKRATOS_CONCURRENCY="4", SOKRATOS_MAX_ATTEMPTS="2")
    proc = start_daemon(env, log)
    try:
        assert wait_until(lambda: _outcomes(url) >= 30, timeout=60), tail(log)
        ballast = fill(mount)
        # Another client writes WAL until the server can write no more.
        with (
            pytest.raises(psycopg.OperationalError),
            psycopg.connect(url, autocommit=True) as other,
        ):
            other.execute(
                "CREATE TABLE scratch AS SELECT g, repeat('x', 500) AS t"
                " FROM generate_series(1, 200000) g"
            )
        # The server PANICked, and its crash recovery could not write WAL either: it is down.
        assert wait_until(lambda: _outcomes(url) < 0, timeout=30), server.log.read_text()[-3000:]
        time.sleep(8.0)
        assert "PANIC:  could not write" in server.log.read_text(), server.log.read_text()[-3000:]
        ballast.unlink()
        restarted = server.start()  # as the operator (or systemd) starts it once space is freed
        if restarted.returncode != 0:  # (a backend of the crashed server not yet gone)
            time.sleep(3)
            restarted = server.start()
        assert restarted.returncode == 0, server.log.read_text()[-3000:]
        back = time.monotonic()
        assert wait_until(lambda: _outcomes(url) >= ITEMS, timeout=120), tail(log)
        recover = time.monotonic() - back
        assert proc.poll() is None, tail(log)
    finally:
        code = stop(proc)
    assert code == 0, tail(log)
    with psycopg.connect(url, autocommit=True) as db:
        fig = assert_exactly_once(db, keys)
        failed = count(db, "SELECT count(*) FROM failed_operations")
        attempts = dict(
            db.execute("SELECT attempts, count(*) FROM work_outcomes GROUP BY 1").fetchall()
        )
    assert failed == 0, tail(log)
    assert fig.by_outcome == {"saved": ITEMS}, fig
    # The items in flight at the crash (at most the 4 slots' and a claim's) ran again.
    assert attempts.get(1, 0) >= ITEMS - 8 and set(attempts) <= {1, 2}, attempts
    assert any(e.get("event") == "waiting_for_database" for e in log_events(log)), tail(log)
    report("wal_disk_full_server_panics", fig, recover, attempts=attempts)
