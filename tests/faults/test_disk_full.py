"""A real full disk: the queue's tables in a tablespace on a small tmpfs, filled with a ballast
file while the worker drains, then freed. Nothing is lost or doubled, no item is dead-lettered
for the server's full disk (53100), the log says the disk is full, and the worker carries on by
itself once there is space again.

A hunt (2026-12-07) found the items claimed meanwhile dead-lettered: the claims still went
through (their rows fit in pages already there), each settle was refused for the full disk
and abandoned to its lease, and each claim counted another attempt until "worker died during
the last attempt". A settle the server refused for a full disk rolled back, so its attempt is
now given back when this worker claims the item again (as an owed give-back)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psycopg
import pytest

from tests.faults.support import (
    Figures,
    cli,
    figures,
    log_events,
    outcome_count,
    report,
    stop,
    tail,
)
from tests.support.daemon import daemon_env, start_daemon, wait_until
from tests.support.db import count, enqueue_many
from tests.support.tmpfs import can_mount, fill, small_tmpfs, tables_on_tmpfs

pytestmark = [pytest.mark.faults, pytest.mark.subprocess, pytest.mark.slow]

ITEMS = 300
# Two or three settles given up at 0.8 x the 5 s lease: within the three give-backs an item
# is allowed for the database (DATABASE_GIVE_BACKS_PER_ITEM), after which they count.
FULL_S = 8.0
TABLES = ["pending_triage", "work_outcomes", "memories", "failed_operations", "worker_heartbeats"]


@pytest.mark.timeout(240)
def test_a_tablespace_that_fills_up_under_load_is_waited_out(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    if not can_mount():
        pytest.skip("mounting a tmpfs needs root")
    keys = [("pending_triage", i) for i in enqueue_many(db, ITEMS, behaviour="sleep:0.05")]
    log = tmp_path / "worker.log"
    env = daemon_env(
        database_url, tmp_path, SOKRATOS_CONCURRENCY="4", SOKRATOS_MAX_ATTEMPTS="2",
        SOKRATOS_LEASE="5s",
    )  # fmt: skip
    with small_tmpfs(8) as mount, tables_on_tmpfs(db, mount, TABLES):
        proc = start_daemon(env, log)
        try:
            assert wait_until(lambda: outcome_count(db) >= 30, timeout=60), tail(log)
            ballast = fill(mount)
            assert wait_until(
                lambda: any(e.get("event") == "waiting_for_database" for e in log_events(log)),
                timeout=60,
            ), tail(log)
            stalled = outcome_count(db)
            time.sleep(FULL_S)  # past the lease: the items cut off are claimed again
            status = cli(env, "status", "--json")
            during = outcome_count(db)
            ballast.unlink()  # space freed
            freed = time.monotonic()
            assert wait_until(lambda: outcome_count(db) > during, timeout=60), tail(log)
            recover = time.monotonic() - freed
            assert wait_until(lambda: outcome_count(db) >= ITEMS, timeout=120), tail(log)
            assert proc.poll() is None, tail(log)
        finally:
            code = stop(proc)
        fig: Figures = figures(db, keys)
        failed = count(db, "SELECT count(*) FROM failed_operations")
        rows = db.execute("SELECT outcome, count(*) FROM work_outcomes GROUP BY 1").fetchall()
        attempts = db.execute("SELECT attempts, count(*) FROM work_outcomes GROUP BY 1").fetchall()
    waits = [e for e in log_events(log) if e.get("event") == "waiting_for_database"]
    assert code == 0, tail(log)
    assert fig.lost == 0 and fig.dup_outcomes == 0 and fig.dup_origins == 0, fig
    assert fig.outcomes == ITEMS, fig
    assert failed == 0, (rows, tail(log))
    assert rows == [("saved", ITEMS)], rows
    # Each on its first attempt: the full disk cost none.
    assert attempts == [(1, ITEMS)], attempts
    # Said once, with what to do (it was said anew every 2 s, each claim that went through
    # taken for the end of the outage, and the hint asked whether the server was up).
    assert len(waits) == 1, waits
    assert "No space left on device" in waits[0]["error"], waits
    assert "free space on the disk" in waits[0]["hint"], waits
    assert status.returncode == 0, status
    worker = json.loads(status.stdout)["workers"][0]
    assert worker["state"] == "waiting for database", worker
    assert "No space left on device" in worker["detail"]["why"], worker
    report(f"tablespace_full_{FULL_S:g}s_under_load", fig, recover, saved_before_full=stalled)


@pytest.mark.timeout(240)
def test_an_item_whose_own_settle_the_server_always_refuses_for_room_is_dead_lettered(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """A settle that alone does not fit (a large archive on an almost full disk) is refused
    every time while the others go through: its give-backs for the database are bounded as a
    read outage's are, then its attempts count, and it ends in failed_operations instead of
    running for ever (found by a review: each loop cost an LLM call and held a slot)."""
    keys = [("pending_triage", i) for i in enqueue_many(db, 3)]
    stuck = keys[1][1]
    db.execute(
        f"""CREATE FUNCTION refuse_for_room() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
              IF NEW.item_id = {stuck} AND NEW.outcome = 'saved' THEN
                RAISE EXCEPTION 'could not extend file: No space left on device'
                  USING ERRCODE = '53100';
              END IF;
              RETURN NEW;
            END $$;
            CREATE TRIGGER refuse_for_room BEFORE INSERT ON work_outcomes
              FOR EACH ROW EXECUTE FUNCTION refuse_for_room();"""
    )
    log = tmp_path / "worker.log"
    env = daemon_env(database_url, tmp_path, SOKRATOS_MAX_ATTEMPTS="2")
    proc = start_daemon(env, log)
    try:
        assert wait_until(lambda: outcome_count(db) >= 3, timeout=150), tail(log)
    finally:
        code = stop(proc)
    fig: Figures = figures(db, keys)
    assert code == 0, tail(log)
    assert fig.lost == 0 and fig.dup_outcomes == 0, fig
    assert db.execute(
        "SELECT item_id, outcome FROM work_outcomes ORDER BY item_id"
    ).fetchall() == [(keys[0][1], "saved"), (stuck, "failed"), (keys[2][1], "saved")]
    assert count(db, "SELECT count(*) FROM failed_operations") == 1
