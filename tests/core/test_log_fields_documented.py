"""Documented log fields, checked on the real JSON lines the worker writes (review R5).

README ("Logs go to stderr as JSON lines ..."): "each line logged while an item is handled
with its `queue`, `item_id` and `attempt`"; docs/production.md §9 (Fenced settles): a worker
whose lease was taken over "logs `lease_lost` (with `new_owner`, or `finished_by_attempt` ...)";
docs/production.md §9 (Leases): a claim past SOKRATOS_MAX_ATTEMPTS "is not an attempt", the
dead letter's `attempts` is the last attempt counted; docs/backends.md: the item's `attempt` in
log lines is "its attempt at the item, as in `failed_operations`".
"""

from __future__ import annotations

import json
import time

import psycopg

from sokratos_worker.model import Queue
from sokratos_worker.runner import Runner
from sokratos_worker.store.connection import Database
from tests.core.test_item_log_context import json_lines
from tests.support.db import count, enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings

PAYLOAD = json.dumps({"exchange": "user: hi\nassistant: hello", "behaviour": "ok"})


def test_every_lease_lost_line_names_the_item_attempt_and_the_new_owner(
    db: psycopg.Connection, database_url: str
) -> None:
    """The lease renewer's own ``lease_lost`` line (leases.py) carried neither the item's
    ``attempt`` nor ``new_owner``, unlike the settle's line and the docs, and came again at
    every renewal pass until the handler ended: once now, then the settle's."""
    [item] = enqueue_many(db, 1, behaviour="sleep:2.5", prefix="r5lost")
    database = Database(database_url, size=4)
    runner = Runner(
        settings=fast_settings(concurrency=1, lease=3),  # renewals every second
        database=database,
        handlers={Queue.TRIAGE: ScriptedHandler()},
        worker_id="old-owner",
    )
    try:
        with json_lines() as lines:
            runner.start(drain_only=False)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not count(
                db, "SELECT count(*) FROM pending_triage WHERE lease_owner = 'old-owner'"
            ):
                time.sleep(0.02)
            # What another worker's claim after an expiry writes.
            db.execute(
                "UPDATE pending_triage SET lease_owner = 'new-owner', attempts = attempts + 1,"
                " lease_expires_at = clock_timestamp() + interval '60 seconds' WHERE id = %s",
                (item,),
            )
            time.sleep(4.0)  # renewals meet the takeover; then the handler's settle is refused
            runner.shutdown(1)
    finally:
        database.close()
    lost = [e for e in lines if e["event"] == "lease_lost"]
    assert 1 <= len(lost) <= 2, lost  # the renewer's (once) and the settle's
    for line in lost:
        assert line.get("queue") == "pending_triage" and line.get("item_id") == item, line
        assert line.get("attempt") == 1, line  # README: every line about an item in flight
        assert line.get("new_owner") == "new-owner", line  # production.md §9


def test_the_dead_letter_line_of_a_claim_past_the_limit_names_the_attempt_recorded(
    db: psycopg.Connection, database_url: str
) -> None:
    """A row inserted with attempts preset (5, SOKRATOS_MAX_ATTEMPTS=3) is dead-lettered at its
    claim with ``attempts`` 5 (the claim is not an attempt); its ``item_dead_lettered`` line
    said ``attempt`` 6, an attempt that neither failed_operations nor the history knows."""
    db.execute("INSERT INTO pending_triage (payload, attempts) VALUES (%s::jsonb, 5)", (PAYLOAD,))
    handler = ScriptedHandler()
    database = Database(database_url, size=6)
    runner = Runner(
        settings=fast_settings(max_attempts=3),
        database=database,
        handlers={Queue.TRIAGE: handler},
        worker_id="r5",
    )
    try:
        with json_lines() as lines:
            runner.start(drain_only=True, budget_s=8.0)
            assert runner.wait_drained(30)
            runner.shutdown(1)
    finally:
        database.close()
    assert handler.calls == 0
    row = db.execute("SELECT attempts FROM failed_operations").fetchone()
    assert row is not None and row[0] == 5  # as documented
    (dead,) = [e for e in lines if e["event"] == "item_dead_lettered"]
    assert dead.get("attempt") == row[0], dead
