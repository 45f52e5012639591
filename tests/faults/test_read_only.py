"""The database turns read-only under a running worker (its URL now reaches a standby, as
during a failover) and writable again: waited out like an outage, nothing lost or doubled;
a worker that starts against a read-only server says so and exits 75."""

from __future__ import annotations

import time
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from sokratos_worker.testing.scripted_llm import ScriptedLLM
from tests.faults.support import (
    EMBED_DIM,
    Key,
    answer,
    assert_exactly_once,
    cli,
    enqueue_triage,
    exchange,
    outcome_count,
    pipeline_env,
    report,
    start_worker,
    stop,
    tail,
    time_to_next_outcome,
)
from tests.support.daemon import daemon_env, start_daemon, wait_until
from tests.support.db import enqueue_many

pytestmark = [pytest.mark.faults, pytest.mark.subprocess, pytest.mark.slow]


def _set_read_only(db: psycopg.Connection, on: bool) -> None:
    """New sessions get the setting; the worker's sessions are ended so it reconnects."""
    name = db.info.dbname
    statement = "ALTER DATABASE {} SET default_transaction_read_only = on" if on else (
        "ALTER DATABASE {} RESET default_transaction_read_only"
    )
    db.execute(sql.SQL(statement).format(sql.Identifier(name)))
    db.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )


@pytest.mark.timeout(240)
def test_a_database_that_turns_read_only_and_back_is_waited_out(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    keys: list[Key] = [
        enqueue_triage(db, exchange(f"tokro{i}", save=i % 2 == 0)) for i in range(200)
    ]
    log = tmp_path / "worker.log"
    with (
        ScriptedLLM(chat=answer, latency=0.02) as server,
        ScriptedLLM(embed_dim=EMBED_DIM) as embed,
    ):
        env = pipeline_env(database_url, tmp_path, [server], embed)
        proc = start_worker(env, log)
        try:
            assert wait_until(lambda: outcome_count(db) >= 40, timeout=90), tail(log)
            _set_read_only(db, True)
            assert wait_until(lambda: "read-only" in log.read_text(), timeout=30), tail(log)
            stalled = outcome_count(db)
            time.sleep(3.0)  # a while of refused writes: no outcome can land
            assert outcome_count(db) == stalled
            assert proc.poll() is None, "the worker died on a read-only database: " + tail(log)
            _set_read_only(db, False)
            back = time.monotonic()
            recover = time_to_next_outcome(db, stalled, back, timeout=60)
            assert wait_until(lambda: outcome_count(db) >= len(keys), timeout=120), tail(log)
            fig = assert_exactly_once(db, keys)
        finally:
            assert stop(proc) == 0, tail(log)
    text = log.read_text()
    assert "target_session_attrs=read-write" in text
    assert '"claim_failed"' not in text, "a read-only server is an outage, not a crash"
    report("database_read_only_then_writable", fig, recover, done_before=stalled)


def test_a_read_only_server_at_start_exits_75_and_check_and_status_say_why(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    _set_read_only(db, True)
    with ScriptedLLM() as server, ScriptedLLM(embed_dim=EMBED_DIM) as embed:
        env = pipeline_env(database_url, tmp_path, [server], embed, SOKRATOS_STARTUP_TIMEOUT="2s")
        log = tmp_path / "worker.log"
        assert start_worker(env, log).wait(60) == 75
        assert "read-only" in log.read_text() and "primary" in log.read_text(), tail(log)
        checked = cli(env, "check")
        status = cli(env, "status")
    assert status.returncode == 0, status.stderr
    assert "read-only: the server is read-only" in status.stdout, status.stdout
    assert checked.returncode == 1
    [line] = [x for x in checked.stdout.splitlines() if x.split()[:1] == ["database"]] or [
        checked.stdout
    ]
    assert "read-only" in line, checked.stdout


def test_run_once_cut_off_by_a_read_only_server_exits_75_and_the_next_run_finishes(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    n = 120
    enqueue_many(db, n, behaviour="sleep:0.05")
    env = daemon_env(database_url, tmp_path, SOKRATOS_TICK_BUDGET="6s", SOKRATOS_LEASE="2s")
    log = tmp_path / "once.log"
    proc = start_daemon(env, log, "--once")
    assert wait_until(lambda: outcome_count(db) >= 20, timeout=60), tail(log)
    _set_read_only(db, True)
    assert proc.wait(90) == 75, tail(log)
    assert "run_once_incomplete" in log.read_text()
    left = n - outcome_count(db)
    assert left > 0
    _set_read_only(db, False)
    again = start_daemon(env, log, "--once")
    assert again.wait(90) == 0, tail(log)
    assert outcome_count(db) == n
    assert db.execute("SELECT count(DISTINCT item_id) FROM work_outcomes").fetchone() == (n,)
    assert db.execute("SELECT count(*) FROM pending_triage").fetchone() == (0,)
