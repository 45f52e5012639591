"""Mutation testing (session 29): the fence of the one-statement settle that also claims the
slot's next item (``_settle_claim``) is a copy of its own, which no test held to the promise.

Real PostgreSQL; assertions on the rows.
"""

from __future__ import annotations

import psycopg

from sokratos_worker.model import Effects, Outcome, Queue
from sokratos_worker.store import queue as store
from tests.support.db import count, enqueue_many


def _expire(db: psycopg.Connection) -> None:
    db.execute("UPDATE pending_triage SET lease_expires_at = now() - interval '1 second'")


def _skip() -> Effects:
    return Effects(Outcome.SKIPPED, detail="scripted skip")


def test_a_stale_settle_that_claims_next_is_fenced_by_its_owner(db: psycopg.Connection) -> None:
    """Kills: ``_settle_claim``'s fence without ``lease_owner = %(owner)s``. A new owner took the
    item over and gave the attempt back, so only the owner tells the old worker's late settle
    (the hot path: settle and claim the next item in one statement) from the item's own."""
    enqueue_many(db, 1)
    (old,) = store.claim(db, Queue.TRIAGE, owner="dead", limit=1, lease_s=60)
    _expire(db)
    (new,) = store.claim(db, Queue.TRIAGE, owner="alive", limit=1, lease_s=60)
    assert store.give_back(db, new, owner="alive")
    result, next_items = store.settle_success(db, old, _skip(), owner="dead", claim_from=old.queue)
    assert not result.settled and next_items == []
    assert count(db, "SELECT count(*) FROM work_outcomes") == 0
    row = db.execute("SELECT attempts, lease_owner FROM pending_triage").fetchone()
    assert row == (1, None)


def test_a_stale_settle_that_claims_next_is_fenced_by_its_attempt(db: psycopg.Connection) -> None:
    """Kills: ``_settle_claim``'s fence without ``attempts = %(attempt)s``. The same worker id
    (another slot of the process) claimed the expired item again; the first slot's late
    settle must neither delete it nor record an outcome for the attempt still running."""
    enqueue_many(db, 1)
    (first,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    _expire(db)
    (second,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    result, _ = store.settle_success(db, first, _skip(), owner="w", claim_from=first.queue)
    assert not result.settled
    assert count(db, "SELECT count(*) FROM work_outcomes") == 0
    assert db.execute("SELECT attempts, lease_owner FROM pending_triage").fetchone() == (2, "w")
    result, _ = store.settle_success(db, second, _skip(), owner="w", claim_from=second.queue)
    assert result.settled
    assert db.execute("SELECT outcome, attempts FROM work_outcomes").fetchall() == [("skipped", 2)]
