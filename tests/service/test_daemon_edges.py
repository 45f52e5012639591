"""The daemon's life at its edges, against a real PostgreSQL (a mutation review of daemon.py
and app.py): the retention job, the tick's steps and heartbeat row, readiness, the LISTEN
connection's reconnects and back-off, the email thread, `serve` and `run --once` stopping, and
the local model server's give-up exit code."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpcore  # noqa: F401  (httpx imports it lazily: see the local model test)
import psycopg
import pytest
from structlog.testing import capture_logs

from sokratos_worker import daemon
from sokratos_worker.app import _once_restoring_signals, _watch_local_model
from sokratos_worker.config import EmailAccountConfig, Settings
from sokratos_worker.daemon import Worker, build_worker
from sokratos_worker.errors import DatabaseUnavailable
from sokratos_worker.llm import local
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.model import Queue
from sokratos_worker.service.jobs import DaemonThreadExecutor
from sokratos_worker.service.metrics import Metrics
from sokratos_worker.service.sdnotify import Notifier
from sokratos_worker.spool import spool_enqueue
from sokratos_worker.store.connection import Database
from sokratos_worker.store.failures import PURGE_BATCH
from sokratos_worker.store.queue import NOTIFY_CHANNEL
from sokratos_worker.store.status import live_workers
from tests.llm.test_local_process import StandIn
from tests.support.daemon import wait_until
from tests.support.db import count, enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings
from tests.support.ports import unused_port

pytestmark = pytest.mark.postgres


def _events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in list(logs) if e.get("event") == name]


@contextmanager
def _connections_refused(server: str, db: psycopg.Connection) -> Iterator[None]:
    """New connections to this test's database are refused (as while it is away); the ones
    already open go on. (``server``: the maintenance database, which may change it.)"""
    name = db.info.dbname
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
        try:
            yield
        finally:
            admin.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')


def _cut_listener(db: psycopg.Connection) -> int:
    """Terminate the worker's LISTEN session (its connection drops); returns how many."""
    rows = db.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE datname = current_database() AND query = %s AND pid <> pg_backend_pid()",
        (f"LISTEN {NOTIFY_CHANNEL}",),
    ).fetchall()
    return len(rows)


def test_maintenance_prunes_each_table_by_its_own_retention(
    db: psycopg.Connection, database_url: str
) -> None:
    """Heartbeats go after 7 days, failures after SOKRATOS_FAILED_OPS_TTL_DAYS and processed
    emails after SOKRATOS_PROCESSED_EMAILS_TTL_DAYS, each by its own setting."""
    db.execute(
        "INSERT INTO worker_heartbeats (worker_id, hostname, pid, version, last_tick_at, state)"
        " VALUES ('gone', 'h', 1, 'v', now() - interval '8 days', 'stopped'),"
        "        ('recent', 'h', 2, 'v', now() - interval '2 days', 'stopped')"
    )
    db.execute(
        "INSERT INTO failed_operations (op_type, label, error_message, created_at)"
        " VALUES ('distillation', 'old', 'e', now() - interval '60 days'),"
        "        ('distillation', 'new', 'e', now() - interval '10 days')"
    )
    # Rows without an account (Sokratos's own) go by age alone.
    db.execute(
        "INSERT INTO processed_emails (message_id, seen_at)"
        " VALUES ('<old@x>', now() - interval '100 days'), ('<mid@x>', now() - interval '60 days')"
    )
    settings = Settings(failed_ops_ttl_days=30, processed_emails_ttl_days=90)
    database = Database(database_url, size=1)
    try:
        worker = build_worker(settings, database, lambda _ctx: {}, None, None)
        with capture_logs() as logs:
            worker.maintenance()
    finally:
        database.close()
    assert [r[0] for r in db.execute("SELECT worker_id FROM worker_heartbeats")] == ["recent"]
    assert [r[0] for r in db.execute("SELECT label FROM failed_operations")] == ["new"]
    assert [r[0] for r in db.execute("SELECT message_id FROM processed_emails")] == ["<mid@x>"]
    [finished] = _events(logs, "maintenance_finished")
    assert finished["pruned"] == {
        "processed_emails": 1,
        "failed_operations": 1,
        "worker_heartbeats": 1,
    }


