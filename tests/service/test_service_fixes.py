"""Service-layer defects a review proved, each against a real PostgreSQL: a large spool held up
the start and a stop, `run --once` looked dead during a long drain, retention never ran under
`run --once` (and only an hour after `run` started), the stop's grace showed as "running",
items settled in the grace appeared in no report, a refused LISTEN connection made the worker
not ready, and a busy metrics port exited 78 (never restarted)."""

from __future__ import annotations

import gc
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from structlog.testing import capture_logs

from sokratos_worker import daemon, spool
from sokratos_worker.app import _once_restoring_signals
from sokratos_worker.config import Settings
from sokratos_worker.daemon import Worker, build_worker
from sokratos_worker.exit_codes import EXIT_TEMPFAIL
from sokratos_worker.model import Queue
from sokratos_worker.service.sdnotify import Notifier
from sokratos_worker.spool import import_spool, spool_enqueue
from sokratos_worker.store.connection import Database
from tests.support.daemon import wait_until
from tests.support.db import count, enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings

pytestmark = pytest.mark.postgres


def _events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in list(logs) if e.get("event") == name]


@contextmanager
def _signals_restored() -> Iterator[None]:
    """``serve`` installs its own stop handlers: put pytest's back afterwards."""
    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {signum: signal.getsignal(signum) for signum in stop_signals}
    try:
        yield
    finally:
        gc.unfreeze()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _triage_worker(database: Database, settings: Settings, handler: ScriptedHandler) -> Worker:
    return build_worker(
        settings,
        database,
        lambda _ctx: {Queue.TRIAGE: handler},
        None,
        None,
        notifier=Notifier({}),
    )


def _sigterm_when(condition: Callable[[], bool], then: Callable[[], None] | None = None) -> None:
    """In a thread: SIGTERM this process once ``condition`` holds, then run ``then``."""

    def watch() -> None:
        if wait_until(condition, timeout=30):
            os.kill(os.getpid(), signal.SIGTERM)  # (the handler runs in the main thread)
            if then is not None:
                then()

    threading.Thread(target=watch, daemon=True).start()


# -- 1. a large spool is imported a bounded number of files at a time ---------------------


