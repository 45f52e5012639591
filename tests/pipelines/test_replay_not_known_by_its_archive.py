"""A replayed distillation whose raw archive was saved (its last attempt failed) saves the
facts it now extracts: the known-fact check (any memory within 0.15) took the item's own
raw archive chunk for the fact and skipped it, so the replay saved nothing (found by a
distillation hunt). A raw archive holds the words, not the fact."""

from __future__ import annotations

import psycopg
import pytest

from sokratos_worker.model import Effects, Outcome, Queue
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


def test_a_replay_saves_the_fact_its_own_raw_archive_holds(
    db: psycopg.Connection, database: Database
) -> None:
    embedder = FakeEmbedder()
    base = embedder.vector("x")
    embedder.vectors["[Conversation archived*"] = base  # a one-line conversation's chunk ...
    embedder.vectors[FACT] = near(base, 0.10)  # ... is close to the fact it states
    chat = FakeChat()
    handler = distill_handler(database, chat, embedder)
    failed = make_item(PAYLOAD, queue=Queue.DISTILLATION, item_id=1)
    apply(db, Effects(Outcome.ARCHIVED, memories=handler.final_failure_memories(failed)))
    chat.script("distillation", {"facts": [{"text": FACT, "salience": 8, "tags": ["birth"]}]})
    chat.script("contradiction", {"verdicts": [{"existing": 1, "contradicts": False}]})
    replay = make_item(PAYLOAD, queue=Queue.DISTILLATION, item_id=2)  # `failed retry`
    effects = handler.handle(replay)
    assert effects.outcome is Outcome.SAVED, effects.detail
    apply(db, effects)
    facts = [r for r in memory_rows(db) if r["source"] != "conversation_archive"]
    assert [r["summary"] for r in facts] == [FACT]