def test_maintenance_keeps_every_failure_without_a_ttl_and_purges_past_one_batch(
    db: psycopg.Connection, database_url: str
) -> None:
    """SOKRATOS_FAILED_OPS_TTL_DAYS=0 (the default) keeps failures of any age; with a TTL the
    hourly purge is `failed purge`'s, batch after batch until none is left."""
    db.execute(
        "INSERT INTO failed_operations (op_type, label, error_message, created_at)"
        " SELECT 'distillation', 'old', 'e', now() - interval '10 years'"
        " FROM generate_series(1, %s)",
        (PURGE_BATCH * 2 + 5,),
    )
    database = Database(database_url, size=1)
    try:
        build_worker(Settings(), database, lambda _ctx: {}, None, None).maintenance()
        kept = db.execute("SELECT count(*) FROM failed_operations").fetchone()
        settings = Settings(failed_ops_ttl_days=30)
        with capture_logs() as logs:
            build_worker(settings, database, lambda _ctx: {}, None, None).maintenance()
    finally:
        database.close()
    assert kept == (PURGE_BATCH * 2 + 5,)
    assert db.execute("SELECT count(*) FROM failed_operations").fetchone() == (0,)
    [finished] = _events(logs, "maintenance_finished")
    assert finished["pruned"]["failed_operations"] == PURGE_BATCH * 2 + 5


def test_a_heartbeat_that_cannot_reach_the_database_is_skipped_and_makes_the_worker_not_ready(
    db: psycopg.Connection, database_url: str, pg_server: str
) -> None:
    """The tick's heartbeat meeting an outage says heartbeat_skipped (not a traceback) and
    /readyz answers 503 from then, though the runner (idle or not started) saw nothing."""
    with _connections_refused(pg_server, db):
        database = Database(database_url, size=1)
        try:
            worker = build_worker(Settings(), database, lambda _ctx: {}, None, None)
            assert worker._ready()
            with capture_logs() as logs:
                worker._record_heartbeat()
            ready = worker._ready()
        finally:
            database.close()
    [skipped] = _events(logs, "heartbeat_skipped")
    assert skipped["log_level"] == "warning" and skipped["reason"] == "database unavailable"
    assert not _events(logs, "heartbeat_failed"), logs
    assert not ready, "a heartbeat that found the database away left /readyz at 200"
    assert count(db, "SELECT count(*) FROM worker_heartbeats") == 0


def test_a_heartbeat_behind_a_busy_pool_is_skipped_and_keeps_the_worker_ready(
    db: psycopg.Connection, database_url: str
) -> None:
    """Every pooled connection lent to the worker's own threads for the pool's 5 s (slow
    statements, lock waits) is a database that answers: the heartbeat is skipped, /readyz
    stays 200 (it would otherwise flap to 503 under load)."""
    database = Database(database_url, size=1)
    try:
        worker = build_worker(Settings(), database, lambda _ctx: {}, None, None)
        with database.connection(), capture_logs() as logs:  # a slot's, in a slow statement
            worker._record_heartbeat()
        ready = worker._ready()
    finally:
        database.close()
    [skipped] = _events(logs, "heartbeat_skipped")
    assert "pooled connections stayed in use" in skipped["error"], skipped
    assert ready, "a heartbeat behind a busy pool made /readyz answer 503"
    assert count(db, "SELECT count(*) FROM worker_heartbeats") == 0


