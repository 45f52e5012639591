"""A claim past SOKRATOS_MAX_ATTEMPTS, on the real JSON lines the worker writes (review R5).

docs/production.md (Leases): such a claim "is not an attempt", its dead letter's `attempts` is
the last attempt counted; docs/backends.md: the `attempt` in log lines is "its attempt at the
item, as in `failed_operations`". (The lease renewer's `lease_lost` fields are checked in
tests/durability/test_lease_lost_while_running.py.)
"""

from __future__ import annotations

import json

import psycopg

from sokratos_worker.model import Queue
from sokratos_worker.runner import Runner
from sokratos_worker.store.connection import Database
from tests.core.test_item_log_context import json_lines
from tests.support.handlers import ScriptedHandler, fast_settings

PAYLOAD = json.dumps({"exchange": "user: hi\nassistant: hello", "behaviour": "ok"})


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
