"""A distillation item from Sokratos (Go) whose messages carry Go's zero time, on a host west
of UTC. Go marshals a message's unset time.Time as "0001-01-01T00:00:00Z" (``omitempty`` does
not omit a struct): messages restored after a restart have no time (reference §5.2).

Each message's timestamp is shown in the host's local time: year 1 at 00:00 UTC is year 0 in
New York, which datetime cannot hold (OverflowError), and the item failed every attempt. Go's
zero time means no time: the message is shown without one, as Sokratos shows it. At the other
end, a time whose local time would be year 10000 is shown as written."""

from __future__ import annotations

import json
import time

import psycopg
import pytest

from sokratos_worker.pipelines import prompts
from sokratos_worker.testing.scripted_llm import Reply, Request, ScriptedLLM
from tests.pipelines.conftest import drain, enqueue, outcome

LISBON = "The user moved to Lisbon in March."


def _distilling(request: Request) -> Reply:
    if request.messages[0]["content"].startswith(prompts.DISTILLATION[:40]):
        return Reply.chat({"facts": [{"text": LISBON, "salience": 7, "tags": ["home"]}]})
    return Reply.chat({"verdicts": []})


@pytest.mark.parametrize(
    ("stamp", "zone"),
    [
        ("0001-01-01T00:00:00Z", "America/New_York"),  # Go's zero time: year 0 locally
        ("0001-01-01T00:00:00+00:00", "America/New_York"),
        ("9999-12-31T23:30:00Z", "Asia/Tokyo"),  # year 10000 locally: shown as written
    ],
)
def test_a_message_time_out_of_range_locally_is_still_distilled(
    db: psycopg.Connection,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    stamp: str,
    zone: str,
) -> None:
    payload = {
        "messages": [
            {"role": "user", "content": "I moved to Lisbon in March.", "timestamp": stamp},
            {"role": "assistant", "content": "Nice!", "timestamp": stamp},
        ]
    }
    item = enqueue(db, "SELECT sokratos_enqueue_distillation(%s::jsonb)", json.dumps(payload))
    monkeypatch.setenv("TZ", zone)
    time.tzset()
    try:
        with ScriptedLLM(chat=_distilling) as server:
            drain(database_url, server)
    finally:
        monkeypatch.undo()
        time.tzset()
    result, _, detail = outcome(db, "pending_distillation", item)
    assert result == "saved", detail


def test_an_item_created_at_no_datetime_holds_is_archived_without_a_time(
    db: psycopg.Connection, database_url: str
) -> None:
    """A producer's created_at of 'infinity' (the archive header's time) came to the claim,
    which psycopg could not load: the claim failed after committing, for ever (review,
    2026-12-05). The header now says no time, and the conversation is kept."""
    payload = {"messages": [{"role": "user", "content": "I moved to Lisbon in March."}]}
    item = enqueue(db, "SELECT sokratos_enqueue_distillation(%s::jsonb)", json.dumps(payload))
    db.execute("UPDATE pending_distillation SET created_at = 'infinity'")
    with ScriptedLLM(chat=lambda _: Reply.chat({"not": "facts"})) as server:
        drain(database_url, server)
    result, memory_ids, detail = outcome(db, "pending_distillation", item)
    assert result == "archived", detail
    row = db.execute("SELECT summary FROM memories WHERE id = %s", (memory_ids[0],)).fetchone()
    assert row is not None
    assert row[0] == "[Conversation archived]\nuser: I moved to Lisbon in March.", row
