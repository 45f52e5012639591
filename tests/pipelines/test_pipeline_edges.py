"""Behaviour of triage, distillation and the write path that no other test pinned (found by
planting mutants): limits at their exact boundary, candidates, origins, columns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

from sokratos_worker.errors import InvalidPayload
from sokratos_worker.llm.types import ContextTooLong, EmbeddingReplyInvalid
from sokratos_worker.model import Item, Outcome, Queue
from sokratos_worker.pipelines import DistillationHandler, TriageHandler
from sokratos_worker.pipelines import payload as fields
from sokratos_worker.pipelines.archive import format_messages
from sokratos_worker.pipelines.text import bound_triage_input, chunk_text
from sokratos_worker.pipelines.write import MemoryWriter
from sokratos_worker.store.connection import Database
from sokratos_worker.store.memories import MemoryReader

from .conftest import apply, insert_memory, make_item, memory_rows
from .fakes import FakeChat, FakeEmbedder, hashed_vector, near

pytestmark = pytest.mark.postgres

# The limits written out (8,000 from behaviour §1.2; the floor and the archive cap are this
# project's): a test importing the constant would follow a wrong edit of it.
SHORTEST_HALVED_BYTES = 1000
TRIAGE_MAX_BYTES = 8000
MAX_ARCHIVE_BYTES = 32 * 16000

EXCHANGE = "user: my sister Anna just moved to Lisbon for work\nassistant: That's a big move!"
SUMMARY = "The user's sister Anna moved to Lisbon for work."


def verdict(score: float, summary: str = SUMMARY, **extra: object) -> dict[str, object]:
    return {
        "salience_score": score,
        "summary": summary,
        "category": "personal",
        "tags": ["family"],
        "save": True,
        "paradigm_shift": False,
        **extra,
    }


def triage_handler(database: Database, chat: FakeChat, embedder: FakeEmbedder) -> TriageHandler:
    reader = MemoryReader(database, embedding_model=embedder.model)
    return TriageHandler(reader, MemoryWriter(reader, chat, embedder), chat, embedder)


def distill_handler(
    database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> DistillationHandler:
    reader = MemoryReader(database, embedding_model=embedder.model)
    return DistillationHandler(MemoryWriter(reader, chat, embedder), chat, embedder)


def distill_item(payload: dict[str, Any], *, item_id: int = 3, attempt: int = 1) -> Item:
    return make_item(payload, queue=Queue.DISTILLATION, item_id=item_id, attempt=attempt)


def exactly(size: int, head: str = "user: ", tail: str = "\nassistant: ok") -> str:
    """An exchange of exactly ``size`` UTF-8 bytes."""
    return head + "w" * (size - len(head) - len(tail)) + tail


# --- the write path: contradiction candidates, near-duplicates ---------------------------------


def test_a_long_memory_supersedes_the_candidate_the_verdict_names_from_its_first_chunk(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    """At most the three nearest live memories are offered; the one the verdict numbers is
    superseded, by the first chunk of a memory saved in several (behaviour §2 steps 3 and 8)."""
    summary = "\n".join(
        f"Fact {i}: the user now works night shifts at the port." for i in range(60)
    )
    chunks = chunk_text(summary)
    assert len(chunks) >= 2
    base = embedder.vector(chunks[0])
    ids = {d: insert_memory(db, f"candidate at {d}", near(base, d)) for d in (0.1, 0.15, 0.2, 0.3)}
    chat.script("conversation_triage", verdict(7, summary=summary))
    chat.script("contradiction", {"verdicts": [{"existing": 2, "contradicts": True}]})
    effects = triage_handler(database, chat, embedder).handle(make_item({"exchange": EXCHANGE}))
    assert effects.outcome is Outcome.SAVED
    assert [line for line in chat.calls[-1].user.splitlines() if "EXISTING_" in line] == [
        "EXISTING_1: candidate at 0.1",
        "EXISTING_2: candidate at 0.15",
        "EXISTING_3: candidate at 0.2",
    ]
    apply(db, effects)
    rows = memory_rows(db)
    assert len(rows) == len(ids) + len(chunks)
    first_chunk = next(r["id"] for r in rows if r["origin"] == "pending_triage:7:0")
    superseded = {r["id"]: r["superseded_by"] for r in rows}
    assert [superseded[ids[d]] for d in (0.1, 0.15, 0.2, 0.3)] == [None, first_chunk, None, None]


def test_a_recent_memory_at_distance_0_1_is_no_near_duplicate_for_triage(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    """Triage's near-duplicate guard is 0.05 within an hour (0.15 is distillation's): a recent
    memory at 0.1 is a contradiction candidate, and the new memory is saved."""
    close = insert_memory(db, "Anna lives in Lisbon.", near(embedder.vector(SUMMARY), 0.1))
    chat.script("conversation_triage", verdict(6))
    chat.script("contradiction", {"verdicts": [{"existing": 1, "contradicts": False}]})
    effects = triage_handler(database, chat, embedder).handle(make_item({"exchange": EXCHANGE}))
    assert effects.outcome is Outcome.SAVED
    assert effects.existing_memory_ids == ()
    [new_id] = apply(db, effects)
    assert {r["id"]: r["summary"] for r in memory_rows(db)} == {
        close: "Anna lives in Lisbon.",
        new_id: SUMMARY,
    }


# --- triage ------------------------------------------------------------------------------------


def test_the_coverage_note_counts_only_memories_within_0_3_of_the_first_500_bytes(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    """The coverage check embeds the input's first 500 bytes and counts live memories closer
    than 0.3 (behaviour §1.4): three at 0.35 add no note."""
    exchange = "user: " + "my sister Anna moved to Lisbon. " * 40 + "\nassistant: ok"
    snippet_vec = hashed_vector("snippet")
    embedder.vectors[exchange[:500]] = snippet_vec
    for n in range(3):
        insert_memory(db, f"related {n}", near(snippet_vec, 0.35), age="3 hours")
    chat.script("conversation_triage", verdict(1))
    triage_handler(database, chat, embedder).handle(make_item({"exchange": exchange}))
    assert embedder.embedded[0] == exchange[:500]
    assert chat.calls[0].user == exchange


def test_a_long_email_and_its_coverage_note_fit_the_8000_byte_input_together(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    """An email longer than the triage limit is cut to leave room for the coverage note: the
    note is sent whole and the input stays within 8,000 bytes."""
    text = "From: HR\nSubject: Your offer\n\n" + "We are pleased to offer you the role. " * 300
    snippet_vec = hashed_vector("snippet")
    embedder.vectors[text[:500]] = snippet_vec
    for distance in (0.05, 0.1, 0.2):
        insert_memory(db, f"offer {distance}", near(snippet_vec, distance), age="3 hours")
    chat.script("email_triage", verdict(0))
    item = make_item({"text": text}, source="email")
    triage_handler(database, chat, embedder).handle(item)
    sent = chat.calls[0].user
    assert len(sent.encode()) <= TRIAGE_MAX_BYTES
    assert sent.startswith(text[:1000])
    assert sent.endswith(
        "\n[Note: 3 similar memories already exist. Save this only if it is "
        "genuinely new information.]"
    )


@dataclass
class SnippetRefusingEmbedder(FakeEmbedder):
    """Refuses one text as junk for that input only (EmbeddingReplyInvalid), embeds the rest."""

    refused: str = ""

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        if self.refused in texts:
            raise EmbeddingReplyInvalid("junk for this input")
        return super().embed(texts)


def test_a_coverage_snippet_the_embedder_refuses_only_skips_the_note(
    db: psycopg.Connection, database: Database, chat: FakeChat
) -> None:
    """The coverage check is best effort (behaviour §1.4 step 2): its snippet failing to embed
    costs the note, not the triage; the memory is still saved."""
    embedder = SnippetRefusingEmbedder(refused=EXCHANGE)
    chat.script("conversation_triage", verdict(6))
    effects = triage_handler(database, chat, embedder).handle(make_item({"exchange": EXCHANGE}))
    assert chat.calls[0].user == EXCHANGE
    assert effects.outcome is Outcome.SAVED
    apply(db, effects)
    assert [r["summary"] for r in memory_rows(db)] == [SUMMARY]


def test_a_conversation_is_saved_whatever_the_models_save_flag(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    """Conversation triage ignores the model's save flag (behaviour §1.2 step 5); the domain tag
    comes first and a model's own "Conversation" tag does not repeat it."""
    chat.script("conversation_triage", verdict(6, save=False, tags=["Conversation", "family"]))
    effects = triage_handler(database, chat, embedder).handle(make_item({"exchange": EXCHANGE}))
    assert effects.outcome is Outcome.SAVED
    apply(db, effects)
    assert [(r["summary"], r["tags"]) for r in memory_rows(db)] == [
        (SUMMARY, ["conversation", "family"])
    ]


