"""A database outage is said once, not per item and per retry: its start (waiting_for_database,
with a hint) and its end (database_reachable_again, with how long it lasted), also when every
slot is busy and the dispatcher never claims (before, neither was logged then, and each item in
flight logged settle_waiting_for_database at every retry: ~65 warnings in a 70 s outage at
concurrency 8)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from sokratos_worker.testing.scripted_llm import ScriptedLLM
from tests.faults.support import (
    EMBED_DIM,
    DelayedAnswers,
    assert_exactly_once,
    enqueue_triage,
    exchange,
    log_events,
    outcome_count,
    pipeline_env,
    start_worker,
    stop,
    tail,
)
from tests.support.daemon import wait_until

pytestmark = [pytest.mark.faults, pytest.mark.subprocess, pytest.mark.slow]

# Long enough for the settles to meet it: each memory read waits 5 s for a connection first.
DOWN_S = 25.0


@pytest.mark.timeout(240)
def test_an_outage_with_every_slot_busy_is_said_once_with_its_end(
    db: psycopg.Connection,
    database_url: str,
    tmp_path: Path,
    restart_postgres: Callable[[float], None],
) -> None:
    keys = [enqueue_triage(db, exchange(f"tokout{i}", save=True)) for i in range(6)]
    chat = DelayedAnswers(2.0)
    log = tmp_path / "worker.log"
    with ScriptedLLM(chat=chat) as server, ScriptedLLM(embed_dim=EMBED_DIM) as embed:
        env = pipeline_env(
            database_url, tmp_path, [server], embed, backend_timeout=30.0, SOKRATOS_CONCURRENCY="2"
        )
        env["SOKRATOS_LEASE"] = "2m"  # the settles wait the outage out rather than give up
        proc = start_worker(env, log)
        try:
            assert wait_until(lambda: chat.calls >= 2, timeout=60), tail(log)
            db.close()
            # Both slots are in their model calls: their settles meet the outage.
            restart_postgres(DOWN_S)
            with psycopg.connect(database_url, autocommit=True) as again:
                assert wait_until(lambda: outcome_count(again) >= len(keys), timeout=120), tail(
                    log
                )
                assert_exactly_once(again, keys)
        finally:
            assert stop(proc) == 0, tail(log)
    events = log_events(log)
    named = lambda name: [e for e in events if e.get("event") == name]  # noqa: E731
    [start] = named("waiting_for_database")
    assert start["level"] == "warning" and "nothing is lost" in start["hint"], start
    [end] = named("database_reachable_again")
    assert 0 < end["down_s"] < DOWN_S + 30, end  # from when the worker first met it
    settle_waits = named("settle_waiting_for_database")
    assert 1 <= len(settle_waits) <= 2, settle_waits  # each item in flight once, at info
    assert {e["level"] for e in settle_waits} == {"info"}, settle_waits
    listener = [e for e in named("listen_reconnecting") if e["level"] == "warning"]
    assert len(listener) <= 1, listener
