"""durability.md, table row "every backend answers 401/403/404 (a configuration problem) |
released; claiming pauses; `status`/`check` name the backend | given back", end to end: the
real daemon with the real pipelines against scripted servers refusing every request (and the
probe) with 401 and 404. Nothing is dead-lettered, no attempt is used, the state is "no backend"
and `status` names each backend and the refusal; once the servers accept, the items are saved
with one attempt each.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import psycopg
import pytest

from sokratos_worker.testing.scripted_llm import CHAT, HEALTH, MODELS, PROBE, Reply, ScriptedLLM
from tests.faults.support import (
    EMBED_DIM,
    answer,
    assert_exactly_once,
    cli,
    enqueue_triage,
    exchange,
    outcome_count,
    pipeline_env,
    scalar,
    start_worker,
    stop,
    tail,
)
from tests.support.daemon import wait_until

pytestmark = [pytest.mark.faults, pytest.mark.subprocess, pytest.mark.slow]


def _refuse(server: ScriptedLLM, status: int, message: str) -> None:
    for path in (CHAT, PROBE, MODELS, HEALTH):
        server.on(path, lambda r, s=status, m=message: Reply.error(s, m))


def _status(env: dict[str, str]) -> list[dict[str, object]]:
    result = cli(env, "status", "--json", timeout=30)
    if result.returncode != 0:
        return []
    return list(json.loads(result.stdout).get("workers", []))


@pytest.mark.timeout(180)
def test_every_backend_refusing_with_401_and_404_gives_attempts_back_and_names_them(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    keys = [enqueue_triage(db, exchange(f"tokcfg{i}", save=True)) for i in range(4)]
    log = tmp_path / "worker.log"
    with (
        ScriptedLLM(chat=answer) as primary,
        ScriptedLLM(chat=answer) as fallback,
        ScriptedLLM(embed_dim=EMBED_DIM) as embed,
    ):
        _refuse(primary, 401, "invalid api key")
        _refuse(fallback, 404, "model 'scripted' not found")
        env = pipeline_env(
            database_url, tmp_path, [primary, fallback], embed, SOKRATOS_MAX_ATTEMPTS="2"
        )
        proc = start_worker(env, log)
        try:
            assert wait_until(
                lambda: any(w.get("state") == "no backend" for w in _status(env)), timeout=60
            ), tail(log)
            time.sleep(3)  # long enough for a worker that retried to use attempts up
            assert outcome_count(db) == 0, tail(log)
            assert scalar(db, "SELECT count(*) FROM failed_operations") == 0
            assert scalar(db, "SELECT coalesce(max(attempts), 0) FROM pending_triage") == 0
            assert scalar(
                db, "SELECT count(*) FROM pending_triage WHERE lease_owner IS NOT NULL"
            ) == 0
            [worker] = _status(env)
            why = json.dumps(worker)
            # status names the backends and why they refuse (a configuration problem).
            assert "primary" in why and "fallback" in why, why
            assert "401" in why and "404" in why, why
            text = cli(env, "status", timeout=30).stdout
            assert "no backend" in text and "primary" in text, text
            # The configuration is fixed: claiming resumes, one attempt each.
            for server in (primary, fallback):
                server.on(CHAT, answer)
                server.on(PROBE, lambda r: Reply.chat("OK"))
                server.on(MODELS, lambda r: Reply(json_body={"object": "list", "data": []}))
                server.on(HEALTH, lambda r: Reply(json_body={"status": "ok"}))
            assert wait_until(lambda: outcome_count(db) >= len(keys), timeout=90), tail(log)
        finally:
            assert stop(proc) == 0, tail(log)
    assert_exactly_once(db, keys)
    rows = db.execute("SELECT outcome, attempts FROM work_outcomes").fetchall()
    assert sorted(rows) == [("saved", 1)] * len(keys), rows
