"""The shared write path: guarded supersession, pinned dimension, chunk origins."""

from __future__ import annotations

import dataclasses

import psycopg
import pytest

from sokratos_worker.llm.types import EmbeddingFailed
from sokratos_worker.model import Effects, NewMemory, Outcome, Supersession
from sokratos_worker.pipelines.write import MemoryDraft, MemoryWriter
from sokratos_worker.store.connection import Database
from sokratos_worker.store.memories import MemoryReader, write_effects

from .conftest import apply, insert_memory, make_item, memory_rows
from .fakes import FakeChat, FakeEmbedder, hashed_vector

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
    # The settle re-checks the chunk the plan checked; a triage draft is no distilled fact.
    assert [(m.duplicate_check, m.fact_check) for m in plan.memories] == [
        (True, False),
        (False, False),
        (False, False),
    ]
    fact = MemoryWriter(reader, FakeChat(), embedder).plan(
        make_item({}, item_id=8), DRAFT, fact_dedupe=True
    )
    assert fact.memories[0].fact_check and not fact.memories[1].fact_check
    apply(db, Effects(Outcome.SAVED, memories=plan.memories))
    assert {r["pipeline_id"] for r in memory_rows(db)} == {3}


@pytest.mark.parametrize("with_embedder", [True, False])
def test_nul_and_lone_surrogates_in_the_models_text_are_escaped_and_reported(
    db: psycopg.Connection, database: Database, embedder: FakeEmbedder, with_embedder: bool
) -> None:
    """A model's "\\u0000" is valid JSON but PostgreSQL text cannot hold it: escaped (and
    reported, so the outcome can say so) instead of failing the insert on every attempt."""
    reader = MemoryReader(database, embedding_model=embedder.model)
    writer = MemoryWriter(reader, FakeChat(), embedder if with_embedder else None)
    draft = dataclasses.replace(DRAFT, text="Moved to Graz.\x00", tags=("a\udcffb",))
    plan = writer.plan(make_item({}), draft)
    assert plan.escaped
    [memory] = plan.memories
    assert (memory.summary, memory.tags) == ("Moved to Graz.\\u0000", ("a\\udcffb",))
    apply(db, Effects(Outcome.SAVED, memories=plan.memories))
    assert memory_rows(db)[0]["summary"] == "Moved to Graz.\\u0000"
    assert not writer.plan(make_item({}, item_id=9), DRAFT).escaped


def test_an_embedding_of_the_wrong_dimension_fails_the_attempt(
    database: Database, embedder: FakeEmbedder
) -> None:
    embedder.dim = 16
    reader = MemoryReader(database, embedding_model=embedder.model)
    with pytest.raises(EmbeddingFailed, match="expected 16"):
        MemoryWriter(reader, FakeChat(), embedder).plan(make_item({}), DRAFT)


def _chunk(origin: str, vec: list[float] | None, *, head: bool) -> NewMemory:
    return NewMemory(
        origin=origin,
        summary=f"text of {origin}",
        salience=5,
        embedding=tuple(vec) if vec is not None else None,
        embedding_model="fake-embed" if vec is not None else None,
        duplicate_check=head,
    )


def test_a_draft_another_item_saved_meanwhile_is_dropped_at_the_settle(
    db: psycopg.Connection,
) -> None:
    same, other = hashed_vector("a fact"), hashed_vector("another fact")
    old = insert_memory(db, "older, contradicted", hashed_vector("old"))
    meanwhile = insert_memory(db, "a fact", same)  # committed after the handler looked
    effects = Effects(
        Outcome.SAVED,
        memories=(
            _chunk("q:1:0", same, head=True),
            _chunk("q:1:1", hashed_vector("its second chunk"), head=False),
            _chunk("q:1:2", other, head=True),
        ),
        supersessions=(Supersession(old, "q:1:0"), Supersession(old, "q:1:2")),
    )
    with db.transaction():
        written = write_effects(db, effects)
    assert written.duplicate_of == (meanwhile,) and written.new == 1
    rows = {r["origin"]: r for r in memory_rows(db)}
    assert set(rows) == {None, "q:1:2"}  # the duplicate draft and its chunk are not written
    assert written.memory_ids == (rows["q:1:2"]["id"], meanwhile)
    superseded = db.execute("SELECT superseded_by FROM memories WHERE id = %s", (old,)).fetchone()
    assert superseded == (rows["q:1:2"]["id"],)


def test_the_settle_check_skips_its_own_earlier_write_and_unflagged_memories(
    db: psycopg.Connection,
) -> None:
    vec = hashed_vector("a fact")
    first = apply(db, Effects(Outcome.SAVED, memories=(_chunk("q:2:0", vec, head=True),)))
    # A replay of the same item finds its own row, not a duplicate.
    again = apply(db, Effects(Outcome.SAVED, memories=(_chunk("q:2:0", vec, head=True),)))
    assert again == first
    # A raw archive (no flag) is always written, however close.
    archive = apply(db, Effects(Outcome.ARCHIVED, memories=(_chunk("q:3:0", vec, head=False),)))
    assert len(archive) == 1 and archive != first
    assert len(memory_rows(db)) == 2


def test_a_distilled_fact_another_item_saved_meanwhile_is_dropped_at_the_settle(
    db: psycopg.Connection,
) -> None:
    """Distillation's wider rule (any memory within 0.15, not only a near-duplicate within
    0.05) is checked again at the settle, for facts flagged with ``fact_check``."""
    known = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    close = [1.0, 0.45, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # cosine distance 0.088
    existing = insert_memory(db, "a known fact", known, memory_type="identity")
    fact = _chunk("pending_distillation:5:0", close, head=True)
    kept = apply(db, Effects(Outcome.SAVED, memories=(fact,)))  # a triage draft: kept
    assert len(kept) == 1 and existing not in kept
    db.execute("DELETE FROM memories WHERE id = %s", (kept[0],))
    distilled = dataclasses.replace(fact, origin="pending_distillation:6:0", fact_check=True)
    with db.transaction():
        written = write_effects(db, Effects(Outcome.SAVED, memories=(distilled,)))
    assert written.duplicate_of == (existing,) and written.new == 0
    assert [m["id"] for m in memory_rows(db)] == [existing]


def test_a_fact_is_not_dropped_for_a_sibling_written_earlier_in_the_same_settle(
    db: psycopg.Connection,
) -> None:
    first = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    second = [1.0, 0.45, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    facts = tuple(
        dataclasses.replace(_chunk(f"pending_distillation:7:{i}", vec, head=True), fact_check=True)
        for i, vec in enumerate((first, second))
    )
    assert len(apply(db, Effects(Outcome.SAVED, memories=facts))) == 2
