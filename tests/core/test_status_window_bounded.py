"""`status`'s last 24 hours end now: a failure created 'infinity' (a row Sokratos's Go code
wrote) or an outcome dated tomorrow counted as recent for ever (hunt, 2026-12-06)."""

from __future__ import annotations

import psycopg

from sokratos_worker.store import status as status_store


def test_rows_dated_in_the_future_are_not_in_the_last_24_hours(db: psycopg.Connection) -> None:
    db.execute(
        """INSERT INTO failed_operations (op_type, label, error_message, created_at)
           VALUES ('memory_save', 'now', 'e', now()),
                  ('memory_save', 'for ever', 'e', 'infinity'),
                  ('embedding', 'tomorrow', 'e', now() + interval '1 day')"""
    )
    db.execute(
        """INSERT INTO work_outcomes (queue, item_id, source, outcome, decided_at)
           VALUES ('pending_triage', 1, 'conversation', 'saved', now()),
                  ('pending_triage', 2, 'conversation', 'saved', 'infinity')"""
    )
    assert status_store.failures_24h(db) == {"memory_save": 1}
    assert status_store.outcomes_24h(db) == {"pending_triage": {"saved": 1}}
