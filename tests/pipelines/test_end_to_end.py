"""From enqueue to outcome rows: the real runner and chat client, a scripted LLM server."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from sokratos_worker.pipelines import prompts
from sokratos_worker.testing.scripted_llm import Reply, Request, ScriptedLLM

from .conftest import drain, enqueue, memory_rows

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

SAVED_SUMMARY = "The user's daughter Mia started school in Graz."


def respond(request: Request) -> Reply:
    """Route by prompt; triage scores by keyword; a POISON input never gets a valid reply."""
    system = request.messages[0]["content"]
    user = request.messages[-1]["content"]
    if any("POISON" in str(m.get("content")) for m in request.messages):
        return Reply.chat({"not": "what was asked"})
    if system.startswith(prompts.CONTRADICTION[:40]):
        return Reply.chat({"verdicts": [{"existing": 1, "contradicts": False}]})
    if system.startswith(prompts.DISTILLATION[:40]):
        return Reply.chat(
            {
                "facts": [
                    {
                        "text": "The user climbs at Kosmos in Leipzig.",
                        "salience": 6,
                        "tags": ["hobby"],
                    }
                ]
            }
        )
    if system.startswith(prompts.EMAIL_TRIAGE[:40]):
        return Reply.chat(_verdict(6, "A newsletter.", save=False))
    if "daughter" in user:
        return Reply.chat(_verdict(7, SAVED_SUMMARY))
    return Reply.chat(_verdict(1, "No new information."))


def _verdict(score: float, summary: str, *, save: bool = True) -> dict[str, Any]:
    return {
        "salience_score": score,
        "summary": summary,
        "category": "personal",
        "tags": ["family"],
        "save": save,
        "paradigm_shift": False,
    }


def test_items_end_in_the_right_outcomes_and_rows(
    db: psycopg.Connection, database_url: str
) -> None:
    triage = "SELECT sokratos_enqueue_triage(%s::jsonb, NULL, %s)"
    distil = "SELECT sokratos_enqueue_distillation(%s::jsonb)"
    exchange = "user: my daughter Mia started school in Graz today\nassistant: Congratulations!"
    ids = {
        "saved": enqueue(
            db, triage, json.dumps({"exchange": exchange, "pipeline_id": 99}), "conversation"
        ),
        "trivial": enqueue(db, triage, json.dumps({"exchange": "ok"}), "conversation"),
        "low": enqueue(
            db,
            triage,
            json.dumps({"exchange": "user: what's the weather\nassistant: sunny"}),
            "conversation",
        ),
        "email": enqueue(
            db, triage, json.dumps({"text": "From: news@x\n\nSale!", "date": None}), "email"
        ),
    }
    invalid = db.execute(
        "INSERT INTO pending_triage (payload) VALUES ('{\"exchange\": 5}') RETURNING id"
    ).fetchone()
    assert invalid is not None
    messages = {
        "messages": [
            {"role": "user", "content": "Which gym is closest?"},
            {
                "role": "assistant",
                "tool_calls": [{"id": "c1", "function": {"name": "maps", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "Kosmos Leipzig"},
            {"role": "user", "content": "Great, I climb there twice a week."},
        ]
    }
    distilled = enqueue(db, distil, json.dumps(messages))
    poison = enqueue(
        db,
        distil,
        json.dumps(
            {"archive_text": "[Conversation archived x]\nuser: POISON I was born in Oslo in 1990."}
        ),
    )

    with ScriptedLLM(chat=respond) as server:
        drain(database_url, server, SOKRATOS_CONCURRENCY="2")

    outcomes = {
        (row[0], row[1]): (row[2], row[3])
        for row in db.execute("SELECT queue, item_id, outcome, memory_ids FROM work_outcomes")
    }
    memories = {r["id"]: r for r in memory_rows(db)}
    assert outcomes[("pending_triage", ids["trivial"])][0] == "skipped"
    assert outcomes[("pending_triage", ids["low"])][0] == "skipped"
    assert outcomes[("pending_triage", ids["email"])][0] == "skipped"
    assert outcomes[("pending_triage", invalid[0])][0] == "failed"
    outcome, [saved_id] = outcomes[("pending_triage", ids["saved"])]
    assert outcome == "saved"
    saved = memories[saved_id]
    assert (saved["summary"], saved["pipeline_id"], saved["origin"]) == (
        SAVED_SUMMARY,
        99,
        f"pending_triage:{ids['saved']}:0",
    )
    outcome, [fact_id] = outcomes[("pending_distillation", distilled)]
    assert outcome == "saved"
    assert memories[fact_id]["summary"] == "The user climbs at Kosmos in Leipzig."
    outcome, archive_ids = outcomes[("pending_distillation", poison)]
    assert outcome == "archived"
    assert [memories[i]["source"] for i in archive_ids] == ["conversation_archive"]
    assert "born in Oslo" in memories[archive_ids[0]]["summary"]
    failures = dict(db.execute("SELECT op_type, error_message FROM failed_operations").fetchall())
    assert "exchange" in failures["conversation_triage"]
    assert set(failures) == {"conversation_triage", "distillation"}
    assert db.execute("SELECT count(*) FROM pending_triage").fetchone() == (0,)
    assert db.execute("SELECT count(*) FROM pending_distillation").fetchone() == (0,)
    # The distillation prompt carried the tool call and its result.
    distil_inputs = [
        b["messages"][-1]["content"]
        for b in server.bodies()
        if b["messages"][0]["content"].startswith(prompts.DISTILLATION[:40])
    ]
    assert any(
        "assistant called maps({})\n[maps result] Kosmos Leipzig" in t for t in distil_inputs
    )


def test_the_same_fact_triaged_by_many_slots_at_once_is_saved_once(
    db: psycopg.Connection, database_url: str
) -> None:
    """Each slot's near-duplicate check ran before any of the others committed; the settle's
    re-check under a lock keeps one memory (a probe saved 8 of 60 at concurrency 8)."""
    exchange = "user: my daughter Mia started school in Graz today\nassistant: Congratulations!"
    n = 24
    ids = [
        enqueue(db, "SELECT sokratos_enqueue_triage(%s::jsonb)", json.dumps({"exchange": exchange}))
        for _ in range(n)
    ]
    with ScriptedLLM(chat=respond, latency=0.05) as server:  # (so that the slots overlap)
        drain(database_url, server, SOKRATOS_CONCURRENCY="8")

    rows = db.execute(
        "SELECT item_id, outcome, memory_ids, detail FROM work_outcomes WHERE queue = 'pending_triage'"
    ).fetchall()
    assert sorted(r[0] for r in rows) == sorted(ids)  # each item one outcome
    memories = memory_rows(db)
    assert [m["summary"] for m in memories] == [SAVED_SUMMARY]
    kept = memories[0]["id"]
    assert [r[1] for r in rows].count("saved") == 1
    assert {r[1] for r in rows} == {"saved", "skipped"}
    assert all(r[2] == [kept] for r in rows), rows
    assert all(f"near-duplicate of memory {kept}" in r[3] for r in rows if r[1] == "skipped")


def test_a_distillation_cut_off_at_max_tokens_is_saved_from_the_shorter_retry(
    db: psycopg.Connection, database_url: str
) -> None:
    """A long archive whose first reply runs out of tokens: one attempt, the facts saved."""
    fact = "The user climbs at Kosmos in Leipzig."

    def respond_cut_off_first(request: Request) -> Reply:
        if "cut off" in str(request.messages[-1].get("content")):
            return Reply.chat({"facts": [{"text": fact, "salience": 6, "tags": ["hobby"]}]})
        return Reply.chat('{"facts": [{"text": "The user climbs at Kos', finish_reason="length")

    item = enqueue(
        db,
        "SELECT sokratos_enqueue_distillation(%s::jsonb)",
        json.dumps({"archive_text": "user: I climb at Kosmos in Leipzig twice a week."}),
    )
    with ScriptedLLM(chat=respond_cut_off_first) as server:
        drain(database_url, server)
        assert server.count() == 2  # the cut-off reply and the shorter one

    outcome, memory_ids = db.execute(
        "SELECT outcome, memory_ids FROM work_outcomes WHERE item_id = %s", (item,)
    ).fetchone() or (None, None)
    assert outcome == "saved"
    assert [memory_rows(db)[0]["summary"]] == [fact]
    assert len(memory_ids) == 1
    assert db.execute("SELECT count(*) FROM failed_operations").fetchone() == (0,)


def _enqueue_exchange(db: psycopg.Connection) -> int:
    exchange = "user: I moved to Graz last week with my family\nassistant: Welcome to Graz!"
    return enqueue(
        db, "SELECT sokratos_enqueue_triage(%s::jsonb)", json.dumps({"exchange": exchange})
    )


def _triage_outcome(db: psycopg.Connection, item: int) -> tuple[Any, ...] | None:
    return db.execute(
        "SELECT outcome, detail FROM work_outcomes WHERE queue = 'pending_triage' AND item_id = %s",
        (item,),
    ).fetchone()


def test_a_nan_salience_is_never_saved(db: psycopg.Connection, database_url: str) -> None:
    """NaN clears every threshold (NaN < t is False) and PostgreSQL sorts it above every
    number: a reply scoring NaN is an invalid reply, so the item fails instead."""
    reply = json.dumps(_verdict(123456789, SAVED_SUMMARY)).replace("123456789", "NaN")
    item = _enqueue_exchange(db)
    with ScriptedLLM(chat=lambda r: Reply.chat(reply)) as server:
        drain(database_url, server)
    assert memory_rows(db) == []
    assert (_triage_outcome(db, item) or ("?",))[0] == "failed"


def test_a_nul_in_the_models_summary_is_escaped_noted_and_saved(
    db: psycopg.Connection, database_url: str
) -> None:
    """Contract: bytes PostgreSQL cannot store are escaped and noted, never a failed item."""
    reply = _verdict(7, "The user moved to Graz.\u0000")
    reply["tags"] = ["graz\udcff"]
    item = _enqueue_exchange(db)
    with ScriptedLLM(chat=lambda r: Reply.chat(json.dumps(reply))) as server:
        drain(database_url, server)
    outcome = _triage_outcome(db, item)
    assert outcome is not None and outcome[0] == "saved", outcome
    assert "escaped" in outcome[1]
    [memory] = memory_rows(db)
    assert memory["summary"] == "The user moved to Graz.\\u0000"
    assert memory["tags"] == ["conversation", "graz\\udcff"]


def test_a_request_refused_only_for_this_item_uses_its_attempts(
    db: psycopg.Connection, database_url: str
) -> None:
    """Every request of this item gets 403 (a WAF rule) while the health probe, same key and
    model, succeeds: the attempt counts and the item reaches failed_operations, instead of
    being given back, claiming paused and resumed, and the item sent again for ever."""
    item = _enqueue_exchange(db)
    waf = Reply.error(403, "Request blocked by WAF rule 942100", type="forbidden")
    with ScriptedLLM(chat=lambda r: waf) as server:
        drain(database_url, server)
        sent = server.count()
    assert sent == 1
    assert db.execute("SELECT count(*) FROM pending_triage").fetchone() == (0,)
    assert db.execute("SELECT count(*) FROM failed_operations").fetchone() == (1,)
    assert (_triage_outcome(db, item) or ("?",))[0] == "failed"
