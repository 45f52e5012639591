"""A migration holds the queue and bookkeeping tables (ACCESS EXCLUSIVE) under load and the
worker is stopped meanwhile: the stop ends in bounded time (it used to wait for the lock),
producers' enqueues meanwhile are spooled (they used to wait), and a new worker finishes the
work once the lock is gone, the spooled items included, nothing lost or doubled."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from sokratos_worker.testing.scripted_llm import ScriptedLLM
from tests.faults.support import (
    EMBED_DIM,
    Key,
    answer,
    assert_exactly_once,
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
from tests.support.daemon import ROOT, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.subprocess, pytest.mark.slow]

LOCKED = "pending_triage, worker_heartbeats, failed_operations"


@pytest.mark.timeout(240)
def test_a_stop_while_a_migration_holds_the_tables_ends_and_loses_nothing(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    keys: list[Key] = [
        enqueue_triage(db, exchange(f"toklock{i}", save=i % 2 == 0)) for i in range(200)
    ]
    log = tmp_path / "worker.log"
    locker = psycopg.connect(database_url)
    with (
        ScriptedLLM(chat=answer, latency=0.02) as server,
        ScriptedLLM(embed_dim=EMBED_DIM) as embed,
    ):
        env = pipeline_env(
            database_url, tmp_path, [server], embed, SOKRATOS_SHUTDOWN_GRACE="2s"
        )
        proc = start_worker(env, log)
        try:
            assert wait_until(lambda: outcome_count(db) >= 40, timeout=90), tail(log)
            locker.execute(f"LOCK TABLE {LOCKED} IN ACCESS EXCLUSIVE MODE")
            stalled = outcome_count(db)
            time.sleep(3.0)  # settles and claims wait behind the lock: no outcome lands
            assert outcome_count(db) == stalled
            assert proc.poll() is None, "the worker died behind a lock: " + tail(log)
            spooled = [
                _enqueue_by_cli(env, f"toklockspool{i}", key=f"lockspool-{i}") for i in (0, 1)
            ]
            assert all(out.startswith("spooled ") for out in spooled), spooled
            asked = time.monotonic()
            assert stop(proc, timeout=60) == 0, tail(log)
            stop_s = time.monotonic() - asked
        finally:
            locker.rollback()  # the migration ends
            locker.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        text = log.read_text()
        assert "release_failed" in text and "heartbeat_timed_out" in text, tail(log)
        # Grace 2 s, then the release and the last heartbeat give up after 5 s each (12.5 s
        # measured; the pool's close also waited 5 s for a new connection's warm-up). It
        # used to wait for as long as the lock was held.
        assert stop_s < 2 + 5 + 5 + 13, f"the stop took {stop_s:.1f} s"
        restarted = time.monotonic()
        again = start_worker(env, log)
        try:
            recover = time_to_next_outcome(db, stalled, restarted, timeout=60)
            assert wait_until(lambda: outcome_count(db) >= len(keys) + 2, timeout=120), tail(log)
            rows = db.execute(
                "SELECT item_id FROM sokratos_idempotency_keys WHERE key LIKE 'lockspool-%'"
            ).fetchall()
            keys += [("pending_triage", int(row[0])) for row in rows]
            assert len(rows) == 2
            fig = assert_exactly_once(db, keys)
            assert not list((tmp_path / "data" / "spool").glob("*.json"))
        finally:
            assert stop(again) == 0, tail(log)
    report(
        "migration_lock_with_a_stop",
        fig,
        recover,
        done_before=stalled,
        stop_s=round(stop_s, 2),
        spooled_during_lock=len(spooled),
    )


def _enqueue_by_cli(env: dict[str, str], tok: str, *, key: str) -> str:
    """``sokratos-worker enqueue triage`` as a producer runs it; its stdout."""
    text = exchange(tok, save=True)["exchange"]
    proc = subprocess.run(
        [sys.executable, "-m", "sokratos_worker", "enqueue", "triage", "--exchange", text,
         "--key", key],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()
