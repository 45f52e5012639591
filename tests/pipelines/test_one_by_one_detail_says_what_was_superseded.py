"""Candidates too long together are compared one at a time; when one call judges a memory
contradicted and another fails, the memory supersedes the first all the same. The outcome's
detail said "nothing superseded" for a distilled fact (only triage had its own wording, found
by a review): one helper now words it for both pipelines from the plan's counts."""

from __future__ import annotations

import psycopg
import pytest

from sokratos_worker.llm.types import ContextTooLong
from sokratos_worker.model import Queue
from sokratos_worker.pipelines import write
from sokratos_worker.store.connection import Database
from sokratos_worker.store.memories import MemoryReader
from tests.pipelines.conftest import apply, insert_memory, make_item, memory_rows
from tests.pipelines.fakes import FakeChat, FakeEmbedder, hashed_vector, near
from tests.pipelines.test_distill import distill_handler

pytestmark = pytest.mark.postgres

FACT = "The user now works at Acme."
TOO_LONG = ContextTooLong("small: input exceeds the model's context", backend="small")


def _two_candidates(db: psycopg.Connection) -> tuple[FakeEmbedder, int]:
    """Initech (contradicted) and hiking near FACT's vector; Initech's id."""
    embedder = FakeEmbedder()
    vec = hashed_vector(FACT)
    embedder.vectors[FACT] = vec
    initech = insert_memory(db, "User works at Initech.", near(vec, 0.20))
    insert_memory(db, "User likes hiking.", near(vec, 0.30))
    return embedder, initech


def _one_judged_one_failed() -> FakeChat:
    return FakeChat().script(
        "contradiction",
        TOO_LONG,  # both candidates together
        {"verdicts": [{"existing": 1, "contradicts": True}]},  # Initech alone
        TOO_LONG,  # hiking alone
    )


def test_a_distilled_fact_says_what_its_one_by_one_check_superseded(
    db: psycopg.Connection, database: Database
) -> None:
    embedder, initech = _two_candidates(db)
    chat = _one_judged_one_failed()
    chat.script("distillation", {"facts": [{"text": FACT, "salience": 8, "tags": ["job"]}]})
    handler = distill_handler(database, chat, embedder)
    item = make_item(
        {"messages": [{"role": "user", "content": "I work at Acme now."}]},
        queue=Queue.DISTILLATION,
        item_id=5,
    )
    effects = handler.handle(item)
    apply(db, effects)
    superseded = [r["id"] for r in memory_rows(db) if r["superseded_by"] is not None]
    assert superseded == [initech]
    assert "nothing superseded" not in (effects.detail or ""), effects.detail
    assert (
        "contradiction check failed (ContextTooLong): 1 of 2 candidates unchecked, 1 superseded"
        in (effects.detail or "")
    ), effects.detail


def test_the_plan_counts_the_candidates_checked_and_unchecked(
    db: psycopg.Connection, database: Database
) -> None:
    embedder, _ = _two_candidates(db)
    reader = MemoryReader(database, embedding_model=embedder.model)
    writer = write.MemoryWriter(reader, _one_judged_one_failed(), embedder)
    draft = write.MemoryDraft(FACT, salience=8, memory_type="general", source="conversation", tags=())
    plan = writer.plan(make_item({"exchange": "x"}), draft)
    assert (plan.checked, plan.unchecked, len(plan.supersessions)) == (1, 1, 1)
    assert plan.contradiction_failed == "ContextTooLong"
    assert write.contradiction_note([plan]) == (
        "contradiction check failed (ContextTooLong): 1 of 2 candidates unchecked, 1 superseded"
    )
