"""durability.md, item life 1: "No transaction stays open while an LLM or IMAP call runs."

The real daemon with the real pipelines against a slow scripted model (every call takes 1.5 s):
while the calls run, no session of the database sits "idle in transaction" and no statement
stays active for the length of a call (a claim's FOR UPDATE would then hold row locks through
the LLM call).
"""

from __future__ import annotations

import time
from pathlib import Path

import psycopg
import pytest

from sokratos_worker.testing.scripted_llm import CHAT, ScriptedLLM
from tests.faults.support import (
    EMBED_DIM,
    answer,
    assert_exactly_once,
    enqueue_distillation,
    enqueue_triage,
    exchange,
    messages_archive,
    outcome_count,
    pipeline_env,
    start_worker,
    stop,
    tail,
)

pytestmark = [pytest.mark.faults, pytest.mark.subprocess, pytest.mark.slow]

OPEN = (
    "SELECT state, now() - coalesce(xact_start, query_start), left(query, 120)"
    " FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    " AND backend_type = 'client backend'"
    # (A transaction between two of its statements is idle in it for a moment: only one
    # open for half of a 1.5 s call counts.)
    " AND ((state LIKE 'idle in transaction%%' AND now() - xact_start > interval '0.5 second')"
    "      OR (state = 'active' AND now() - query_start > interval '1 second'"
    "          AND query NOT ILIKE '%%LISTEN%%'))"
)


@pytest.mark.timeout(180)
def test_no_transaction_is_open_while_the_model_answers(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    # A third item repeating the first's token is added once the first is saved: its attempt
    # reads the memories (duplicate / contradiction candidates) around its chat call.
    keys = [enqueue_triage(db, exchange("toktx1", save=True)) for _ in range(1)]
    keys.append(enqueue_distillation(db, messages_archive("toktx2")))
    log = tmp_path / "worker.log"
    seen: list[tuple[object, ...]] = []
    with (
        ScriptedLLM(chat=answer, latency=1.5) as server,
        ScriptedLLM(embed_dim=EMBED_DIM) as embed,
    ):
        env = pipeline_env(database_url, tmp_path, [server], embed, backend_timeout=10.0)
        proc = start_worker(env, log)
        try:
            deadline = time.monotonic() + 120
            while outcome_count(db) < len(keys) and time.monotonic() < deadline:
                seen.extend(db.execute(OPEN).fetchall())
                if outcome_count(db) >= 1 and len(keys) == 2:
                    keys.append(enqueue_triage(db, exchange("toktx1", save=True)))
                time.sleep(0.1)
            assert outcome_count(db) >= len(keys), tail(log)
            calls = server.count(CHAT)
        finally:
            assert stop(proc) == 0, tail(log)
    assert calls >= 2, calls  # the calls really ran while we watched
    assert_exactly_once(db, keys)
    assert not seen, seen
