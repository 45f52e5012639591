"""A queue row's ``attempt_errors`` is the worker's own column, but a producer or an operator
can write it (a restore, a hand-made INSERT): entries that are not objects, or a value that
is not an array, must not stop the item from being dead-lettered. Before, the dead letter's
history step called ``.get`` on every entry: the settle failed with AttributeError on every
attempt, and the item never reached failed_operations (2026-12-05)."""

from __future__ import annotations

import json

import psycopg
import pytest

from tests.core.test_attempts_used_up import _dead_letter, _drain
from tests.support.db import enqueue_many

FOREIGN_HISTORIES = {
    "strings": '["tried by hand", 7, null]',
    "an object": '{"note": "not a list"}',
    "a string": '"no history"',
}


@pytest.mark.parametrize("history", FOREIGN_HISTORIES.values(), ids=FOREIGN_HISTORIES.keys())
def test_a_failing_item_with_a_foreign_history_is_dead_lettered(
    db: psycopg.Connection, database_url: str, history: str
) -> None:
    (item_id,) = enqueue_many(db, 1)
    db.execute(
        "UPDATE pending_triage SET attempt_errors = %s::jsonb, attempts = 2,"
        " payload = payload || %s::jsonb WHERE id = %s",
        (history, json.dumps({"behaviour": "fail"}), item_id),
    )
    handler = _drain(database_url, max_attempts=3)
    assert handler.calls == 1  # the third and last attempt
    assert db.execute("SELECT count(*) FROM pending_triage").fetchone() == (0,)
    error, attempts, _, entries = _dead_letter(db)
    assert attempts == 3 and "scripted failure on attempt 3" in error
    # The last attempt's entry is there, after whatever was written before it.
    ours = [e for e in entries if isinstance(e, dict) and "error" in e and "at" in e]
    assert [e["attempt"] for e in ours] == [3], entries
    outcome = db.execute("SELECT outcome FROM work_outcomes WHERE item_id = %s", (item_id,))
    assert outcome.fetchone() == ("failed",)