def test_a_spool_import_takes_a_bounded_number_of_files_and_says_how_many_are_left(
    db: psycopg.Connection, database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With SPOOL_FILES_PER_IMPORT files per import, a backlog is imported over several ticks
    (each short, so a start or a stop is never held up for the whole backlog): every file
    exactly once, oldest first, and each limited import says how many wait."""
    monkeypatch.setattr(spool, "SPOOL_FILES_PER_IMPORT", 3, raising=False)
    spool_dir = tmp_path / "spool"
    for i in range(7):
        spool_enqueue(
            spool_dir,
            Queue.TRIAGE,
            {"exchange": f"user: {i}\nassistant: ok"},
            idempotency_key=f"spooled-{i}",
            source=None,
        )
    database = Database(database_url, size=1)
    try:
        with capture_logs() as logs:
            imported = [import_spool(spool_dir, database) for _ in range(4)]
    finally:
        database.close()
    assert imported == [3, 3, 1, 0]
    assert [e["left"] for e in _events(logs, "spool_import_limited")] == [4, 1]
    keys = db.execute(
        "SELECT k.key FROM pending_triage t"
        " JOIN sokratos_idempotency_keys k ON k.item_id = t.id AND k.queue = 'pending_triage'"
        " ORDER BY t.id"
    ).fetchall()
    assert [k for (k,) in keys] == [f"spooled-{i}" for i in range(7)]
    assert list(spool_dir.glob("*.json")) == []


def test_a_spool_import_of_slow_files_ends_at_its_time_budget(
    db: psycopg.Connection, database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files that each take long to store (large conversations) end an import at its time
    budget, checked between files: the file limit alone held a start or a stop for as long
    as 1,000 such files took. Every file is still imported once, over several imports."""
    monkeypatch.setattr(spool, "SPOOL_IMPORT_BUDGET_S", 0.5, raising=False)
    db.execute(
        """CREATE FUNCTION slow_insert() RETURNS trigger LANGUAGE plpgsql AS
           $$BEGIN PERFORM pg_sleep(0.4); RETURN NEW; END$$;
           CREATE TRIGGER slow_insert BEFORE INSERT ON pending_triage
           FOR EACH ROW EXECUTE FUNCTION slow_insert()"""
    )
    spool_dir = tmp_path / "spool"
    for i in range(4):
        spool_enqueue(
            spool_dir,
            Queue.TRIAGE,
            {"exchange": f"user: {i}\nassistant: ok"},
            idempotency_key=f"slow-{i}",
            source=None,
        )
    database = Database(database_url, size=1)
    try:
        with capture_logs() as logs:
            first = import_spool(spool_dir, database)
            rest = [import_spool(spool_dir, database) for _ in range(4)]
    finally:
        database.close()
    assert first in (1, 2), first  # (0.4 s a file, 0.5 s budget: 4 before)
    assert first + sum(rest) == 4
    assert _events(logs, "spool_import_limited")[0]["left"] == 4 - first
    assert count(db, "SELECT count(*) FROM pending_triage") == 4
    assert list(spool_dir.glob("*.json")) == []


# -- 2. `run --once` writes its heartbeat while it drains ---------------------------------


@pytest.mark.timeout(120)
def test_run_once_writes_its_heartbeat_every_interval_while_it_drains(
    db: psycopg.Connection, database_url: str
) -> None:
    """A drain longer than three heartbeats: the row's last tick moves on every interval (or
    `status` calls the working `run --once` dead), then ends "stopped"."""
    database = Database(database_url, size=3)
    ticks: set[datetime] = set()
    drained = threading.Event()

    def watch_heartbeats() -> None:
        with psycopg.connect(database_url, autocommit=True) as look:
            while not drained.is_set():
                for state, at in look.execute(
                    "SELECT state, last_tick_at FROM worker_heartbeats"
                ).fetchall():
                    if state == "running":
                        ticks.add(at)
                time.sleep(0.1)

    try:
        worker = _triage_worker(
            database, fast_settings(concurrency=1, heartbeat_interval=1), ScriptedHandler()
        )
        (item_id,) = enqueue_many(db, 1, behaviour="sleep:4.5")
        watcher = threading.Thread(target=watch_heartbeats, daemon=True)
        watcher.start()
        code = _once_restoring_signals(worker)
        drained.set()
        watcher.join(10)
    finally:
        database.close()
    assert code == 0
    assert count(db, "SELECT count(*) FROM work_outcomes WHERE item_id = %s", item_id) == 1
    assert len(ticks) >= 4, f"the heartbeat was written {len(ticks)} times in a 4.5 s drain"
    assert db.execute("SELECT state FROM worker_heartbeats").fetchall() == [("stopped",)]


# -- 3. retention runs under `run --once`, and soon after `run` starts ----------------------


def _old_rows(db: psycopg.Connection) -> None:
    """A processed email, a failure and a heartbeat row far past their retention."""
    db.execute(
        "INSERT INTO processed_emails (message_id, seen_at)"
        " VALUES ('<old@x>', now() - interval '200 days')"
    )
    db.execute(
        "INSERT INTO failed_operations (op_type, label, error_message, created_at)"
        " VALUES ('triage', 'old', 'old', now() - interval '200 days')"
    )
    db.execute(
        "INSERT INTO worker_heartbeats (worker_id, hostname, pid, version, last_tick_at, state)"
        " VALUES ('old:1:abc', 'h', 1, 'v', now() - interval '30 days', 'stopped')"
    )


def _old_rows_left(db: psycopg.Connection) -> dict[str, int]:
    return {
        "processed_emails": count(db, "SELECT count(*) FROM processed_emails"),
        "failed_operations": count(db, "SELECT count(*) FROM failed_operations"),
        "worker_heartbeats": count(
            db, "SELECT count(*) FROM worker_heartbeats WHERE worker_id = 'old:1:abc'"
        ),
    }


NOTHING_LEFT = {"processed_emails": 0, "failed_operations": 0, "worker_heartbeats": 0}


def test_run_once_prunes_past_the_retention_after_its_drain(
    db: psycopg.Connection, database_url: str
) -> None:
    """A timer-driven worker (`run --once`) applies the TTLs too: it never runs the daemon's
    hourly job."""
    _old_rows(db)
    database = Database(database_url, size=3)
    try:
        worker = _triage_worker(
            database,
            fast_settings(failed_ops_ttl_days=1, processed_emails_ttl_days=1),
            ScriptedHandler(),
        )
        with capture_logs() as logs:
            code = _once_restoring_signals(worker)
    finally:
        database.close()
    assert code == 0
    assert _old_rows_left(db) == NOTHING_LEFT
    [finished] = _events(logs, "maintenance_finished")
    assert finished["pruned"] == {
        "processed_emails": 1,
        "failed_operations": 1,
        "worker_heartbeats": 1,
    }


@pytest.mark.timeout(60)
def test_retention_gives_up_a_table_another_session_holds_locked(
    db: psycopg.Connection, database_url: str
) -> None:
    """A migration holding email_checkpoints: retention gives up its lock wait after 5 s (or
    `run --once`, which now runs it, never exited), says so, and leaves the pooled connection
    as it found it."""
    _old_rows(db)
    database = Database(database_url, size=1)
    try:
        settings = fast_settings(processed_emails_ttl_days=1)
        worker = _triage_worker(database, settings, ScriptedHandler())
        with psycopg.connect(database_url) as locker, capture_logs() as logs:
            locker.execute("LOCK TABLE email_checkpoints IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            worker.maintenance()
            took = time.monotonic() - started
            locker.rollback()
        with database.connection() as conn:
            lock_timeout = conn.execute("SHOW lock_timeout").fetchone()
    finally:
        database.close()
    assert took < 15, took
    assert [e["event"] for e in logs if "maintenance" in e["event"]] == ["maintenance_timed_out"]
    assert lock_timeout == ("0",)
    assert count(db, "SELECT count(*) FROM processed_emails") == 1  # pruned at the next run


@pytest.mark.timeout(120)
def test_serve_runs_retention_soon_after_start(
    db: psycopg.Connection, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run` prunes a short while after start, not only an hour later (a worker restarted
    more often never pruned at all)."""
    monkeypatch.setattr(daemon, "MAINTENANCE_FIRST_RUN_AFTER_S", 0.5, raising=False)
    _old_rows(db)
    database = Database(database_url, size=4)
    try:
        with _signals_restored():
            worker = _triage_worker(
                database,
                fast_settings(
                    failed_ops_ttl_days=1, processed_emails_ttl_days=1, heartbeat_interval=60
                ),
                ScriptedHandler(),
            )
            # (SIGTERM after 8 s at the latest: a worker that never prunes stops too)
            give_up_at = time.monotonic() + 8.0
            _sigterm_when(
                lambda: _old_rows_left(db) == NOTHING_LEFT or time.monotonic() > give_up_at
            )
            code = worker.serve()
    finally:
        database.close()
    assert code == 0
    assert _old_rows_left(db) == NOTHING_LEFT


# -- 4 and 5. the stop's grace: "stopping", and its settled items reported ------------------


def _serve_stopping_with_an_item_in_flight(
    db: psycopg.Connection, database_url: str
) -> tuple[int, list[dict[str, Any]], list[Any], int]:
    """Serve; SIGTERM while an item sleeps 3 s; returns the exit code, the logs, the heartbeat
    row's state seen a second into the grace, and the item's id."""
    database = Database(database_url, size=4)
    handler = ScriptedHandler()
    seen: list[Any] = []

    def look_during_the_grace() -> None:
        time.sleep(1.0)  # the item sleeps 3 s: still in flight
        with psycopg.connect(database_url, autocommit=True) as look:
            seen.extend(look.execute("SELECT state FROM worker_heartbeats").fetchall())

    try:
        with _signals_restored():
            worker = _triage_worker(
                database,
                fast_settings(concurrency=1, shutdown_grace=10, heartbeat_interval=60),
                handler,
            )
            (item_id,) = enqueue_many(db, 1, behaviour="sleep:3")
            _sigterm_when(lambda: handler.calls == 1, then=look_during_the_grace)
            with capture_logs() as logs:
                code = worker.serve()
    finally:
        database.close()
    return code, logs, seen, item_id


@pytest.mark.timeout(120)
def test_the_heartbeat_says_stopping_during_the_stop_grace_and_stopped_last(
    db: psycopg.Connection, database_url: str
) -> None:
    """`status` shows a worker finishing its items after a stop signal as stopping, not
    running; "stopped" is still its last row."""
    code, _logs, seen, item_id = _serve_stopping_with_an_item_in_flight(db, database_url)
    assert code == 0
    assert seen == [("stopping",)]
    assert count(db, "SELECT count(*) FROM work_outcomes WHERE item_id = %s", item_id) == 1
    assert db.execute("SELECT state FROM worker_heartbeats").fetchall() == [("stopped",)]


@pytest.mark.timeout(120)
def test_items_settled_during_the_stop_grace_are_counted_in_worker_stopped(
    db: psycopg.Connection, database_url: str
) -> None:
    """tick_finished and worker_stopped together count every item the process ended: the one
    settled after the last tick is in worker_stopped's queues."""
    code, logs, _seen, _item_id = _serve_stopping_with_an_item_in_flight(db, database_url)
    assert code == 0
    reports = [e["queues"] for e in _events(logs, "tick_finished")]
    [stopped] = _events(logs, "worker_stopped")
    saved = sum(q.get("pending_triage", {}).get("saved", 0) for q in [*reports, stopped["queues"]])
    assert saved == 1
    assert stopped["queues"]["pending_triage"]["saved"] == 1


# -- 6. a LISTEN connection refused for a limit is no outage -------------------------------


@pytest.fixture
def limited_role_url(db: psycopg.Connection, database_url: str) -> Iterator[str]:
    """The test database's URL for a role that may open one connection at a time."""
    role = f"limited_{os.getpid()}_{time.monotonic_ns() % 10**6}"
    db.execute(sql.SQL("CREATE ROLE {} LOGIN CONNECTION LIMIT 1").format(sql.Identifier(role)))
    info = psycopg.conninfo.conninfo_to_dict(database_url)
    info["user"] = role
    info.pop("password", None)
    try:
        yield psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})
    finally:
        db.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,)
        )
        db.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_a_listener_refused_by_a_connection_limit_leaves_the_worker_ready(
    limited_role_url: str,
) -> None:
    """The role's CONNECTION LIMIT, taken by the pool, refuses the LISTEN connection: the
    server answered, so /readyz and sokratos_database_up stay up (they flapped at each retry)."""
    database = Database(limited_role_url, size=1)  # (its one connection is the limit)
    try:
        assert database.wait_ready(10)
        worker = _triage_worker(database, fast_settings(), ScriptedHandler())
        with capture_logs() as logs:
            listener = threading.Thread(target=worker.listen_forever, daemon=True)
            listener.start()
            assert wait_until(lambda: bool(_events(logs, "listen_reconnecting")), timeout=10)
            reachable = worker.database_contact.reachable
            worker._stop.set()
            listener.join(15)
    finally:
        database.close()
    [refused] = _events(logs, "listen_reconnecting")[:1]
    assert "too many connections for role" in refused["error"]
    assert reachable, "a refusal for a connection limit was taken for an outage"


# -- 7. a busy metrics address is a temporary failure ---------------------------------------


def test_a_metrics_address_in_use_exits_75_naming_what_holds_it(database_url: str) -> None:
    """Another process on SOKRATOS_METRICS_ADDR (two instances, one port): exit 75, which
    systemd restarts (78 is never restarted), naming the address and its holder."""
    busy = socket.create_server(("127.0.0.1", 0))
    port = busy.getsockname()[1]
    database = Database(database_url, size=1)
    try:
        with _signals_restored():
            worker = _triage_worker(
                database, fast_settings(metrics_addr=f"127.0.0.1:{port}"), ScriptedHandler()
            )
            with capture_logs() as logs:
                code = worker.serve()
    finally:
        database.close()
        busy.close()
    assert code == EXIT_TEMPFAIL
    [said] = _events(logs, "metrics_address_unavailable")
    assert said["addr"] == f"127.0.0.1:{port}"
    assert said["held_by"].endswith(f"(pid {os.getpid()})")
    assert said["exit_code"] == EXIT_TEMPFAIL
