"""The paradigm-shift flag ends the triage detail, as docs/production.md tells the main
application, also when the contradiction check failed or the model's text was escaped, and
when the memory was a near-duplicate (found by a triage hunt).

A life-altering event (a new job, a move) is just what contradicts memories already saved, so
its contradiction check is the one most likely to have candidates, and a failed verdict's note
was appended after the flag: a main application testing the documented suffix missed the
transition.
"""

from __future__ import annotations

import json

import psycopg
import pytest

from sokratos_worker.llm.types import ChatFailed
from sokratos_worker.model import Outcome
from sokratos_worker.store.connection import Database
from sokratos_worker.testing.scripted_llm import Reply, ScriptedLLM

from .conftest import drain, enqueue, insert_memory, make_item, outcome
from .fakes import FakeChat, FakeEmbedder, hashed_vector, near
from .test_triage import EXCHANGE, SUMMARY, triage_handler, verdict

pytestmark = pytest.mark.postgres

ENGAGED = "The user got engaged to Sam."


def test_the_flag_ends_the_detail_after_a_failed_contradiction_check_and_an_escape(
    db: psycopg.Connection, database: Database, chat: FakeChat, embedder: FakeEmbedder
) -> None:
    base = embedder.vector(SUMMARY)
    embedder.vectors[SUMMARY + "*"] = base  # (the summary as stored, its NUL escaped)
    insert_memory(db, "Anna lives in Porto.", near(base, 0.2))
    chat.script("conversation_triage", verdict(9, summary=SUMMARY + "\x00", paradigm_shift=True))
    chat.script("contradiction", ChatFailed("no valid reply"))
    effects = triage_handler(database, chat, embedder).handle(make_item({"exchange": EXCHANGE}))
    assert effects.outcome is Outcome.SAVED
    detail = effects.detail or ""
    assert "contradiction check failed (ChatFailed): 1 of 1 candidates unchecked" in detail
    assert "the model's reply" in detail
    assert detail.endswith("; paradigm shift flagged"), detail
    assert effects.recorded_detail().endswith("; paradigm shift flagged")


def test_a_near_duplicate_keeps_the_flag_for_the_memory_it_names(
    db: psycopg.Connection, database_url: str
) -> None:
    """Sokratos runs the transition for a near-duplicate too (the save returns the existing
    memory, the triage goes on); the skipped outcome dropped the flag, so the main application
    never learnt of the event when the earlier copy (a distilled fact, Sokratos's own triage,
    or the same event scored without the flag) did not carry it."""
    existing = insert_memory(db, "The user got engaged to Sam.", hashed_vector(ENGAGED))
    item = enqueue(
        db,
        "SELECT sokratos_enqueue_triage(%s::jsonb)",
        json.dumps({"exchange": "user: Sam proposed last night, we're engaged!\nassistant: Wow!"}),
    )
    flagged = verdict(9, summary=ENGAGED, paradigm_shift=True)
    with ScriptedLLM(chat=lambda request: Reply.chat(flagged)) as server:
        drain(database_url, server)
    assert outcome(db, "pending_triage", item) == (
        "skipped",
        [existing],
        f"near-duplicate of memory {existing}; paradigm shift flagged",
    )
