"""WATCHDOG=1 follows the dispatcher's progress: a hung dispatcher stops the pings."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from sokratos_worker.config import Settings
from sokratos_worker.daemon import DISPATCHER_STALL_S, Worker
from sokratos_worker.handlers import HandlerContext
from sokratos_worker.service.sdnotify import Notifier
from sokratos_worker.store.connection import Database


@pytest.fixture
def worker_and_socket(tmp_path: Path, database_url: str) -> Iterator[tuple[Worker, socket.socket]]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.5)
    settings = Settings()
    database = Database(database_url, size=2)
    worker = Worker(
        settings=settings,
        database=database,
        handlers={},
        context=HandlerContext(settings=settings, database=database, chat=None, embedder=None),
        notifier=Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"}),
    )
    yield worker, sock
    sock.close()
    database.close()


def _pinged(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b"WATCHDOG=1"
    except TimeoutError:
        return False


def test_pings_only_while_the_dispatcher_makes_progress(
    worker_and_socket: tuple[Worker, socket.socket],
) -> None:
    worker, sock = worker_and_socket
    worker._progressed()  # the dispatcher's loop came round: it pings at once
    assert _pinged(sock)
    # The main loop's once-a-second call, long after the dispatcher's last progress:
    worker._last_progress -= DISPATCHER_STALL_S + 1
    worker._last_watchdog = 0.0
    with capture_logs() as logs:
        worker._watchdog()
        worker._watchdog()
    assert not _pinged(sock)
    stalled = [e for e in logs if e["event"] == "dispatcher_stalled"]
    assert len(stalled) == 1 and stalled[0]["log_level"] == "error"
    # Progress again (e.g. a long backend probe ended): the pings resume.
    worker._progressed()
    assert _pinged(sock)
