"""Reads that end by a deadline: an ``http.client`` response whose status line, headers and
body together take no longer than the read timeout, however slowly a server sends them.
"""

from __future__ import annotations

import functools
import http.client
import io
import socket
import time
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer


# A read may end this fraction of the read timeout past the deadline: the socket's timeout
# is changed (a system call) only when a wait could overshoot more, so a prompt answer
# costs none.
DEADLINE_SLACK = 0.05


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each cut so that none ends past one deadline.

    Status line, ``100 Continue`` answers, headers and body all come through here: a server
    that dribbles any of them a byte at a time cannot hold the call past the read timeout.
    """

    def __init__(self, raw: io.RawIOBase, sock: socket.socket, timeout: float) -> None:
        super().__init__()
        self._raw = raw
        self._sock = sock
        self._slack = timeout * DEADLINE_SLACK
        self._deadline = time.monotonic() + timeout

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int | None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the response's deadline has passed")
        waits = self._sock.gettimeout()
        if waits is None or waits > left + self._slack:
            self._sock.settimeout(left)  # (a system call: only when a wait could overshoot)
        return self._raw.readinto(buffer)

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


class DeadlineResponse(http.client.HTTPResponse):
    """An ``HTTPResponse`` that reads through a :class:`_DeadlineReader`."""

    def __init__(
        self,
        sock: socket.socket,
        debuglevel: int = 0,
        method: str | None = None,
        url: str | None = None,
        *,
        timeout: float,
    ) -> None:
        super().__init__(sock, debuglevel, method, url)
        # Nothing is read yet: the buffer's socket reader is taken over, not copied.
        self.fp = io.BufferedReader(_DeadlineReader(self.fp.detach(), sock, timeout))


def response_class(timeout: float | None) -> type[http.client.HTTPResponse]:
    """What ``getresponse()`` builds: one whose reads end by ``timeout`` from now."""
    if timeout is None:
        return http.client.HTTPResponse
    # (http.client only calls it, as it would a class)
    return cast(
        "type[http.client.HTTPResponse]", functools.partial(DeadlineResponse, timeout=timeout)
    )
