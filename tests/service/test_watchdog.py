"""WATCHDOG=1 follows the dispatcher's progress: a hung dispatcher stops the pings."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from structlog.testing import capture_logs

from sokratos_worker.config import Settings
from sokratos_worker.daemon import Worker
from sokratos_worker.handlers import HandlerContext
from sokratos_worker.model import Queue
from sokratos_worker.service.sdnotify import Notifier
from sokratos_worker.service.watchdog import DISPATCHER_STALL_S
from sokratos_worker.store.connection import Database
from tests.support.daemon import wait_until
from tests.support.handlers import ScriptedHandler


def _worker(database: Database, notifier: Notifier) -> Worker:
    settings = Settings()
    return Worker(
        settings=settings,
        database=database,
        handlers={Queue.TRIAGE: ScriptedHandler()},
        context=HandlerContext(settings=settings, database=database, chat=None, embedder=None),
        notifier=notifier,
    )


@pytest.fixture
def worker_and_socket(tmp_path: Path, database_url: str) -> Iterator[tuple[Worker, socket.socket]]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.5)
    database = Database(database_url, size=2)
    worker = _worker(database, Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"}))
    yield worker, sock
    sock.close()
    database.close()


def _pinged(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b"WATCHDOG=1"
    except TimeoutError:
        return False


def _received(sock: socket.socket) -> list[str]:
    """Every datagram waiting on the socket."""
    messages = []
    while True:
        try:
            messages.append(sock.recv(4096).decode())
        except TimeoutError:
            return messages


def test_pings_only_while_the_dispatcher_makes_progress(
    worker_and_socket: tuple[Worker, socket.socket],
) -> None:
    worker, sock = worker_and_socket
    worker.watchdog.progressed()  # the dispatcher's loop came round: it pings at once
    assert _pinged(sock)
    # The main loop's once-a-second call, long after the dispatcher's last progress:
    worker.watchdog._last_progress -= DISPATCHER_STALL_S + 1
    worker.watchdog._last_look = time.monotonic()  # (the main loop looks every 0.25 s)
    worker.watchdog._last_watchdog = 0.0
    with capture_logs() as logs:
        worker.watchdog.look()
        worker.watchdog.look()
    assert not _pinged(sock)
    stalled = [e for e in logs if e["event"] == "dispatcher_stalled"]
    assert len(stalled) == 1 and stalled[0]["log_level"] == "error"
    # Progress again (e.g. a long backend probe ended): the pings resume.
    worker.watchdog.progressed()
    assert _pinged(sock)


def test_a_dispatcher_waiting_for_another_sessions_lock_is_named_not_restarted(
    worker_and_socket: tuple[Worker, socket.socket], database_url: str
) -> None:
    """A migration holding the queue table past the stall limit: the worker says who holds
    it, keeps the pings going (a new process would wait for the same lock) and says when
    the wait ended. Before, the pings stopped and systemd restarted it every ~3 minutes."""
    worker, sock = worker_and_socket
    with psycopg.connect(database_url, application_name="a-migration") as locker:
        locker.execute("LOCK TABLE pending_triage IN ACCESS EXCLUSIVE MODE")
        blocker_pid = locker.info.backend_pid
        claim = threading.Thread(target=worker.runner._claim_for_idle_slots, daemon=True)
        claim.start()
        assert wait_until(lambda: worker.runner.dispatcher_backend_pid is not None, timeout=10)

        def waiting_for_the_lock() -> bool:
            # Autocommit: inside a transaction pg_stat_activity is read once and kept.
            with psycopg.connect(database_url, autocommit=True) as conn:
                row = conn.execute(
                    "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                    (worker.runner.dispatcher_backend_pid,),
                ).fetchone()
            return row is not None and row[0] == "Lock"

        assert wait_until(waiting_for_the_lock, timeout=10)
        worker.watchdog._last_progress -= DISPATCHER_STALL_S + 1  # as if it had waited 2 minutes
        worker.watchdog._last_look = time.monotonic()  # (the main loop looks every 0.25 s)
        worker.watchdog._last_watchdog = 0.0
        with capture_logs() as logs:
            worker.watchdog.look()
            assert _received(sock) == [
                "STATUS=running: claiming waits for a lock on pending_triage"
                f" (held by pid {blocker_pid})",
                "WATCHDOG=1",
            ]
            worker.watchdog._last_watchdog = 0.0
            worker.watchdog.look()  # the next look is 10 s away: the answer is remembered
            assert _received(sock) == ["WATCHDOG=1"]
        events = [e["event"] for e in logs]
        assert "dispatcher_stalled" not in events
        (waiting,) = [e for e in logs if e["event"] == "dispatcher_waiting_for_lock"]
        assert waiting["tables"] == ["pending_triage"]
        assert [b["pid"] for b in waiting["held_by"]] == [blocker_pid]
        assert waiting["held_by"][0]["application"] == "a-migration"
        assert f"pg_terminate_backend({blocker_pid})" in waiting["hint"]
        assert claim.is_alive()  # still waiting: the lock is held
        worker._record_heartbeat()  # the tick: `status` shows the wait too
        (detail,) = locker.execute(
            "SELECT detail FROM worker_heartbeats WHERE worker_id = %s", (worker.worker_id,)
        ).fetchone() or (None,)
        assert detail["lock_wait"] == (
            f"claiming waits for a lock on pending_triage (held by pid {blocker_pid})"
        )
        locker.rollback()
    claim.join(10)
    assert not claim.is_alive()
    with capture_logs() as logs:
        worker.watchdog.progressed()  # the dispatcher's next round
    assert [e["event"] for e in logs] == ["dispatcher_lock_released"]
    assert _received(sock)[0].startswith("STATUS=running: 0 of ")
    assert logs[0]["waited_s"] >= DISPATCHER_STALL_S


def test_a_dispatcher_stalled_outside_any_lock_wait_is_still_reported(
    worker_and_socket: tuple[Worker, socket.socket],
) -> None:
    """The look finds no lock (here: no statement in progress): the stall stops the pings."""
    worker, sock = worker_and_socket
    worker.runner.dispatcher_backend_pid = None
    worker.watchdog._last_progress -= DISPATCHER_STALL_S + 1
    worker.watchdog._last_look = time.monotonic()  # (the main loop looks every 0.25 s)
    worker.watchdog._last_watchdog = 0.0
    with capture_logs() as logs:
        worker.watchdog.look()
    assert not _pinged(sock)
    assert [e["event"] for e in logs] == ["dispatcher_stalled"]


@pytest.mark.parametrize(
    ("state", "detail", "expected"),
    [
        ("waiting for database", "connection refused", "STATUS=waiting for database: connection refused"),
        ("stopping", "", "STATUS=stopping"),
    ],
)
def test_a_status_line_written_after_a_lock_wait_says_the_state_as_it_is(
    worker_and_socket: tuple[Worker, socket.socket], state: str, detail: str, expected: str
) -> None:
    """The end of a lock wait, and the tick, rewrite STATUS= from the running line: it said
    "running" while the worker waited for the database or was stopping (the tick's look at
    the state came before its write)."""
    worker, sock = worker_and_socket
    worker.watchdog._lock_wait = object()  # type: ignore[assignment]  # a wait the next round ends
    worker.runner._worker_state.state, worker.runner._worker_state.detail = state, detail
    with capture_logs():
        worker.watchdog.progressed()
    assert expected in _received(sock), state


def test_a_process_stopped_as_a_whole_is_not_a_stalled_dispatcher(
    worker_and_socket: tuple[Worker, socket.socket],
) -> None:
    """SIGSTOP or a paused VM for longer than the stall limit: on SIGCONT the main loop's look
    could come before the dispatcher's next round, and called it stalled (no more pings:
    systemd restarted a worker that had only been paused). Its own look was as late."""
    worker, sock = worker_and_socket
    frozen = DISPATCHER_STALL_S + 5
    worker.watchdog._last_progress -= frozen
    worker.watchdog._last_look -= frozen
    worker.watchdog._last_watchdog = 0.0
    with capture_logs() as logs:
        worker.watchdog.look()
    assert _pinged(sock)
    assert "dispatcher_stalled" not in [e["event"] for e in logs]


def test_closing_the_database_first_waits_for_the_heartbeat_writer(
    tmp_path: Path, database_url: str
) -> None:
    """A state change's heartbeat write still running when the pool closed failed against it
    and logged into whatever ran next (a later test's capture); the close waits for it."""
    database = Database(database_url, size=2)
    worker = _worker(database, Notifier({}))
    entered, release = threading.Event(), threading.Event()
    written: list[str] = []
    record = worker._record_heartbeat

    def slow_record() -> None:
        entered.set()
        release.wait(10)
        record()
        written.append("written")

    worker.heartbeats._write = slow_record
    worker._on_state("running", "")
    assert entered.wait(5)
    threading.Timer(0.3, release.set).start()
    with capture_logs() as logs:
        database.close()
    assert written == ["written"]  # finished against an open pool, before it closed
    assert [e["event"] for e in logs if "heartbeat" in e["event"]] == []
    worker._on_state("running", "")  # after the close: no write starts
    assert not wait_until(lambda: len(written) > 1, timeout=0.5)
