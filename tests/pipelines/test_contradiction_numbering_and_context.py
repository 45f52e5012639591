"""The contradiction check's verdicts are applied to the memories they judge: a model that
numbers them from 0 has none applied (each would supersede another memory than the one
judged), and candidates too long together for a backend's context are compared one at a time
instead of leaving the contradicted memory live."""

from __future__ import annotations

import psycopg
import pytest

from sokratos_worker.llm.types import ContextTooLong
from sokratos_worker.model import Effects, Outcome
from sokratos_worker.pipelines.write import MemoryDraft, MemoryWriter
from sokratos_worker.store.connection import Database
from sokratos_worker.store.memories import MemoryReader
from tests.pipelines.conftest import apply, insert_memory, make_item, memory_rows
from tests.pipelines.fakes import FakeChat, FakeEmbedder, hashed_vector, near

pytestmark = pytest.mark.postgres

NEW = "User now works at Acme."


def _draft() -> MemoryDraft:
    return MemoryDraft(
        text=NEW, salience=6, memory_type="general", source="conversation", tags=()
    )


def _superseded(
    db: psycopg.Connection, database: Database, chat: FakeChat
) -> tuple[dict[int, bool], str | None]:
    """Plan the new memory's write with ``chat`` and apply it: which memories ended
    superseded, and why no verdict came (if it did not)."""
    embedder = FakeEmbedder(vectors={NEW: hashed_vector(NEW)})
    reader = MemoryReader(database, embedding_model=embedder.model)
    plan = MemoryWriter(reader, chat, embedder).plan(make_item({}), _draft())
    apply(db, Effects(Outcome.SAVED, memories=plan.memories, supersessions=plan.supersessions))
    rows = {r["id"]: r["superseded_by"] is not None for r in memory_rows(db)}
    return rows, plan.contradiction_failed


def test_verdicts_numbered_from_zero_supersede_nothing(
    db: psycopg.Connection, database: Database
) -> None:
    vec = hashed_vector(NEW)
    hiking = insert_memory(db, "User likes hiking.", near(vec, 0.10))  # EXISTING_1
    initech = insert_memory(db, "User works at Initech.", near(vec, 0.30))  # EXISTING_2
    chat = FakeChat().script(
        "contradiction",
        {
            "verdicts": [
                {"existing": 0, "contradicts": False},  # meant hiking
                {"existing": 1, "contradicts": True},  # meant Initech
            ]
        },
    )
    rows, failed = _superseded(db, database, chat)
    assert rows[hiking] is False and rows[initech] is False
    assert failed == "MisnumberedVerdicts"


def test_candidates_too_long_together_are_compared_one_at_a_time(
    db: psycopg.Connection, database: Database
) -> None:
    vec = hashed_vector(NEW)
    hiking = insert_memory(db, "User likes hiking.", near(vec, 0.10))
    initech = insert_memory(db, "User works at Initech.", near(vec, 0.30))
    chat = FakeChat().script(
        "contradiction",
        ContextTooLong("small: input exceeds the model's context", backend="small"),
        {"verdicts": [{"existing": 1, "contradicts": False}]},  # hiking alone
        {"verdicts": [{"existing": 1, "contradicts": True}]},  # Initech alone
    )
    rows, failed = _superseded(db, database, chat)
    assert rows[hiking] is False and rows[initech] is True
    assert failed is None
    asked = [c.user for c in chat.calls if c.purpose == "contradiction"]
    assert len(asked) == 3 and "Initech" not in asked[1] and "hiking" not in asked[2]


def test_one_candidate_still_too_long_saves_the_memory_and_says_so(
    db: psycopg.Connection, database: Database
) -> None:
    vec = hashed_vector(NEW)
    initech = insert_memory(db, "User works at Initech.", near(vec, 0.30))
    chat = FakeChat().script(
        "contradiction", ContextTooLong("small: input exceeds the model's context")
    )
    rows, failed = _superseded(db, database, chat)
    assert rows[initech] is False and len(rows) == 2  # the new memory saved, nothing superseded
    assert failed == "ContextTooLong"


def test_one_by_one_a_later_failure_keeps_what_an_earlier_call_found(
    db: psycopg.Connection, database: Database
) -> None:
    """Candidate 1 judged contradicted, candidate 2's own call then failed: the whole check
    failed, and memory 1 stayed live (found in review)."""
    vec = hashed_vector(NEW)
    initech = insert_memory(db, "User works at Initech.", near(vec, 0.10))
    hiking = insert_memory(db, "User likes hiking.", near(vec, 0.30))
    chat = FakeChat().script(
        "contradiction",
        ContextTooLong("small: input exceeds the model's context", backend="small"),
        {"verdicts": [{"existing": 1, "contradicts": True}]},  # Initech alone
        ContextTooLong("small: input exceeds the model's context", backend="small"),
    )
    rows, failed = _superseded(db, database, chat)
    assert rows[initech] is True and rows[hiking] is False
    assert failed == "ContextTooLong"
