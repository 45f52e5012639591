"""One item from enqueue to its outcome row through the real runner: the user's words reach
triage past a tool result, a null alternative field is absent, a known fact names its memory."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from sokratos_worker.pipelines import prompts
from sokratos_worker.testing.scripted_llm import Reply, Request, ScriptedLLM

from .conftest import drain, enqueue, insert_memory, outcome
from .fakes import hashed_vector

pytestmark = pytest.mark.postgres

ANNA = "The user's sister Anna moved to Lisbon for work."
LISBON = "The user moved to Lisbon in March."
KOSMOS = "The user climbs at Kosmos in Leipzig twice a week."


def _verdict(score: float, summary: str) -> dict[str, Any]:
    return {
        "salience_score": score,
        "summary": summary,
        "category": "personal",
        "tags": ["family"],
        "save": True,
        "paradigm_shift": False,
    }


def _triage(request: Request) -> Reply:
    """A model that saves what the user said, and scores tool output 0 (the prompt's rule)."""
    system = request.messages[0]["content"]
    if system.startswith(prompts.CONTRADICTION[:40]):
        return Reply.chat({"verdicts": []})
    if "sister Anna just moved to Lisbon" in request.messages[-1]["content"]:
        return Reply.chat(_verdict(7, ANNA))
    return Reply.chat(_verdict(0, "No new information."))


def _distilling(fact: str, salience: int, tag: str) -> Any:
    def respond(request: Request) -> Reply:
        if request.messages[0]["content"].startswith(prompts.DISTILLATION[:40]):
            return Reply.chat({"facts": [{"text": fact, "salience": salience, "tags": [tag]}]})
        return Reply.chat({"verdicts": []})

    return respond


def _summaries(db: psycopg.Connection, memory_ids: list[int]) -> list[str]:
    return [r[0] for r in db.execute("SELECT summary FROM memories WHERE id = ANY(%s)", (memory_ids,))]


def test_user_words_survive_a_tool_result_containing_the_assistant_marker(
    db: psycopg.Connection, database_url: str
) -> None:
    """The 800-byte reply cap once cut after a tool result's "\\nassistant: ", replacing the
    user's message with tool output: the model scored that and the user's fact was skipped."""
    # A tool returning the assistant's earlier notes (no "user: " line in it).
    transcript = "\n".join(
        f"assistant: reminder {i}: water the plants and check the mail, as every day."
        for i in range(40)
    )
    exchange = (
        f"[read_chat_log result] {transcript}\n"
        "user: my sister Anna just moved to Lisbon for work\n"
        "assistant: That's a big move!"
    )
    item = enqueue(
        db,
        "SELECT sokratos_enqueue_triage(%s::jsonb)",
        json.dumps({"exchange": exchange, "tools_used": True}),
    )
    with ScriptedLLM(chat=_triage) as server:
        drain(database_url, server)
        sent = [
            b["messages"][-1]["content"]
            for b in server.bodies()
            if b["messages"][0]["content"].startswith(prompts.CONVERSATION_TRIAGE[:40])
        ]

    assert sent, "no triage request was made"
    # The user's own message must reach the model (the tool output is what may be cut).
    assert "my sister Anna just moved to Lisbon" in sent[0]
    result, memory_ids, detail = outcome(db, "pending_triage", item)
    assert result == "saved", detail
    assert _summaries(db, memory_ids) == [ANNA]


@pytest.mark.parametrize(
    "payload",
    [
        {
            "messages": [{"role": "user", "content": "I moved to Lisbon in March."}],
            "archive_text": None,
        },
        {
            "messages": None,
            "archive_text": "[Conversation archived 2026-03-01 10:00]\n"
            "user: I moved to Lisbon in March.",
        },
    ],
    ids=["archive_text_null", "messages_null"],
)
def test_a_null_alternative_field_is_absent(
    db: psycopg.Connection, database_url: str, payload: dict[str, object]
) -> None:
    """A Go struct without ``omitempty`` sends the unused field as null: the SQL check accepts
    it (the producer is told the item is queued), so the worker must distil it too."""
    item = enqueue(db, "SELECT sokratos_enqueue_distillation(%s::jsonb)", json.dumps(payload))
    with ScriptedLLM(chat=_distilling(LISBON, 7, "home")) as server:
        drain(database_url, server)
    result, memory_ids, detail = outcome(db, "pending_distillation", item)
    assert result == "saved", detail
    assert _summaries(db, memory_ids) == [LISBON]


def test_a_known_fact_names_the_memory_that_holds_it(
    db: psycopg.Connection, database_url: str
) -> None:
    """The contract: a skipped near-duplicate's memory_ids is the existing memory (that is how
    anyone proves the fact was not lost), for the handler's 0.15 check as for the settle's."""
    # Saved yesterday (outside the 1-hour near-duplicate window, inside the 0.15 fact rule).
    existing = insert_memory(db, KOSMOS, hashed_vector(KOSMOS), age="1 day")
    item = enqueue(
        db,
        "SELECT sokratos_enqueue_distillation(%s::jsonb)",
        json.dumps({"messages": [{"role": "user", "content": "I climb at Kosmos twice a week."}]}),
    )
    with ScriptedLLM(chat=_distilling(KOSMOS, 6, "hobby")) as server:
        drain(database_url, server)
    result, memory_ids, detail = outcome(db, "pending_distillation", item)
    assert result == "skipped", detail
    assert db.execute("SELECT count(*) FROM memories").fetchone() == (1,)  # nothing written
    assert memory_ids == [existing], detail


def test_a_made_up_source_is_recorded_as_conversation_in_the_outcome(
    db: psycopg.Connection, database_url: str
) -> None:
    """contract §3: work_outcomes.source is conversation, email or distillation. A row the
    producer inserted with another source is dead-lettered naming source (op_type
    conversation_triage), and its outcome said that source ('telegram')."""
    item = enqueue(
        db,
        "INSERT INTO pending_triage (payload, source) VALUES (%s::jsonb, 'telegram') RETURNING id",
        json.dumps({"exchange": "user: my sister Anna just moved to Lisbon\nassistant: ok"}),
    )
    with ScriptedLLM(chat=_triage) as server:
        drain(database_url, server)
    result, _, detail = outcome(db, "pending_triage", item)
    assert result == "failed", detail
    row = db.execute(
        "SELECT o.source, f.op_type, f.error_message, f.context_data->>'source'"
        " FROM work_outcomes o JOIN failed_operations f ON f.item_id = o.item_id"
        " WHERE o.item_id = %s",
        (item,),
    ).fetchone()
    assert row is not None
    source, op_type, error, kept = row
    assert (source, op_type, kept) == ("conversation", "conversation_triage", "telegram")
    assert "source must be conversation or email" in error, error
