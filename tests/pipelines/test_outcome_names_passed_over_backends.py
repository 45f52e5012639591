"""durability.md: "The log and the outcome say which backend answered and which were skipped
and why." The primary answers every completion with a 500, the fallback answers: each item's
work_outcomes row names the fallback as its backend and the primary, with why, in its detail.

(The outcome named only the fallback: a primary that kept failing showed only in the logs.)
The real runner, pipelines and chat client in-process against real PostgreSQL.
"""

from __future__ import annotations

import psycopg
import pytest

from sokratos_worker.model import Effects, Outcome
from sokratos_worker.store.memories import Written
from sokratos_worker.store.queue import _after_duplicates
from sokratos_worker.testing.scripted_llm import CHAT, Reply, ScriptedLLM
from tests.faults.support import (
    answer,
    enqueue_distillation,
    enqueue_triage,
    exchange,
    messages_archive,
)

from .conftest import drain

pytestmark = [pytest.mark.postgres]

PASSED_OVER = "passed over primary (failed: http_500: CUDA out of memory)"


def test_each_outcome_names_the_backend_passed_over_and_why(
    db: psycopg.Connection, database_url: str
) -> None:
    triage = enqueue_triage(db, exchange("tokfallback1", save=True))
    distillation = enqueue_distillation(db, messages_archive("tokfallback2"))
    with ScriptedLLM(chat=answer) as primary, ScriptedLLM(chat=answer) as fallback:
        primary.on(CHAT, lambda r: Reply.error(500, "CUDA out of memory"))
        drain(database_url, primary, fallback)
        assert primary.count(CHAT) >= 2  # really tried for both items
    rows = db.execute(
        "SELECT queue, outcome, backend, detail FROM work_outcomes ORDER BY queue"
    ).fetchall()
    assert [(q, backend) for q, _, backend, _ in rows] == [
        (distillation[0], "fallback"),
        (triage[0], "fallback"),
    ], rows
    for queue, outcome, _, detail in rows:
        assert outcome == "saved", (queue, detail)
        assert detail.endswith(f"; {PASSED_OVER}"), (queue, detail)


@pytest.mark.parametrize(
    ("written", "ends"),
    [
        (Written(memory_ids=(5,), new=0, duplicate_of=(5,)), "saved by another item meanwhile)"),
        (Written(memory_ids=(5, 6), new=1, duplicate_of=(5,)), "meanwhile: not written"),
    ],
    ids=["became-a-skip", "partly-dropped"],
)
def test_what_was_passed_over_still_ends_a_detail_the_settle_rewrote(
    written: Written, ends: str
) -> None:
    # A near-duplicate saved meanwhile replaced the detail (the note was lost) or was noted
    # after it (the note no longer ended it).
    effects = Effects(Outcome.SAVED, detail="salience 7 (threshold 5)").noted(PASSED_OVER)
    _, detail = _after_duplicates(effects, written)
    recorded = effects.recorded_detail(detail)
    assert recorded.endswith(f"{ends}; {PASSED_OVER}"), recorded