def test_the_heartbeat_row_carries_what_status_reads(
    db: psycopg.Connection, database_url: str
) -> None:
    """The detail keys `status` reads: heartbeat_s (overdue past 3x it), the queues handled,
    concurrency, items in flight, the worker's own embedding configuration and why."""
    settings = fast_settings(
        concurrency=3,
        heartbeat_interval=7,
        embedding_url="http://127.0.0.1:9/v1",
        embedding_model="m",
        embedding_dim=4,
    )
    database = Database(database_url, size=1)
    try:
        worker = build_worker(
            settings, database, lambda _ctx: {Queue.TRIAGE: ScriptedHandler()}, None, None
        )
        worker._record_heartbeat()
    finally:
        database.close()
    row = db.execute("SELECT state, detail FROM worker_heartbeats").fetchone()
    assert row == (
        "running",
        {
            "backends": [],
            "concurrency": 3,
            "embeddings": "configured",
            "heartbeat_s": 7.0,
            "in_flight": 0,
            "queues": ["pending_triage"],
            "why": "",
        },
    )


def test_the_end_of_an_outage_is_written_to_the_heartbeat_at_once(
    db: psycopg.Connection, database_url: str
) -> None:
    """Waiting for the database cannot be written (it is said as a warning); "running" again
    is, at once (by the heartbeat writer's thread, within moments), not at the next heartbeat
    (a minute later by default: `status` showed the worker silent meanwhile)."""
    database = Database(database_url, size=1)

    def row() -> list[tuple[object, ...]]:
        return db.execute(
            "SELECT state, last_tick_at > now() - interval '1 minute' FROM worker_heartbeats"
        ).fetchall()

    try:
        worker = build_worker(
            fast_settings(), database, lambda _ctx: {Queue.TRIAGE: ScriptedHandler()}, None, None
        )
        state = worker.runner._worker_state  # what the runner's claims and settles report to
        with capture_logs() as logs:
            state.database_lost(DatabaseUnavailable("database unavailable: connection refused"))
        assert count(db, "SELECT count(*) FROM worker_heartbeats") == 0
        state.database_back()
        written = wait_until(lambda: row() == [("running", True)], timeout=5)
    finally:
        database.close()
    assert written, row()
    # (journald's priority: waiting for the database is a warning, as "no backend" is)
    [waiting] = _events(logs, "worker_state")
    assert (waiting["state"], waiting["log_level"]) == ("waiting for database", "warning")


def test_a_heartbeat_woken_late_still_runs_within_its_interval(database_url: str) -> None:
    """A tick the scheduler wakes for late (a paused VM, a busy host) runs if it is late by
    less than its interval, rather than being dropped as missed (the row going stale until
    the next one); retention likewise within its hour."""
    database = Database(database_url, size=1)
    scheduler = None
    try:
        worker = build_worker(
            Settings(heartbeat_interval=30.0), database, lambda _ctx: {}, None, None
        )
        scheduler = worker._start_scheduler(DaemonThreadExecutor())
        scheduler.pause()  # (the jobs' settings are looked at, not their runs)
        grace = {job.id: job.misfire_grace_time for job in scheduler.get_jobs()}
    finally:
        if scheduler is not None:
            scheduler.shutdown(wait=False)
        database.close()
    assert grace == {"heartbeat": 30, "maintenance": 3600}


def _poison_spool_file(spool_dir: Path, name: str) -> Path:
    """A spool file nested too deep for the JSON parser (RecursionError, not ValueError): no
    client writes one, but a file in the spool can hold anything."""
    spool_dir.mkdir(parents=True, exist_ok=True)
    path = spool_dir / name
    path.write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    return path


