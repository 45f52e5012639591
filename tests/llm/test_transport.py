"""The http.client transport behaves as httpx's own: the same tests run against both.

A raw HTTP/1.1 server on 127.0.0.1 answers by path, so each test can state what the peer
does: keep the connection, close it, hang, cut a body short, compress, chunk.
"""

from __future__ import annotations

import gzip
import json
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from sokratos_worker.llm.http import environment_proxies, make_client
from sokratos_worker.llm.transport import ResponseTooLarge, StdlibTransport

TRANSPORTS: dict[str, Callable[[], httpx.BaseTransport]] = {
    "stdlib": StdlibTransport,
    "httpx-default": httpx.HTTPTransport,
}


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        self.server.connections += 1
        sock: socket.socket = self.request
        reader = sock.makefile("rb")
        sock.settimeout(self.server.idle_timeout)
        while True:
            try:
                line = reader.readline()
            except (TimeoutError, OSError):
                return  # idle too long: close, as servers with a keep-alive timeout do
            if not line:
                return
            path = line.split()[1].decode()
            length, chunked, cookie = 0, False, None
            while (header := reader.readline()) not in (b"\r\n", b""):
                name, _, value = header.decode().partition(":")
                cookie = value.strip() if name.lower() == "cookie" else cookie
                if name.lower() == "content-length":
                    length = int(value)
                chunked |= name.lower() == "transfer-encoding" and "chunked" in value.lower()
            if path == "/early-413":  # answers without reading the body, then closes
                sock.sendall(
                    b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 8\r\n"
                    b"Connection: close\r\n\r\ntoo long"
                )
                threading.Event().wait(0.3)
                reader.close()  # with the body unread, the close resets the connection
                return
            body = _read_chunks(reader) if chunked else reader.read(length) if length else b""
            if not self._answer(sock, path, body, cookie):
                return

    def _answer(self, sock: socket.socket, path: str, body: bytes, cookie: str | None) -> bool:
        """Reply for ``path``; False closes the connection."""
        if path == "/hang":
            threading.Event().wait(5)
            return False
        if path == "/drop":
            sock.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"cut')
            return False
        if path == "/gzip":
            data = gzip.compress(b'{"ok": true}')
            head = f"Content-Encoding: gzip\r\nContent-Length: {len(data)}\r\n"
            sock.sendall(f"HTTP/1.1 200 OK\r\n{head}\r\n".encode() + data)
            return True
        if path == "/chunked":
            sock.sendall(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                b'6\r\n{"ok":\r\n6\r\n true}\r\n0\r\n\r\n'
            )
            return True
        if path == "/trickle":
            return _trickle(sock)
        if path.startswith("/slow-headers/"):  # this many header bytes, 0.1 s apart
            count = int(path.rpartition("/")[2])
            return _dribble(sock, [b"HTTP/1.1 200 OK\r\nX-Slow: ", *[b"a"] * count, b"\r\n"])
        if path.startswith("/late/"):  # this many seconds of silence, then the answer
            threading.Event().wait(float(path.rpartition("/")[2]))
        if path == "/continues":  # "100 Continue" every 0.1 s
            return _dribble(sock, [b"HTTP/1.1 100 Continue\r\n\r\n"] * 30)
        if path.startswith("/big/"):
            return _big(sock, path)
        if path == "/status/503":
            sock.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy")
            return True
        closing = path == "/close"
        data = json.dumps({"path": path, "echo": body.decode(), "cookie": cookie}).encode()
        head = f"Content-Length: {len(data)}\r\n" + ("Connection: close\r\n" if closing else "")
        if path == "/set-cookie":
            head += "Set-Cookie: session=abc; Path=/\r\n"
        sock.sendall(f"HTTP/1.1 200 OK\r\n{head}\r\n".encode() + data)
        return not closing


def _trickle(sock: socket.socket) -> bool:
    """A byte every 0.1 s, each wait far below the read timeout."""
    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
    for _ in range(100):
        threading.Event().wait(0.1)
        try:
            sock.sendall(b"x")
        except OSError:
            return False
    return True


def _dribble(sock: socket.socket, pieces: list[bytes]) -> bool:
    """``pieces`` 0.1 s apart, then the end of a small 200 answer."""
    try:
        for piece in pieces:
            sock.sendall(piece)
            threading.Event().wait(0.1)
        sock.sendall(b"HTTP/1.1 200 OK\r\n" if b"100" in pieces[0] else b"")
        sock.sendall(b"Content-Length: 2\r\n\r\n{}")
    except OSError:
        return False
    return True


