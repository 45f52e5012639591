"""A later fact of one distillation is checked against the facts planned earlier in the same
item, as Sokratos's fact-by-fact saves check it against the ones just saved. The contradiction
check looked only at memories already in the table: an archive whose first window said "lives
in Oslo" and whose second "moved to Lisbon" left both live (found by a selfcontra hunt)."""

from __future__ import annotations

import json
import math
from typing import Any

import psycopg
import pytest

from sokratos_worker.model import Queue
from sokratos_worker.pipelines import prompts
from sokratos_worker.pipelines.distill import DISTILL_MAX_BYTES
from sokratos_worker.store.connection import Database
from sokratos_worker.testing.scripted_llm import Reply, Request, ScriptedLLM

from . import conftest
from .conftest import apply, drain, enqueue, insert_memory, make_item, memory_rows, outcome
from .fakes import DIM, FakeChat, FakeEmbedder, hashed_vector, near
from .test_distill import distill_handler

pytestmark = pytest.mark.postgres

OSLO = "The user lives in Oslo."
LISBON = "The user moved to Lisbon."
OSLO_AGAIN = "The user's home is in Oslo."
BIRDS = "The user keeps two parrots."
BERGEN = "The user lives in Bergen."
PLACES = {OSLO, LISBON, OSLO_AGAIN, BERGEN}  # where the user lives: any two contradict


def _archive(first: str, second: str) -> str:
    """An archive of more than one window: ``first`` said early, ``second`` at the end."""
    filler = [f"[2026-03-14 09:{i % 60:02d}] user: small talk number {i}" for i in range(800)]
    lines = [f"[2026-03-14 08:59] user: {first}", *filler, f"[2026-03-14 10:00] user: {second}"]
    text = "[Conversation archived 2026-03-14 10:05]\n" + "\n".join(lines)
    assert len(text.encode()) > 2 * DISTILL_MAX_BYTES
    return text


def _model(facts_by_words: dict[str, str], places: set[str]) -> Any:
    """Each distillation window yields the facts whose words it holds; a contradiction check
    judges two facts about where the user lives contradicting, anything else compatible."""
    asked: list[str] = []

    def respond(request: Request) -> Reply:
        system = request.messages[0]["content"]
        user = request.messages[-1]["content"]
        if system.startswith(prompts.DISTILLATION[:40]):
            facts = [
                {"text": fact, "salience": 7, "tags": ["home"]}
                for words, fact in facts_by_words.items()
                if words in user
            ]
            return Reply.chat({"facts": facts})
        asked.append(user)
        new, *existing = (line.split(": ", 1)[1] for line in user.splitlines())
        verdicts = [
            {"existing": n, "contradicts": new in places and old in places}
            for n, old in enumerate(existing, start=1)
        ]
        return Reply.chat({"verdicts": verdicts})

    respond.asked = asked  # type: ignore[attr-defined]
    return respond


def _with_embedder(monkeypatch: pytest.MonkeyPatch, embedder: FakeEmbedder) -> None:
    """The runner that ``drain`` builds embeds with ``embedder``."""
    monkeypatch.setattr(conftest, "FakeEmbedder", lambda: embedder)


def _distil(db: psycopg.Connection, database_url: str, text: str, model: Any) -> int:
    before = db.execute("SELECT count(*) FROM work_outcomes").fetchone()
    item = enqueue(
        db,
        "SELECT sokratos_enqueue_distillation(%s::jsonb)",
        json.dumps({"archive_text": text}),
    )
    with ScriptedLLM(chat=model) as server:
        drain(database_url, server)
    after = db.execute("SELECT count(*) FROM work_outcomes").fetchone()
    assert before is not None and after is not None
    assert after[0] - before[0] == 1  # one item in, one outcome
    return item


