"""A proxy in front of the test Dovecot that answers ``NO`` to a UID FETCH of chosen UIDs.

Some servers refuse a message they cannot return with a tagged ``NO`` (Dovecot closes the
connection with ``BYE`` instead); everything else is relayed to Dovecot unchanged.
:class:`ByeProxy` closes the session with ``* BYE`` instead.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from collections.abc import Callable, Iterator

_FETCH = re.compile(rb"^(\S+) UID FETCH ([0-9,:]+) \(.*BODY", re.IGNORECASE)


def _uids(uid_set: bytes) -> set[int]:
    """The UIDs of a sequence set without ``*`` (``1,3:5``)."""
    found: set[int] = set()
    for part in uid_set.split(b","):
        low, _, high = part.partition(b":")
        found.update(range(int(low), int(high or low) + 1))
    return found


class RefusingProxy:
    """Use as a context manager; connect to ``port``; ``refused`` holds the UIDs to refuse."""

    fetch = _FETCH  # the FETCH commands it answers itself (for a refused UID)

    def __init__(
        self,
        upstream_port: int,
        refused: set[int],
        answer: bytes = b"[SERVERBUG] cannot read the message",
    ) -> None:
        self.upstream_port = upstream_port
        self.refused = refused
        self.answer = answer
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self.connections = 0  # sessions relayed
        self.fetches = 0  # UID FETCH commands the clients sent

    def __enter__(self) -> RefusingProxy:
        self._spawn(self._accept_forever)
        return self

    def __exit__(self, *_exc: object) -> None:
        for sock in [self._listener, *self._sockets]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self._threads:
            thread.join(10)

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_forever(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed by __exit__
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._sockets += [client, upstream]
            self._spawn(self._copy, upstream, client)
            self._spawn(self._commands, client, upstream)

    @staticmethod
    def _copy(source: socket.socket, target: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                target.sendall(data)

    def _lines(self, client: socket.socket) -> Iterator[bytes]:
        """The client's command lines, counted."""
        self.connections += 1
        for line in client.makefile("rb"):
            if b"UID FETCH" in line.upper():
                self.fetches += 1
            yield line

    def _commands(self, client: socket.socket, upstream: socket.socket) -> None:
        """Relay the client's command lines, answering a refused FETCH itself."""
        with contextlib.suppress(OSError, ValueError):
            for line in self._lines(client):
                match = self.fetch.match(line)
                if match and _uids(match.group(2)) & self.refused:
                    client.sendall(match.group(1) + b" NO " + self.answer + b"\r\n")
                else:
                    upstream.sendall(line)


class ByeProxy(RefusingProxy):
    """Closes the session with ``* BYE <answer>`` on a body FETCH of a refused UID; a new
    connection is served by Dovecot again (the reconnect works)."""

    def _commands(self, client: socket.socket, upstream: socket.socket) -> None:
        with contextlib.suppress(OSError, ValueError):
            for line in self._lines(client):
                match = self.fetch.match(line)
                if match and _uids(match.group(2)) & self.refused:
                    client.sendall(b"* BYE " + self.answer + b"\r\n")
                    for sock in (client, upstream):
                        with contextlib.suppress(OSError):
                            sock.shutdown(socket.SHUT_RDWR)
                    return
                upstream.sendall(line)


class OmittingProxy(RefusingProxy):
    """Relays a body UID FETCH without the UIDs in ``refused``: the server answers OK without
    them, as a server may for a message it cannot read (while UID SEARCH still lists it).
    With ``alone_too`` False, a FETCH of one such UID alone is relayed whole (a server that
    only fails it within a batch)."""

    alone_too = True

    def _commands(self, client: socket.socket, upstream: socket.socket) -> None:
        with contextlib.suppress(OSError, ValueError):
            for line in self._lines(client):
                match = self.fetch.match(line)
                if match is None:
                    upstream.sendall(line)
                    continue
                asked = sorted(_uids(match.group(2)))
                if len(asked) == 1 and not self.alone_too:
                    upstream.sendall(line)
                    continue
                kept = ",".join(str(uid) for uid in asked if uid not in self.refused)
                if not kept:
                    client.sendall(match.group(1) + b" OK Fetch completed.\r\n")
                    continue
                upstream.sendall(line.replace(match.group(2), kept.encode(), 1))


_LISTED = re.compile(rb"^\* \d+ FETCH \(.*\bUID (\d+)\b")
_LITERAL = re.compile(rb"\{(\d+)\}\r\n$")


class UnlistingProxy(OmittingProxy):
    """An :class:`OmittingProxy` that also drops, from the server's answers, the untagged
    FETCH lines without a body (the listing's ``* n FETCH (UID u RFC822.SIZE ...)``) of the
    UIDs in ``unlisted``: the listing leaves them out while UID SEARCH still finds them."""

    def __init__(self, upstream_port: int, refused: set[int], unlisted: set[int]) -> None:
        super().__init__(upstream_port, refused)
        self.unlisted = unlisted

    def _copy(self, source: socket.socket, target: socket.socket) -> None:  # type: ignore[override]
        with contextlib.suppress(OSError, ValueError):
            answers = source.makefile("rb")
            while line := answers.readline():
                literal = _LITERAL.search(line)
                if literal is not None:  # a body follows: relayed whole, never dropped
                    target.sendall(line + answers.read(int(literal.group(1))))
                    continue
                listed = _LISTED.match(line)
                if listed is None or int(listed.group(1)) not in self.unlisted:
                    target.sendall(line)
