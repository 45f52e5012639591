"""The owed give-back (see test_owed_give_back.py) where its write meets a stop or loses its
answer, and the SQL fence that keeps it to the attempt owed.

Found by a review of 74cc404 (owedfix hunt, 2026-12-07):

- a stop whose take of the items in flight came between the owed give-back's commit and the
  slot's swap of the corrected claim released the uncorrected claim, fenced and so writing
  nothing: the item stayed leased to the exiting worker, and the next takeover counted the
  attempt again (on the last attempt: failed_operations, "worker died during the last attempt");
- a give-back that committed but whose answer was lost with its connection was taken for not
  written: the slot ran the stale claim, every settle of it was fenced, its result dropped as
  "another worker took it over", and the orphan release then uncounted a run that happened.

Real parts: PostgreSQL, the runner in-process; the lost answer is the pool's connection raising
DatabaseUnavailable after its transaction committed, as a connection cut then does.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb
from structlog.testing import capture_logs

from sokratos_worker.errors import DatabaseUnavailable
from sokratos_worker.model import Item, Queue
from sokratos_worker.runner import Runner
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import Database
from sokratos_worker.store.queue_sql import DIED_ENTRY, QUEUE_SQL
from tests.support.daemon import wait_until
from tests.support.db import count, enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings

pytestmark = pytest.mark.postgres

LEASE_S = 3.0
WORKER = "owed-worker"
ANSWER_LOST = "database unavailable: server closed the connection unexpectedly"


def _owed_and_expired(db: psycopg.Connection, runner: Runner, item_id: int) -> None:
    """Attempt 1 of the item, claimed by this worker, owes its give-back (an outage kept it
    from being written) and its lease has run out: the next claim takes it over as attempt 2."""
    [ours] = store.claim(db, Queue.TRIAGE, owner=WORKER, limit=1, lease_s=1)
    assert (ours.id, ours.attempt) == (item_id, 1)
    runner._settler._owe_give_back(ours, owed=True)  # (as an abandoned give-back does)
    expired = "SELECT count(*) FROM pending_triage WHERE id = %s AND lease_expires_at < now()"
    assert wait_until(lambda: count(db, expired, item_id) == 1, timeout=10)


def _row(db: psycopg.Connection, item_id: int) -> tuple[Any, ...] | None:
    return db.execute(
        "SELECT attempts, lease_owner FROM pending_triage WHERE id = %s", (item_id,)
    ).fetchone()


def _runner(database: Database, handler: ScriptedHandler) -> Runner:
    return Runner(
        settings=fast_settings(concurrency=1, lease=LEASE_S),
        database=database,
        handlers={Queue.TRIAGE: handler},
        worker_id=WORKER,
    )


@pytest.mark.timeout(120)
def test_a_stop_between_the_owed_give_back_and_its_correction_frees_the_item(
    db: psycopg.Connection, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stop (no grace left) takes the items in flight just after the owed give-back of the
    takeover claim committed and before the slot holds the corrected claim: its release is
    fenced by the claim (attempt 2; the row says 1) and writes nothing. The slot must release
    the corrected claim itself, not run it: the exiting worker leaves nothing leased, and the
    item's attempts are back where they were before its first claim."""
    [item_id] = enqueue_many(db, 1, behaviour="sleep:20", prefix="stop")
    database = Database(database_url, size=4)
    handler = ScriptedHandler()
    runner = _runner(database, handler)
    _owed_and_expired(db, runner, item_id)
    paid = threading.Event()
    stop_done = threading.Event()
    pay = runner._settler.pay_owed_give_back

    def pay_then_meet_the_stop(item: Item) -> Item | None:
        claim = pay(item)
        paid.set()
        stop_done.wait(30)  # (the stop's take and release land here)
        return claim

    monkeypatch.setattr(runner._settler, "pay_owed_give_back", pay_then_meet_the_stop)
    try:
        with capture_logs() as logs:
            runner.start()
            assert paid.wait(30)
            assert _row(db, item_id) == (1, WORKER)  # paid: the takeover's count undone
            released_by_stop = runner.shutdown(0)
            stop_done.set()
            freed = wait_until(lambda: _row(db, item_id) == (0, None), timeout=10)
    finally:
        stop_done.set()
        database.close()
    assert freed, f"still {_row(db, item_id)} after the stop (attempts, lease_owner)"
    assert released_by_stop == 0  # (its release was fenced: the race this test is about)
    assert handler.calls == 0
    assert count(db, "SELECT count(*) FROM work_outcomes") == 0
    events = [e["event"] for e in logs]
    assert "owed_give_back_written" in events and "item_released" in events, events
    counts = runner.take_stats().counts[Queue.TRIAGE.value]
    assert (counts["claimed"], counts["given_back"]) == (1, 2), counts


class LosesTheOwedGiveBacksAnswer:
    """The worker's database, but the connection that writes the owed give-back raises
    DatabaseUnavailable once its transaction has committed (the answer lost with the
    connection); with ``then_away``, the next checkout raises it too (the database gone)."""

    def __init__(self, database: Database, *, then_away: bool = False) -> None:
        self._database = database
        self._then_away = then_away
        self.answers_lost = 0
        self.rereads_refused = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._database, name)

    @contextmanager
    def connection(self) -> Iterator[Any]:
        if self._then_away and self.answers_lost and not self.rereads_refused:
            self.rereads_refused += 1
            raise DatabaseUnavailable(ANSWER_LOST)
        with self._database.connection() as conn:
            recorder = _Recorder(conn)
            yield recorder
        if recorder.wrote_owed_give_back and not self.answers_lost:
            self.answers_lost += 1
            raise DatabaseUnavailable(ANSWER_LOST)


