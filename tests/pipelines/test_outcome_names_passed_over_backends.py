"""durability.md: "The log and the outcome say which backend answered and which were skipped
and why." The primary answers every completion with a 500, the fallback answers: each item's
work_outcomes row names the fallback as its backend and the primary, with why, in its detail.

(The outcome named only the fallback: a primary that kept failing showed only in the logs.)
Runner in-process with the real pipelines and real PostgreSQL.
"""

from __future__ import annotations

import psycopg
import pytest

from sokratos_worker.config import load_settings
from sokratos_worker.handlers import HandlerContext
from sokratos_worker.llm import build_chat_client, build_embedder
from sokratos_worker.model import Effects, Outcome
from sokratos_worker.pipelines import build_handlers
from sokratos_worker.runner import Runner
from sokratos_worker.store.connection import Database
from sokratos_worker.store.memories import Written
from sokratos_worker.store.queue import _after_duplicates
from sokratos_worker.testing.scripted_llm import CHAT, Reply, ScriptedLLM
from tests.faults.support import (
    EMBED_DIM,
    answer,
    backends_env,
    enqueue_distillation,
    enqueue_triage,
    exchange,
    messages_archive,
)

pytestmark = [pytest.mark.postgres]

PASSED_OVER = "passed over primary (failed: http_500: CUDA out of memory)"


def test_each_outcome_names_the_backend_passed_over_and_why(
    db: psycopg.Connection, database_url: str
) -> None:
    triage = enqueue_triage(db, exchange("tokfallback1", save=True))
    distillation = enqueue_distillation(db, messages_archive("tokfallback2"))
    with (
        ScriptedLLM(chat=answer) as primary,
        ScriptedLLM(chat=answer) as fallback,
        ScriptedLLM(embed_dim=EMBED_DIM) as embed,
    ):
        primary.on(CHAT, lambda r: Reply.error(500, "CUDA out of memory"))
        settings = load_settings(
            {
                "SOKRATOS_DATABASE_URL": database_url,
                "SOKRATOS_CONCURRENCY": "1",
                "SOKRATOS_LLM_BACKENDS": backends_env(primary, fallback, timeout=5),
                "SOKRATOS_EMBEDDING_URL": embed.url,
                "SOKRATOS_EMBEDDING_MODEL": "scripted-embed",
                "SOKRATOS_EMBEDDING_DIM": str(EMBED_DIM),
            }
        )
        database = Database(database_url, size=4)
        try:
            context = HandlerContext(
                settings, database, build_chat_client(settings), build_embedder(settings)
            )
            runner = Runner(
                settings=settings,
                database=database,
                handlers=build_handlers(context),
                worker_id="passed-over",
            )
            runner.start(drain_only=True)
            assert runner.wait_drained(120)
            runner.shutdown(1.0)
        finally:
            database.close()
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
