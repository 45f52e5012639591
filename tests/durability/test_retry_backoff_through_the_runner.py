"""durability.md, item life 5 and 6 through the runner in-process (real PostgreSQL):

5. Failure with attempts left clears the lease and sets run_after with exponential backoff and
   jitter; the error is kept in last_error and in the item's history.
6. Last failure inserts failed_operations (full payload, every attempt's error) and the outcome
   row and deletes the item, in one transaction.
"""

from __future__ import annotations

import psycopg

from sokratos_worker.config import Settings
from sokratos_worker.model import Queue
from sokratos_worker.runner import Runner
from sokratos_worker.store.connection import Database
from tests.support.db import count, enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings


def _drain(database_url: str, handler: ScriptedHandler, settings: Settings) -> None:
    database = Database(database_url, size=4)
    runner = Runner(
        settings=settings, database=database, handlers={Queue.TRIAGE: handler}, worker_id="backoff"
    )
    runner.start(drain_only=True)
    assert runner.wait_drained(30)
    runner.shutdown(1)
    database.close()


def test_each_failed_attempt_backs_off_exponentially_and_the_last_keeps_every_error(
    db: psycopg.Connection, database_url: str
) -> None:
    [item] = enqueue_many(db, 1, behaviour="fail", prefix="backoff")
    payload = db.execute("SELECT payload FROM pending_triage").fetchone()[0]
    settings = fast_settings(retry_base=10.0, retry_max=1000.0, max_attempts=3)
    handler = ScriptedHandler()
    for attempt, base in ((1, 10.0), (2, 40.0)):
        _drain(database_url, handler, settings)
        row = db.execute(
            "SELECT attempts, lease_owner, lease_expires_at, last_error,"
            " extract(epoch FROM run_after - (attempt_errors -> -1 ->> 'at')::timestamptz),"
            " jsonb_array_length(attempt_errors), attempt_errors -> -1 ->> 'attempt',"
            " attempt_errors -> -1 ->> 'backend'"
            " FROM pending_triage"
        ).fetchone()
        assert row is not None
        attempts, owner, expires, last_error, delay, history, entry_attempt, backend = row
        assert (attempts, owner, expires) == (attempt, None, None), row
        assert last_error == f"scripted failure on attempt {attempt}"
        assert base * 0.8 - 0.01 <= float(delay) <= base * 1.2 + 0.01, (attempt, delay)
        assert history == attempt and entry_attempt == str(attempt) and backend == "scripted"
        db.execute("UPDATE pending_triage SET run_after = now()")  # the backoff has passed
    _drain(database_url, handler, settings)
    assert handler.calls == 3
    assert count(db, "SELECT count(*) FROM pending_triage") == 0
    row = db.execute(
        "SELECT error_message, attempts, context_data -> 'payload',"
        " context_data -> 'attempts' FROM failed_operations WHERE item_id = %s",
        (item,),
    ).fetchone()
    assert row is not None
    error, attempts, kept, history = row
    assert error == "scripted failure on attempt 3" and attempts == 3
    assert kept == payload
    assert [h["error"] for h in history] == [f"scripted failure on attempt {n}" for n in (1, 2, 3)]
    assert [h["attempt"] for h in history] == [1, 2, 3]
    assert db.execute(
        "SELECT outcome, attempts FROM work_outcomes WHERE item_id = %s", (item,)
    ).fetchone() == ("failed", 3)
