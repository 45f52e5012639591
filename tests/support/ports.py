"""Ports on 127.0.0.1 for tests."""

from __future__ import annotations

import socket


def unused_port() -> int:
    """A port nothing listens on now (bound, then released): a server that is down, or a
    free port for one a test starts."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
