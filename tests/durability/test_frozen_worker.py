"""A worker process frozen with SIGSTOP (not killed: a paused VM, a suspended laptop, a
`docker pause`), then resumed with SIGCONT: fenced if another took its item over, quiet if
idle, never calling itself stalled.

Real daemons (subprocesses), real PostgreSQL, scripted OpenAI-compatible servers.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from pathlib import Path

import psycopg
import pytest

from sokratos_worker.testing.scripted_llm import ScriptedLLM
from tests.faults.support import (
    EMBED_DIM,
    DelayedAnswers,
    answer,
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

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


@pytest.mark.timeout(180)
def test_frozen_mid_item_past_its_lease_is_fenced_after_resume(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    key = enqueue_triage(db, exchange("tokfrz1", save=True))
    chat = DelayedAnswers(9.0, first_only=True)
    log_a = tmp_path / "a.log"
    log_b = tmp_path / "b.log"
    with ScriptedLLM(chat=chat) as server, ScriptedLLM(embed_dim=EMBED_DIM) as embed:
        env = pipeline_env(database_url, tmp_path, [server], embed, backend_timeout=30.0)
        a = start_worker(env, log_a)
        b = None
        try:
            assert wait_until(lambda: chat.calls >= 1, timeout=60), tail(log_a)
            owner_a = db.execute(
                "SELECT lease_owner, attempts FROM pending_triage WHERE id = %s", (key[1],)
            ).fetchone()
            assert owner_a is not None and owner_a[1] == 1
            os.kill(a.pid, signal.SIGSTOP)
            frozen_at = time.monotonic()
            b = start_worker(env, log_b)
            assert wait_until(lambda: outcome_count(db) >= 1, timeout=60), tail(log_b)
            # The slow answer to A has been sent by now (9 s after its request).
            time.sleep(max(0.0, 10.0 - (time.monotonic() - frozen_at)))
            os.kill(a.pid, signal.SIGCONT)
            # A reads its answer, embeds, and tries to settle: it must be refused.
            assert wait_until(
                lambda: any(
                    e.get("item_id") == key[1] and e.get("attempt") == 1 and e.get("event")
                    in ("lease_lost", "item_already_settled", "item_settled", "item_gone")
                    for e in log_events(log_a)
                ),
                timeout=30,
            ), tail(log_a)
            time.sleep(2.5)  # a tick or two after the refusal
            assert a.poll() is None, tail(log_a)
        finally:
            os.kill(a.pid, signal.SIGCONT)
            code_a = stop(a)
            code_b = stop(b) if b is not None else 0
    assert code_a == 0, tail(log_a)
    assert code_b == 0, tail(log_b)
    assert_exactly_once(db, [key])
    outcome = db.execute(
        "SELECT outcome, memory_ids FROM work_outcomes WHERE queue = %s AND item_id = %s", key
    ).fetchone()
    assert outcome is not None and outcome[0] == "saved", outcome
    assert db.execute("SELECT count(*) FROM memories").fetchone()[0] == 1
    assert db.execute("SELECT count(*) FROM failed_operations").fetchone()[0] == 0
    events_a = log_events(log_a)
    errors_a = [e for e in events_a if e.get("level") in ("error", "critical")]
    assert not errors_a, errors_a
    about = [
        (e.get("event"), e.get("level"), e.get("outcome"), e.get("new_owner"))
        for e in events_a
        if e.get("item_id") == key[1] and e.get("event") != "llm_call_finished"
    ]
    # durability.md, item life 3: the fenced worker "logs that it lost the lease". It must not
    # report the other worker's outcome as its own settle.
    assert any(e[0] == "lease_lost" for e in about), about
    assert not any(e[0] == "item_already_settled" for e in about), about
    # The item is counted once over both workers' tick_finished reports (and metrics).
    settled = 0
    for events in (events_a, log_events(log_b)):
        for e in events:
            if e.get("event") == "tick_finished":
                q = (e.get("queues") or {}).get("pending_triage") or {}
                settled += sum(q.get(k, 0) for k in ("saved", "skipped", "archived", "failed"))
    assert settled == 1, f"the item's outcome was counted {settled} times by the two workers"


def _ts(e: dict) -> float:
    from datetime import datetime

    return datetime.fromisoformat(str(e["timestamp"]).replace("Z", "+00:00")).timestamp()


@pytest.mark.timeout(120)
def test_frozen_while_idle_resumes_quietly(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    log_a = tmp_path / "a.log"
    with ScriptedLLM(chat=answer) as server, ScriptedLLM(embed_dim=EMBED_DIM) as embed:
        env = pipeline_env(database_url, tmp_path, [server], embed)
        a = start_worker(env, log_a)
        try:
            assert wait_until(lambda: "worker_started" in log_a.read_text(), timeout=60)
            time.sleep(2.0)
            # Someone else's item, leased to another worker, while A sleeps: enqueued and
            # leased in one transaction, so A (woken by the commit's NOTIFY) never claims it.
            with db.transaction():
                other = enqueue_triage(db, exchange("tokoth1", save=True))
                db.execute(
                    "UPDATE pending_triage SET lease_owner = 'someone-else', attempts = 1,"
                    " lease_expires_at = now() + interval '60 seconds' WHERE id = %s",
                    (other[1],),
                )
            os.kill(a.pid, signal.SIGSTOP)
            time.sleep(10.0)
            resumed = time.time()
            os.kill(a.pid, signal.SIGCONT)
            mine = enqueue_triage(db, exchange("tokmine1", save=True))
            assert wait_until(lambda: outcome_count(db) >= 1, timeout=30), tail(log_a)
            time.sleep(4.0)
            assert a.poll() is None, tail(log_a)
            row = db.execute(
                "SELECT lease_owner, attempts FROM pending_triage WHERE id = %s", (other[1],)
            ).fetchone()
        finally:
            os.kill(a.pid, signal.SIGCONT)
            code = stop(a)
    assert code == 0, tail(log_a)
    assert row == ("someone-else", 1)
    assert_exactly_once(db, [mine])
    after = [e for e in log_events(log_a) if _ts(e) >= resumed - 0.5]
    noisy = [e for e in after if e.get("level") in ("warning", "error", "critical")]
    ticks = [e for e in after if e.get("event") == "tick_finished"]
    print("\nafter resume:", [(e.get("event"), e.get("level")) for e in after][:30])
    assert not noisy, noisy  # no scheduled_job_missed burst: the missed ticks coalesce
    assert ticks, "no tick after the resume"


@pytest.mark.timeout(240)
def test_frozen_longer_than_the_stall_limit_then_resumed_is_not_called_stalled(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """A VM paused, a laptop lid closed, a `docker pause`: the process is frozen as a whole for
    longer than DISPATCHER_STALL_S (120 s). Resumed, the dispatcher comes round within a second;
    the worker must not report its own dispatcher as hung nor stop the watchdog pings."""
    import socket

    log_a = tmp_path / "a.log"
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(0.2)
    received: list[tuple[float, str]] = []
    stop_reading = threading.Event()

    def read() -> None:
        while not stop_reading.is_set():
            try:
                data = sock.recv(4096)
            except OSError:
                continue
            received.append((time.time(), data.decode(errors="replace")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    with ScriptedLLM(chat=answer) as server, ScriptedLLM(embed_dim=EMBED_DIM) as embed:
        env = pipeline_env(
            database_url, tmp_path, [server], embed,
            NOTIFY_SOCKET=str(sock_path), WATCHDOG_USEC="4000000",
        )
        a = start_worker(env, log_a)
        try:
            assert wait_until(lambda: "worker_started" in log_a.read_text(), timeout=60)
            time.sleep(2.0)
            os.kill(a.pid, signal.SIGSTOP)
            time.sleep(125.0)
            resumed = time.time()
            os.kill(a.pid, signal.SIGCONT)
            time.sleep(6.0)
            assert a.poll() is None, tail(log_a)
        finally:
            os.kill(a.pid, signal.SIGCONT)
            code = stop(a)
            stop_reading.set()
            reader.join(2)
            sock.close()
    assert code == 0, tail(log_a)
    after = [e for e in log_events(log_a) if _ts(e) >= resumed - 0.5]
    print("\nafter resume:", [(e.get("event"), e.get("level")) for e in after][:30])
    stalled = [e for e in after if e.get("event") == "dispatcher_stalled"]
    assert not stalled, stalled
    pings = [t for t, msg in received if t >= resumed and "WATCHDOG=1" in msg]
    # Generous bounds (a loaded machine): within the 4 s watchdog, which is what matters.
    assert pings and pings[0] - resumed < 3.5, (pings[:3], resumed)
    gaps = [b - a_ for a_, b in itertools.pairwise(pings)]
    assert all(g < 3.9 for g in gaps), gaps
