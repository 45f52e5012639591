"""Scenarios 2 and 7: PostgreSQL restarted under load, and kill -9 of the worker, repeatedly,
both with the real pipelines against a scripted model."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from sokratos_worker.testing.scripted_llm import ScriptedLLM
from tests.faults.support import (
    EMBED_DIM,
    Chaos,
    Key,
    assert_exactly_once,
    enqueue_distillation,
    enqueue_triage,
    exchange,
    messages_archive,
    outcome_count,
    pipeline_env,
    report,
    start_worker,
    stop,
    tail,
    text_archive,
    time_to_next_outcome,
)
from tests.support.daemon import wait_until

pytestmark = [pytest.mark.faults, pytest.mark.subprocess, pytest.mark.slow]


def _load(db: psycopg.Connection, n: int, prefix: str) -> list[Key]:
    keys: list[Key] = []
    with db.transaction():
        for i in range(n):
            tok = f"tok{prefix}{i}"
            if i % 5 == 3:
                keys.append(enqueue_distillation(db, messages_archive(tok)))
            elif i % 5 == 4:
                keys.append(enqueue_distillation(db, text_archive(tok)))
            else:
                keys.append(enqueue_triage(db, exchange(tok, save=i % 5 != 2, tools=i % 2 == 0)))
    return keys


@pytest.mark.timeout(240)
def test_postgres_restart_under_load_with_the_real_pipelines(
    db: psycopg.Connection,
    database_url: str,
    tmp_path: Path,
    restart_postgres: Callable[[float], None],
) -> None:
    keys = _load(db, 300, "pg")
    log = tmp_path / "worker.log"
    with (
        ScriptedLLM(chat=Chaos(), latency=0.02) as server,
        ScriptedLLM(embed_dim=EMBED_DIM) as embed,
    ):
        env = pipeline_env(database_url, tmp_path, [server], embed)
        proc = start_worker(env, log)
        try:
            assert wait_until(lambda: outcome_count(db) >= 60, timeout=90), tail(log)
            db.close()
            restart_postgres(8.0)  # longer than the pool's wait: the worker must ride it out
            back = time.monotonic()
            assert proc.poll() is None, "the worker died with the database: " + tail(log)
            with psycopg.connect(database_url, autocommit=True) as again:
                before = outcome_count(again)
                recover = time_to_next_outcome(again, before, back, timeout=60)
                assert wait_until(lambda: outcome_count(again) >= len(keys), timeout=120), tail(log)
                assert proc.poll() is None
                fig = assert_exactly_once(again, keys)
        finally:
            assert stop(proc) == 0, tail(log)
    text = log.read_text()
    assert "waiting_for_database" in text or "settle_waiting_for_database" in text
    report("postgres_restart_8s_under_load", fig, recover, done_before_restart=before)


@pytest.mark.timeout(300)
def test_kill_9_during_drains_repeatedly(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    keys = _load(db, 600, "k")
    log = tmp_path / "worker.log"
    recoveries: list[float] = []
    kills = 0
    with (
        ScriptedLLM(chat=Chaos(error_rate=0.05, seed=3), latency=0.03) as server,
        ScriptedLLM(embed_dim=EMBED_DIM) as embed,
    ):
        env = pipeline_env(database_url, tmp_path, [server], embed)
        proc = start_worker(env, log)
        try:
            for step in range(1, 6):
                target = len(keys) * step // 7
                assert wait_until(
                    lambda t=target, p=proc: outcome_count(db) >= t or p.poll() is not None,
                    timeout=120,
                ), tail(log)
                assert proc.poll() is None, tail(log)
                proc.kill()
                proc.wait(10)
                kills += 1
                done = outcome_count(db)
                assert done < len(keys), "the drain finished before the kill: slow the model"
                restarted = time.monotonic()
                proc = start_worker(env, log)
                recoveries.append(time_to_next_outcome(db, done, restarted, timeout=60))
            assert wait_until(lambda: outcome_count(db) >= len(keys), timeout=180), tail(log)
        finally:
            assert stop(proc) == 0, tail(log)
    assert kills >= 5
    fig = assert_exactly_once(db, keys)
    worker_died = db.execute(
        "SELECT count(*) FROM work_outcomes WHERE detail LIKE '%worker died%'"
    ).fetchone()
    report(
        f"kill9_x{kills}_during_drains",
        fig,
        recoveries,
        died_on_last_attempt=worker_died[0] if worker_died else 0,
    )
