"""The shared write path: guarded supersession, pinned dimension, chunk origins."""

from __future__ import annotations

import psycopg
import pytest

from sokratos_worker.llm.types import EmbeddingFailed
from sokratos_worker.model import Effects, NewMemory, Outcome, Supersession
from sokratos_worker.pipelines.write import MemoryDraft, MemoryWriter
from sokratos_worker.store.connection import Database
from sokratos_worker.store.memories import MemoryReader

from .conftest import apply, insert_memory, make_item, memory_rows
from .fakes import FakeChat, FakeEmbedder

pytestmark = pytest.mark.postgres

DRAFT = MemoryDraft(
    text="line one of a long memory\n" * 100,  # 2600 bytes: three chunks
    salience=6,
    memory_type="general",
    source="conversation",
    tags=("conversation",),
    pipeline_id=3,
)


def test_supersession_never_overwrites_an_earlier_one(db: psycopg.Connection) -> None:
    newer = insert_memory(db, "newer", None)
    old = insert_memory(db, "old", None)
    db.execute("UPDATE memories SET superseded_by = %s WHERE id = %s", (newer, old))
    effects = Effects(
        Outcome.SAVED,
        memories=(NewMemory(origin="pending_triage:1:0", summary="newest", salience=5),),
        supersessions=(Supersession(old_memory_id=old, new_origin="pending_triage:1:0"),),
    )
    apply(db, effects)
    assert {r["id"]: r["superseded_by"] for r in memory_rows(db)}[old] == newer


def test_long_text_becomes_chunks_with_consecutive_origins(
    db: psycopg.Connection, database: Database, embedder: FakeEmbedder
) -> None:
    reader = MemoryReader(database, embedding_model=embedder.model)
    plan = MemoryWriter(reader, FakeChat(), embedder).plan(make_item({}), DRAFT, first_chunk=2)
    assert [m.origin for m in plan.memories] == [
        "pending_triage:7:2",
        "pending_triage:7:3",
        "pending_triage:7:4",
    ]
    assert all(len(m.summary.encode()) <= 1200 for m in plan.memories)
    apply(db, Effects(Outcome.SAVED, memories=plan.memories))
    assert {r["pipeline_id"] for r in memory_rows(db)} == {3}


def test_an_embedding_of_the_wrong_dimension_fails_the_attempt(
    database: Database, embedder: FakeEmbedder
) -> None:
    embedder.dim = 16
    reader = MemoryReader(database, embedding_model=embedder.model)
    with pytest.raises(EmbeddingFailed, match="expected 16"):
        MemoryWriter(reader, FakeChat(), embedder).plan(make_item({}), DRAFT)
