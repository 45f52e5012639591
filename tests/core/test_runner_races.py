"""Interleavings of claims, settles and renewals, forced one step at a time (found in review).

Each test drives the runner's steps by hand or injects the other thread's step into the
window, against a real PostgreSQL, and asserts the attempt accounting of durability.md.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
import structlog

from sokratos_worker.errors import DatabaseUnavailable
from sokratos_worker.model import Item, Queue
from sokratos_worker.runner import Runner
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import Database
from tests.support.db import count, enqueue_many, outcomes
from tests.support.handlers import ScriptedHandler, fast_settings


class Recording(ScriptedHandler):
    """Also records the attempt number of every run."""

    def __init__(self) -> None:
        super().__init__()
        self.attempts: list[int] = []

    def handle(self, item: Item) -> Any:
        self.attempts.append(item.attempt)
        return super().handle(item)


def _runner(
    database: Database, done: list[tuple[str, str]], **overrides: object
) -> tuple[Runner, Recording]:
    handler = Recording()
    runner = Runner(
        settings=fast_settings(**overrides),
        database=database,
        handlers={Queue.TRIAGE: handler},
        worker_id="test",
        on_item_done=lambda q, kind, _s: done.append((q.value, kind)),
    )
    return runner, handler


def test_a_refused_settle_after_an_adopted_reclaim_is_retried_under_the_new_claim(
    db: psycopg.Connection, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    enqueue_many(db, 1, behaviour="skip")
    database = Database(database_url, size=4)
    done: list[tuple[str, str]] = []
    runner, _ = _runner(database, done)
    (first,) = store.claim(db, Queue.TRIAGE, owner="test", limit=1, lease_s=30)
    runner._track_claimed([first])  # a slot runs it (attempt 1) ...
    db.execute("UPDATE pending_triage SET lease_expires_at = now() - interval '1 s'")
    assert runner._claim_for_idle_slots() == (1, 1)  # ... and it is claimed again: adopted

    def refused(*_args: object, **_kwargs: object) -> None:
        raise psycopg.errors.CheckViolation("memories refused (injected)")

    monkeypatch.setattr(store, "settle_success", refused)
    runner._process(first)
    database.close()
    row = db.execute("SELECT attempts, lease_owner, last_error FROM pending_triage").fetchone()
    assert row is not None and row[:2] == (2, None) and "memories refused" in row[2]
    assert done == [("pending_triage", "retry")] and runner.inflight_count() == 0


def test_a_claim_landing_between_give_back_and_untrack_is_given_back_not_leaked(
    db: psycopg.Connection, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The give-back has landed and the slot still tracks the item when another thread's claim
    takes it again. Claiming paused before the give-back (test_pause_before_give_back.py), so
    that claim gives it back too, its attempt uncounted: not run, not left leased."""
    enqueue_many(db, 1, behaviour="unavailable")
    database = Database(database_url, size=4)
    done: list[tuple[str, str]] = []
    runner, _ = _runner(database, done)
    (item,) = store.claim(db, Queue.TRIAGE, owner="test", limit=1, lease_s=30)
    runner._track_claimed([item])
    real_count = runner._settler._count

    def count_after_a_concurrent_claim(*args: Any, **kwargs: Any) -> None:
        runner._claim_for_idle_slots()  # another thread's claim lands in this window
        real_count(*args, **kwargs)

    monkeypatch.setattr(runner._settler, "_count", count_after_a_concurrent_claim)
    runner._process(item)
    database.close()
    assert db.execute("SELECT attempts, lease_owner FROM pending_triage").fetchone() == (0, None)
    assert runner.inflight_count() == 0 and not runner._inflight._adopted
    assert runner._handoff.empty()
    assert runner.take_stats().counts[Queue.TRIAGE]["given_back"] == 2


def test_an_abandoned_attempt_counts_even_when_its_lease_expires_unclaimed(
    db: psycopg.Connection, database_url: str
) -> None:
    # Every retry is refused by the database: each attempt is abandoned and must count, so the
    # item reaches failed_operations instead of having its attempts given back for ever.
    db.execute("ALTER TABLE pending_triage ADD CONSTRAINT no_retry CHECK (last_error IS NULL)")
    enqueue_many(db, 1, behaviour="fail")
    database = Database(database_url, size=4)
    done: list[tuple[str, str]] = []
    runner, handler = _runner(database, done, concurrency=1, lease=1.5, max_attempts=2)
    runner.start()
    deadline = time.monotonic() + 20
    while not count(db, "SELECT count(*) FROM failed_operations") and time.monotonic() < deadline:
        time.sleep(0.1)
    runner.request_stop()
    runner.shutdown(1)
    database.close()
    assert handler.attempts == [1, 2], handler.attempts
    assert outcomes(db) and set(outcomes(db).values()) == {"failed"}