def _big(sock: socket.socket, path: str) -> bool:
    """/big/{length|chunked}/MEGABYTES, then close."""
    _, _, framing, megabytes = path.split("/")
    block = b"x" * 1024 * 1024
    # "Connection: close": the server closes after it (a keep-alive reuse would race the FIN).
    if framing == "length":
        head = f"Content-Length: {int(megabytes) * len(block)}\r\nConnection: close\r\n"
        sock.sendall(f"HTTP/1.1 200 OK\r\n{head}\r\n".encode())
    else:
        sock.sendall(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )
    try:
        for _ in range(int(megabytes)):
            sock.sendall(block if framing == "length" else b"100000\r\n" + block + b"\r\n")
        if framing == "chunked":
            sock.sendall(b"0\r\n\r\n")
    except OSError:
        pass  # the client stopped reading
    return False


def _read_chunks(reader: Any) -> bytes:
    body = b""
    while size := int(reader.readline().split(b";")[0], 16):
        body += reader.read(size)
        reader.readline()  # the CRLF after each chunk
    reader.readline()  # the CRLF after the last, empty chunk
    return body


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, idle_timeout: float) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.idle_timeout = idle_timeout
        self.connections = 0
        self.closed = 0  # connections this server has closed

    def shutdown_request(self, request: Any) -> None:
        super().shutdown_request(request)
        self.closed += 1

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


def _serve(idle_timeout: float) -> Iterator[_Server]:
    server = _Server(idle_timeout)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def server() -> Iterator[_Server]:
    yield from _serve(idle_timeout=10.0)


@pytest.fixture(params=sorted(TRANSPORTS))
def client(request: pytest.FixtureRequest) -> Iterator[httpx.Client]:
    with httpx.Client(transport=TRANSPORTS[request.param](), timeout=2.0) as http:
        yield http


def test_keeps_the_connection_alive_between_calls(client: httpx.Client, server: _Server) -> None:
    for n in range(5):
        reply = client.post(f"{server.url}/echo", json={"n": n})
        assert reply.status_code == 200
        assert json.loads(reply.json()["echo"]) == {"n": n}
    assert server.connections == 1


def test_connection_close_from_the_server_is_honoured(
    client: httpx.Client, server: _Server
) -> None:
    for _ in range(3):
        assert client.get(f"{server.url}/close").status_code == 200
    assert server.connections == 3


def test_an_idle_connection_the_server_closed_is_not_reused(client: httpx.Client) -> None:
    for server in _serve(idle_timeout=0.05):
        assert client.get(f"{server.url}/one").status_code == 200
        # The server closes the idle connection meanwhile (bounded: a loaded machine may be
        # slow to run its thread, and a connection still open would rightly be reused).
        deadline = time.monotonic() + 10
        while server.closed == 0:
            assert time.monotonic() < deadline, "the server never closed the idle connection"
            threading.Event().wait(0.01)
        assert client.get(f"{server.url}/two").json()["path"] == "/two"
        assert server.connections == 2


def test_a_server_that_never_answers_is_a_read_timeout(
    client: httpx.Client, server: _Server
) -> None:
    with pytest.raises(httpx.ReadTimeout):
        client.get(f"{server.url}/hang", timeout=0.3)


def test_nothing_listening_is_a_connect_error(client: httpx.Client) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, never listening: connections are refused
        with pytest.raises(httpx.ConnectError):
            client.get(f"http://127.0.0.1:{port}/")


def test_a_body_cut_short_is_a_protocol_error(client: httpx.Client, server: _Server) -> None:
    with pytest.raises(httpx.RemoteProtocolError):
        client.get(f"{server.url}/drop")
    assert client.get(f"{server.url}/after").status_code == 200  # and the client goes on


@pytest.mark.parametrize("path", ["/gzip", "/chunked"])
def test_compressed_and_chunked_bodies_are_decoded(
    client: httpx.Client, server: _Server, path: str
) -> None:
    assert client.get(f"{server.url}{path}").json() == {"ok": True}


def test_error_statuses_are_returned_not_raised(client: httpx.Client, server: _Server) -> None:
    reply = client.get(f"{server.url}/status/503")
    assert (reply.status_code, reply.text, reply.reason_phrase) == (
        503,
        "busy",
        "Service Unavailable",
    )


def test_a_large_body_arrives_whole(client: httpx.Client, server: _Server) -> None:
    reply = client.post(f"{server.url}/echo", content=b"x" * 70_000)
    assert reply.json()["echo"] == "x" * 70_000


