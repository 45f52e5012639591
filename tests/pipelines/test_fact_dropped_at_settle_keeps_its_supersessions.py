"""A fact dropped at the settle, because another item saved the same fact between the plan
and the settle, cancelled the supersessions it took part in: an item planning "lives in Oslo"
then "moved to Lisbon" (superseding Oslo) met another item's "home is in Oslo", dropped its
own Oslo as a duplicate, and left that memory and Lisbon both live. The memory that made the
draft redundant now stands for it (found by a review)."""

from __future__ import annotations

import math

import psycopg
import pytest

from sokratos_worker.model import Effects, Queue
from sokratos_worker.store.connection import Database

from .conftest import apply, insert_memory, make_item, memory_rows
from .fakes import DIM, FakeChat, FakeEmbedder
from .test_distill import distill_handler

pytestmark = pytest.mark.postgres

OSLO = "The user lives in Oslo."
LISBON = "The user moved to Lisbon."
BERGEN = "The user lives in Bergen."
OSLO_AGAIN = "The user's home is in Oslo."
LISBON_AGAIN = "The user now lives in Lisbon."


def _unit(*coordinates: float) -> list[float]:
    """A unit vector of the fake embedder's dimension along ``coordinates``."""
    norm = math.sqrt(sum(c * c for c in coordinates))
    return [c / norm for c in coordinates] + [0.0] * (DIM - len(coordinates))


OSLO_VEC = _unit(1.0)
LISBON_VEC = _unit(0.7, math.sqrt(1 - 0.49))  # 0.3 from Oslo: a candidate, not a known fact


def _lisbon_supersedes_oslo(database: Database, chat: FakeChat) -> Effects:
    """An item's plan: Oslo, then Lisbon contradicting it."""
    embedder = FakeEmbedder(vectors={OSLO: OSLO_VEC, LISBON: LISBON_VEC})
    chat.script("distillation", {"facts": [{"text": OSLO, "salience": 7}, {"text": LISBON, "salience": 7}]})
    chat.script("contradiction", {"verdicts": [{"existing": 1, "contradicts": True}]})
    effects = distill_handler(database, chat, embedder).handle(
        make_item({"archive_text": "[x] user: Oslo, then Lisbon"}, queue=Queue.DISTILLATION)
    )
    assert len(effects.draft_supersessions) == 1
    return effects


def _live(db: psycopg.Connection) -> list[str]:
    return [r["summary"] for r in memory_rows(db) if r["superseded_by"] is None]


def test_an_earlier_fact_dropped_at_the_settle_is_superseded_in_the_other_items_memory(
    db: psycopg.Connection, database: Database, chat: FakeChat
) -> None:
    effects = _lisbon_supersedes_oslo(database, chat)
    # Another item saves Oslo in other words (0.1 from Oslo, 0.37 from Lisbon) meanwhile.
    other = insert_memory(db, OSLO_AGAIN, _unit(0.9, 0.0, math.sqrt(1 - 0.81)))
    db.commit()

    apply(db, effects)

    rows = {r["summary"]: r for r in memory_rows(db)}
    assert set(rows) == {OSLO_AGAIN, LISBON}  # the item's Oslo was dropped
    assert rows[OSLO_AGAIN]["superseded_by"] == rows[LISBON]["id"]
    assert _live(db) == [LISBON]
    assert other == rows[OSLO_AGAIN]["id"]


def test_a_later_fact_dropped_at_the_settle_supersedes_through_the_other_items_memory(
    db: psycopg.Connection, database: Database, chat: FakeChat
) -> None:
    effects = _lisbon_supersedes_oslo(database, chat)
    # Another item saves Lisbon in other words (0.1 from Lisbon, 0.37 from Oslo) meanwhile.
    lisbon_again = [0.9 * x for x in LISBON_VEC]
    lisbon_again[2] = math.sqrt(1 - 0.81)
    insert_memory(db, LISBON_AGAIN, lisbon_again)
    db.commit()

    apply(db, effects)

    rows = {r["summary"]: r for r in memory_rows(db)}
    assert set(rows) == {LISBON_AGAIN, OSLO}
    assert rows[OSLO]["superseded_by"] == rows[LISBON_AGAIN]["id"]
    assert _live(db) == [LISBON_AGAIN]


def test_a_saved_memory_a_fact_dropped_at_the_settle_contradicted_is_superseded_all_the_same(
    db: psycopg.Connection, database: Database, chat: FakeChat
) -> None:
    bergen = insert_memory(db, BERGEN, OSLO_VEC)  # (an older home, where Oslo's vector is)
    db.commit()
    embedder = FakeEmbedder(vectors={LISBON: LISBON_VEC})
    chat.script("distillation", {"facts": [{"text": LISBON, "salience": 7}]})
    chat.script("contradiction", {"verdicts": [{"existing": 1, "contradicts": True}]})
    effects = distill_handler(database, chat, embedder).handle(
        make_item({"archive_text": "[x] user: I moved to Lisbon"}, queue=Queue.DISTILLATION)
    )
    assert [s.old_memory_id for s in effects.supersessions] == [bergen]
    lisbon_again = [0.9 * x for x in LISBON_VEC]
    lisbon_again[2] = math.sqrt(1 - 0.81)
    other = insert_memory(db, LISBON_AGAIN, lisbon_again)
    db.commit()

    apply(db, effects)

    rows = {r["summary"]: r for r in memory_rows(db)}
    assert set(rows) == {BERGEN, LISBON_AGAIN}
    assert rows[BERGEN]["superseded_by"] == other
    assert _live(db) == [LISBON_AGAIN]


def test_both_facts_dropped_for_one_memory_leave_it_live(
    db: psycopg.Connection, database: Database, chat: FakeChat
) -> None:
    effects = _lisbon_supersedes_oslo(database, chat)
    # Halfway between them: 0.08 from each, so both are known facts at the settle.
    between = insert_memory(db, OSLO_AGAIN, _unit(1.7, math.sqrt(1 - 0.49)))
    db.commit()

    apply(db, effects)

    assert [(r["id"], r["superseded_by"]) for r in memory_rows(db)] == [(between, None)]


def test_an_identity_memory_standing_for_a_dropped_fact_is_not_superseded(
    db: psycopg.Connection, database: Database, chat: FakeChat
) -> None:
    effects = _lisbon_supersedes_oslo(database, chat)
    insert_memory(db, OSLO_AGAIN, _unit(0.9, 0.0, math.sqrt(1 - 0.81)), memory_type="identity")
    db.commit()

    apply(db, effects)

    assert sorted(_live(db)) == sorted([OSLO_AGAIN, LISBON])  # identity is never superseded
