"""The owed give-back (see test_owed_give_back.py) where its write meets a stop.

Found by a review of 74cc404 (owedfix hunt, 2026-12-07):

- a stop whose take of the items in flight came between the owed give-back's commit and the
  slot's swap of the corrected claim released the uncorrected claim, fenced and so writing
  nothing: the item stayed leased to the exiting worker, and the next takeover counted the
  attempt again (on the last attempt: failed_operations, "worker died during the last attempt").

Real parts: PostgreSQL, the runner in-process.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from structlog.testing import capture_logs

from sokratos_worker.model import Item, Queue
from sokratos_worker.runner import Runner
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import Database
from tests.support.daemon import wait_until
from tests.support.db import count, enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings

pytestmark = pytest.mark.postgres

LEASE_S = 3.0
WORKER = "owed-worker"


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
