"""systemd's notify protocol (``sd_notify(3)``) without libsystemd.

One datagram per message to the AF_UNIX socket named in ``$NOTIFY_SOCKET``; a leading ``@``
names the abstract namespace (a NUL byte in the address). Without ``$NOTIFY_SOCKET`` every
method does nothing, so the daemon calls them unconditionally. As libsystemd's sd_notify(),
a send waits while the socket's queue is full (a busy PID 1), here for at most
:data:`SEND_TIMEOUT_S`. A failed send is logged once and never raised: losing a status line
must not stop the worker (a lost ``WATCHDOG=1`` is systemd's to judge), but a lost
``READY=1`` or ``STOPPING=1`` is sent again with the next message, since each is sent once
and systemd would otherwise wait for it until its timeout.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import structlog

log = structlog.get_logger(__name__)

# systemd truncates nothing, but a status line is for humans: keep it to one short line.
_MAX_STATUS = 400

# How long a send waits for room in a full queue (the caller may be the watchdog's thread).
SEND_TIMEOUT_S = 1.0

# Sent once each: when lost, they go again with the next message.
_STATE_CHANGES = ("READY=1", "STOPPING=1")


class Notifier:
    """Sends ``READY=1``, ``STATUS=``, ``WATCHDOG=1``, ``STOPPING=1`` … to systemd.

    ``environ`` defaults to :data:`os.environ`; tests pass their own mapping. The
    environment is read once, at construction.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self._address = _socket_address(env.get("NOTIFY_SOCKET", ""))
        self._watchdog_interval = _watchdog_interval(env)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._failed = False
        self._undelivered: list[str] = []  # state changes a failed send lost

    @property
    def enabled(self) -> bool:
        """True when systemd (or a test) listens on ``$NOTIFY_SOCKET``."""
        return self._address is not None

    def watchdog_interval(self) -> float | None:
        """Half of ``WATCHDOG_USEC`` in seconds (the daemon pings every half of that), or None.

        None when the watchdog is off, or when ``WATCHDOG_PID`` names another process.
        """
        return self._watchdog_interval

    def ready(self, status: str | None = None) -> bool:
        """``READY=1``: start-up finished (migrations applied, the pool is up)."""
        return self.notify("READY=1", *_status_lines(status))

    def status(self, text: str) -> bool:
        """``STATUS=text``: the one line ``systemctl status`` shows."""
        return self.notify(*_status_lines(text))

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: the loop made progress (or is knowingly waiting)."""
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1``: shutdown began; systemd waits up to ``TimeoutStopSec``."""
        return self.notify("STOPPING=1", *_status_lines(status))

    def extend_timeout(self, seconds: float) -> bool:
        """``EXTEND_TIMEOUT_USEC``: ask for more time to start or stop (systemd ≥ 236)."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={max(0, int(seconds * 1_000_000))}")

    @contextmanager
    def extending_timeout(self, seconds: float) -> Iterator[None]:
        """While the block runs, ask for ``seconds`` more every third of them (from a thread:
        one long statement must not let an extension run out)."""
        if not self.enabled:
            yield
            return
        done = threading.Event()

        def keep_extending() -> None:
            while True:
                self.extend_timeout(seconds)
                if done.wait(seconds / 3):
                    return

        thread = threading.Thread(target=keep_extending, name="sd-extend-timeout", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def notify(self, *lines: str) -> bool:
        """Send the lines as one datagram; True when sent, False when off or failed."""
        if self._address is None or not lines:
            return False
        with self._lock:
            pending = [line for line in self._undelivered if line not in lines]
            message = "\n".join([*pending, *lines]).encode("utf-8", "replace")
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    self._sock.settimeout(SEND_TIMEOUT_S)
                    # Connected: only then does the wait for room sleep (unconnected, poll
                    # reports room at once and the send loop spun a CPU for the whole wait).
                    self._sock.connect(self._address)
                self._sock.send(message)
            except OSError as exc:  # (a timeout too)
                self._close_locked()
                lost = [line for line in (*pending, *lines) if line in _STATE_CHANGES]
                self._undelivered = list(dict.fromkeys(lost))
                if not self._failed:
                    self._failed = True
                    log.warning(
                        "sd_notify_failed",
                        error=str(exc) or type(exc).__name__,
                        errno=exc.errno,
                        hint="systemd's notify socket is full or gone; "
                        + (
                            f"{' and '.join(self._undelivered)} goes again with the next message"
                            if self._undelivered
                            else "later messages are tried as usual"
                        ),
                    )
                return False
            self._undelivered = []
        return True

    def close(self) -> None:
        """Close the socket (sending again reopens it)."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _socket_address(value: str) -> str | bytes | None:
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    # vsock and other forms are not ours to speak; say so once at construction.
    log.warning("sd_notify_unsupported_socket", notify_socket=value)
    return None


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return usec / 2_000_000


def _status_lines(text: str | None) -> list[str]:
    if text is None:
        return []
    one_line = " ".join(text.split())[:_MAX_STATUS]
    return [f"STATUS={one_line}"]


__all__ = ["Notifier"]