def test_a_tick_step_failing_outside_the_database_is_said_and_the_tick_goes_on(
    db: psycopg.Connection, database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any other exception in a step of the tick (here a bug planted in the spool import) is
    logged as <step>_failed with its traceback, and the rest of the tick (the heartbeat) still
    runs."""
    settings = Settings(data_dir=tmp_path / "data")

    def buggy_import(*_args: object) -> int:
        raise RecursionError("a bug in the spool import")

    monkeypatch.setattr(daemon, "import_spool", buggy_import)
    database = Database(database_url, size=1)
    try:
        worker = build_worker(settings, database, lambda _ctx: {}, None, None)
        with capture_logs() as logs:
            imported = worker.tick_without_report()
        ready = worker._ready()
    finally:
        database.close()
    assert imported == 0
    [failed] = _events(logs, "spool_import_failed")
    assert failed["log_level"] == "error" and failed["exc_info"] is True, failed
    assert ready  # (a bug is no outage)
    assert db.execute("SELECT state FROM worker_heartbeats").fetchall() == [("no backend",)]


def test_each_tick_writes_the_running_status_line(tmp_path: Path, database_url: str) -> None:
    """`systemctl status` shows what a running worker does now (its items in flight), written
    again at every tick, not only the line from the start."""
    path = str(tmp_path / "notify.sock")
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(path)
    receiver.settimeout(5.0)
    database = Database(database_url, size=1)
    try:
        worker = build_worker(
            fast_settings(concurrency=3),
            database,
            lambda _ctx: {Queue.TRIAGE: ScriptedHandler()},
            None,
            None,
            notifier=Notifier({"NOTIFY_SOCKET": path}),
        )
        worker.tick()
        said = receiver.recv(4096)
    finally:
        database.close()
        receiver.close()
    assert said == b"STATUS=running: 0 of 3 items in flight; queues pending_triage"


@pytest.mark.subprocess
def test_a_local_model_server_that_keeps_dying_stops_the_worker_with_exit_75(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past its restart limit the local model server is a dependency that stays away: the
    worker stops as SIGTERM would and exits 75 (EX_TEMPFAIL), not 1 (a bug) nor 78."""
    monkeypatch.setattr(local, "RESTART_LIMIT", 0)  # (the first death is past the limit)
    server = StandIn(n_threads=1, startup_timeout=30)
    # (Its start imports httpcore, already imported above: in a full run of this module,
    # CPython 3.11's import lock raised KeyError there, a finalizer importing meanwhile.)
    gc.collect()
    server.start()
    chat = FallbackChatClient([server.backend])
    database = Database(database_url, size=1)
    try:
        worker = build_worker(Settings(), database, lambda _ctx: {}, chat, None)
        with capture_logs() as logs:
            _watch_local_model(server, chat, worker)
            assert server._process is not None
            os.kill(server._process.pid, signal.SIGKILL)  # (the OOM killer, a segfault)
            assert wait_until(lambda: worker.stop_requested, timeout=20)
            assert worker.notice_signal()
    finally:
        server.stop()
        chat.close()
        database.close()
    assert worker.exit_code == 75
    [said] = _events(logs, "stop_requested")
    assert (said["reason"], said["exit_code"]) == ("local_model_gave_up", 75)


def _unreachable_account() -> EmailAccountConfig:
    """An IMAP account whose server refuses connections: each check of it fails at once."""
    return EmailAccountConfig(
        name="away", host="127.0.0.1", port=unused_port(), username="u", password="p",
        security="none",
    )  # fmt: skip


def test_the_email_thread_looks_for_due_accounts_as_often_as_they_are_due(
    database_url: str,
) -> None:
    """An account due every second is checked every second (the thread looks every minute,
    or sooner when the interval is shorter), not once a minute."""
    # (below the 30 s a configuration may set, as tests/email/check_in_subprocess.py does)
    settings = Settings(email_accounts=[_unreachable_account()]).model_copy(
        update={"email_check_interval": 1.0}
    )
    database = Database(database_url, size=1)
    try:
        worker = build_worker(settings, database, lambda _ctx: {}, None, None)
        with capture_logs() as logs:
            thread = worker._start_email_thread()
            assert thread is not None
            time.sleep(4.5)
            worker._stop.set()
            thread.join(10)
    finally:
        database.close()
    failed = _events(logs, "email_check_failed")
    assert len(failed) >= 3, f"{len(failed)} checks in 4.5 s of an account due every second"


def test_an_email_check_interval_of_0_starts_no_email_thread(database_url: str) -> None:
    """0 disables email checks: no thread (one would look for due accounts without pause,
    a core spinning for nothing)."""
    settings = Settings(email_accounts=[_unreachable_account()], email_check_interval=0)
    database = Database(database_url, size=1)
    try:
        worker = build_worker(settings, database, lambda _ctx: {}, None, None)
        thread = worker._start_email_thread()
        worker._stop.set()  # (ends one started all the same)
    finally:
        database.close()
    assert thread is None


def test_run_once_writes_the_stopped_heartbeat(db: psycopg.Connection, database_url: str) -> None:
    """`run --once` ends with the "stopped" heartbeat: `status` does not list the finished
    process as live until its heartbeat goes stale."""
    database = Database(database_url, size=3)
    try:
        worker = build_worker(
            fast_settings(), database, lambda _ctx: {Queue.TRIAGE: ScriptedHandler()}, None, None
        )
        (item_id,) = enqueue_many(db, 1, behaviour="skip")
        assert _once_restoring_signals(worker) == 0
    finally:
        database.close()
    assert count(db, "SELECT count(*) FROM work_outcomes WHERE item_id = %s", item_id) == 1
    assert db.execute("SELECT state FROM worker_heartbeats").fetchall() == [("stopped",)]
    assert live_workers(db, stale_after_s=600) == []


@pytest.mark.timeout(120)
def test_run_once_stopped_by_sigterm_gives_items_in_flight_the_grace_once(
    db: psycopg.Connection, database_url: str
) -> None:
    """SIGTERM during `run --once`: an item still running at the end of SOKRATOS_SHUTDOWN_GRACE
    is released then, not after a second grace (a stop twice as long as configured, past a
    unit's TimeoutStopSec)."""
    grace = 3.0
    database = Database(database_url, size=3)
    handler = ScriptedHandler()
    signalled: list[float] = []

    def sigterm_once_the_item_runs() -> None:
        if wait_until(lambda: handler.calls == 1, timeout=30):
            signalled.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGTERM)  # (the handler runs in the main thread)

    try:
        worker = build_worker(
            fast_settings(concurrency=1, shutdown_grace=grace),
            database,
            lambda _ctx: {Queue.TRIAGE: handler},
            None,
            None,
        )
        (item_id,) = enqueue_many(db, 1, behaviour="sleep:12")
        threading.Thread(target=sigterm_once_the_item_runs, daemon=True).start()
        code = _once_restoring_signals(worker)
        ended = time.monotonic()
        lease = db.execute(
            "SELECT lease_owner FROM pending_triage WHERE id = %s", (item_id,)
        ).fetchall()
        time.sleep(max(0.0, signalled[0] + 12.5 - time.monotonic()))  # (the handler returns)
    finally:
        database.close()
    assert code == 0
    assert lease == [(None,)]  # released, to run again
    assert ended - signalled[0] < grace + 1.5, (
        f"run --once exited {ended - signalled[0]:.1f} s after SIGTERM with a {grace:g} s grace"
    )


