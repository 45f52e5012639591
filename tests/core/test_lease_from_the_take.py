"""Mutation testing (session 29): a lease runs from the moment the statement takes the row
(``clock_timestamp()``), not from the statement's start (``now()``).

A claim, a settle that claims the next item, or a renewal that waited behind a lock (a
migration, an operator's LOCK TABLE) longer than the lease would otherwise grant a lease
already over, and another worker would take the item while it runs here. Kills each of the
three ``clock_timestamp()`` → ``now()`` mutants. Real PostgreSQL; assertions on the rows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from sokratos_worker.model import Effects, Outcome, Queue
from sokratos_worker.store import queue as store
from tests.support.db import enqueue_many

LEASE_S = 4.0
LOCKED_S = 5.0  # longer than the lease


def _lock_then(database_url: str, run: Callable[[], Any]) -> None:
    """Run ``run`` in a thread while another session holds the queue table locked."""
    with psycopg.connect(database_url) as locker:
        locker.execute("LOCK TABLE pending_triage IN ACCESS EXCLUSIVE MODE")
        worker = threading.Thread(target=run)
        worker.start()
        time.sleep(LOCKED_S)
        locker.rollback()
        worker.join(30)
        assert not worker.is_alive()


def _lease_left(db: psycopg.Connection) -> list[float]:
    rows = db.execute(
        "SELECT EXTRACT(EPOCH FROM lease_expires_at - clock_timestamp())::float"
        " FROM pending_triage WHERE lease_owner = 'w' ORDER BY id"
    ).fetchall()
    return [float(r[0]) for r in rows]


@pytest.mark.parametrize("path", ["claim", "settle_claim", "renew"])
def test_a_lease_granted_after_waiting_behind_a_lock_is_a_whole_lease(
    db: psycopg.Connection, database_url: str, path: str
) -> None:
    enqueue_many(db, 2)
    with psycopg.connect(database_url, autocommit=True) as conn:
        if path == "claim":
            _lock_then(
                database_url,
                lambda: store.claim(conn, Queue.TRIAGE, owner="w", limit=1, lease_s=LEASE_S),
            )
        elif path == "settle_claim":
            (first,) = store.claim(conn, Queue.TRIAGE, owner="w", limit=1, lease_s=600)
            effects = Effects(Outcome.SKIPPED, detail="scripted skip")
            _lock_then(
                database_url,
                lambda: store.settle_success(
                    conn, first, effects, owner="w", claim_from=first.queue, lease_s=LEASE_S
                ),
            )
        else:
            items = store.claim(conn, Queue.TRIAGE, owner="w", limit=2, lease_s=600)
            ids = [i.id for i in items]
            _lock_then(
                database_url,
                lambda: store.renew(conn, Queue.TRIAGE, owner="w", ids=ids, lease_s=LEASE_S),
            )
    left = _lease_left(db)
    assert left, "nothing was leased"
    # Granted at the take, the lease has most of LEASE_S left; from the statement's
    # start, it ended while the statement waited (negative).
    assert all(s > 0 for s in left), left
