"""A dead letter's history lists every attempt once, however the last one ended: taken over by
a claim that was given back again (the stop's release, the renewer's orphan release), or run
on by this worker after its own dispatcher claimed it again past its lease. A review found
the last attempt listed twice and blamed on a lowered limit in the first case, and its real
error replaced by "worker died" in the second (2026-12-05)."""

from __future__ import annotations

import json
import time

import psycopg
import pytest

from sokratos_worker.errors import ItemError
from sokratos_worker.model import Effects, Item, NewMemory, Queue
from sokratos_worker.runner import Runner
from sokratos_worker.settle import WORKER_DIED
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import Database
from tests.core.test_attempts_used_up import _dead_letter, _drain
from tests.support.db import enqueue_many
from tests.support.handlers import fast_settings


def _last_attempt_died_then_take_over_given_back(db: psycopg.Connection, how: str) -> None:
    enqueue_many(db, 1)
    for attempt in (1, 2, 3):  # the third attempt's worker is killed: its lease runs out
        (item,) = store.claim(db, Queue.TRIAGE, owner="dead", limit=1, lease_s=60)
        assert item.attempt == attempt
        if attempt < 3:
            assert store.schedule_retry(db, item, owner="dead", error=f"boom {attempt}", delay_s=0)
    db.execute("UPDATE pending_triage SET lease_expires_at = now() - interval '1 s'")
    # Another worker's claim takes it over, and gives it back (it was stopping: the runner's
    # _release -> store.give_back; or release_orphans after the claim's answer was lost).
    (taken,) = store.claim(db, Queue.TRIAGE, owner="w2", limit=1, lease_s=60)
    assert taken.took_over_lease and taken.attempt == 4
    if how == "give_back":
        assert store.give_back(db, taken, owner="w2")
    else:
        released = store.release_orphans(
            db, Queue.TRIAGE, owner="w2", keep=[], lease_s=60, older_than_s=0
        )
        assert released == [taken.id]


@pytest.mark.parametrize("how", ["give_back", "release_orphans"])
def test_a_given_back_take_over_keeps_the_dead_letter_history_exact(
    db: psycopg.Connection, database_url: str, how: str
) -> None:
    _last_attempt_died_then_take_over_given_back(db, how)
    handler = _drain(database_url, max_attempts=3)
    assert handler.calls == 0
    error, attempts, _, history = _dead_letter(db)
    assert attempts == 3
    # Every attempt counted exactly once.
    assert [entry["attempt"] for entry in history] == [1, 2, 3], history
    # And the reason is the dead worker, not "the limit was lowered / attempts preset".
    assert error == WORKER_DIED, error


PAYLOAD = json.dumps({"exchange": "user: hi\nassistant: hello"})


class _OutlivesItsLease:
    def __init__(self, database_url: str) -> None:
        self.url = database_url
        self.runner: Runner | None = None

    def handle(self, item: Item) -> Effects:
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute("UPDATE pending_triage SET lease_expires_at = now() - interval '1 s'")
            assert self.runner is not None
            self.runner.wake(notified=False)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # our own dispatcher claims it again
                row = conn.execute("SELECT attempts FROM pending_triage").fetchone()
                if row is not None and row[0] == item.attempt + 1:
                    break
                time.sleep(0.05)
            else:
                raise AssertionError("never claimed again")
        raise ItemError("the model answered nonsense (the real error)", backend="scripted")

    def final_failure_memories(self, item: Item) -> tuple[NewMemory, ...]:
        return ()

    def probe(self) -> bool:
        return True


def test_the_last_attempts_real_error_is_in_the_history(
    db: psycopg.Connection, database_url: str
) -> None:
    db.execute("INSERT INTO pending_triage (payload, attempts) VALUES (%s::jsonb, 2)", (PAYLOAD,))
    handler = _OutlivesItsLease(database_url)
    database = Database(database_url, size=6)
    runner = Runner(
        settings=fast_settings(max_attempts=3),
        database=database,
        handlers={Queue.TRIAGE: handler},
        worker_id="test",
    )
    handler.runner = runner
    try:
        runner.start(drain_only=True, budget_s=15.0)
        assert runner.wait_drained(40)
        runner.shutdown(1)
    finally:
        database.close()
    error, attempts, _, history = _dead_letter(db)
    assert error == "the model answered nonsense (the real error)"
    assert attempts == 3
    assert history[-1]["error"] == error, history  # not the claim's "worker died ..."