def test_a_scrape_reports_the_database_down_while_the_runner_waits_for_it(
    database_url: str,
) -> None:
    """sokratos_database_up is what /readyz answers: a scrape that reached the database while
    the runner still waits for it (its claims failing) says 0, as /readyz says 503."""
    database = Database(database_url, size=1)
    metrics = Metrics()
    try:
        worker = build_worker(
            fast_settings(), database, lambda _ctx: {Queue.TRIAGE: ScriptedHandler()}, None, None,
            metrics=metrics,
        )  # fmt: skip
        worker.runner._worker_state.database_lost(
            DatabaseUnavailable("database unavailable: the pool could not open a connection")
        )
        worker._refresh_metrics(metrics)  # (its own statements succeed)
        ready = worker._ready()
    finally:
        database.close()
    assert not ready
    assert metrics.registry.get_sample_value("sokratos_database_up") == 0


@pytest.mark.timeout(120)
def test_serve_writes_the_stopped_heartbeat_only_after_the_items_in_flight_end(
    db: psycopg.Connection, database_url: str
) -> None:
    """While a stopping worker finishes its items (the grace), `status` still lists it with
    them; "stopped" is its last heartbeat, written once they ended; the email thread ends
    with the stop (no email_check_abandoned); it exits 0."""
    database = Database(database_url, size=4)
    handler = ScriptedHandler()
    seen: dict[str, Any] = {}

    def stop_once_the_item_runs() -> None:
        if not wait_until(lambda: handler.calls == 1, timeout=30):
            return
        with psycopg.connect(database_url, autocommit=True) as look:
            os.kill(os.getpid(), signal.SIGTERM)  # (the handler runs in the main thread)
            time.sleep(1.0)  # the item sleeps 3 s: still in flight
            seen["during_grace"] = look.execute("SELECT state FROM worker_heartbeats").fetchall()

    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {signum: signal.getsignal(signum) for signum in stop_signals}
    try:
        settings = fast_settings(
            concurrency=1,
            shutdown_grace=10,
            heartbeat_interval=60,
            email_accounts=[_unreachable_account()],  # (its thread waits for the next look)
        )
        worker = build_worker(
            settings,
            database,
            lambda _ctx: {Queue.TRIAGE: handler},
            None,
            None,
            notifier=Notifier({}),
        )
        (item_id,) = enqueue_many(db, 1, behaviour="sleep:3")
        threading.Thread(target=stop_once_the_item_runs, daemon=True).start()
        with capture_logs() as logs:
            code = worker.serve()
    finally:
        gc.unfreeze()
        for signum, handler_before in previous.items():
            signal.signal(signum, handler_before)
        database.close()
    assert code == 0
    # Stopping, not stopped, while its item is in flight (nor running, as it said until
    # 2026-12-06: test_service_fixes.py).
    assert seen["during_grace"] == [("stopping",)], "listed as stopped with its item in flight"
    assert count(db, "SELECT count(*) FROM work_outcomes WHERE item_id = %s", item_id) == 1
    assert db.execute("SELECT state FROM worker_heartbeats").fetchall() == [("stopped",)]
    # The email thread, waiting for its next look, ended with the stop: nothing abandoned.
    assert len(_events(logs, "email_check_failed")) == 1  # (its check at start)
    assert _events(logs, "email_check_abandoned") == []
    assert [e["exit_code"] for e in _events(logs, "worker_stopped")] == [0]


