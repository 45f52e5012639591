"""Mutation testing (session 29): the raw archive of a distillation that never distils keeps
every chunk of the conversation, each under an origin of its own.

Kills: ``final_failure_memories`` giving every chunk ``item.origin(0)``: the memory insert is
idempotent by origin, so all chunks after the first were dropped and the archived conversation
lost all but its first ~1,000 bytes (the tests looked at the planned rows, not at the table).
Real runner, pipelines, scripted chat server and PostgreSQL; assertions on the rows.
"""

from __future__ import annotations

import json

import psycopg
import pytest

from sokratos_worker.config import load_settings
from sokratos_worker.handlers import HandlerContext
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.pipelines import build_handlers
from sokratos_worker.runner import Runner
from sokratos_worker.store.connection import Database
from sokratos_worker.testing.scripted_llm import Reply, Request, ScriptedLLM
from tests.pipelines.fakes import FakeEmbedder

pytestmark = pytest.mark.postgres

MESSAGES = [f"message {n}: " + "the user talked about the garden in Oslo. " * 20 for n in range(8)]


def _never_valid(_: Request) -> Reply:
    return Reply.chat({"not": "what was asked"})  # no backend ever distils it


def _drain(database_url: str, server: ScriptedLLM) -> None:
    settings = load_settings(
        {
            "SOKRATOS_DATABASE_URL": database_url,
            "SOKRATOS_MAX_ATTEMPTS": "1",
            "SOKRATOS_LLM_BACKENDS": json.dumps(
                [{"name": "scripted", "url": server.url, "model": "scripted", "timeout": 5}]
            ),
        }
    )
    chat = FallbackChatClient(settings.llm_backends)
    database = Database(database_url, size=settings.pool_size)
    try:
        handlers = build_handlers(HandlerContext(settings, database, chat, FakeEmbedder()))
        runner = Runner(settings=settings, database=database, handlers=handlers, worker_id="w")
        runner.start(drain_only=True, budget_s=20)
        assert runner.wait_drained(60)
        runner.shutdown(1)
    finally:
        chat.close()
        database.close()


def test_a_long_conversation_archived_after_failing_keeps_every_chunk(
    db: psycopg.Connection, database_url: str
) -> None:
    payload = {"messages": [{"role": "user", "content": text} for text in MESSAGES]}
    enqueued = db.execute(
        "SELECT sokratos_enqueue_distillation(%s::jsonb)", (json.dumps(payload),)
    ).fetchone()
    assert enqueued is not None
    (item_id,) = enqueued
    with ScriptedLLM(chat=_never_valid) as server:
        _drain(database_url, server)
    row = db.execute(
        "SELECT outcome, memory_ids FROM work_outcomes WHERE item_id = %s", (item_id,)
    ).fetchone()
    assert row is not None, "no outcome recorded"
    outcome, memory_ids = row
    assert outcome == "archived"
    rows = db.execute(
        "SELECT origin, summary FROM memories WHERE source = 'conversation_archive' ORDER BY id"
    ).fetchall()
    assert len(rows) > 1  # the conversation is several chunks long
    assert sorted(memory_ids) == sorted(
        r[0] for r in db.execute("SELECT id FROM memories WHERE source = 'conversation_archive'")
    )
    assert len({origin for origin, _ in rows}) == len(rows)
    archived = "\n".join(summary for _, summary in rows)
    for n in range(len(MESSAGES)):
        assert f"message {n}: " in archived, f"message {n} was lost from the raw archive"
