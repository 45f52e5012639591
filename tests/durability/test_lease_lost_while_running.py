"""durability.md, item life 3 and table row "a lease lost to another worker (expired while the
call ran) | this worker's settle is refused and rolled back; the new owner finishes".

Runner in-process, real PostgreSQL: while the item's handler runs, another worker takes the item
over (as a claim after lease expiry does: new owner, attempt counted). The running worker's
settle must change nothing (no memory, no outcome, the row stays the new owner's), its renewals
must not take the lease back, and it must log that it lost the lease.
"""

from __future__ import annotations

import time

import psycopg

from sokratos_worker.model import Queue
from sokratos_worker.runner import Runner
from sokratos_worker.store.connection import Database
from tests.core.test_item_log_context import json_lines
from tests.support.db import count, enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings


def test_a_settle_after_the_lease_was_taken_over_changes_nothing(
    db: psycopg.Connection, database_url: str
) -> None:
    [item] = enqueue_many(db, 1, behaviour="sleep:2.5", prefix="lost")
    database = Database(database_url, size=4)
    runner = Runner(
        settings=fast_settings(concurrency=1, lease=3),
        database=database,
        handlers={Queue.TRIAGE: ScriptedHandler()},
        worker_id="old-owner",
    )
    with json_lines() as logs:  # the JSON lines as written (item context included)
        runner.start(drain_only=False)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not count(
            db, "SELECT count(*) FROM pending_triage WHERE lease_owner = 'old-owner'"
        ):
            time.sleep(0.02)
        # Taken over: what another worker's claim after an expiry writes.
        db.execute(
            "UPDATE pending_triage SET lease_owner = 'new-owner', attempts = attempts + 1,"
            " lease_expires_at = clock_timestamp() + interval '60 seconds' WHERE id = %s",
            (item,),
        )
        time.sleep(4.0)  # the handler ends, its settle is tried; renewals run meanwhile
        runner.shutdown(1)
    database.close()
    row = db.execute("SELECT lease_owner, attempts FROM pending_triage WHERE id = %s", (item,))
    assert row.fetchone() == ("new-owner", 2)
    assert count(db, "SELECT count(*) FROM work_outcomes") == 0
    assert count(db, "SELECT count(*) FROM memories") == 0
    events = [e for e in logs if e["event"] == "lease_lost"]
    assert events and any(e.get("new_owner") == "new-owner" for e in events), [
        e["event"] for e in logs
    ]
    # The renewer's line too (review R5): it named neither the attempt nor the new owner,
    # and came at every renewal pass; once now, then the settle's.
    assert 1 <= len(events) <= 2, events
    for line in events:
        assert line.get("queue") == "pending_triage" and line.get("item_id") == item, line
        assert line.get("attempt") == 1 and line.get("new_owner") == "new-owner", line
