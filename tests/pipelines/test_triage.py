"""Triage against real PostgreSQL: every decision path and the rows its Effects leave."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import psycopg
import pytest

from sokratos_worker.config import BackendConfig, load_settings
from sokratos_worker.errors import InvalidPayload, ItemError
from sokratos_worker.handlers import HandlerContext
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.llm.types import (
    ChatFailed,
    ContextTooLong,
    EmbeddingsUnavailable,
    NoBackendReachable,
)
from sokratos_worker.model import Outcome, Queue
from sokratos_worker.pipelines import DistillationHandler, TriageHandler, build_handlers
from sokratos_worker.pipelines.text import SHORTEST_HALVED_BYTES
from sokratos_worker.pipelines.write import MemoryWriter
from sokratos_worker.store.connection import Database
from sokratos_worker.store.memories import MemoryReader
from sokratos_worker.testing.scripted_llm import Reply, ScriptedLLM

from .conftest import apply, insert_memory, make_item, memory_rows
from .fakes import FakeChat, FakeEmbedder, hashed_vector, near

pytestmark = pytest.mark.postgres

EXCHANGE = "user: my sister Anna just moved to Lisbon for work\nassistant: That's a big move!"
SUMMARY = "The user's sister Anna moved to Lisbon for work."


def verdict(score: float, summary: str = SUMMARY, **extra: object) -> dict[str, object]:
    return {
        "salience_score": score,
        "summary": summary,
        "category": "personal",
        "tags": ["family", "relocation"],
        "save": True,
        "paradigm_shift": False,
        **extra,
    }


def triage_handler(
    database: Database, chat: FakeChat, embedder: FakeEmbedder | None
) -> TriageHandler:
    reader = MemoryReader(database, embedding_model=embedder.model if embedder else None)
    return TriageHandler(reader, MemoryWriter(reader, chat, embedder), chat, embedder)


def test_trivial_exchange_is_skipped_without_an_llm_call(
    database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    effects = triage_handler(database, chat, embedder).handle(make_item({"exchange": " hi\n "}))
    assert effects.outcome is Outcome.SKIPPED
    assert effects.detail == "trivial exchange"
    assert chat.calls == []


@pytest.mark.parametrize(
    ("tools_used", "score", "expected"),
    [
        (False, 4.9, Outcome.SKIPPED),  # parametric: threshold 5
        (False, 5.0, Outcome.SAVED),
        (True, 2.9, Outcome.SKIPPED),  # tool-grounded: threshold 3
        (True, 3.0, Outcome.SAVED),
    ],
)
def test_default_thresholds(
    database: Database,
    chat: FakeChat,
    embedder: FakeEmbedder,
    *,
    tools_used: bool,
    score: float,
    expected: Outcome,
) -> None:
    chat.script("conversation_triage", verdict(score))
    item = make_item({"exchange": EXCHANGE, "tools_used": tools_used})
    effects = triage_handler(database, chat, embedder).handle(item)
    assert effects.outcome is expected
    assert effects.backend == "fake"
    if expected is Outcome.SKIPPED:
        assert "below triage_conversation" in effects.detail
        assert effects.memories == ()


def test_adaptive_threshold_is_read_from_the_table(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    db.execute(
        "INSERT INTO adaptive_params (key, value, source) VALUES "
        "('triage_conversation_unverified_threshold', 7, 'reflection')"
    )
    chat.script("conversation_triage", verdict(6.5))
    effects = triage_handler(database, chat, embedder).handle(make_item({"exchange": EXCHANGE}))
    assert effects.outcome is Outcome.SKIPPED
    assert effects.detail == "salience 6.5 below triage_conversation_unverified_threshold 7"


def test_a_score_just_below_the_threshold_is_shown_as_it_is(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    """Six significant digits showed 6.9999999 as 7: "salience 7 below ... 7" reads as a bug."""
    db.execute(
        "INSERT INTO adaptive_params (key, value, source) VALUES "
        "('triage_conversation_unverified_threshold', 7, 'reflection')"
    )
    chat.script("conversation_triage", verdict(6.9999999))
    effects = triage_handler(database, chat, embedder).handle(make_item({"exchange": EXCHANGE}))
    assert effects.outcome is Outcome.SKIPPED
    assert effects.detail == "salience 6.9999999 below triage_conversation_unverified_threshold 7"


def test_a_score_just_above_a_fine_threshold_is_shown_as_it_is(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    db.execute(
        "INSERT INTO adaptive_params (key, value, source) VALUES "
        "('triage_conversation_unverified_threshold', 6.6666666, 'reflection')"
    )
    chat.script("conversation_triage", verdict(6.6666667))
    effects = triage_handler(database, chat, embedder).handle(make_item({"exchange": EXCHANGE}))
    assert effects.outcome is Outcome.SAVED
    assert effects.detail.startswith("salience 6.6666667 (threshold 6.6666666)")


@pytest.mark.parametrize("value", ["NaN", "-Infinity"])
def test_a_non_finite_adaptive_threshold_falls_back_to_the_default(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder, value: str
) -> None:
    """A float column holds NaN and infinities. "salience < NaN" is false, so a NaN threshold
    saved every exchange, "No new information." at salience 0 included (Sokratos's
    "salience >= NaN" saves none); the default (behaviour §1.6, fail-open) is used instead."""
    db.execute(
        "INSERT INTO adaptive_params (key, value, source) VALUES "
        "('triage_conversation_unverified_threshold', %s::float8, 'manual')",
        (value,),
    )
    chat.script("conversation_triage", verdict(0, summary="No new information."))
    effects = triage_handler(database, chat, embedder).handle(make_item({"exchange": EXCHANGE}))
    assert effects.outcome is Outcome.SKIPPED
    assert effects.detail == "salience 0 below triage_conversation_unverified_threshold 5"


def test_saved_memory_has_every_column(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    chat.script("conversation_triage", verdict(12, tags=["Family", "conversation"]))
    payload = {
        "exchange": EXCHANGE,
        "tools_used": False,
        "pipeline_id": 4242,
        "occurred_at": "2026-03-14T08:00:00Z",
    }
    effects = triage_handler(database, chat, embedder).handle(make_item(payload, item_id=42))
    assert effects.outcome is Outcome.SAVED
    ids = apply(db, effects)
    [row] = memory_rows(db)
    assert ids == (row["id"],)
    assert row["summary"] == SUMMARY
    assert row["salience"] == 10.0  # clamped from 12
    assert row["tags"] == ["conversation", "Family"]
    assert row["memory_type"] == "general"
    assert row["source"] == "conversation"
    assert row["source_date"] == datetime(2026, 3, 14, 8, 0, tzinfo=UTC)
    assert row["pipeline_id"] == 4242
    assert row["origin"] == "pending_triage:42:0"
    assert row["embedding_model"] == "fake-embed"
    assert row["dims"] == 8
    assert row["superseded_by"] is None


@pytest.mark.parametrize(
    ("source", "payload"),
    [
        ("conversation", {"exchange": EXCHANGE, "pipeline_id": 0,
                          "occurred_at": "0001-01-01T00:00:00Z"}),
        ("email", {"text": "From: a@example.org\n\nMy new address is Rua 1, Porto",
                   "date": "0001-01-01T00:00:00Z"}),
        # The zero time shown in a zone west of UTC falls in year 0, which Python cannot hold.
        ("conversation", {"exchange": EXCHANGE, "occurred_at": "0000-12-31T19:00:00-05:00"}),
        ("email", {"text": "From: a@example.org\n\nMy new address is Rua 1, Porto",
                   "date": "0000-12-31T16:00:00-08:00"}),
        ("conversation", {"exchange": EXCHANGE, "occurred_at": "0001-01-01T05:30:00+05:30"}),
    ],
    ids=["conversation", "email", "conversation-west", "email-west", "conversation-east"],
)
def test_gos_zero_values_are_stored_as_no_date_and_no_pipeline(
    *,
    db: psycopg.Connection,
    database: Database,
    chat: FakeChat,
    embedder: FakeEmbedder,
    source: str,
    payload: dict[str, object],
) -> None:
    # An unset Go time.Time marshals as 0001-01-01T00:00:00Z: it was saved as that date.
    chat.script(f"{source}_triage", verdict(9))
    item = dataclasses.replace(make_item(payload, item_id=43), source=source)
    effects = triage_handler(database, chat, embedder).handle(item)
    assert effects.outcome is Outcome.SAVED, effects.detail
    apply(db, effects)
    [row] = memory_rows(db)
    assert (row["source_date"], row["pipeline_id"]) == (None, None)


def test_replaying_an_item_writes_nothing_twice(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    chat.script("conversation_triage", verdict(6), verdict(6))
    handler = triage_handler(database, chat, embedder)
    item = make_item({"exchange": EXCHANGE}, item_id=9)
    first = handler.handle(item)
    # A crash after the LLM answered and before the commit: the replay decides again.
    replay = handler.handle(item)
    assert replay.memories == first.memories
    ids = apply(db, first)
    assert apply(db, replay) == ids
    assert apply(db, first) == ids
    assert len(memory_rows(db)) == 1


def test_near_duplicate_is_skipped_with_the_existing_id(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    existing = insert_memory(db, "Anna moved to Lisbon.", embedder.vector(SUMMARY))
    chat.script("conversation_triage", verdict(7))
    effects = triage_handler(database, chat, embedder).handle(make_item({"exchange": EXCHANGE}))
    assert effects.outcome is Outcome.SKIPPED
    assert effects.existing_memory_ids == (existing,)
    assert apply(db, effects) == (existing,)
    assert len(memory_rows(db)) == 1


def test_an_old_near_duplicate_does_not_block_the_save(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    old = insert_memory(db, "Anna moved to Lisbon.", embedder.vector(SUMMARY), age="2 hours")
    chat.script("conversation_triage", verdict(7))
    chat.script("contradiction", {"verdicts": [{"existing": 1, "contradicts": False}]})
    effects = triage_handler(database, chat, embedder).handle(make_item({"exchange": EXCHANGE}))
    assert effects.outcome is Outcome.SAVED
    assert effects.supersessions == ()
    assert "EXISTING_1: Anna moved to Lisbon." in chat.calls[-1].user
    apply(db, effects)
    assert [r["superseded_by"] for r in memory_rows(db) if r["id"] == old] == [None]


def test_contradiction_supersedes_the_old_memory(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    new_summary = "The user now prefers tea over coffee."
    base = embedder.vector(new_summary)
    old = insert_memory(db, "The user prefers coffee.", near(base, 0.2))
    unrelated = insert_memory(db, "The user likes hiking.", near(base, 0.35))
    far = insert_memory(db, "The user owns a bike.", near(base, 0.6))
    chat.script("conversation_triage", verdict(6, summary=new_summary))
    chat.script(
        "contradiction",
        {
            "verdicts": [
                {"existing": 1, "contradicts": True},
                {"existing": 2, "contradicts": False},
            ]
        },
    )
    exchange = "user: I switched to tea, no more coffee for me\nassistant: Noted."
    effects = triage_handler(database, chat, embedder).handle(make_item({"exchange": exchange}))
    assert effects.outcome is Outcome.SAVED
    prompt = chat.calls[-1].user
    assert prompt.splitlines() == [
        f"NEW: {new_summary}",
        "EXISTING_1: The user prefers coffee.",
        "EXISTING_2: The user likes hiking.",
    ]
    [new_id] = apply(db, effects)
    superseded = {r["id"]: r["superseded_by"] for r in memory_rows(db)}
    assert superseded == {old: new_id, unrelated: None, far: None, new_id: None}


def test_a_failed_verdict_still_saves_without_supersession(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    base = embedder.vector(SUMMARY)
    insert_memory(db, "Anna lives in Porto.", near(base, 0.2))
    chat.script("conversation_triage", verdict(6))
    chat.script("contradiction", ChatFailed("no valid reply"))
    effects = triage_handler(database, chat, embedder).handle(make_item({"exchange": EXCHANGE}))
    assert effects.outcome is Outcome.SAVED
    assert effects.supersessions == ()
    # The outcome row says so: an operator can tell "nothing contradicted" from "not checked".
    assert "contradiction check failed (ChatFailed)" in (effects.detail or "")


def test_superseded_and_identity_memories_are_not_candidates(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    base = embedder.vector(SUMMARY)
    insert_memory(db, "identity", near(base, 0.1), memory_type="identity")
    newer = insert_memory(db, "newer", near(base, 0.5))
    db.execute(
        "INSERT INTO memories (summary, embedding, superseded_by) VALUES ('gone', %s::vector, %s)",
        ("[" + ",".join(map(repr, near(base, 0.1))) + "]", newer),
    )
    # A memory from another embedding model with another dimension must not break the query.
    db.execute("INSERT INTO memories (summary, embedding) VALUES ('other model', '[1,0,0]')")
    chat.script("conversation_triage", verdict(6))
    effects = triage_handler(database, chat, embedder).handle(make_item({"exchange": EXCHANGE}))
    assert effects.outcome is Outcome.SAVED
    assert chat.purposes() == ["conversation_triage"]  # no candidate: no verdict call


def test_coverage_note_when_three_live_memories_are_close(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    snippet_vec = hashed_vector("snippet")
    embedder.vectors["user: my sister*"] = snippet_vec
    for distance in (0.05, 0.1, 0.2):
        insert_memory(db, f"close {distance}", near(snippet_vec, distance), age="3 hours")
    insert_memory(db, "reflection", near(snippet_vec, 0.01), memory_type="reflection")
    chat.script("conversation_triage", verdict(1))
    triage_handler(database, chat, embedder).handle(make_item({"exchange": EXCHANGE}))
    user = chat.calls[0].user
    assert user.startswith(EXCHANGE)
    assert user.endswith(
        "[Note: 3 similar memories already exist. Save this only if it is "
        "genuinely new information.]"
    )


def test_no_coverage_note_below_three(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    snippet_vec = hashed_vector("snippet")
    embedder.vectors["user: my sister*"] = snippet_vec
    for distance in (0.05, 0.4):
        insert_memory(db, f"m {distance}", near(snippet_vec, distance))
    chat.script("conversation_triage", verdict(1))
    triage_handler(database, chat, embedder).handle(make_item({"exchange": EXCHANGE}))
    assert chat.calls[0].user == EXCHANGE


def test_long_reply_and_tool_context_are_bounded(
    database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    exchange = (
        "[fetch result] " + "t" * 30000 + "\nuser: remember my PIN hint\nassistant: " + "r" * 5000
    )
    chat.script("conversation_triage", verdict(0))
    item = make_item({"exchange": exchange, "tools_used": True})
    triage_handler(database, chat, embedder).handle(item)
    sent = chat.calls[0].user
    assert len(sent.encode()) <= 8000
    assert "user: remember my PIN hint\nassistant: " + "r" * 800 + "..." in sent


def test_context_too_long_halves_the_input_until_it_fits_then_fails_at_the_floor(
    database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    """A 2,048-token context (llama.cpp's default) refused 4,000 bytes of Japanese: the item
    failed on every attempt when the input was halved only once (review R2)."""
    exchange = "user: " + "u" * 7000 + "\nassistant: ok"
    too_long = ContextTooLong("too long")
    chat.script("conversation_triage", too_long, too_long, verdict(0))
    effects = triage_handler(database, chat, embedder).handle(make_item({"exchange": exchange}))
    assert effects.outcome is Outcome.SKIPPED
    sizes = [len(c.user.encode()) for c in chat.calls]
    assert len(sizes) == 3 and sizes[0] <= 8000 and sizes[1] <= 4000 and sizes[2] <= 2000
    # Never below SHORTEST_HALVED_BYTES: at 1,000 bytes the refusal is the item's failure.
    chat.calls.clear()
    chat.script("conversation_triage", *[too_long] * 4)
    with pytest.raises(ContextTooLong):
        triage_handler(database, chat, embedder).handle(make_item({"exchange": exchange}))
    sizes = [len(c.user.encode()) for c in chat.calls]
    assert len(sizes) == 4 and 500 < sizes[-1] <= SHORTEST_HALVED_BYTES, sizes
    # A short input is halved from its own length, not from the 8,000-byte limit.
    chat.calls.clear()
    chat.script("conversation_triage", too_long, verdict(0))
    short = "user: " + "s" * 1500 + "\nassistant: ok"
    triage_handler(database, chat, embedder).handle(make_item({"exchange": short}))
    assert [len(c.user.encode()) for c in chat.calls][1] <= 800


def email_payload(**extra: object) -> dict[str, object]:
    return {
        "account": "personal",
        "mailbox": "INBOX",
        "uidvalidity": 1,
        "uid": 17,
        "message_id": "<abc@example.com>",
        "from": "HR <hr@example.com>",
        "to": "me@example.com",
        "cc": "",
        "subject": "Your offer",
        "date": "Fri, 13 Mar 2026 10:15:00 +0100",
        "attachments": [],
        "text": "From: HR\nTo: me\nSubject: Your offer\nDate: 2026-03-13 10:15\n\nWe are pleased.",
        **extra,
    }


def test_an_empty_summary_is_skipped_below_the_threshold_and_retried_above_it(
    database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    chat.script("conversation_triage", verdict(1, summary=""), verdict(8, summary=""))
    handler = triage_handler(database, chat, embedder)
    item = make_item({"exchange": "user: nothing much today\nassistant: ok, enjoy"})
    effects = handler.handle(item)
    assert effects.outcome is Outcome.SKIPPED and "below" in (effects.detail or "")
    with pytest.raises(ItemError, match="no summary"):
        handler.handle(item)


def test_a_paradigm_shift_flag_is_left_in_the_outcome_for_the_main_application(
    database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    chat.script("conversation_triage", verdict(9, paradigm_shift=True))
    effects = triage_handler(database, chat, embedder).handle(make_item({"exchange": EXCHANGE}))
    assert effects.outcome is Outcome.SAVED
    assert (effects.detail or "").endswith("; paradigm shift flagged")


def test_email_save_false_vetoes_a_high_score(
    database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    chat.script("email_triage", verdict(9, save=False))
    item = make_item(email_payload(), source="email")
    effects = triage_handler(database, chat, embedder).handle(item)
    assert effects.outcome is Outcome.SKIPPED
    assert effects.detail == "save=false"


def test_email_saved_with_email_columns(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    chat.script("email_triage", verdict(1, summary="HR sent the user a job offer."))
    item = make_item(email_payload(), source="email", item_id=5)
    effects = triage_handler(database, chat, embedder).handle(item)
    assert effects.outcome is Outcome.SAVED
    apply(db, effects)
    [row] = memory_rows(db)
    assert row["memory_type"] == "email"
    assert row["source"] == "email"
    assert row["tags"] == ["email", "family", "relocation"]
    assert row["source_date"] == datetime(2026, 3, 13, 9, 15, tzinfo=UTC)
    assert row["pipeline_id"] is None
    assert row["origin"] == "pending_triage:5:0"


def test_email_below_threshold_and_unparsable_date(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    chat.script("email_triage", verdict(0.5), verdict(2))
    handler = triage_handler(database, chat, embedder)
    skipped = handler.handle(make_item(email_payload(), source="email"))
    assert skipped.outcome is Outcome.SKIPPED
    assert skipped.detail == "salience 0.5 below triage_email_threshold 1"
    saved = handler.handle(make_item(email_payload(date="not a date"), source="email"))
    assert saved.memories[0].source_date is None


def test_email_prompt_carries_the_preference_traits(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    db.execute(
        """CREATE TABLE personality_traits (id bigserial, category text, trait_key text,
                                            trait_value text, context text)"""
    )
    db.execute(
        """INSERT INTO personality_traits (category, trait_key, trait_value) VALUES
           ('preference', 'newsletters', 'not interested in newsletters'),
           ('style', 'tone', 'terse'),
           ('preference', 'calendar', 'mornings free')"""
    )
    chat.script("email_triage", verdict(0, save=False), verdict(0, save=False))
    handler = triage_handler(database, chat, embedder)
    handler.handle(make_item(email_payload(), source="email"))
    system = chat.calls[0].system
    assert system.endswith(
        "\n- calendar: mornings free\n- newsletters: not interested in newsletters"
    )
    assert "tone" not in system
    db.execute("DROP TABLE personality_traits")
    handler.handle(make_item(email_payload(), source="email"))
    assert "User Preferences" not in chat.calls[1].system


def test_without_an_embedder_memories_are_saved_bare(
    db: psycopg.Connection, database: Database, chat: FakeChat
) -> None:
    insert_memory(db, "Anna moved to Lisbon.", None, model=None)
    chat.script("conversation_triage", verdict(8))
    effects = triage_handler(database, chat, None).handle(make_item({"exchange": EXCHANGE}))
    assert effects.outcome is Outcome.SAVED
    apply(db, effects)
    rows = memory_rows(db)
    assert [(r["dims"], r["embedding_model"]) for r in rows] == [(None, None), (None, None)]
    assert chat.purposes() == ["conversation_triage"]


@pytest.mark.parametrize(
    ("source", "payload", "field"),
    [
        ("conversation", {}, "exchange"),
        ("conversation", {"exchange": 12}, "exchange"),
        ("conversation", {"exchange": EXCHANGE, "tools_used": "yes"}, "tools_used"),
        ("conversation", {"exchange": EXCHANGE, "pipeline_id": "12"}, "pipeline_id"),
        ("conversation", {"exchange": EXCHANGE, "occurred_at": "yesterday"}, "occurred_at"),
        ("email", {"subject": "x"}, "text"),
        ("email", {"text": "body", "subject": 3}, "subject"),
        ("carrier-pigeon", {"exchange": EXCHANGE}, "source"),
    ],
)
def test_invalid_payload_names_the_field(
    database: Database,
    chat: FakeChat,
    embedder: FakeEmbedder,
    *,
    source: str,
    payload: dict[str, object],
    field: str,
) -> None:
    with pytest.raises(InvalidPayload) as raised:
        triage_handler(database, chat, embedder).handle(make_item(payload, source=source))
    assert raised.value.field == field
    assert field in str(raised.value)
    assert chat.calls == []


def test_backend_outages_propagate(
    database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    chat.script("conversation_triage", NoBackendReachable("all circuits open"))
    handler = triage_handler(database, chat, embedder)
    with pytest.raises(NoBackendReachable):
        handler.handle(make_item({"exchange": EXCHANGE}))
    embedder.error = EmbeddingsUnavailable("connection refused")
    with pytest.raises(EmbeddingsUnavailable):
        handler.handle(make_item({"exchange": EXCHANGE}))
    assert not handler.probe()


def test_embedding_outage_after_the_llm_answered_propagates(
    database: Database, chat: FakeChat
) -> None:
    class FlakyEmbedder(FakeEmbedder):
        def embed_splitting(self, text: str) -> list[tuple[str, list[float]]]:
            raise EmbeddingsUnavailable("went away")

    embedder = FlakyEmbedder()
    chat.script("conversation_triage", verdict(8))
    with pytest.raises(EmbeddingsUnavailable):
        triage_handler(database, chat, embedder).handle(make_item({"exchange": EXCHANGE}))


def test_build_handlers(database: Database, chat: FakeChat, embedder: FakeEmbedder) -> None:
    settings = load_settings({})
    assert build_handlers(HandlerContext(settings, database, None, embedder)) == {}
    handlers = build_handlers(HandlerContext(settings, database, chat, embedder))
    assert isinstance(handlers[Queue.TRIAGE], TriageHandler)
    assert isinstance(handlers[Queue.DISTILLATION], DistillationHandler)
    assert handlers[Queue.TRIAGE].final_failure_memories(make_item({"exchange": "x"})) == ()
    assert handlers[Queue.TRIAGE].probe()


def test_a_backend_outage_at_the_contradiction_check_gives_the_attempt_back(
    db: psycopg.Connection, database: Database
) -> None:
    """The chat server goes away after the triage answered and before the contradiction
    check: that is an outage (the attempt is given back and the check runs next time), not a
    verdict that failed. It used to save the memory for good with the contradicted memory
    left live (behaviour §2: Sokratos defers such a check; durability: not the item's fault)."""
    # The answer closes its connection, so the next call has to connect again.
    answer = dataclasses.replace(Reply.chat(verdict(6)), close=True)
    server = ScriptedLLM(chat=lambda request: answer).start()

    class ServerGoesAway(FakeEmbedder):
        def embed_splitting(self, text: str) -> list[tuple[str, list[float]]]:
            server.close()  # between the triage call and the contradiction call
            return super().embed_splitting(text)

    embedder = ServerGoesAway()
    insert_memory(db, "Anna lives in Porto.", near(embedder.vector(SUMMARY), 0.2))
    chat = FallbackChatClient([BackendConfig(name="s", url=server.url, model="m", timeout=5)])
    try:
        with pytest.raises(NoBackendReachable):
            triage_handler(database, chat, embedder).handle(make_item({"exchange": EXCHANGE}))
    finally:
        chat.close()
        server.close()
    assert server.count() == 1  # the triage itself was answered


def test_an_exchange_that_fits_reaches_the_model_whole_even_when_the_reply_quotes_a_dialogue(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    """The exchange was always split into tool context (capped at 3,000 bytes) and
    conversation, at the last "user:" line before the last "assistant:": a reply quoting a
    chat put the user's real words in the tool context, cut away, though all of it fitted
    the 8,000 bytes Go sends whole (review R1)."""
    tools = "[read_chat_log result] " + "yesterday we talked about climbing gyms. " * 115 + "\n"
    user = "user: I am allergic to peanuts, please remember that. What did we discuss?"
    reply = (
        "\nassistant: Noted, no peanuts. Yesterday went like this:\n"
        "user: find me a gym\nassistant: Kosmos is 2 km away."
    )
    chat.script("conversation_triage", verdict(6, "The user is allergic to peanuts."))
    effects = triage_handler(database, chat, embedder).handle(
        make_item({"exchange": tools + user + reply, "tools_used": True})
    )
    assert chat.calls[0].user == tools + user + reply
    apply(db, effects)
    assert [r["summary"] for r in memory_rows(db)] == ["The user is allergic to peanuts."]
