"""An attempt that died with its worker (kill -9, or a settle abandoned in an outage) is
counted in ``attempts`` and is in the dead letter's history (``context_data.attempts``):
durability.md's "failed_operations (full payload, every attempt's error)". It was missing
unless it was the last one, so the record said N attempts and listed N-1."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from sokratos_worker.testing.scripted_llm import ScriptedLLM
from tests.faults.support import (
    EMBED_DIM,
    POISON,
    answer,
    enqueue_triage,
    pipeline_env,
    start_worker,
    stop,
    tail,
)
from tests.support.daemon import wait_until

pytestmark = [pytest.mark.faults, pytest.mark.subprocess]


@pytest.mark.timeout(120)
def test_an_attempt_that_died_with_its_worker_is_in_the_dead_letters_history(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    key = enqueue_triage(db, {"exchange": f"user: my code word is tokd1 {POISON}\nassistant: ok"})
    # As a worker killed with SIGKILL leaves it: claimed (attempt 1 counted), lease expired.
    db.execute(
        "UPDATE pending_triage SET attempts = 1, lease_owner = 'vm@a:4242:dead00',"
        " lease_expires_at = now() - interval '1 second' WHERE id = %s",
        (key[1],),
    )
    log = tmp_path / "worker.log"
    with ScriptedLLM(chat=answer) as server, ScriptedLLM(embed_dim=EMBED_DIM) as embed:
        env = pipeline_env(database_url, tmp_path, [server], embed, SOKRATOS_MAX_ATTEMPTS="3")
        proc = start_worker(env, log)
        try:
            assert wait_until(
                lambda: db.execute("SELECT count(*) FROM work_outcomes").fetchone() == (1,),
                timeout=60,
            ), tail(log)
        finally:
            assert stop(proc) == 0, tail(log)
    row = db.execute(
        "SELECT attempts, context_data -> 'attempts' FROM failed_operations"
        " WHERE source_queue = 'pending_triage' AND item_id = %s",
        (key[1],),
    ).fetchone()
    assert row is not None, tail(log)
    attempts, history = row
    assert attempts == 3
    # Every attempt counted is in the history, the one that died included.
    assert [e["attempt"] for e in history] == [1, 2, 3], history
    assert "died" in history[0]["error"], history