class _Recorder:
    """A connection that notes whether it ran give_back_owed."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self._conn = conn
        self.wrote_owed_give_back = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def execute(self, query: Any, params: Any = None) -> Any:
        if query == QUEUE_SQL[Queue.TRIAGE].give_back_owed:
            self.wrote_owed_give_back = True
        return self._conn.execute(query, params)


@pytest.mark.timeout(120)
def test_an_owed_give_back_whose_answer_was_lost_runs_under_the_owed_attempt(
    db: psycopg.Connection, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owed give-back commits and its answer is lost: the row, read again, says it was
    written, so the item runs under attempt 1 and is saved. (It ran the stale claim, attempt
    2, whose settle was fenced; its result was dropped as another worker's lease.)"""
    [item_id] = enqueue_many(db, 1, prefix="lost")
    database = Database(database_url, size=4)
    handler = ScriptedHandler()
    runner = _runner(database, handler)
    _owed_and_expired(db, runner, item_id)
    losing = LosesTheOwedGiveBacksAnswer(database)
    monkeypatch.setattr(runner._settler, "database", losing)
    try:
        with capture_logs() as logs:
            runner.start()
            saved = wait_until(
                lambda: count(db, "SELECT count(*) FROM work_outcomes") == 1, timeout=30
            )
            runner.shutdown(2)
    finally:
        database.close()
    events = [e["event"] for e in logs]
    assert losing.answers_lost == 1
    assert saved, (_row(db, item_id), events)
    assert db.execute("SELECT outcome, attempts FROM work_outcomes").fetchall() == [("saved", 1)]
    assert "owed_give_back_written" in events and "owed_give_back_failed" not in events, events
    assert "lease_lost" not in events, events
    assert handler.calls == 1
    counts = runner.take_stats().counts[Queue.TRIAGE.value]
    assert (counts["claimed"], counts["given_back"], counts["saved"]) == (1, 1, 1), counts


@pytest.mark.timeout(120)
def test_an_owed_give_back_not_known_to_be_written_is_left_to_its_lease_and_paid_later(
    db: psycopg.Connection, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owed give-back commits, its answer is lost, and the read that would tell is refused
    too: the item is not run (a run whose settle the written give-back fences is an LLM call
    wasted) but left to its lease, still owed; at this worker's next claim of it, once that
    lease ran out, the give-back is written again and the item runs once, under attempt 1."""
    [item_id] = enqueue_many(db, 1, prefix="unknown")
    database = Database(database_url, size=4)
    handler = ScriptedHandler()
    runner = _runner(database, handler)
    _owed_and_expired(db, runner, item_id)
    losing = LosesTheOwedGiveBacksAnswer(database, then_away=True)
    monkeypatch.setattr(runner._settler, "database", losing)
    try:
        with capture_logs() as logs:
            runner.start()
            saved = wait_until(
                lambda: count(db, "SELECT count(*) FROM work_outcomes") == 1, timeout=60
            )
            runner.shutdown(2)
    finally:
        database.close()
    events = [e["event"] for e in logs]
    assert (losing.answers_lost, losing.rereads_refused) == (1, 1)
    assert saved, (_row(db, item_id), events)
    assert db.execute("SELECT outcome, attempts FROM work_outcomes").fetchall() == [("saved", 1)]
    assert events.count("owed_give_back_failed") == 1, events
    assert events.count("owed_give_back_written") == 1, events
    assert handler.calls == 1
    assert count(db, "SELECT count(*) FROM failed_operations") == 0


def test_the_owed_give_back_uncounts_only_the_attempt_its_history_entry_names(
    db: psycopg.Connection,
) -> None:
    """give_back_owed for attempt 2 (claim 3, leased to this worker) whose last history entry
    names this worker's lease but attempt 1, an attempt that really died: not written (the
    fence on the entry's attempt); with the entry naming attempt 2, it is."""
    [item_id] = enqueue_many(db, 1, prefix="fence")

    def history(attempt: int) -> None:
        died = f"{DIED_ENTRY} (its lease, held by {WORKER}, expired)"
        entry = {"attempt": attempt, "error": died}
        db.execute(
            "UPDATE pending_triage SET attempts = 3, lease_owner = %s,"
            " lease_expires_at = now() + interval '1 minute',"
            " attempt_errors = jsonb_build_array(%s::jsonb) WHERE id = %s",
            (WORKER, Jsonb(entry), item_id),
        )

    params = {"id": item_id, "owner": WORKER, "attempt": 3}
    owed = QUEUE_SQL[Queue.TRIAGE].give_back_owed
    history(1)
    assert db.execute(owed, params).fetchone() is None
    assert _row(db, item_id) == (3, WORKER)
    history(2)
    assert db.execute(owed, params).fetchone() == (item_id,)
    assert _row(db, item_id) == (2, WORKER)
    entries = "SELECT jsonb_array_length(attempt_errors) FROM pending_triage WHERE id = %s"
    assert count(db, entries, item_id) == 0  # (the entry went with the attempt)
