"""durability.md, table row "every backend answered 4xx for this request (other than 408/429),
e.g. context too long even after shortening | retry after backoff; failed_operations on the
last | used", and "Context too long: truncate by the pipeline's rules and retry; never send the
same oversize request to every backend".

Runner in-process, real pipelines, real PostgreSQL; both backends answer every completion with
llama.cpp's 400 exceed_context_size_error (their probe is fine). The triage item is shortened
and retried on the first backend, never sent to the fallback, uses each attempt and ends in
failed_operations with its payload.
"""

from __future__ import annotations

import time

import psycopg
import pytest
from structlog.testing import capture_logs

from sokratos_worker.config import load_settings
from sokratos_worker.handlers import HandlerContext
from sokratos_worker.llm import build_chat_client, build_embedder
from sokratos_worker.pipelines import build_handlers
from sokratos_worker.runner import Runner
from sokratos_worker.store.connection import Database
from sokratos_worker.testing.scripted_llm import CHAT, Reply, ScriptedLLM
from tests.faults.support import EMBED_DIM, answer, backends_env, enqueue_triage, exchange

pytestmark = [pytest.mark.postgres]

TOO_LONG = Reply.error(
    400,
    "the request exceeds the available context size, try increasing it",
    type="exceed_context_size_error",
)


@pytest.mark.timeout(120)
def test_context_too_long_on_every_backend_uses_attempts_and_spares_the_fallback(
    db: psycopg.Connection, database_url: str
) -> None:
    # The user's own words are long (a reply is capped at 800 bytes anyway): halved in turn.
    long_user = exchange("tokctx1", save=True)
    long_user["exchange"] = long_user["exchange"].replace(
        "\nassistant: ", " and more. " * 700 + "\nassistant: "
    )
    key = enqueue_triage(db, long_user)
    payload = db.execute("SELECT payload FROM pending_triage WHERE id = %s", (key[1],)).fetchone()
    with (
        ScriptedLLM(chat=answer) as primary,
        ScriptedLLM(chat=answer) as fallback,
        ScriptedLLM(embed_dim=EMBED_DIM) as embed,
    ):
        for server in (primary, fallback):
            server.on(CHAT, lambda r: TOO_LONG)
        conf = load_settings(
            {
                "SOKRATOS_DATABASE_URL": database_url,
                "SOKRATOS_CONCURRENCY": "1",
                "SOKRATOS_MAX_ATTEMPTS": "2",
                "SOKRATOS_RETRY_BASE": "10ms",
                "SOKRATOS_RETRY_MAX": "20ms",
                "SOKRATOS_LLM_BACKENDS": backends_env(primary, fallback, timeout=5),
                "SOKRATOS_EMBEDDING_URL": embed.url,
                "SOKRATOS_EMBEDDING_MODEL": "scripted-embed",
                "SOKRATOS_EMBEDDING_DIM": str(EMBED_DIM),
            }
        )
        database = Database(database_url, size=4)
        try:
            handlers = build_handlers(
                HandlerContext(conf, database, build_chat_client(conf), build_embedder(conf))
            )
            with capture_logs():
                for n in range(10):
                    runner = Runner(
                        settings=conf, database=database, handlers=handlers, worker_id=f"ctx{n}"
                    )
                    runner.start(drain_only=True)
                    assert runner.wait_drained(60)
                    runner.shutdown(1.0)
                    if not db.execute("SELECT count(*) FROM pending_triage").fetchone()[0]:
                        break
                    time.sleep(0.05)
        finally:
            database.close()
        primary_calls, fallback_calls = primary.count(CHAT), fallback.count(CHAT)
    outcome = db.execute(
        "SELECT outcome, attempts FROM work_outcomes WHERE item_id = %s", (key[1],)
    ).fetchone()
    assert outcome == ("failed", 2), outcome
    error, kept = db.execute(
        "SELECT error_message, context_data -> 'payload' FROM failed_operations"
        " WHERE item_id = %s",
        (key[1],),
    ).fetchone()
    assert kept == payload[0]
    assert "context" in error.lower(), error
    # Halved down to 1,000 bytes (7.7 kB, 3.8, 1.9, 0.96) in each attempt.
    assert primary_calls == 2 * 4, (primary_calls, error)
    assert fallback_calls == 0, fallback_calls  # the same oversize request never went there