def test_one_client_is_safe_to_share_between_threads(client: httpx.Client, server: _Server) -> None:
    errors: list[BaseException] = []
    seen: list[int] = []

    def calls(worker: int) -> None:
        try:
            for n in range(25):
                reply = client.post(f"{server.url}/echo", json={"w": worker, "n": n})
                echoed = json.loads(reply.json()["echo"])
                assert echoed == {"w": worker, "n": n}
                seen.append(worker)
        except BaseException as exc:  # reported below: a thread's assertion is not a failure
            errors.append(exc)

    threads = [threading.Thread(target=calls, args=(w,)) for w in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    assert len(seen) == 150


def test_a_proxy_from_the_environment_is_still_honoured(
    server: _Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", server.url)
    assert environment_proxies()
    with make_client(name="proxied", timeout=2.0) as client:
        reply = client.get("http://backend.invalid/v1/models")
    assert reply.json()["path"] == "http://backend.invalid/v1/models"  # absolute form: a proxy


def test_without_a_proxy_the_backend_is_called_directly(
    server: _Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("all_proxy", raising=False)
    assert not environment_proxies()
    with make_client(name="direct", timeout=2.0) as client:
        assert client.get(f"{server.url}/v1/models").json()["path"] == "/v1/models"


def test_a_header_that_cannot_be_sent_is_a_local_protocol_error(
    client: httpx.Client, server: _Server
) -> None:
    with pytest.raises(httpx.LocalProtocolError):
        client.get(f"{server.url}/echo", headers={"X-Split": "one\r\nInjected: two"})
    assert client.get(f"{server.url}/after").status_code == 200


def test_an_answer_sent_before_the_body_was_read_is_returned(
    client: httpx.Client, server: _Server
) -> None:
    # nginx's client_max_body_size, for one: the 413 says "shorten the prompt".
    reply = client.post(f"{server.url}/early-413", content=b"x" * 20_000_000)
    assert (reply.status_code, reply.text) == (413, "too long")


def test_a_body_of_unknown_length_is_sent_chunked(client: httpx.Client, server: _Server) -> None:
    parts = iter([b"one ", b"two ", b"three"])
    reply = client.post(f"{server.url}/echo", content=parts)
    assert reply.json()["echo"] == "one two three"
    assert client.get(f"{server.url}/after").status_code == 200  # the connection is still sound


def test_the_worker_client_keeps_no_cookies(server: _Server) -> None:
    with httpx.Client(trust_env=False) as plain:  # httpx's default, for contrast
        plain.get(f"{server.url}/set-cookie")
        assert plain.get(f"{server.url}/echo").json()["cookie"] == "session=abc"
    with make_client(name="api", timeout=2.0) as client:
        assert client.get(f"{server.url}/set-cookie").status_code == 200
        assert client.get(f"{server.url}/echo").json()["cookie"] is None
        assert len(client.cookies) == 0


def test_a_body_dribbled_a_byte_at_a_time_is_bounded_by_the_read_timeout(
    server: _Server,
) -> None:
    """Each byte arrives well within the timeout; the whole answer may not take longer."""
    with httpx.Client(transport=StdlibTransport(), timeout=1.0) as http:
        started = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            http.get(f"{server.url}/trickle")
        assert time.monotonic() - started < 6.0  # not the 10 s the server would take
        assert http.get(f"{server.url}/after").status_code == 200


@pytest.mark.parametrize("path", ["/slow-headers/30", "/continues"])
def test_headers_dribbled_or_endless_continues_are_bounded_by_the_read_timeout(
    server: _Server, path: str
) -> None:
    """The deadline covers the status line and headers too, not only the body."""
    with httpx.Client(transport=StdlibTransport(), timeout=1.0) as http:
        started = time.monotonic()
        with pytest.raises(httpx.ReadTimeout, match=r"longer than 1\.0s"):
            http.get(f"{server.url}{path}")
        assert time.monotonic() - started < 2.0  # not the 3 s the server would take
        assert http.get(f"{server.url}/after").status_code == 200


def test_the_next_call_on_a_connection_gets_the_whole_timeout_again(server: _Server) -> None:
    """The socket timeout cut short near one call's deadline does not shorten the next's.
    (Generous margins for a loaded machine: the first call ends ~1.2 s before its deadline,
    leaving its socket timeout cut to about that; the next waits 2.5 s of its 4.)"""
    with httpx.Client(transport=StdlibTransport(), timeout=4.0) as http:
        assert http.get(f"{server.url}/slow-headers/26").status_code == 200  # ~2.8 s
        assert http.get(f"{server.url}/late/2.5").status_code == 200  # 2.5 s of silence
    assert server.connections == 1


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_response_over_the_size_limit_is_refused(server: _Server, framing: str) -> None:
    transport = StdlibTransport(max_response_bytes=2 * 1024 * 1024)
    with httpx.Client(transport=transport, timeout=5.0) as http:
        with pytest.raises(ResponseTooLarge):
            http.get(f"{server.url}/big/{framing}/8")
        assert http.get(f"{server.url}/big/{framing}/1").status_code == 200
        assert http.get(f"{server.url}/after").status_code == 200
