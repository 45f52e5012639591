"""A TCP proxy in front of the test PostgreSQL that can cut the network without a reset.

Not a test module. :meth:`TcpProxy.blackhole` is a network partition: nothing crosses any more
and new connections are accepted but never answered, so a statement's answer and a cancel
request are both lost (no RST, no FIN), as when a cable or a firewall drops the traffic.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any

from psycopg.conninfo import conninfo_to_dict, make_conninfo


def upstream_of(url: str) -> Any:
    """Where a proxy in front of the server of ``url`` connects: a Unix socket's path, or
    (host, port)."""
    info = conninfo_to_dict(url)
    host = str(info.get("host") or "localhost")
    port = int(info.get("port") or 5432)
    return f"{host}/.s.PGSQL.{port}" if host.startswith("/") else (host.split(",", 1)[0], port)


def url_through(url: str, port: int) -> str:
    """``url`` with its server replaced by a proxy listening on 127.0.0.1:``port``."""
    info = {k: str(v) for k, v in conninfo_to_dict(url).items() if v is not None}
    info.pop("hostaddr", None)
    info.update(host="127.0.0.1", port=str(port))
    return make_conninfo(**info)


class TcpProxy:
    """Forwards 127.0.0.1:<port> to the server of ``url``; ``blackhole()`` stops forwarding in
    both directions and leaves new connections unanswered (a network partition)."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._target = upstream_of(url)
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.1)
        self._holes = False
        self._closed = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return url_through(self._url, self._server.getsockname()[1])

    def blackhole(self) -> None:
        """Cut the network: forward nothing more, answer no new connection."""
        self._holes = True

    def close(self) -> None:
        self._closed = True
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.close()
        with contextlib.suppress(OSError):
            self._server.close()

    def _keep(self, s: socket.socket) -> None:
        with self._lock:
            self._sockets.append(s)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except (TimeoutError, OSError):
                continue
            self._keep(client)
            if self._holes:
                continue  # accepted, never answered
            family = socket.AF_UNIX if isinstance(self._target, str) else socket.AF_INET
            upstream = socket.socket(family, socket.SOCK_STREAM)
            upstream.connect(self._target)
            self._keep(upstream)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(0.05)
        while not self._closed:
            if self._holes:
                threading.Event().wait(0.05)  # hold the bytes: nothing crosses any more
                continue
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            try:
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