def test_a_settle_that_landed_before_its_answer_was_lost_counts_as_its_outcome(
    db: psycopg.Connection, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    enqueue_many(db, 1)
    database = Database(database_url, size=4)
    done: list[tuple[str, str]] = []
    runner, _ = _runner(database, done, concurrency=1)
    real = store.settle_success
    dropped: list[int] = []

    def drop_the_answer(conn: Any, *args: Any, **kwargs: Any) -> Any:
        result = real(conn, *args, **kwargs)
        if not dropped:
            dropped.append(1)
            raise DatabaseUnavailable("connection dropped after COMMIT (injected)")
        return result

    monkeypatch.setattr(store, "settle_success", drop_the_answer)
    runner.start(drain_only=True)
    assert runner.wait_drained(30)
    runner.shutdown(1)
    database.close()
    assert set(outcomes(db).values()) == {"saved"}
    assert done == [("pending_triage", "saved")]
    assert runner.take_stats().counts["pending_triage"]["saved"] == 1


def test_an_item_given_back_at_the_grace_end_before_a_slot_took_it_is_not_run(
    db: psycopg.Connection, database_url: str
) -> None:
    """An item still waiting in the handoff when the stop's grace ends is released with the
    rest; the slot that takes it afterwards must not run it (its settle would be fenced, the
    LLM call wasted)."""
    enqueue_many(db, 1, behaviour="skip")
    database = Database(database_url, size=4)
    done: list[tuple[str, str]] = []
    runner, handler = _runner(database, done, concurrency=1)
    assert runner._claim_for_idle_slots() == (1, 1)  # claimed, tracked, in the handoff
    assert runner.shutdown(0) == 1  # the grace ends before any slot started it
    runner._slot_loop()  # the slot now takes it, then the stop's None
    database.close()
    assert handler.attempts == []
    assert db.execute("SELECT attempts, lease_owner FROM pending_triage").fetchone() == (0, None)
    # Reported once, as the stop's release (sokratos_items_total{outcome="released"}), and
    # never as a slot's attempt.
    assert done == [("pending_triage", "released")] and outcomes(db) == {}


def test_the_grace_counts_from_the_stop_not_from_a_state_report_that_waited(
    db: psycopg.Connection, database_url: str
) -> None:
    """The stop's STOPPING report can wait behind another report's heartbeat write; the grace
    must not start only once it is made, or the stop outlasts SOKRATOS_SHUTDOWN_GRACE by that
    wait (and systemd's TimeoutStopSec with it)."""
    enqueue_many(db, 1, behaviour="sleep:8")
    database = Database(database_url, size=4)
    reported: dict[str, float] = {}

    def slow_stopping_report(state: str, _detail: str) -> None:
        if state == "stopping":
            time.sleep(3)  # the heartbeat write it waits behind
            reported[state] = time.monotonic()

    runner = Runner(
        settings=fast_settings(concurrency=1),
        database=database,
        handlers={Queue.TRIAGE: ScriptedHandler()},
        worker_id="test",
        on_state=slow_stopping_report,
    )
    runner.start()
    deadline = time.monotonic() + 20
    while not runner.inflight_count() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert runner.shutdown(3) == 1  # still sleeping at the end of the grace: released
    after_report = time.monotonic() - reported["stopping"]
    database.close()
    # The grace (3 s) had passed by the time the report was made: the release follows at once.
    assert after_report < 1.5, after_report
    assert db.execute("SELECT attempts, lease_owner FROM pending_triage").fetchone() == (0, None)


def test_another_workers_dead_letter_of_our_last_attempt_is_not_taken_for_our_settle(
    db: psycopg.Connection, database_url: str
) -> None:
    """A ran the last attempt past its lease (frozen); B's claim found no attempt left and
    dead-lettered the item under that attempt's number ("worker died"). A's settle, fenced,
    took that outcome for its own commit: item_already_settled, and `failed` counted by both
    workers (found by a two-process hunt). It is lease_lost."""
    enqueue_many(db, 1, behaviour="skip")
    database = Database(database_url, size=4)
    done_a: list[tuple[str, str]] = []
    a, _ = _runner(database, done_a, max_attempts=1)
    b = Runner(
        settings=fast_settings(max_attempts=1),
        database=database,
        handlers={Queue.TRIAGE: Recording()},
        worker_id="other",
    )
    (first,) = store.claim(db, Queue.TRIAGE, owner="test", limit=1, lease_s=30)
    a._track_claimed([first])  # A runs the last attempt ...
    db.execute("UPDATE pending_triage SET lease_expires_at = now() - interval '1 s'")
    assert b._claim_for_idle_slots()[1] == 1  # ... frozen past its lease: B claims it
    b._process(b._handoff.get_nowait())  # no attempt left: B dead-letters it
    a._process(first)  # A wakes up and settles
    database.close()
    assert outcomes(db) and set(outcomes(db).values()) == {"failed"}
    assert done_a == [("pending_triage", "lease_lost")], done_a
    assert "failed" not in a.take_stats().counts[Queue.TRIAGE]


def test_our_own_dead_letter_past_the_limit_is_recognised_when_its_answer_was_lost(
    db: psycopg.Connection, database_url: str
) -> None:
    """A claim past the limit dead-letters the item under the attempt before it; when the
    commit's answer is lost, the fenced report must take that outcome for ours (`failed`
    counted), not for another worker's (lease_lost, the failure counted by nobody)."""
    enqueue_many(db, 1, behaviour="skip")
    db.execute("UPDATE pending_triage SET attempts = 1")  # the last attempt died
    database = Database(database_url, size=4)
    runner, _ = _runner(database, [], max_attempts=1)
    (item,) = store.claim(db, Queue.TRIAGE, owner="test", limit=1, lease_s=30)
    assert item.attempt == 2
    runner._track_claimed([item])
    runner._process(item)  # NoAttemptLeft: dead-lettered under attempt 1
    assert set(outcomes(db).values()) == {"failed"}
    runner.take_stats()
    bound = structlog.get_logger().bind(item_id=item.id)
    assert runner._settler.report_fenced(item, bound, released="retry") == "failed"
    database.close()
