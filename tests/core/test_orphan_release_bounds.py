"""Mutation testing (session 29): which leases of its own the renewer gives back as orphans.

Only live leases taken more than ``older_than_s`` ago and not held by a slot are orphans: a
claim on its way to a slot is not one, and an expired lease is anyone's to claim again (that
claim counts the attempt that died). Real PostgreSQL; assertions on the rows.
"""

from __future__ import annotations

import psycopg

from sokratos_worker.model import Queue
from sokratos_worker.store import queue as store
from tests.support.db import enqueue_many

LEASE_S = 60.0
AGE_S = 20.0  # the renewer's interval: lease / 3


def _rows(db: psycopg.Connection) -> list[tuple[int, int, str | None]]:
    return db.execute("SELECT id, attempts, lease_owner FROM pending_triage ORDER BY id").fetchall()


def _release(db: psycopg.Connection, keep: list[int]) -> list[int]:
    return store.release_orphans(
        db, Queue.TRIAGE, owner="w", keep=keep, lease_s=LEASE_S, older_than_s=AGE_S
    )


def test_a_claim_just_made_is_not_given_back_as_an_orphan(db: psycopg.Connection) -> None:
    """Kills: release_orphans without ``lease_expires_at < now() + (lease - age)``. A claim the
    dispatcher has committed but not yet handed to a slot is in no slot's keep list; releasing
    it would give back the attempt of an item about to run (a poison item would never use up
    its attempts, durability.md §2)."""
    enqueue_many(db, 1)
    (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=LEASE_S)
    assert _release(db, keep=[]) == []
    assert _rows(db) == [(item.id, 1, "w")]
    # Once the lease is older than the renewer's interval, it is an orphan: given back.
    db.execute("UPDATE pending_triage SET lease_expires_at = now() + interval '30 seconds'")
    assert _release(db, keep=[]) == [item.id]
    assert _rows(db) == [(item.id, 0, None)]


def test_an_expired_lease_of_its_own_keeps_its_attempt(db: psycopg.Connection) -> None:
    """Kills: release_orphans without ``lease_expires_at > now()``. An attempt whose lease ran
    out (its settle could not be written, then forgotten) counted: giving it back would let an
    item that kills its worker loop for ever; the next claim records it as died instead."""
    enqueue_many(db, 2)
    items = store.claim(db, Queue.TRIAGE, owner="w", limit=2, lease_s=LEASE_S)
    expired, running = sorted(items, key=lambda i: i.id)
    db.execute(
        "UPDATE pending_triage SET lease_expires_at = now() - interval '1 second' WHERE id = %s",
        (expired.id,),
    )
    db.execute(
        "UPDATE pending_triage SET lease_expires_at = now() + interval '30 seconds' WHERE id = %s",
        (running.id,),
    )
    assert _release(db, keep=[running.id]) == []
    assert _rows(db) == [(expired.id, 1, "w"), (running.id, 1, "w")]
    (again,) = store.claim(db, Queue.TRIAGE, owner="x", limit=1, lease_s=LEASE_S)
    assert (again.id, again.attempt, again.took_over_lease) == (expired.id, 2, True)