def test_a_refused_input_of_exactly_the_floor_is_not_halved(
    database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    """An input of SHORTEST_HALVED_BYTES (1,000) the context refuses fails the item after one
    request; one byte more is halved and asked again."""
    too_long = ContextTooLong("too long")
    chat.script("conversation_triage", too_long, verdict(0))
    handler = triage_handler(database, chat, embedder)
    with pytest.raises(ContextTooLong):
        handler.handle(make_item({"exchange": exactly(SHORTEST_HALVED_BYTES)}))
    assert [len(c.user.encode()) for c in chat.calls] == [SHORTEST_HALVED_BYTES]
    chat.calls.clear()
    chat.replies.clear()
    chat.script("conversation_triage", too_long, verdict(0))
    handler.handle(make_item({"exchange": exactly(SHORTEST_HALVED_BYTES + 1)}))
    assert [len(c.user.encode()) for c in chat.calls] == [SHORTEST_HALVED_BYTES + 1, 500]


def test_max_tokens_of_each_request(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    """max_tokens as Sokratos's tokens.go: triage 2048, distillation 2048, contradiction 1024."""
    insert_memory(db, "Anna lives in Porto.", near(embedder.vector(SUMMARY), 0.2))
    chat.script("conversation_triage", verdict(6))
    chat.script("contradiction", {"verdicts": []})
    triage_handler(database, chat, embedder).handle(make_item({"exchange": EXCHANGE}))
    chat.script("distillation", {"facts": []})
    distill_handler(database, chat, embedder).handle(distill_item({"archive_text": "[x] user: hi"}))
    assert [(c.purpose, c.max_tokens) for c in chat.calls] == [
        ("conversation_triage", 2048),
        ("contradiction", 1024),
        ("distillation", 2048),
    ]


def test_an_input_of_exactly_8000_bytes_is_sent_whole() -> None:
    """An input that fits the 8,000-byte triage limit exactly keeps its tool context whole
    (only a longer one has its tools cut to 3,000 bytes)."""
    conversation = "user: what did the search say?\nassistant: see above"
    tools = "[search result] " + "t" * 100
    tools += "u" * (TRIAGE_MAX_BYTES - len(tools) - len(conversation) - 1) + "\n"
    exchange = tools + conversation
    assert len(exchange.encode()) == TRIAGE_MAX_BYTES
    assert bound_triage_input(exchange) == exchange
    longer = tools[:-1] + "v\n" + conversation
    assert len(bound_triage_input(longer).encode()) < TRIAGE_MAX_BYTES


def test_a_chunk_tail_of_50_bytes_is_kept_and_one_of_49_dropped() -> None:
    """Memories are cut at 1,200 bytes and a tail under 50 bytes is a scrap (behaviour §3.2)."""
    head = "a" * 1199 + "\n"
    assert chunk_text(head + "b" * 50) == ["a" * 1199, "b" * 50]
    assert chunk_text(head + "b" * 49) == ["a" * 1199]
    # A text of 1,200 bytes or less is one chunk, unchanged (not trimmed) as Go keeps it.
    assert chunk_text(head) == [head]


# --- distillation ------------------------------------------------------------------------------


def test_distilled_facts_carry_the_pipeline_id(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    """Each fact row keeps the pipeline_id of the conversation it came from (behaviour §5.4)."""
    chat.script(
        "distillation",
        {
            "facts": [
                {"text": "The user lives in Leipzig.", "salience": 7},
                {"text": "The user goes climbing.", "salience": 6},
            ]
        },
    )
    chat.script("contradiction", {"verdicts": []})  # climbing, checked against Leipzig
    payload = {"archive_text": "[x] user: I live in Leipzig and climb", "pipeline_id": 42}
    apply(db, distill_handler(database, chat, embedder).handle(distill_item(payload)))
    assert [r["pipeline_id"] for r in memory_rows(db)] == [42, 42]


def test_an_archive_of_exactly_the_maximum_is_distilled_and_one_byte_more_refused(
    database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    """32 windows of 16,000 bytes are distilled; a longer archive is refused whole."""
    text = ("x" * 99 + "\n") * (MAX_ARCHIVE_BYTES // 100)
    assert len(text.encode()) == MAX_ARCHIVE_BYTES
    chat.script("distillation", *[{"facts": []}] * 40)
    handler = distill_handler(database, chat, embedder)
    effects = handler.handle(distill_item({"archive_text": text}))
    assert effects.outcome is Outcome.SKIPPED
    assert len(chat.calls) == MAX_ARCHIVE_BYTES // 16000
    with pytest.raises(InvalidPayload, match="archive_text"):
        handler.handle(distill_item({"archive_text": text + "y"}))


def test_a_refused_distillation_window_of_exactly_the_floor_is_not_halved(
    database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    """A window of SHORTEST_HALVED_BYTES the context refuses fails after one request."""
    text = "[x] user: " + "w" * (SHORTEST_HALVED_BYTES - 10)
    assert len(text.encode()) == SHORTEST_HALVED_BYTES
    chat.script("distillation", ContextTooLong("too long"), {"facts": []}, {"facts": []})
    with pytest.raises(ContextTooLong):
        distill_handler(database, chat, embedder).handle(distill_item({"archive_text": text}))
    assert len(chat.calls) == 1


def test_the_archive_fallback_is_kept_on_a_later_final_attempt(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    """The raw archive is kept whichever attempt is the last (the third by default)."""
    item = distill_item({"archive_text": "[x] user: I am 40 and live in Oslo"}, attempt=3)
    memories = distill_handler(database, chat, embedder).final_failure_memories(item)
    assert [(m.origin, m.summary, m.tags) for m in memories] == [
        (
            "pending_distillation:3:0",
            "[x] user: I am 40 and live in Oslo",
            ("conversation_archive",),
        )
    ]


def test_tool_call_arguments_are_cut_at_500_bytes() -> None:
    """A tool call's arguments are kept up to 500 bytes, then cut with "..."."""

    def call(arguments: str) -> list[str]:
        message = {"role": "assistant", "tool_calls": [{"name": "f", "arguments": arguments}]}
        return format_messages([message])

    assert call("a" * 500) == ["assistant called f(" + "a" * 500 + ")"]
    assert call("a" * 501) == ["assistant called f(" + "a" * 500 + "...)"]


def test_a_message_that_is_only_agent_state_is_left_out_of_the_archive() -> None:
    """Everything from "\\n\\n[Current Agent State]" on is cut, also at the very start of a
    message: the agent's state is no fact about the user (behaviour §5.2)."""
    messages = [
        {"role": "assistant", "content": "\n\n[Current Agent State]\nmode: planning"},
        {"role": "user", "content": "I moved to Oslo"},
    ]
    assert format_messages(messages) == ["user: I moved to Oslo"]


def test_a_pipeline_id_must_be_an_integer_that_fits_a_bigint() -> None:
    """pipeline_id is refused as the item's fault from 2**63 on (before the settle's bigint
    column would refuse it) and as a boolean (JSON true is no id); a bigint's extremes pass."""
    for fits in (2**63 - 1, -(2**63)):
        assert fields.optional_int({"pipeline_id": fits}, "pipeline_id") == fits
    for beyond in (2**63, -(2**63) - 1):
        with pytest.raises(InvalidPayload, match="64-bit"):
            fields.optional_int({"pipeline_id": beyond}, "pipeline_id")
    with pytest.raises(InvalidPayload, match="not bool"):
        fields.optional_int({"pipeline_id": True}, "pipeline_id")


def test_tools_used_must_be_a_boolean_not_a_number() -> None:
    """tools_used picks the threshold (3 or 5): a 1 or 0 is refused, not taken as a flag."""
    assert fields.optional_bool({"tools_used": True}, "tools_used") is True
    for number in (1, 0):
        with pytest.raises(InvalidPayload, match="must be a boolean, not int"):
            fields.optional_bool({"tools_used": number}, "tools_used")


def test_gos_zero_time_on_a_message_is_no_time_in_the_archive() -> None:
    """A message stamped with Go's zero time (an unset time.Time) is written without a time,
    as Sokratos writes it, not as "[0001-01-01 00:00]"."""
    message = {"role": "user", "content": "I moved to Oslo", "timestamp": "0001-01-01T00:00:00Z"}
    assert format_messages([message]) == ["user: I moved to Oslo"]
