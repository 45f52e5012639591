"""A raw conversation_archive chunk holds words, not facts: a replayed distillation's fact
within 0.05 of the archive its own failure saved (under an hour before) was counted a
near-duplicate, when planning and at the settle, and never saved (found by a review; the
known-fact check already left archives out)."""

from __future__ import annotations

import psycopg
import pytest

from sokratos_worker.model import Effects, NewMemory, Outcome, Queue
from sokratos_worker.store.connection import Database
from tests.pipelines.conftest import apply, make_item, memory_rows
from tests.pipelines.fakes import FakeChat, FakeEmbedder, near
from tests.pipelines.test_distill import distill_handler

pytestmark = pytest.mark.postgres

FACT = "The user was born in Oslo in 1990."
PAYLOAD = {
    "messages": [
        {"role": "user", "content": "I was born in Oslo in 1990."},
        {"role": "assistant", "content": "Noted, thanks."},
    ]
}


def _archive_saved(db: psycopg.Connection, database: Database) -> tuple[FakeEmbedder, FakeChat]:
    """The failed distillation's raw archive, saved now; the fact's vector within 0.03 of it."""
    embedder = FakeEmbedder()
    base = embedder.vector("x")
    embedder.vectors["[Conversation archived*"] = base
    embedder.vectors[FACT] = near(base, 0.03)
    chat = FakeChat()
    failed = make_item(PAYLOAD, queue=Queue.DISTILLATION, item_id=1)
    handler = distill_handler(database, chat, embedder)
    apply(db, Effects(Outcome.ARCHIVED, memories=handler.final_failure_memories(failed)))
    return embedder, chat


def test_a_replayed_fact_near_its_own_archive_is_saved(
    db: psycopg.Connection, database: Database
) -> None:
    embedder, chat = _archive_saved(db, database)
    chat.script("distillation", {"facts": [{"text": FACT, "salience": 8, "tags": ["birth"]}]})
    chat.script("contradiction", {"verdicts": [{"existing": 1, "contradicts": False}]})
    handler = distill_handler(database, chat, embedder)
    effects = handler.handle(make_item(PAYLOAD, queue=Queue.DISTILLATION, item_id=2))
    assert effects.outcome is Outcome.SAVED, effects.detail
    apply(db, effects)
    facts = [r["summary"] for r in memory_rows(db) if r["source"] != "conversation_archive"]
    assert facts == [FACT]


def test_the_settle_does_not_drop_a_fact_for_an_archive_near_it(
    db: psycopg.Connection, database: Database
) -> None:
    embedder, _ = _archive_saved(db, database)
    fact = NewMemory(
        origin="pending_distillation:2:0",
        summary=FACT,
        salience=8,
        embedding=tuple(embedder.vector(FACT)),
        embedding_model=embedder.model,
        duplicate_check=True,
        fact_check=True,
    )
    apply(db, Effects(Outcome.SAVED, memories=(fact,)))
    facts = [r["origin"] for r in memory_rows(db) if r["source"] != "conversation_archive"]
    assert facts == ["pending_distillation:2:0"]


def test_a_replayed_fact_is_not_judged_against_its_own_archive(
    db: psycopg.Connection, database: Database
) -> None:
    """Nor is an archive a contradiction candidate: judged against the archive its failure
    saved (its nearest memory), a replayed fact could supersede it and hide the raw record."""
    embedder, chat = _archive_saved(db, database)
    chat.script("distillation", {"facts": [{"text": FACT, "salience": 8, "tags": ["birth"]}]})
    chat.script("contradiction", {"verdicts": [{"existing": 1, "contradicts": True}]})
    handler = distill_handler(database, chat, embedder)
    effects = handler.handle(make_item(PAYLOAD, queue=Queue.DISTILLATION, item_id=2))
    apply(db, effects)
    assert "contradiction" not in chat.purposes(), chat.purposes()
    archives = [r for r in memory_rows(db) if r["source"] == "conversation_archive"]
    assert archives and all(r["superseded_by"] is None for r in archives), archives
