"""PostgreSQL crashing under a running worker: one of its backends killed with SIGKILL, so the
postmaster ends every session and runs crash recovery. The worker rides it out by itself:
nothing lost or doubled, the outage said, every item on its first attempt or the next."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psycopg
import pytest

from tests.faults.support import (
    assert_exactly_once,
    log_events,
    outcome_count,
    report,
    stop,
    tail,
)
from tests.support.daemon import daemon_env, start_daemon, wait_until
from tests.support.db import count, enqueue_many

pytestmark = [pytest.mark.faults, pytest.mark.subprocess, pytest.mark.slow]

ITEMS = 300


def _worker_backend(conn: psycopg.Connection) -> int | None:
    """The server process of one of the worker's sessions (another client's, not ``conn``'s)."""
    row = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND backend_type = 'client backend' LIMIT 1"
    ).fetchone()
    return int(row[0]) if row else None


@pytest.mark.timeout(240)
def test_a_backend_killed_with_sigkill_resets_the_server_and_the_worker_rides_it_out(
    database_url: str, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("killing the server's process needs root (it runs as another user)")
    with psycopg.connect(database_url, autocommit=True) as db:
        keys = [("pending_triage", i) for i in enqueue_many(db, ITEMS, behaviour="sleep:0.05")]
    log = tmp_path / "worker.log"
    env = daemon_env(database_url, tmp_path, SOKRATOS_CONCURRENCY="4")
    proc = start_daemon(env, log)
    recoveries: list[float] = []
    try:
        for target in (60, 150):
            with psycopg.connect(database_url, autocommit=True) as db:
                assert wait_until(lambda t=target: outcome_count(db) >= t, timeout=60), tail(log)
                victim = _worker_backend(db)
                assert victim is not None
                done = outcome_count(db)
            os.kill(victim, signal.SIGKILL)  # the postmaster resets every session
            crashed = time.monotonic()

            def more_done(before: int = done) -> bool:
                try:
                    with psycopg.connect(database_url, autocommit=True, connect_timeout=2) as c:
                        return outcome_count(c) > before
                except psycopg.OperationalError:
                    return False  # (still in crash recovery)

            assert wait_until(more_done, timeout=60, interval=0.1), tail(log)
            recoveries.append(time.monotonic() - crashed)
            assert proc.poll() is None, tail(log)
        with psycopg.connect(database_url, autocommit=True) as db:
            assert wait_until(lambda: outcome_count(db) >= ITEMS, timeout=120), tail(log)
    finally:
        code = stop(proc)
    assert code == 0, tail(log)
    with psycopg.connect(database_url, autocommit=True) as db:
        fig = assert_exactly_once(db, keys)
        failed = count(db, "SELECT count(*) FROM failed_operations")
        attempts = db.execute("SELECT attempts, count(*) FROM work_outcomes GROUP BY 1").fetchall()
    assert failed == 0, tail(log)
    assert fig.by_outcome == {"saved": ITEMS}, fig
    events = log_events(log)
    said = [e for e in events if e.get("event") == "waiting_for_database"]
    assert said, tail(log)
    report("postgres_backend_sigkill_x2", fig, recoveries, attempts=dict(attempts))
