"""contract §1: a worker started with no LLM backend configured is in the "no backend" state.

It claims nothing, so "running" (what its heartbeat, sd_notify and the state gauge said) let a
monitor take it for healthy. Its heartbeat, `status` (text and --json, with `cannot_process`),
the STATUS= line and the gauge all say "no backend" and what to set; /readyz stays 200 (it is
about the database), as docs/production.md §11 says.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client import generate_latest
from structlog.testing import capture_logs

from sokratos_worker.config import Settings
from sokratos_worker.daemon import NO_BACKEND_CONFIGURED, Worker
from sokratos_worker.handlers import HandlerContext
from sokratos_worker.model import Queue
from sokratos_worker.service.sdnotify import Notifier
from sokratos_worker.status import cannot_process, render_status
from sokratos_worker.store.connection import Database
from sokratos_worker.store.status import live_workers
from sokratos_worker.worker_state import State
from tests.support.daemon import wait_until
from tests.support.handlers import ScriptedHandler


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.5)
    yield path, sock
    sock.close()


def _received(sock: socket.socket) -> list[str]:
    messages = []
    while True:
        try:
            messages.append(sock.recv(4096).decode())
        except TimeoutError:
            return messages


def _worker(database: Database, path: str, handlers: dict[Queue, Any], chat: Any = None) -> Worker:
    settings = Settings()
    return Worker(
        settings=settings,
        database=database,
        handlers=handlers,
        context=HandlerContext(settings=settings, database=database, chat=chat, embedder=None),
        notifier=Notifier({"NOTIFY_SOCKET": path}),
    )


def _status_report(db: psycopg.Connection) -> dict[str, Any]:
    workers = live_workers(db, stale_after_s=180)
    for worker in workers:
        if why := cannot_process(worker):
            worker["cannot_process"] = why
    return {
        "database": "ok",
        "queues": {},
        "failures_24h": {},
        "workers": workers,
        "email_accounts": [],
        "embeddings": "configured",
    }


def test_a_worker_without_handlers_reports_no_backend_everywhere(
    db: psycopg.Connection,
    database_url: str,
    notify_socket: tuple[str, socket.socket],
) -> None:
    path, sock = notify_socket
    database = Database(database_url, size=2)
    try:
        worker = _worker(database, path, handlers={})
        with capture_logs() as logs:
            worker.tick()
        scraped = generate_latest(worker.metrics.registry).decode()
        ready = worker._ready()
    finally:
        database.close()
    assert worker.runner.state == State.RUNNING  # (run --once still drains nothing, exit 0)
    assert worker.reported_state() == (State.NO_BACKEND, NO_BACKEND_CONFIGURED)
    assert "SOKRATOS_LLM_BACKENDS" in NO_BACKEND_CONFIGURED
    assert _received(sock) == [f"STATUS={State.NO_BACKEND}: {NO_BACKEND_CONFIGURED}"]
    assert 'sokratos_worker_state{state="no_backend"} 1.0' in scraped, scraped
    assert ready  # /readyz is about the database
    (tick,) = [e for e in logs if e["event"] == "tick_finished"]
    assert tick["state"] == State.NO_BACKEND
    report = _status_report(db)
    (w,) = report["workers"]
    assert w["state"] == "no backend"
    assert w["detail"]["why"] == NO_BACKEND_CONFIGURED
    assert w["cannot_process"] == "no LLM backend configured: items wait"
    (line,) = [x for x in render_status(report).splitlines() if x.startswith("worker ")]
    assert f": no backend ({NO_BACKEND_CONFIGURED}), last tick" in line, line


def test_a_worker_with_handlers_still_reports_running(
    db: psycopg.Connection,
    database_url: str,
    notify_socket: tuple[str, socket.socket],
) -> None:
    path, sock = notify_socket
    database = Database(database_url, size=2)
    try:
        worker = _worker(database, path, handlers={Queue.TRIAGE: ScriptedHandler()})
        worker.tick()
    finally:
        database.close()
    assert worker.reported_state() == (State.RUNNING, "")
    [status] = _received(sock)
    assert status.startswith("STATUS=running: 0 of 4 items in flight; queues pending_triage")
    (w,) = _status_report(db)["workers"]
    assert w["state"] == "running" and "cannot_process" not in w


def test_a_backend_outage_keeps_its_own_reason(
    db: psycopg.Connection, database_url: str, notify_socket: tuple[str, socket.socket]
) -> None:
    """A worker with handlers whose backends are unreachable: "no backend" as before, with
    the runner's reason, and not flagged as unable to process."""
    path, _ = notify_socket
    database = Database(database_url, size=2)
    try:
        worker = _worker(database, path, handlers={Queue.TRIAGE: ScriptedHandler()})
        worker.runner._worker_state.set(State.NO_BACKEND, "no LLM backend reachable (scripted)")
        # (written by the heartbeat writer's thread, within moments)
        assert wait_until(lambda: len(_status_report(db)["workers"]) == 1, timeout=5)
    finally:
        database.close()
    (w,) = _status_report(db)["workers"]
    assert (w["state"], w["detail"]["why"]) == ("no backend", "no LLM backend reachable (scripted)")
    assert "cannot_process" not in w


def test_a_handler_factory_that_returned_none_is_not_called_unconfigured(
    database_url: str, notify_socket: tuple[str, socket.socket]
) -> None:
    path, _ = notify_socket
    database = Database(database_url, size=1)
    try:
        worker = _worker(database, path, handlers={}, chat=object())
    finally:
        database.close()
    state, why = worker.reported_state()
    assert state == State.NO_BACKEND and "SOKRATOS_LLM_BACKENDS" not in why
