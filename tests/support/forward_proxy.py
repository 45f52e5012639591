"""A small forward HTTP proxy on 127.0.0.1 for the proxy tests (not a test module).

Absolute-form requests are forwarded (one per connection, ``Connection: close`` upstream);
``CONNECT`` opens a tunnel. Only the proxy knows where its backends are: ``upstreams`` maps a
``host:port`` as a request names it (``llm.test:443``, a name no resolver knows) to a port on
127.0.0.1, and any other target is answered 502, so a call that reached a backend is a call
the proxy carried (a loopback backend is called directly, never through the proxy).
``connect_answer`` replaces the tunnel with a function of the client socket (a 407, a dripping
reply, ...).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Seen:
    request_line: str
    headers: dict[str, str]


class ForwardProxy:
    def __init__(
        self,
        connect_answer: Callable[[socket.socket], None] | None = None,
        upstreams: dict[str, int] | None = None,
    ) -> None:
        self.connect_answer = connect_answer
        self.upstreams = dict(upstreams or {})
        self.seen: list[Seen] = []
        self.connections = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    def url(self, userinfo: str = "") -> str:
        return f"http://{userinfo + '@' if userinfo else ''}127.0.0.1:{self.port}"

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=2)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, OSError):
                continue
            self.connections += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    conn.close()
                    return
                data += chunk
            head, _, rest = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            self.seen.append(Seen(lines[0], headers))
            method, target, _ = lines[0].split(" ", 2)
            if method == "CONNECT":
                if self.connect_answer is not None:
                    self.connect_answer(conn)
                    conn.close()
                    return
                upstream = self._upstream(conn, target)
                if upstream is None:
                    return
                conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                if rest:
                    upstream.sendall(rest)
                self._pipe(conn, upstream)
                return
            # absolute-form: http://host:port/path
            hostport, _, path = target.removeprefix("http://").partition("/")
            has_port = hostport.rfind(":") > hostport.rfind("]")  # (an IPv6 [address] alone)
            upstream = self._upstream(conn, hostport if has_port else f"{hostport}:80")
            if upstream is None:
                return
            kept = [
                line
                for line in lines[1:]
                if line.partition(":")[0].strip().lower()
                not in ("connection", "proxy-authorization", "keep-alive")
            ]
            new_head = "\r\n".join([f"{method} /{path} HTTP/1.1", *kept, "Connection: close"])
            upstream.sendall(new_head.encode("latin-1") + b"\r\n\r\n" + rest)
            self._pipe(conn, upstream, close_reply=True)
        except OSError:
            conn.close()

    def _upstream(self, conn: socket.socket, authority: str) -> socket.socket | None:
        """The connection to the backend ``authority`` names, or None once answered 502."""
        port = self.upstreams.get(authority.lower())
        if port is None:
            conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
            conn.close()
            return None
        return socket.create_connection(("127.0.0.1", port), timeout=30)

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket, close_reply: bool = False) -> None:
        def one_way(src: socket.socket, dst: socket.socket, mark: bool = False) -> None:
            try:
                while chunk := src.recv(65536):
                    if mark and b"\r\n" in chunk:  # the reply says the proxy closes after it
                        status, _, tail = chunk.partition(b"\r\n")
                        chunk = status + b"\r\nConnection: close\r\n" + tail
                        mark = False
                    dst.sendall(chunk)
            except OSError:
                pass
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

        t = threading.Thread(target=one_way, args=(b, a, close_reply), daemon=True)
        t.start()
        one_way(a, b)
        t.join(timeout=30)
        a.close()
        b.close()
