"""sd_notify datagrams received on real AF_UNIX sockets: a path and an abstract @name."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from sokratos_worker.service.sdnotify import Notifier


def _receiver(address: str | bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(2.0)
    return sock


@pytest.fixture
def path_socket(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    path = str(tmp_path / "notify.sock")
    sock = _receiver(path)
    yield path, sock
    sock.close()


@pytest.fixture
def abstract_socket() -> Iterator[tuple[str, socket.socket]]:
    name = f"sokratos-test-{uuid.uuid4().hex}"
    sock = _receiver(b"\0" + name.encode())
    yield "@" + name, sock
    sock.close()


def _exchange(notifier: Notifier, sock: socket.socket) -> list[bytes]:
    assert notifier.enabled
    assert notifier.ready()
    assert notifier.status("waiting for database")
    assert notifier.watchdog()
    assert notifier.stopping()
    return [sock.recv(4096) for _ in range(4)]


EXPECTED = [b"READY=1", b"STATUS=waiting for database", b"WATCHDOG=1", b"STOPPING=1"]


def test_datagrams_on_a_path_socket(path_socket: tuple[str, socket.socket]) -> None:
    path, sock = path_socket
    notifier = Notifier({"NOTIFY_SOCKET": path})
    assert _exchange(notifier, sock) == EXPECTED
    notifier.close()


def test_datagrams_on_an_abstract_socket(abstract_socket: tuple[str, socket.socket]) -> None:
    name, sock = abstract_socket
    notifier = Notifier({"NOTIFY_SOCKET": name})
    assert _exchange(notifier, sock) == EXPECTED
    notifier.close()


def test_ready_and_stopping_carry_a_status(path_socket: tuple[str, socket.socket]) -> None:
    path, sock = path_socket
    notifier = Notifier({"NOTIFY_SOCKET": path})
    notifier.ready("running: 0 items\nin flight")
    notifier.stopping("draining 2 items")
    assert sock.recv(4096) == b"READY=1\nSTATUS=running: 0 items in flight"
    assert sock.recv(4096) == b"STOPPING=1\nSTATUS=draining 2 items"


def test_without_notify_socket_everything_is_a_no_op() -> None:
    notifier = Notifier({})
    assert not notifier.enabled
    assert notifier.ready() is False
    assert notifier.status("x") is False
    assert notifier.watchdog() is False
    assert notifier.stopping() is False
    assert notifier.watchdog_interval() is None


def test_default_environ_is_os_environ(
    path_socket: tuple[str, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, sock = path_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "20000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    notifier = Notifier()
    assert notifier.watchdog_interval() == 10.0
    notifier.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"


def test_send_failure_is_logged_once_and_never_raised(tmp_path: Path) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens.sock")})
    with capture_logs() as logs:
        assert notifier.ready() is False
        assert notifier.watchdog() is False
        assert notifier.status("still fine") is False
    failures = [entry for entry in logs if entry["event"] == "sd_notify_failed"]
    assert len(failures) == 1
    assert failures[0]["log_level"] == "warning"


def test_reconnects_after_the_listener_comes_back(tmp_path: Path) -> None:
    path = str(tmp_path / "late.sock")
    notifier = Notifier({"NOTIFY_SOCKET": path})
    assert notifier.watchdog() is False
    sock = _receiver(path)
    try:
        assert notifier.watchdog() is True
        assert sock.recv(4096) == b"WATCHDOG=1"
    finally:
        sock.close()


def _fill(path: str) -> int:
    """Queue datagrams until the kernel refuses more, as on a busy PID 1's socket."""
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sender.setblocking(False)
    sent = 0
    with contextlib.suppress(BlockingIOError), sender:
        while sent < 100_000:
            sender.sendto(b"STATUS=another unit", path)
            sent += 1
    return sent


def _drain(sock: socket.socket) -> list[bytes]:
    sock.settimeout(0.2)
    received: list[bytes] = []
    with contextlib.suppress(TimeoutError):
        while True:
            received.append(sock.recv(4096))
    return received


def test_a_send_waits_for_room_in_a_full_queue(path_socket: tuple[str, socket.socket]) -> None:
    # A non-blocking send dropped READY=1 on EAGAIN; libsystemd's sd_notify() waits instead.
    path, sock = path_socket
    queued = _fill(path)
    assert queued > 0
    notifier = Notifier({"NOTIFY_SOCKET": path})
    reader = threading.Timer(0.2, lambda: sock.recv(4096))  # PID 1 reads one a moment later
    reader.start()
    try:
        assert notifier.ready() is True
    finally:
        reader.join()
    assert _drain(sock)[-1] == b"READY=1"


def test_a_lost_ready_goes_again_with_the_next_message(
    path_socket: tuple[str, socket.socket],
) -> None:
    path, sock = path_socket
    _fill(path)
    notifier = Notifier({"NOTIFY_SOCKET": path})
    with capture_logs() as logs:
        cpu = time.process_time()
        assert notifier.ready() is False  # full for longer than the send waits
        cpu = time.process_time() - cpu
    # The wait sleeps (an unconnected socket's send loop spun a CPU for the whole second).
    assert cpu < 0.5, f"{cpu:.2f} s of CPU spent waiting for room"
    # (By event: a daemon thread an earlier test left, such as a heartbeat writer finishing
    # against a closed pool, may log into the same capture.)
    [failed] = [e for e in logs if e["event"] == "sd_notify_failed"]
    assert "READY=1 goes again" in failed["hint"]
    _drain(sock)  # PID 1 catches up
    assert notifier.watchdog() is True
    assert sock.recv(4096) == b"READY=1\nWATCHDOG=1"
    assert notifier.watchdog() is True
    assert sock.recv(4096) == b"WATCHDOG=1"  # sent once it got through


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "nonsense"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval(environ: dict[str, str], expected: float | None) -> None:
    env = {"NOTIFY_SOCKET": "@unused", **environ}
    assert Notifier(env).watchdog_interval() == expected


def test_unsupported_socket_forms_are_ignored() -> None:
    notifier = Notifier({"NOTIFY_SOCKET": "vsock:2:1234"})
    assert not notifier.enabled
    assert notifier.ready() is False


def test_extending_timeout_asks_again_before_each_extension_runs_out(
    path_socket: tuple[str, socket.socket],
) -> None:
    """EXTEND_TIMEOUT_USEC every third of the extension while the block runs, none after."""
    path, sock = path_socket
    notifier = Notifier({"NOTIFY_SOCKET": path})
    with notifier.extending_timeout(0.6):
        received = [sock.recv(4096) for _ in range(3)]
    assert received == [b"EXTEND_TIMEOUT_USEC=600000"] * 3
    sock.settimeout(0)
    with contextlib.suppress(BlockingIOError):
        while sock.recv(4096) == b"EXTEND_TIMEOUT_USEC=600000":  # sent before the block ended
            pass
    sock.settimeout(0.6)
    with pytest.raises(TimeoutError):
        sock.recv(4096)
    notifier.close()
