"""Distillation against real PostgreSQL: facts saved, deduplicated, skipped, archived."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from sokratos_worker.errors import InvalidPayload
from sokratos_worker.llm.embeddings import HttpEmbedder
from sokratos_worker.llm.types import ChatFailed, ContextTooLong, EmbeddingsUnavailable
from sokratos_worker.model import Effects, Item, NewMemory, Outcome, Queue
from sokratos_worker.pipelines import DistillationHandler
from sokratos_worker.pipelines.text import chunk_text
from sokratos_worker.pipelines.write import MemoryWriter
from sokratos_worker.store.connection import Database
from sokratos_worker.store.memories import MemoryReader
from sokratos_worker.testing.scripted_llm import (
    EMBEDDINGS,
    Reply,
    Request,
    ScriptedLLM,
    hash_embedding,
)

from .conftest import apply, insert_memory, make_item, memory_rows
from .fakes import FakeChat, FakeEmbedder, near

pytestmark = pytest.mark.postgres

MESSAGES = {
    "conversation_id": "c-1",
    "messages": [
        {"role": "system", "content": "You are Sokratos."},
        {
            "role": "user",
            "content": "Find me a climbing gym near my new flat in Leipzig",
            "timestamp": "2026-03-14T09:00:00Z",
        },
        {
            "role": "assistant",
            "content": "<think>search it</think>",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "web_search", "arguments": '{"q": "climbing Leipzig"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Kosmos Kletterzentrum, 2 km"},
        {
            "role": "assistant",
            "content": "Kosmos is 2 km away.\n\n[Current Agent State]\nsecret state",
        },
    ],
}

FACTS = {
    "facts": [
        {"text": "The user lives in Leipzig.", "salience": 7, "tags": ["location"]},
        {"text": "the user lives in leipzig. ", "salience": 6, "tags": []},
        {"text": "The user goes climbing.", "salience": 5, "tags": ["hobby", "sport"]},
        # Below 5: not notable, dropped (Go's rule), not raised to 5.
        {"text": "The user might take a walk later.", "salience": 4, "tags": []},
    ]
}


def distill_handler(
    database: Database, chat: FakeChat, embedder: FakeEmbedder | None
) -> DistillationHandler:
    reader = MemoryReader(database, embedding_model=embedder.model if embedder else None)
    return DistillationHandler(MemoryWriter(reader, chat, embedder), chat, embedder)


def distill_item(payload: dict[str, Any], item_id: int = 3) -> Item:
    return make_item(payload, queue=Queue.DISTILLATION, item_id=item_id)


def test_facts_are_saved_with_tool_calls_in_the_input(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    chat.script("distillation", FACTS)
    # The climbing fact lies within 0.4 of the Leipzig one (hashed vectors): it is checked.
    chat.script("contradiction", {"verdicts": []})
    item = make_item(MESSAGES, queue=Queue.DISTILLATION, item_id=3)
    effects = distill_handler(database, chat, embedder).handle(item)
    assert chat.calls[0].user == (
        "[Conversation archived 2026-03-14 09:30]\n"
        "[2026-03-14 09:00] user: Find me a climbing gym near my new flat in Leipzig\n"
        'assistant called web_search({"q": "climbing Leipzig"})\n'
        "[web_search result] Kosmos Kletterzentrum, 2 km\n"
        "assistant: Kosmos is 2 km away."
    )
    assert effects.outcome is Outcome.SAVED
    assert effects.backend == "fake"
    apply(db, effects)
    rows = memory_rows(db)
    assert [(r["summary"], r["salience"], r["tags"], r["origin"]) for r in rows] == [
        ("The user lives in Leipzig.", 7.0, ["location"], "pending_distillation:3:0"),
        ("The user goes climbing.", 5.0, ["hobby", "sport"], "pending_distillation:3:1"),
    ]
    assert {(r["source"], r["memory_type"], r["embedding_model"]) for r in rows} == {
        ("conversation", "general", "fake-embed")
    }
    assert effects.detail == "2 new facts of 4, 1 below salience 5"
    assert apply(db, effects) == tuple(r["id"] for r in rows)  # replay: nothing new
    assert len(memory_rows(db)) == 2


def test_known_facts_are_skipped_and_no_new_fact_means_skipped(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    # Superseded and old memories count too for the 0.15 fact dedupe.
    lives = insert_memory(
        db,
        "Lives in Leipzig",
        near(embedder.vector("The user lives in Leipzig."), 0.1),
        age="30 days",
    )
    climbs = insert_memory(
        db, "Climbs", near(embedder.vector("The user goes climbing."), 0.12), memory_type="identity"
    )
    chat.script("distillation", FACTS)
    effects = distill_handler(database, chat, embedder).handle(distill_item(MESSAGES))
    assert effects.outcome is Outcome.SKIPPED
    assert effects.detail == "no new fact (4 extracted, 2 known, 1 below salience 5)"
    assert effects.memories == ()
    # The outcome names the memories that hold the facts (contract: a skipped duplicate's ids).
    assert sorted(effects.existing_memory_ids) == sorted((lives, climbs))


def test_no_facts_is_skipped(database: Database, chat: FakeChat, embedder: FakeEmbedder) -> None:
    chat.script("distillation", {"facts": []})
    effects = distill_handler(database, chat, embedder).handle(distill_item(MESSAGES))
    assert effects.outcome is Outcome.SKIPPED
    assert effects.detail == "no new fact (0 extracted, 0 known)"


def test_distilled_fact_can_supersede(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    fact = "The user lives in Leipzig."
    old = insert_memory(db, "The user lives in Berlin.", near(embedder.vector(fact), 0.3))
    chat.script("distillation", {"facts": [{"text": fact, "salience": 8, "tags": []}]})
    chat.script("contradiction", {"verdicts": [{"existing": 1, "contradicts": True}]})
    effects = distill_handler(database, chat, embedder).handle(distill_item(MESSAGES))
    [new_id] = apply(db, effects)
    assert {r["id"]: r["superseded_by"] for r in memory_rows(db)} == {old: new_id, new_id: None}


@pytest.mark.parametrize(
    "payload",
    [
        {"archive_text": "[Conversation archived 2026-03-14 09:30]\n\n"},
        {"archive_text": "   "},
        {"messages": []},
        {"messages": [{"role": "system", "content": "prompt"}, {"role": "user", "content": " "}]},
    ],
)
def test_empty_archive_is_skipped_without_an_llm_call(
    database: Database, chat: FakeChat, embedder: FakeEmbedder, payload: dict[str, Any]
) -> None:
    handler = distill_handler(database, chat, embedder)
    effects = handler.handle(distill_item(payload))
    assert effects.outcome is Outcome.SKIPPED
    assert effects.detail == "empty archive"
    assert chat.calls == []
    assert handler.final_failure_memories(distill_item(payload)) == ()


def test_archive_text_is_sent_as_is(
    database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    text = "[Conversation archived 2026-03-14 09:30]\n[2026-03-14 09:00] user: I got married!"
    chat.script("distillation", {"facts": []})
    distill_handler(database, chat, embedder).handle(distill_item({"archive_text": text}))
    assert chat.calls[0].user == text


def test_tool_output_and_the_whole_input_are_bounded(
    database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    messages = [
        {"role": "user", "content": "u" * 100},
        {"role": "assistant", "tool_calls": [{"name": "fetch", "arguments": {"x": "a" * 900}}]},
        {"role": "tool", "name": "fetch", "content": "r" * 5000},
    ] * 20
    chat.script("distillation", ContextTooLong("too long"), *[{"facts": []}] * 12)
    distill_handler(database, chat, embedder).handle(distill_item({"messages": messages}))
    first, second, *rest = (c.user for c in chat.calls)
    assert len(first.encode()) <= 16000
    # Too long for the model: that window is read in two halves, the rest in windows as before.
    assert len(second.encode()) <= 8000 and rest and all(len(t.encode()) <= 16000 for t in rest)
    assert "[fetch result] " + "r" * 1000 + "...\n" in first
    assert "assistant called fetch(" in first
    assert "r" * 1001 not in first


def test_a_long_archive_is_read_in_windows_and_nothing_is_left_out(
    database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    lines = [f"[2026-03-14 09:{i % 60:02d}] user: small talk number {i}" for i in range(800)]
    lines.append("[2026-03-14 10:00] user: I moved to Oslo last week")
    text = "[Conversation archived 2026-03-14 10:05]\n" + "\n".join(lines)
    assert len(text.encode()) > 2 * 16000
    windows = len(chunk_text(text, 16000, min_bytes=1))
    oslo = {"facts": [{"text": "The user lives in Oslo.", "salience": 7}]}
    chat.script("distillation", *[{"facts": []}] * (windows - 1), oslo)
    effects = distill_handler(database, chat, embedder).handle(distill_item({"archive_text": text}))
    sent = [c.user for c in chat.calls]
    assert len(sent) >= 3 and all(len(t.encode()) <= 16000 for t in sent)
    assert "I moved to Oslo last week" in sent[-1]
    assert "\n".join(sent).count("user: ") == len(lines)  # every line went to the model once
    assert effects.outcome is Outcome.SAVED
    assert [m.summary for m in effects.memories] == ["The user lives in Oslo."]


def test_two_wordings_of_one_fact_in_one_archive_are_saved_once(
    database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    first = "The user lives in Leipzig."
    embedder.vectors["The user's home is Leipzig."] = near(embedder.vector(first), 0.05)
    chat.script(
        "distillation",
        {
            "facts": [
                {"text": first, "salience": 7},
                {"text": "The user's home is Leipzig.", "salience": 7},
                {"text": "The user goes climbing.", "salience": 6},
            ]
        },
    )
    chat.script("contradiction", {"verdicts": []})  # climbing, checked against Leipzig
    effects = distill_handler(database, chat, embedder).handle(distill_item(MESSAGES))
    assert [m.summary for m in effects.memories] == [first, "The user goes climbing."]


def test_final_failure_archives_the_raw_text(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    long_messages = [
        {"role": "user", "content": f"line {i}: " + "I really like sailing. " * 5}
        for i in range(30)
    ]
    handler = distill_handler(database, chat, embedder)
    item = distill_item({"messages": long_messages}, item_id=11)
    memories = handler.final_failure_memories(item)
    assert len(memories) > 1
    assert memories[0].summary.startswith("[Conversation archived 2026-03-14 09:30]\nuser: line 0")
    ids = apply(db, _archived(memories))
    rows = memory_rows(db)
    assert [r["origin"] for r in rows] == [f"pending_distillation:11:{i}" for i in range(len(ids))]
    assert {
        (r["salience"], tuple(r["tags"]), r["source"], r["memory_type"], r["dims"]) for r in rows
    } == {(3.0, ("conversation_archive",), "conversation_archive", "general", 8)}
    assert all(len(r["summary"].encode()) <= 1200 for r in rows)
    assert chat.calls == []  # no distillation, no contradiction check


def test_final_failure_archive_keeps_every_message(
    database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    """No 50-byte scrap rule for the raw archive: a short message between two long ones (a
    piece under 50 bytes after the hard cut) is kept too."""
    messages = [
        {"role": "user", "content": "A" * 1190},
        {"role": "user", "content": "ok Oslo"},
        {"role": "assistant", "content": "B" * 1300},
    ]
    handler = distill_handler(database, chat, embedder)
    memories = handler.final_failure_memories(distill_item({"messages": messages}))
    joined = "\n".join(m.summary for m in memories)
    assert "user: ok Oslo" in joined
    assert joined.count("A") == 1190 and joined.count("B") == 1300


_TINY_WINDOW_CHILD = """
from datetime import UTC, datetime
from sokratos_worker.config import BackendConfig
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.model import Item, Queue
from sokratos_worker.pipelines.distill import DistillationHandler
from sokratos_worker.testing.scripted_llm import Reply, ScriptedLLM

