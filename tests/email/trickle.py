"""An IMAP server on 127.0.0.1 that answers normally up to a point, then trickles for ever.

From ``stall_at`` on it sends one byte every ``gap_s`` seconds and never completes a line or a
TLS record, so every single read of the client succeeds within its timeout and the client
never gets anywhere: the probe that kept an email check (and the daemon's heartbeat) stuck.

``stall_at``: ``greeting``, ``handshake`` (the TLS handshake of IMAPS), ``starttls`` (the
handshake after a successful STARTTLS), ``examine`` (after a successful login). With ``tls``
(a server context) the connection is IMAPS: the handshake completes, then the stall comes.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Literal

StallAt = Literal["greeting", "handshake", "starttls", "examine"]

# A TLS handshake record announcing 16 kB that never arrive (type 22, TLS 1.2, length 0x4000).
TLS_RECORD_HEADER = b"\x16\x03\x03\x40\x00"
GREETING = b"* OK [CAPABILITY IMAP4rev1 STARTTLS] trickle ready\r\n"


class TricklingServer:
    """Use as a context manager; ``port`` to connect to, ``accepted`` and ``trickling`` to watch."""

    def __init__(
        self, stall_at: StallAt, *, gap_s: float = 1.0, tls: ssl.SSLContext | None = None
    ) -> None:
        self.stall_at = stall_at
        self.gap_s = gap_s
        self.tls = tls
        self.accepted = 0
        self.trickling = 0  # connections now being trickled to (the client is still reading)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._connections: list[socket.socket] = []
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> TricklingServer:
        self._spawn(self._accept_forever)
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:  # unblocks a handler waiting for the client's next command
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(10)

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_forever(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed by __exit__
            with self._lock:
                self.accepted += 1
                self._connections.append(conn)
            self._spawn(self._serve, conn)

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError, ValueError):
            if self.stall_at == "handshake":
                self._trickle(conn, TLS_RECORD_HEADER)
                return
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
                with self._lock:
                    self._connections.append(conn)
            if self.stall_at == "greeting":
                self._trickle(conn, b"* OK ")
            else:
                conn.sendall(GREETING)
                self._answer_until_stall(conn)

    def _answer_until_stall(self, conn: socket.socket) -> None:
        """Answer CAPABILITY and LOGIN; trickle from STARTTLS or EXAMINE on."""
        for line in conn.makefile("rb"):
            tag, command = [*line.split(), b"", b""][:2]
            command = command.upper()
            if command == b"CAPABILITY":
                conn.sendall(b"* CAPABILITY IMAP4rev1 STARTTLS\r\n" + tag + b" OK done\r\n")
            elif command == b"LOGIN":
                conn.sendall(tag + b" OK logged in\r\n")
            elif command == b"STARTTLS" and self.stall_at == "starttls":
                conn.sendall(tag + b" OK begin TLS now\r\n")
                self._trickle(conn, TLS_RECORD_HEADER)
                return
            elif command in (b"EXAMINE", b"SELECT") and self.stall_at == "examine":
                self._trickle(conn, b"* 1 EXISTS")
                return
            else:
                conn.sendall(tag + b" BAD not in this test\r\n")

    def _trickle(self, conn: socket.socket, prefix: bytes) -> None:
        """``prefix`` then filler, one byte every ``gap_s``, until the client goes or we stop."""
        with self._lock:
            self.trickling += 1
        try:
            sent = 0
            while not self._stop.wait(self.gap_s):
                conn.sendall(prefix[sent : sent + 1] or b"x")
                sent += 1
        finally:
            with self._lock:
                self.trickling -= 1