@contextmanager
def _silent_imap_server() -> Iterator[tuple[int, list[socket.socket]]]:
    """A server that takes connections and never sends IMAP's greeting (a check waits on it
    until its deadline or a cut); yields its port and the connections it took."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            with contextlib.suppress(OSError):
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield int(server.getsockname()[1]), held
    finally:
        done.set()
        thread.join(5)
        for conn in held:
            conn.close()
        server.close()


@pytest.mark.timeout(120)
def test_run_once_says_a_stop_signal_once_while_its_email_check_ends(
    db: psycopg.Connection, database_url: str
) -> None:
    """SIGTERM while `run --once` waits on a silent IMAP server: signal_received is said once
    (not at every look while the cut check unwinds, nor again before the drain), the session
    is cut, nothing is claimed and it exits 0."""
    database = Database(database_url, size=3)
    handler = ScriptedHandler()
    with _silent_imap_server() as (port, taken):
        account = EmailAccountConfig(
            name="silent", host="127.0.0.1", port=port, username="u", password="p",
            security="none",
        )  # fmt: skip
        settings = fast_settings(email_accounts=[account])

        def sigterm_once_the_check_waits() -> None:
            if wait_until(lambda: bool(taken), timeout=30):  # the check waits on it
                time.sleep(0.6)  # (a few of the main thread's looks meanwhile)
                os.kill(os.getpid(), signal.SIGTERM)

        try:
            worker = build_worker(
                settings, database, lambda _ctx: {Queue.TRIAGE: handler}, None, None
            )
            enqueue_many(db, 1, behaviour="skip")
            threading.Thread(target=sigterm_once_the_check_waits, daemon=True).start()
            with capture_logs() as logs:
                code = _once_restoring_signals(worker)
        finally:
            database.close()
    assert code == 0
    assert len(_events(logs, "signal_received")) == 1, _events(logs, "signal_received")
    assert len(_events(logs, "email_sessions_cut")) == 1
    assert handler.calls == 0


@pytest.mark.timeout(120)
def test_serve_waits_moments_for_an_email_check_ending_after_the_stop(
    database_url: str,
) -> None:
    """An email check still busy when the stop begins (here behind a lock on its checkpoint
    table, released a second later) is waited for (up to 5 s, within the grace), not
    abandoned the moment the runner has stopped."""
    database = Database(database_url, size=3)
    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {signum: signal.getsignal(signum) for signum in stop_signals}
    with psycopg.connect(database_url) as locker:  # a migration, say, holding the table
        locker.execute("LOCK TABLE email_checkpoints IN ACCESS EXCLUSIVE MODE")

        def stop_while_the_check_waits() -> None:
            with psycopg.connect(database_url, autocommit=True) as look:
                waits = lambda: count(  # noqa: E731
                    look,
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND query LIKE '%%email_checkpoints%%'",
                )
                if wait_until(lambda: waits() == 1, timeout=30):
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(1.0)
            locker.rollback()  # the check goes on, finds the worker stopping, and ends

        try:
            worker = build_worker(
                fast_settings(email_accounts=[_unreachable_account()], shutdown_grace=10),
                database,
                lambda _ctx: {Queue.TRIAGE: ScriptedHandler()},
                None,
                None,
                notifier=Notifier({}),
            )
            threading.Thread(target=stop_while_the_check_waits, daemon=True).start()
            with capture_logs() as logs:
                code = worker.serve()
        finally:
            gc.unfreeze()
            for signum, handler_before in previous.items():
                signal.signal(signum, handler_before)
            database.close()
    assert code == 0
    assert _events(logs, "email_check_abandoned") == []
    assert _events(logs, "email_check_failed") == []  # (it never reached the server)


@pytest.fixture
def listening(database_url: str) -> Iterator[tuple[Worker, ScriptedHandler, threading.Thread]]:
    """A worker whose runner idles (heartbeat 600 s: only a wake-up makes it claim) and whose
    listener runs in a thread; both stopped afterwards."""
    database = Database(database_url, size=2)
    handler = ScriptedHandler()
    worker = build_worker(
        fast_settings(concurrency=1, heartbeat_interval=600),
        database,
        lambda _ctx: {Queue.TRIAGE: handler},
        None,
        None,
    )
    listener = threading.Thread(target=worker.listen_forever, name="listener", daemon=True)
    worker.runner.start()
    try:
        yield worker, handler, listener
    finally:
        worker._stop.set()
        listener.join(15)
        worker.runner.shutdown(0)
        database.close()


def test_the_listener_backs_off_to_10s_says_an_outage_once_and_drains_when_back(
    db: psycopg.Connection,
    pg_server: str,
    listening: tuple[Worker, ScriptedHandler, threading.Thread],
) -> None:
    """A lost LISTEN connection: the first failure is a warning and the rest of that outage
    debug, the retry delay doubles from 0.5 s up to 10 s, /readyz is 503 meanwhile; back, the
    runner drains what was enqueued meanwhile (its NOTIFY was lost), and the next outage is
    said again, retried after 0.5 s."""
    worker, handler, listener = listening
    with capture_logs() as logs:
        listener.start()
        assert wait_until(lambda: len(_events(logs, "listening")) == 1, timeout=15), logs
        with _connections_refused(pg_server, db):
            assert _cut_listener(db) == 1
            # Failures at ~0, 0.5, 1.5, 3.5, 7.5, 15.5 s: the sixth is retried after the cap.
            assert wait_until(lambda: len(_events(logs, "listen_reconnecting")) >= 6, timeout=40)
            assert not worker._ready(), "the listener lost the database, /readyz still 200"
            (item_id,) = enqueue_many(db, 1, behaviour="skip")  # its NOTIFY reaches nobody
            time.sleep(0.5)
            assert handler.calls == 0  # (the idle runner was not woken)
        outage = _events(logs, "listen_reconnecting")
        assert [e["retry_in_s"] for e in outage[:6]] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0]
        assert [e["log_level"] for e in outage[:6]] == ["warning"] + ["debug"] * 5
        # Back within the 10 s delay: the runner is woken by the reconnect itself.
        assert wait_until(lambda: len(_events(logs, "listening")) == 2, timeout=20), logs
        assert wait_until(
            lambda: (
                count(db, "SELECT count(*) FROM work_outcomes WHERE item_id = %s", item_id) == 1
            ),
            timeout=15,
        ), "the item enqueued while the listener was away waits for the next heartbeat"
        assert worker._ready()
        # A second, short outage is news again, retried at the start of the back-off.
        said = len(_events(logs, "listen_reconnecting"))
        assert _cut_listener(db) == 1
        assert wait_until(lambda: len(_events(logs, "listening")) == 3, timeout=15), logs
    again = _events(logs, "listen_reconnecting")[said:]
    assert [(e["log_level"], e["retry_in_s"]) for e in again] == [("warning", 0.5)]


def test_a_listener_cut_while_stopping_says_nothing(
    db: psycopg.Connection, listening: tuple[Worker, ScriptedHandler, threading.Thread]
) -> None:
    """The database going away because the worker stops (the embedded PostgreSQL is stopped
    after it) is not news: no listen_reconnecting, no failed contact, the listener ends."""
    worker, _handler, listener = listening
    with capture_logs() as logs:
        listener.start()
        assert wait_until(lambda: len(_events(logs, "listening")) == 1, timeout=15), logs
        worker._stop.set()
        assert _cut_listener(db) == 1  # (within the second its wait for a NOTIFY lasts)
        listener.join(15)
    assert not listener.is_alive()
    assert _events(logs, "listen_reconnecting") == []
    assert worker._ready()


# -- a defect the review found, fixed with this test ---------------------------------------------


# A review found that a spool file the JSON parser gives up on with RecursionError (deeply
# nested) was neither imported nor rejected: the error ended import_spool's loop at every tick
# (spool_import_failed with a traceback each time) and no file sorted after it was imported.
def test_a_spool_file_too_deep_to_parse_is_rejected_and_holds_up_no_later_file(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """An unreadable spool file becomes a failed_operations row; the files after it are
    imported in the same tick."""
    settings = Settings(data_dir=tmp_path / "data")
    _poison_spool_file(settings.spool_dir, "20200101T000000000000-poison00.json")
    spool_enqueue(
        settings.spool_dir,
        Queue.TRIAGE,
        {"exchange": "user: hi\nassistant: ho"},
        idempotency_key="after-the-poison",
        source="conversation",
        database=settings.database_identity,
    )
    database = Database(database_url, size=1)
    try:
        worker = build_worker(settings, database, lambda _ctx: {}, None, None)
        worker.tick_without_report()
    finally:
        database.close()
    assert (
        count(db, "SELECT count(*) FROM pending_triage WHERE idempotency_key = 'after-the-poison'")
        == 1
    )
    assert count(db, "SELECT count(*) FROM failed_operations WHERE op_type = 'spool_import'") == 1
