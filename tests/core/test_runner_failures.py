"""When settling a failure fails too: the slot survives, nothing is lost, metrics say what happened."""

from __future__ import annotations

import time

import psycopg
import pytest
import structlog
from structlog.testing import capture_logs

from sokratos_worker.errors import DatabaseUnavailable
from sokratos_worker.model import Queue
from sokratos_worker.runner import Runner
from sokratos_worker.settle import LEASE_LOST, RETRY
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import Database
from tests.support.db import count, enqueue_many, outcomes
from tests.support.handlers import ScriptedHandler, fast_settings


def _runner(database: Database, done: list[tuple[str, str]], **overrides: object) -> Runner:
    handler = ScriptedHandler()
    return Runner(
        settings=fast_settings(**overrides),
        database=database,
        handlers={Queue.TRIAGE: handler, Queue.DISTILLATION: handler},
        worker_id="test",
        on_item_done=lambda q, kind, _s: done.append((q.value, kind)),
    )


def _drain(runner: Runner) -> None:
    runner.start(drain_only=True)
    assert runner.wait_drained(60), "the drain did not end: a slot thread died?"
    runner.shutdown(1)


def test_refused_archive_memory_still_dead_letters_with_the_payload(
    db: psycopg.Connection, database_url: str
) -> None:
    # A memories constraint refuses the raw archive (as a Sokratos database without an
    # embedding for it would): the conversation must still reach failed_operations.
    db.execute("ALTER TABLE memories ADD CONSTRAINT no_raw CHECK (summary <> 'raw archive')")
    ids = enqueue_many(db, 2, behaviour="fail", queue="pending_distillation")
    done: list[tuple[str, str]] = []
    database = Database(database_url, size=4)
    _drain(_runner(database, done, max_attempts=1))
    database.close()
    assert set(outcomes(db, "pending_distillation")) == set(ids)
    assert set(outcomes(db, "pending_distillation").values()) == {"failed"}
    assert count(db, "SELECT count(*) FROM pending_distillation") == 0
    assert count(db, "SELECT count(*) FROM memories") == 0
    texts = db.execute(
        "SELECT context_data->'payload'->>'archive_text' FROM failed_operations ORDER BY 1"
    ).fetchall()
    assert [t[0] for t in texts] == ["archive 0", "archive 1"]
    assert sorted(done) == [("pending_distillation", "failed")] * 2


def test_a_dead_letter_the_database_refuses_leaves_the_slot_working(
    db: psycopg.Connection, database_url: str
) -> None:
    # failed_operations refuses every row: the failing item cannot be settled, but the slot
    # thread lives on, the other items are done, and the item waits for its lease to expire.
    db.execute("ALTER TABLE failed_operations ADD CONSTRAINT never CHECK (false)")
    bad = enqueue_many(db, 1, behaviour="invalid", prefix="bad")
    good = enqueue_many(db, 6, prefix="good")
    done: list[tuple[str, str]] = []
    database = Database(database_url, size=4)
    runner = _runner(database, done, concurrency=1)
    _drain(runner)
    database.close()
    got = outcomes(db)
    assert {got[i] for i in good} == {"saved"} and bad[0] not in got
    row = db.execute("SELECT attempts, lease_owner FROM pending_triage").fetchone()
    assert row == (1, "test")  # leased until it expires; then it runs again
    assert runner.inflight_count() == 0  # not renewed forever
    assert ("pending_triage", "abandoned") in done


def test_attempts_that_do_not_end_the_item_are_counted_as_such(
    db: psycopg.Connection, database_url: str
) -> None:
    enqueue_many(db, 1, behaviour="fail_once")
    done: list[tuple[str, str]] = []
    database = Database(database_url, size=4)
    for _ in range(20):  # the retry backs off 10-20 ms: drain as successive ticks would
        _drain(_runner(database, done))
        if not count(db, "SELECT count(*) FROM pending_triage"):
            break
        time.sleep(0.05)
    database.close()
    assert done == [("pending_triage", "retry"), ("pending_triage", "saved")]