def test_a_later_window_contradicting_an_earlier_one_supersedes_it(
    db: psycopg.Connection, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    embedder = FakeEmbedder()
    oslo = hashed_vector(OSLO)
    embedder.vectors[OSLO] = oslo
    embedder.vectors[LISBON] = near(oslo, 0.30)  # a contradiction candidate, not a known fact
    _with_embedder(monkeypatch, embedder)
    model = _model({"I live in Oslo": OSLO, "I moved to Lisbon": LISBON}, PLACES)

    item = _distil(db, database_url, _archive("I live in Oslo", "I moved to Lisbon"), model)

    rows = memory_rows(db)
    assert [r["summary"] for r in rows] == [OSLO, LISBON]  # history kept, as for saved ones
    oslo_row, lisbon_row = rows
    assert oslo_row["superseded_by"] == lisbon_row["id"]
    assert lisbon_row["superseded_by"] is None
    # The Lisbon fact was asked about the Oslo fact, as if that had been saved first.
    assert model.asked == [prompts.contradiction_input(LISBON, [OSLO])]
    result, memory_ids, detail = outcome(db, "pending_distillation", item)
    assert (result, memory_ids) == ("saved", [oslo_row["id"], lisbon_row["id"]])
    assert detail == "2 new facts of 2; 1 superseded by a later fact of the same archive", detail


def test_a_later_fact_judged_compatible_leaves_both_live(
    db: psycopg.Connection, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    embedder = FakeEmbedder()
    oslo = hashed_vector(OSLO)
    embedder.vectors[OSLO] = oslo
    embedder.vectors[BIRDS] = near(oslo, 0.30)
    _with_embedder(monkeypatch, embedder)
    model = _model({"I live in Oslo": OSLO, "two parrots": BIRDS}, PLACES)

    item = _distil(db, database_url, _archive("I live in Oslo", "I have two parrots"), model)

    rows = memory_rows(db)
    assert [(r["summary"], r["superseded_by"]) for r in rows] == [(OSLO, None), (BIRDS, None)]
    assert model.asked == [prompts.contradiction_input(BIRDS, [OSLO])]
    assert outcome(db, "pending_distillation", item)[2] == "2 new facts of 2"


def _unit(*coordinates: float) -> list[float]:
    """A vector of the fake embedder's dimension, the rest of it filled with zeros."""
    return [*coordinates, *[0.0] * (DIM - len(coordinates))]


def test_saved_memories_and_earlier_facts_are_candidates_together_nearest_first(
    db: psycopg.Connection, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As Sokratos's one query over the table finds them once the earlier fact is saved: the
    saved memory the earlier fact superseded is no candidate any more, and a saved memory
    nearer than the earlier fact comes first."""
    lisbon = _unit(1.0)
    parrots = _unit(0.83, 0.0, math.sqrt(1 - 0.83**2))  # 0.17 from Lisbon
    oslo = _unit(0.7, math.sqrt(1 - 0.49))  # 0.3 from Lisbon, 0.42 from the parrots
    bergen = _unit(0.8, 0.3, 0.0, math.sqrt(1 - 0.64 - 0.09))  # 0.2 from Lisbon, 0.23 from Oslo
    embedder = FakeEmbedder(vectors={LISBON: lisbon, OSLO: oslo})
    bergen_id = insert_memory(db, BERGEN, bergen)
    parrots_id = insert_memory(db, BIRDS, parrots)
    _with_embedder(monkeypatch, embedder)
    model = _model({"I live in Oslo": OSLO, "I moved to Lisbon": LISBON}, PLACES)

    item = _distil(db, database_url, _archive("I live in Oslo", "I moved to Lisbon"), model)

    assert model.asked == [
        prompts.contradiction_input(OSLO, [BERGEN]),
        prompts.contradiction_input(LISBON, [BIRDS, OSLO]),
    ]
    rows = {r["summary"]: r for r in memory_rows(db)}
    assert rows[BERGEN]["superseded_by"] == rows[OSLO]["id"]
    assert rows[OSLO]["superseded_by"] == rows[LISBON]["id"]
    live = [r["id"] for r in rows.values() if r["superseded_by"] is None]
    assert sorted(live) == sorted([parrots_id, rows[LISBON]["id"]])
    assert bergen_id != parrots_id
    assert outcome(db, "pending_distillation", item)[0] == "saved"


def test_one_fact_in_two_windows_in_two_wordings_is_saved_once(
    db: psycopg.Connection, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    embedder = FakeEmbedder()
    oslo = hashed_vector(OSLO)
    embedder.vectors[OSLO] = oslo
    embedder.vectors[OSLO_AGAIN] = near(oslo, 0.05)
    _with_embedder(monkeypatch, embedder)
    model = _model({"I live in Oslo": OSLO, "my home is Oslo": OSLO_AGAIN}, PLACES)

    item = _distil(db, database_url, _archive("I live in Oslo", "my home is Oslo"), model)

    rows = memory_rows(db)
    assert [(r["summary"], r["superseded_by"]) for r in rows] == [(OSLO, None)]
    assert model.asked == []  # a known fact is not saved, so not checked either
    result, memory_ids, detail = outcome(db, "pending_distillation", item)
    assert (result, memory_ids) == ("saved", [rows[0]["id"]])
    assert detail == "1 new facts of 2", detail


def test_the_earlier_fact_is_superseded_in_the_settle_and_a_replay_changes_nothing(
    db: psycopg.Connection, database: Database, chat: FakeChat
) -> None:
    embedder = FakeEmbedder()
    oslo = hashed_vector(OSLO)
    embedder.vectors[OSLO] = oslo
    embedder.vectors[LISBON] = near(oslo, 0.30)
    chat.script(
        "distillation",
        {"facts": [{"text": OSLO, "salience": 7}, {"text": LISBON, "salience": 8}]},
    )
    chat.script("contradiction", {"verdicts": [{"existing": 1, "contradicts": True}]})
    effects = distill_handler(database, chat, embedder).handle(
        make_item({"archive_text": "[x] user: I lived in Oslo, now Lisbon"}, queue=Queue.DISTILLATION)
    )
    assert effects.supersessions == ()
    assert [(d.old_origin, d.new_origin) for d in effects.draft_supersessions] == [
        ("pending_distillation:7:0", "pending_distillation:7:1")
    ]
    ids = apply(db, effects)
    assert apply(db, effects) == ids  # a replay writes and supersedes nothing new
    rows = memory_rows(db)
    assert [(r["summary"], r["superseded_by"]) for r in rows] == [
        (OSLO, rows[1]["id"]),
        (LISBON, None),
    ]


def _toward(cos: float, axis: int) -> list[float]:
    """A unit vector at cosine ``cos`` from the first axis, the rest of it along ``axis``."""
    vec = _unit(cos)
    vec[axis] = math.sqrt(1 - cos * cos)
    return vec


def _plan_facts(
    database: Database, chat: FakeChat, vectors: dict[str, list[float]], *verdicts: list[int]
) -> Any:
    """The item's plan over the facts of ``vectors`` in order; each contradiction check judges
    the candidates numbered in its ``verdicts`` contradicted."""
    chat.script("distillation", {"facts": [{"text": text, "salience": 7} for text in vectors]})
    for contradicted in verdicts:
        chat.script(
            "contradiction",
            {"verdicts": [{"existing": n, "contradicts": True} for n in contradicted]},
        )
    return distill_handler(database, chat, FakeEmbedder(vectors=dict(vectors))).handle(
        make_item({"archive_text": "[x] user: where I live"}, queue=Queue.DISTILLATION)
    )


def _asked(chat: FakeChat) -> list[str]:
    return [call.user for call in chat.calls if call.purpose == "contradiction"]


def test_at_most_three_candidates_the_nearest_of_saved_and_earlier_facts_together(
    db: psycopg.Connection, database: Database, chat: FakeChat
) -> None:
    """Four saved memories within 0.4 of the later fact, the nearest of which the earlier fact
    supersedes, and the earlier fact itself the farthest: the three nearest live ones are
    asked about (the table read asks for one more per memory the earlier facts supersede)."""
    saved = {
        f"The user lived in place {n}.": _toward(1 - distance, n)
        for n, distance in enumerate((0.18, 0.22, 0.26, 0.30), start=1)
    }
    ids = [insert_memory(db, text, vec) for text, vec in saved.items()]
    db.commit()
    first, *others = saved
    # 0.25 from the nearest saved memory, over 0.4 from the others, 0.36 from the later fact.
    earlier = [0.64, 0.4, 0.0, 0.0, 0.0, math.sqrt(1 - 0.64**2 - 0.16), 0.0, 0.0]

    effects = _plan_facts(database, chat, {LISBON: earlier, OSLO: _unit(1.0)}, [1], [])

    assert _asked(chat) == [
        prompts.contradiction_input(LISBON, [first]),
        prompts.contradiction_input(OSLO, others),
    ]
    assert [s.old_memory_id for s in effects.supersessions] == [ids[0]]
    assert effects.draft_supersessions == ()


def test_an_earlier_fact_nearer_than_a_saved_memory_is_asked_about_first(
    db: psycopg.Connection, database: Database, chat: FakeChat
) -> None:
    insert_memory(db, BERGEN, _toward(0.7, 2))  # 0.3 from Oslo, 0.44 from Lisbon
    db.commit()
    lisbon = _unit(0.8, 0.6)  # 0.2 from Oslo

    effects = _plan_facts(database, chat, {LISBON: lisbon, OSLO: _unit(1.0)}, [1])

    assert _asked(chat) == [prompts.contradiction_input(OSLO, [LISBON, BERGEN])]
    assert effects.supersessions == ()  # the verdict on EXISTING_1 is about Lisbon
    assert [(d.old_origin, d.new_origin) for d in effects.draft_supersessions] == [
        ("pending_distillation:7:0", "pending_distillation:7:1")
    ]
    apply(db, effects)
    live = [r["summary"] for r in memory_rows(db) if r["superseded_by"] is None]
    assert sorted(live) == sorted([BERGEN, OSLO])


def test_an_earlier_fact_a_later_one_superseded_is_no_candidate_for_the_next(
    db: psycopg.Connection, database: Database, chat: FakeChat
) -> None:
    """Oslo, then Lisbon superseding it, then Bergen within 0.4 of both: Bergen is asked about
    Lisbon only, as the table would offer once Oslo was superseded."""
    bergen = [0.75, 0.4, math.sqrt(1 - 0.75**2 - 0.16), 0.0, 0.0, 0.0, 0.0, 0.0]
    vectors = {OSLO: _unit(1.0), LISBON: _toward(0.75, 1), BERGEN: bergen}  # 0.25, 0.25, 0.17

    effects = _plan_facts(database, chat, vectors, [1], [1])

    assert _asked(chat) == [
        prompts.contradiction_input(LISBON, [OSLO]),
        prompts.contradiction_input(BERGEN, [LISBON]),
    ]
    apply(db, effects)
    rows = {r["summary"]: r for r in memory_rows(db)}
    assert rows[OSLO]["superseded_by"] == rows[LISBON]["id"]
    assert rows[LISBON]["superseded_by"] == rows[BERGEN]["id"]
    assert rows[BERGEN]["superseded_by"] is None
