"""One settle waiting on a lock (its item row deleted, its memory insert behind a lock on
`memories`: an index build, a transaction left open) must not stop the lease renewal of the
process's other items: the renewer waited on that deleted row, the other items' leases ran
out while they ran, and a second worker ran them again (found by a two-process hunt)."""

from __future__ import annotations

import time

import psycopg

from sokratos_worker.model import Queue
from sokratos_worker.runner import Runner
from sokratos_worker.store.connection import Database
from tests.support.db import enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings


def test_a_settle_behind_a_lock_does_not_stop_the_other_items_renewals(
    db: psycopg.Connection, database_url: str
) -> None:
    (long_item,) = enqueue_many(db, 1, behaviour="sleep:9", prefix="long")
    locker = psycopg.connect(database_url)  # the memories table locked, as an index build does
    locker.execute("LOCK TABLE memories IN SHARE MODE")
    enqueue_many(db, 1, behaviour="ok", prefix="quick")  # its settle waits on the lock
    first, second = Database(database_url, size=6), Database(database_url, size=6)
    a = Runner(
        settings=fast_settings(concurrency=2, lease=3),
        database=first,
        handlers={Queue.TRIAGE: ScriptedHandler()},
        worker_id="A",
    )
    b = Runner(
        settings=fast_settings(concurrency=2, lease=3),
        database=second,
        handlers={Queue.TRIAGE: ScriptedHandler()},
        worker_id="B",
    )
    try:
        a.start()
        time.sleep(1.0)
        b.start()  # both items are A's: B waits for one whose lease runs out
        time.sleep(7)  # more than two leases: without renewals, B takes the long item over
        locker.rollback()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and db.execute(
            "SELECT count(*) FROM work_outcomes"
        ).fetchone() != (2,):
            time.sleep(0.2)
    finally:
        locker.close()
        a.shutdown(2)
        b.shutdown(2)
        first.close()
        second.close()
    row = db.execute(
        "SELECT outcome, attempts FROM work_outcomes WHERE item_id = %s", (long_item,)
    ).fetchone()
    assert row == ("saved", 1), f"the long item was taken over by B: {row}"
    assert db.execute("SELECT count(*) FROM work_outcomes").fetchone() == (2,)
