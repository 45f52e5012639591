"""`run --once` keeps renewing its leases until the items in flight have finished or been
given back: the end of the drain is not the end of the items.

Found by reading (2026-12-06): the drain-only dispatcher stopped the lease renewer when its
drain (or budget) ended, while run --once's shutdown still gave the items in flight a grace;
with SOKRATOS_SHUTDOWN_GRACE over two thirds of SOKRATOS_LEASE the lease ran out mid-item and
another worker could claim and run the item a second time.
"""

from __future__ import annotations

import time

import psycopg

from sokratos_worker.model import Queue
from sokratos_worker.runner import Runner
from sokratos_worker.store.connection import Database
from tests.support.db import enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings


def test_an_item_still_running_after_the_drain_keeps_its_lease(
    db: psycopg.Connection, database_url: str
) -> None:
    """The item outlives the drain's wait (grace + 5 s) and is still leased to this worker
    more than a lease later, then settles once."""
    database = Database(database_url, size=4)
    runner = Runner(
        settings=fast_settings(lease=3, shutdown_grace=1),  # renewed every second
        database=database,
        handlers={Queue.TRIAGE: ScriptedHandler()},
        worker_id="w",
    )
    try:
        [item_id] = enqueue_many(db, 1, behaviour="sleep:12")
        runner.start(drain_only=True, budget_s=0.2)
        assert runner.wait_drained(30)  # ~6 s: the budget's end, then grace + 5 s
        assert runner.inflight_count() == 1
        time.sleep(4)  # longer than the lease: only renewals keep it
        leased = db.execute(
            "SELECT lease_owner, lease_expires_at > now() FROM pending_triage WHERE id = %s",
            (item_id,),
        ).fetchone()
        assert leased == ("w", True)
        runner.shutdown(10)
    finally:
        database.close()
    assert db.execute("SELECT count(*) FROM pending_triage").fetchone() == (0,)
    outcomes = db.execute("SELECT count(*) FROM memories").fetchone()
    assert outcomes == (1,)
