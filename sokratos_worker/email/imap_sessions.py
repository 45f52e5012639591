"""Keeping every open IMAP session cuttable, so no server can hold the worker.

A :class:`SessionWatch` shuts one session's socket down when its deadline passes (a server
that trickles a byte every few seconds never trips the per-read timeout) or the worker stops;
:class:`OpenSessions` is the set of watches one process has open, so that stopping it cuts them
all at once. ``WatchedIMAP4`` and ``WatchedIMAP4SSL`` are imaplib's clients on a socket the
session opened itself, so that the watch holds the socket from before ``connect`` on.
"""

from __future__ import annotations

import contextlib
import imaplib
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Literal

CutReason = Literal["deadline", "stopping"]


def _shut_down(sock: socket.socket) -> None:
    """Shut the socket down so a read blocked on it in another thread returns at once."""
    # The plain socket's shutdown, not SSLSocket's, which also drops the TLS state under the
    # reading thread; a socket already closed or detached has nothing left to cut.
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


class SessionWatch:
    """Cuts one session's connection when its deadline passes or the worker stops."""

    def __init__(self, deadline_s: float) -> None:
        self.cut_reason: CutReason | None = None
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._timer = threading.Timer(deadline_s, self.cut, args=("deadline",))
        self._timer.daemon = True  # a timer left running never holds the process at exit

    def start(self) -> None:
        """Start counting down the deadline."""
        self._timer.start()

    def watch(self, sock: socket.socket) -> None:
        """The socket the session reads from now on; cut at once if the session already is."""
        with self._lock:
            self._socket = sock
            if self.cut_reason is not None:
                _shut_down(sock)

    def cut(self, reason: CutReason) -> None:
        """Shut the watched socket down (and any watched later); the first reason stays."""
        with self._lock:
            if self.cut_reason is None:
                self.cut_reason = reason
            if self._socket is not None:
                _shut_down(self._socket)

    def end(self) -> None:
        """The session is closed: stop the timer and forget the socket."""
        self._timer.cancel()
        with self._lock:
            self._socket = None

    def tls_socket_class(self) -> type[ssl.SSLSocket]:
        """An SSLSocket class that is watched from its handshake on (a server can trickle that)."""
        watch = self

        class WatchedSSLSocket(ssl.SSLSocket):
            def do_handshake(self, block: bool = False) -> None:
                # wrap_socket returns the socket only after the handshake: watch it from here.
                watch.watch(self)
                super().do_handshake(block)

        return WatchedSSLSocket


class OpenSessions:
    """The IMAP sessions open in one process, so that stopping it can cut them all at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watches: set[SessionWatch] = set()
        self._stopping = False

    @property
    def stopping(self) -> bool:
        """True once :meth:`cut_all` ran: every session opened after it is cut at once."""
        return self._stopping

    def add(self, watch: SessionWatch) -> None:
        """Track an opening session (cut at once when the process is stopping)."""
        with self._lock:
            self._watches.add(watch)
            stopping = self._stopping
        if stopping:
            watch.cut("stopping")

    def discard(self, watch: SessionWatch) -> None:
        """Forget a closed session."""
        with self._lock:
            self._watches.discard(watch)

    def cut_all(self) -> int:
        """Cut every open session, and every one opened later; returns how many were open."""
        with self._lock:
            self._stopping = True
            watches = list(self._watches)
        for watch in watches:
            watch.cut("stopping")
        return len(watches)


SocketOpener = Callable[[], socket.socket]


class WatchedIMAP4(imaplib.IMAP4):
    """imaplib's plaintext client on a socket the session opened (and watches)."""

    def __init__(self, host: str, port: int, timeout: float, opener: SocketOpener) -> None:
        self._opener = opener
        super().__init__(host, port, timeout)

    def _create_socket(self, timeout: float | None) -> socket.socket:
        return self._opener()


class WatchedIMAP4SSL(imaplib.IMAP4_SSL):
    """imaplib's implicit-TLS client on a socket the session opened (and watches)."""

    def __init__(
        self, host: str, port: int, context: ssl.SSLContext, timeout: float, opener: SocketOpener
    ) -> None:
        self._opener = opener
        super().__init__(host, port, ssl_context=context, timeout=timeout)

    def _create_socket(self, timeout: float | None) -> socket.socket:
        sock: socket.socket = self.ssl_context.wrap_socket(
            self._opener(), server_hostname=self.host
        )
        return sock