ctx = Reply.error(400, "the request exceeds the available context size",
                  type="exceed_context_size_error")
with ScriptedLLM(chat=lambda r: ctx) as srv:
    chat = FallbackChatClient([BackendConfig(name="s", url=srv.url, model="m", timeout=5)])
    item = Item(queue=Queue.DISTILLATION, id=1, payload={"archive_text": "a\\U0001F600"},
                attempt=1, source="distillation", idempotency_key=None,
                created_at=datetime(2026, 3, 14, tzinfo=UTC))
    try:
        DistillationHandler(None, chat, None).handle(item)
    except Exception as exc:
        print("raised", type(exc).__name__, srv.count())
"""


def test_context_too_long_for_a_tiny_window_ending_in_a_wide_character_fails_not_hangs() -> None:
    """Halving a 5-byte window whose last character is 4 bytes wide once looped for ever in
    chunk_text (CPU-bound, its lease renewed). A window of SHORTEST_HALVED_BYTES or less is
    not halved at all now: ContextTooLong after its one request."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _TINY_WINDOW_CHILD],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("DistillationHandler.handle hung halving the window (killed after 30 s)")
    assert "raised ContextTooLong 1" in done.stdout, done.stderr


def test_final_failure_archive_survives_an_embedding_outage(
    database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    embedder.error = EmbeddingsUnavailable("down")
    handler = distill_handler(database, chat, embedder)
    [memory] = handler.final_failure_memories(distill_item({"archive_text": "[x] user: I am 40"}))
    assert memory.embedding is None
    assert memory.embedding_model is None
    assert memory.summary == "[x] user: I am 40"


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({}, "messages"),
        ({"messages": [], "archive_text": "x"}, "messages"),
        ({"archive_text": 5}, "archive_text"),
        ({"messages": "hi"}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": "x", "timestamp": "noon"}]},
            "messages[0].timestamp",
        ),
        ({"messages": [{"role": "assistant", "tool_calls": {}}]}, "messages[0].tool_calls"),
        ({"archive_text": "x", "pipeline_id": "7"}, "pipeline_id"),
        ({"archive_text": "user: word\n" * 60_000}, "archive_text"),  # 660 kB: 41 windows
        ({"messages": [{"role": "user", "content": "word " * 1_000}] * 200}, "messages"),
    ],
)
def test_invalid_payload_names_the_field(
    database: Database,
    chat: FakeChat,
    embedder: FakeEmbedder,
    *,
    payload: dict[str, object],
    field: str,
) -> None:
    handler = distill_handler(database, chat, embedder)
    with pytest.raises(InvalidPayload) as raised:
        handler.handle(distill_item(payload))
    assert raised.value.field == field
    assert chat.calls == []