def test_lease_renewals_survive_a_database_error(db: psycopg.Connection, database_url: str) -> None:
    # A renewal that hits lock_timeout (not a dropped connection) used to end the renewer
    # thread: every later long item would then lose its lease while still running.
    enqueue_many(db, 1, behaviour="sleep:4")
    done: list[tuple[str, str]] = []
    conninfo = psycopg.conninfo.make_conninfo(database_url, options="-c lock_timeout=200ms")
    database = Database(conninfo, size=4)
    runner = _runner(database, done, lease=1.5)
    runner.start(drain_only=True)
    deadline = time.monotonic() + 10
    while not count(db, "SELECT count(*) FROM pending_triage WHERE lease_owner = 'test'"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with db.transaction():  # hold the row past two renewals (every 0.5 s)
        db.execute("SELECT 1 FROM pending_triage FOR UPDATE").fetchall()
        time.sleep(1.2)
    time.sleep(1.0)
    renewer_alive = [t.is_alive() for t in runner._threads if t.name == "lease-renewer"]
    in_flight = runner.inflight_by_queue()  # what the sokratos_items_in_flight gauge shows
    lease_left = db.execute(
        "SELECT extract(epoch FROM lease_expires_at - now()) FROM pending_triage"
    ).fetchone()
    assert runner.wait_drained(30)
    runner.shutdown(1)
    database.close()
    assert renewer_alive == [True]
    assert in_flight == {Queue.TRIAGE: 1}
    assert lease_left is not None and lease_left[0] > 0  # renewed again after the error
    assert set(outcomes(db).values()) == {"saved"}


def test_an_item_reclaimed_by_its_own_process_runs_once(
    db: psycopg.Connection, database_url: str
) -> None:
    # Its lease runs out while it runs (as after a database outage longer than the lease):
    # the dispatcher's free slot claims it again. It must not run twice, and the run in
    # progress settles it under the new claim.
    # Long enough that the re-claim lands while it runs, even on a loaded machine (if the run
    # ended between the re-claim's statement and its bookkeeping, it would run again).
    enqueue_many(db, 1, behaviour="sleep:5")
    done: list[tuple[str, str]] = []
    database = Database(database_url, size=4)
    handler = ScriptedHandler()
    runner = Runner(
        settings=fast_settings(),
        database=database,
        handlers={Queue.TRIAGE: handler},
        worker_id="test",
        on_item_done=lambda q, kind, _s: done.append((q.value, kind)),
    )
    runner.start(drain_only=True)
    deadline = time.monotonic() + 10
    while not count(db, "SELECT count(*) FROM pending_triage WHERE lease_owner = 'test'"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    db.execute("UPDATE pending_triage SET lease_expires_at = now() - interval '1 second'")
    runner.wake()
    assert runner.wait_drained(30)
    runner.shutdown(1)
    database.close()
    assert handler.calls == 1
    row = db.execute("SELECT outcome, attempts FROM work_outcomes").fetchone()
    assert row == ("saved", 2)  # the re-claim counted, as after any expired lease
    assert done == [("pending_triage", "saved")] and runner.inflight_count() == 0


def test_an_orphaned_lease_of_this_process_is_given_back(
    db: psycopg.Connection, database_url: str
) -> None:
    # A claim whose COMMIT landed but whose answer was lost leaves an item leased to this
    # process that no slot runs: it must not wait out its lease and lose an attempt.
    enqueue_many(db, 1)
    (orphan,) = store.claim(db, Queue.TRIAGE, owner="test", limit=1, lease_s=3)
    db.execute("UPDATE pending_triage SET lease_expires_at = lease_expires_at + interval '1 s'")
    done: list[tuple[str, str]] = []
    database = Database(database_url, size=4)
    runner = _runner(database, done, lease=3)  # renewals (and the orphan check) every second
    # Given back at the first renewal, a second after the start: before the lease (4 s) runs
    # out, after which the item would be claimed again with its lost attempt counted.
    runner.start()
    deadline = time.monotonic() + 30
    while not outcomes(db) and time.monotonic() < deadline:
        time.sleep(0.1)
    runner.request_stop()
    runner.shutdown(1)
    database.close()
    row = db.execute("SELECT outcome, attempts FROM work_outcomes").fetchone()
    assert row == ("saved", 1), row  # the lost claim's attempt was given back
    assert orphan.attempt == 1 and done == [("pending_triage", "saved")]


def test_a_refused_settle_with_the_database_away_does_not_claim_a_new_owner(
    db: psycopg.Connection, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It logged lease_lost "another worker took the item over" (new_owner="unknown") when all
    # that was known was that the settle changed nothing and the database had gone away.
    enqueue_many(db, 1)
    (item,) = store.claim(db, Queue.TRIAGE, owner="test", limit=1, lease_s=60)
    database = Database(database_url, size=2)
    runner = _runner(database, [])

    def unreachable() -> None:
        raise DatabaseUnavailable("connection refused")

    monkeypatch.setattr(database, "connection", unreachable)
    try:
        with capture_logs() as logs:
            kind = runner._settler.report_fenced(
                item, structlog.get_logger().bind(), released=RETRY
            )
    finally:
        monkeypatch.undo()
        database.close()
    assert kind == LEASE_LOST
    events = [e["event"] for e in logs]
    assert "lease_lost" not in events and "settle_refused_owner_unknown" in events, logs
