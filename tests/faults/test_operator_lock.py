"""An operator's long transaction holds pending_triage ACCESS EXCLUSIVE for more than three
leases while the worker runs with items in flight: claims, settles and lease renewals all wait
behind it (a settle blocked on the lock is waiting, not failing, and no other worker could
claim the items meanwhile). Once it ends, every item is saved once, on its first attempt,
none dead-lettered (hunt, 2026-12-07: held as promised)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psycopg
import pytest

from tests.faults.support import assert_exactly_once, outcome_count, report, stop, tail
from tests.support.daemon import daemon_env, start_daemon, wait_until
from tests.support.db import count, enqueue_many

pytestmark = [pytest.mark.faults, pytest.mark.subprocess, pytest.mark.slow]

ITEMS = 120
LOCKED_S = 10.0  # past three 3 s leases


@pytest.mark.timeout(180)
def test_a_queue_locked_past_the_lease_by_an_operator_loses_and_doubles_nothing(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    keys = [("pending_triage", i) for i in enqueue_many(db, ITEMS, behaviour="sleep:0.3")]
    log = tmp_path / "worker.log"
    env = daemon_env(database_url, tmp_path, SOKRATOS_CONCURRENCY="4", SOKRATOS_MAX_ATTEMPTS="2")
    locked, release = threading.Event(), threading.Event()

    def operator() -> None:
        with psycopg.connect(database_url) as conn:
            conn.execute("LOCK TABLE pending_triage IN ACCESS EXCLUSIVE MODE")
            locked.set()
            release.wait(60)

    proc = start_daemon(env, log)
    holder = threading.Thread(target=operator)
    try:
        assert wait_until(lambda: outcome_count(db) >= 20, timeout=60), tail(log)
        holder.start()
        assert locked.wait(10)
        time.sleep(LOCKED_S)
        during = outcome_count(db)
        release.set()
        holder.join(10)
        freed = time.monotonic()
        assert wait_until(lambda: outcome_count(db) > during, timeout=60), tail(log)
        recover = time.monotonic() - freed
        assert wait_until(lambda: outcome_count(db) >= ITEMS, timeout=120), tail(log)
        assert proc.poll() is None, tail(log)
    finally:
        release.set()
        code = stop(proc)
    assert code == 0, tail(log)
    fig = assert_exactly_once(db, keys)
    attempts = dict(db.execute("SELECT attempts, count(*) FROM work_outcomes GROUP BY 1").fetchall())
    assert count(db, "SELECT count(*) FROM failed_operations") == 0, tail(log)
    assert fig.by_outcome == {"saved": ITEMS}, fig
    assert attempts == {1: ITEMS}, attempts
    report(f"pending_triage_locked_{LOCKED_S:g}s", fig, recover, attempts=attempts)