def test_a_failed_llm_call_propagates(
    database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    chat.script("distillation", ChatFailed("invalid replies everywhere"))
    with pytest.raises(ChatFailed):
        distill_handler(database, chat, embedder).handle(distill_item(MESSAGES))


def test_without_an_embedder_facts_are_saved_bare(
    db: psycopg.Connection, database: Database, chat: FakeChat
) -> None:
    chat.script("distillation", FACTS)
    effects = distill_handler(database, chat, None).handle(distill_item(MESSAGES))
    apply(db, effects)
    assert [(r["dims"], r["embedding_model"]) for r in memory_rows(db)] == [(None, None)] * 2


def _archived(memories: tuple[NewMemory, ...]) -> Effects:
    """The effects the runner commits with a failed_operations row."""
    return Effects(Outcome.ARCHIVED, memories=memories)


def test_an_archive_too_long_to_distil_is_refused_whole_without_archive_memories(
    database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    handler = distill_handler(database, chat, embedder)
    item = distill_item({"archive_text": "user: I like tea and biscuits\n" * 30_000})
    with pytest.raises(InvalidPayload, match=r"at most 512,000 are distilled"):
        handler.handle(item)
    assert handler.final_failure_memories(item) == ()  # the payload is kept in the dead letter
    assert chat.calls == []
    # Just below the bound it is read, window by window.
    chat.script("distillation", *[{"facts": []}] * 40)
    fits = distill_item({"archive_text": "user: I like tea and biscuits\n" * 16_000})
    assert handler.handle(fits).outcome is Outcome.SKIPPED
    assert 30 <= len(chat.calls) <= 32


def _too_large_over(limit: int) -> Callable[[Request], Reply]:
    """An embeddings server (llama.cpp) that refuses any input over ``limit`` bytes."""

    def respond(request: Request) -> Reply:
        texts = request.body.get("input", []) if isinstance(request.body, dict) else []
        texts = [texts] if isinstance(texts, str) else texts
        if any(len(str(t).encode()) > limit for t in texts):
            return Reply.error(500, "input is too large to process. increase the physical batch size")
        return Reply.embeddings([hash_embedding(str(t), 8) for t in texts])

    return respond


def test_final_failure_archive_is_embedded_when_a_chunk_is_too_large_for_the_server(
    db: psycopg.Connection, database: Database, chat: FakeChat
) -> None:
    """A chunk the embedding server calls too large (dense tool output: more tokens than its
    batch) is split and embedded in parts, as every other write (and Sokratos's raw-archive
    save, behaviour §3.3/§3.7) does. It used to fail the whole batch, so the archive was kept
    without any vector: refused by Sokratos's NOT NULL column (the dead letter then keeps no
    archive memory), and never found by a vector search elsewhere."""
    messages = [
        {"role": "user", "content": "Remember that I sail on the Alster every Sunday."},
        {"role": "tool", "name": "fetch", "content": '{"k": "v"} ' * 90},  # 990 bytes
    ]
    with ScriptedLLM() as server:
        server.on(EMBEDDINGS, _too_large_over(600))
        embedder = HttpEmbedder(server.url, "scripted", 8)
        try:
            reader = MemoryReader(database, embedding_model="scripted")
            handler = DistillationHandler(MemoryWriter(reader, chat, embedder), chat, embedder)
            memories = handler.final_failure_memories(distill_item({"messages": messages}))
        finally:
            embedder.close()
    assert len(memories) > 1  # the one chunk of the archive, embedded in parts
    assert all(m.embedding is not None and m.embedding_model == "scripted" for m in memories)
    joined = "".join("".join(m.summary.split()) for m in memories)  # (a split trims halves)
    assert "sailontheAlstereverySunday." in joined
    assert joined.count('{"k":"v"}') == 90
    apply(db, _archived(memories))
    rows = memory_rows(db)
    assert [r["origin"] for r in rows] == [f"pending_distillation:3:{i}" for i in range(len(rows))]
    assert {(r["dims"], r["source"]) for r in rows} == {(8, "conversation_archive")}


def test_archive_times_are_in_the_hosts_local_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sokratos writes the header and each message's time in local time (timefmt.DateTime);
    the item's created_at comes in the database session's zone, often UTC."""
    import time
    from datetime import datetime, timedelta, timezone

    from sokratos_worker.pipelines.archive import archive_from_payload

    monkeypatch.setenv("TZ", "Asia/Kolkata")
    time.tzset()
    try:
        archive = archive_from_payload(
            {
                "messages": [
                    {"role": "user", "content": "I moved", "timestamp": "2026-03-14T08:00:00Z"},
                    {"role": "user", "content": "to Pune", "timestamp": "2026-03-14T08:05:00"},
                ]
            },
            datetime(2026, 3, 14, 3, 30, tzinfo=timezone(timedelta(hours=-5))),
        )
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    assert archive.text == (
        "[Conversation archived 2026-03-14 14:00]\n"
        "[2026-03-14 13:30] user: I moved\n"
        "[2026-03-14 08:05] user: to Pune"  # naive: shown as written
    )


def test_an_archive_of_empty_tool_results_is_empty(
    database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    """Go drops a message whose cleaned content is empty, tool results too: such an archive
    was sent to the model as "[get_time result] " and, failing, saved as an archive memory
    holding nothing (review R1)."""
    item = distill_item(
        {"messages": [{"role": "tool", "name": "get_time", "content": "<think>x</think>  "}]}
    )
    handler = distill_handler(database, chat, embedder)
    assert handler.final_failure_memories(item) == ()
    effects = handler.handle(item)
    assert (effects.outcome, effects.detail) == (Outcome.SKIPPED, "empty archive")
    assert chat.calls == []
