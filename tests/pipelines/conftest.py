"""Fixtures for pipeline tests: a pooled Database on the test's fresh PostgreSQL, fakes, items."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

from sokratos_worker.config import load_settings
from sokratos_worker.handlers import HandlerContext
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.model import Effects, Item, Queue
from sokratos_worker.pipelines import build_handlers
from sokratos_worker.runner import Runner
from sokratos_worker.store.connection import Database
from sokratos_worker.store.memories import write_effects
from sokratos_worker.testing.scripted_llm import ScriptedLLM

from .fakes import FakeChat, FakeEmbedder


@pytest.fixture
def database(database_url: str) -> Iterator[Database]:
    database = Database(database_url, size=2)
    yield database
    database.close()


@pytest.fixture
def chat() -> FakeChat:
    return FakeChat()


@pytest.fixture
def embedder() -> FakeEmbedder:
    return FakeEmbedder()


def make_item(
    payload: dict[str, Any],
    *,
    queue: Queue = Queue.TRIAGE,
    item_id: int = 7,
    source: str = "conversation",
    attempt: int = 1,
) -> Item:
    return Item(
        queue=queue,
        id=item_id,
        payload=payload,
        attempt=attempt,
        source=source if queue is Queue.TRIAGE else "distillation",
        idempotency_key=None,
        created_at=datetime(2026, 3, 14, 9, 30, tzinfo=UTC),
    )


def apply(db: psycopg.Connection, effects: Effects) -> tuple[int, ...]:
    """Commit the effects as the settle would: one transaction."""
    with db.transaction():
        return write_effects(db, effects).memory_ids


def vector_literal(vec: list[float]) -> str:
    return "[" + ",".join(repr(x) for x in vec) + "]"


def insert_memory(
    db: psycopg.Connection,
    summary: str,
    vec: list[float] | None,
    *,
    memory_type: str = "general",
    model: str | None = "fake-embed",
    age: str = "0 seconds",
) -> int:
    row = db.execute(
        """INSERT INTO memories (summary, embedding, memory_type, embedding_model, created_at)
           VALUES (%s, %s::vector, %s, %s, now() - %s::interval) RETURNING id""",
        (summary, vector_literal(vec) if vec else None, memory_type, model, age),
    ).fetchone()
    assert row is not None
    return int(row[0])


def memory_rows(db: psycopg.Connection) -> list[dict[str, Any]]:
    with db.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return cur.execute(
            """SELECT id, summary, salience, tags, memory_type, source, source_date, pipeline_id,
                      origin, embedding_model, superseded_by, entities,
                      CASE WHEN embedding IS NULL THEN NULL ELSE vector_dims(embedding) END AS dims
               FROM memories ORDER BY id"""
        ).fetchall()


def enqueue(db: psycopg.Connection, sql: str, *args: Any) -> int:
    """Run an enqueue function (``SELECT sokratos_enqueue_…(…)``); the item id."""
    row = db.execute(sql, args).fetchone()
    assert row is not None
    return int(row[0])


def drain(
    database_url: str, server: ScriptedLLM, *fallbacks: ScriptedLLM, **env: str
) -> None:
    """Run the real runner, pipelines and chat client against ``server`` (then ``fallbacks``,
    in that order) until the queues are empty; one attempt per item, so a retry cannot hide
    a failure. One server is named "scripted", several "primary", "fallback", "third"."""
    names = ["primary", "fallback", "third"] if fallbacks else ["scripted"]
    backends = [
        {"name": name, "url": s.url, "model": "scripted", "timeout": 5}
        for name, s in zip(names, (server, *fallbacks), strict=False)
    ]
    settings = load_settings(
        {
            "SOKRATOS_DATABASE_URL": database_url,
            "SOKRATOS_MAX_ATTEMPTS": "1",
            "SOKRATOS_LLM_BACKENDS": json.dumps(backends),
            **env,
        }
    )
    chat = FallbackChatClient(settings.llm_backends)
    database = Database(database_url, size=settings.pool_size)
    try:
        handlers = build_handlers(HandlerContext(settings, database, chat, FakeEmbedder()))
        runner = Runner(
            settings=settings, database=database, handlers=handlers, worker_id="test-worker"
        )
        runner.start(drain_only=True)
        assert runner.wait_drained(60)
    finally:
        chat.close()
        database.close()


def outcome(db: psycopg.Connection, queue: str, item_id: int) -> tuple[str, list[int], str]:
    """The item's (outcome, memory_ids, detail) from work_outcomes."""
    row = db.execute(
        "SELECT outcome, memory_ids, detail FROM work_outcomes WHERE queue = %s AND item_id = %s",
        (queue, item_id),
    ).fetchone()
    assert row is not None, f"no outcome for {queue} {item_id}"
    return row[0], list(row[1] or []), row[2]
