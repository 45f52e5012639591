"""An email whose Date holds a number no datetime can take is triaged with no date, as any
other unparsable Date is, instead of failing every attempt (found by a triage hunt)."""

from __future__ import annotations

import json

import psycopg
import pytest

from sokratos_worker.pipelines.payload import lenient_datetime
from sokratos_worker.testing.scripted_llm import Reply, ScriptedLLM

from .conftest import drain, enqueue, memory_rows, outcome

pytestmark = pytest.mark.postgres

SUMMARY = "The user's landlord ends the lease on the flat in Graz."
# parsedate_to_datetime raises OverflowError (not ValueError) on these: a spammer's Date, or
# one a producer copied from a broken mail, is enqueued as it is (the SQL check leaves it).
OVERFLOWING_DATES = [
    "Mon, 1 Jan 99999999999999999999 10:00:00 +0000",
    "Mon, 99999999999999999999 Jan 2026 10:00:00 +0000",
    "Mon, 1 Jan 2026 10:00:00 +99999999999999999999",
]


@pytest.mark.parametrize("date", OVERFLOWING_DATES)
def test_a_date_beyond_any_datetime_is_no_date(date: str) -> None:
    assert lenient_datetime(date) is None


def test_an_email_with_an_overflowing_date_is_saved_without_a_date(
    db: psycopg.Connection, database_url: str
) -> None:
    item = enqueue(
        db,
        "SELECT sokratos_enqueue_triage(%s::jsonb, NULL, 'email')",
        json.dumps(
            {
                "text": "From: landlord@example.org\nSubject: Lease\n\nThe lease ends in June.",
                "date": OVERFLOWING_DATES[0],
            }
        ),
    )
    verdict = {
        "salience_score": 6,
        "summary": SUMMARY,
        "category": "personal",
        "tags": ["housing"],
        "save": True,
        "paradigm_shift": False,
    }
    with ScriptedLLM(chat=lambda request: Reply.chat(verdict)) as server:
        drain(database_url, server)
    result, memory_ids, detail = outcome(db, "pending_triage", item)
    assert (result, detail) == ("saved", "salience 6 (threshold 1)")
    rows = memory_rows(db)
    assert [(r["id"], r["summary"], r["source_date"]) for r in rows] == [
        (memory_ids[0], SUMMARY, None)
    ]
    failures = db.execute("SELECT count(*) FROM failed_operations").fetchone()
    assert failures == (0,)
