"""An httpx transport over the standard library's ``http.client``.

httpx's default transport (httpcore + h11) does its HTTP/1.1 work in more Python than
``http.client`` does, so a call costs less CPU on this transport than on httpx's own
(bench/results/http_client.md). With 20 slot threads sharing one GIL, that CPU is time
every other slot waits (bench/README.md).
Everything above the transport (timeouts, headers, JSON, the exceptions callers catch)
is still httpx's. An HTTP proxy is spoken to here too (absolute-form requests, ``CONNECT``
tunnels for https: llm/proxy.py), so a proxied call keeps the deadline and the size cap; a
compressed body is decoded here, within the same cap, before httpx sees it.

Connections are kept alive and reused; an idle one the server has closed is noticed
before it is reused, so a request is never sent twice; and an answer the server sent
before it stopped reading the body (a 413) is returned, not a write error. Both as
httpcore does; tests/llm/test_transport.py runs the same tests against both.
"""

from __future__ import annotations

import http.client
import select
import socket
import ssl
import threading
import zlib

import httpx

from sokratos_worker.llm.deadline_io import response_class
from sokratos_worker.llm.proxy import (
    ProxyAuthenticationRequired,
    TunnelConnection,
    proxy_authorization,
    shown,
)


def _ssl_context(verify: ssl.SSLContext | bool) -> ssl.SSLContext:
    if isinstance(verify, ssl.SSLContext):
        return verify
    return httpx.create_ssl_context(verify=verify)  # False: no verification, as httpx does


def _closed_by_peer(conn: http.client.HTTPConnection) -> bool:
    """An idle connection that is readable has been closed (or sent junk): not reusable."""
    sock = conn.sock
    if sock is None:
        return True
    try:
        poller = select.poll()  # not select(): no FD_SETSIZE limit
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


# Far above any chat reply or embedding batch (32 vectors of 4,096 numbers are ~3 MB of
# JSON); a server past it is broken, and reading on would hold that much per slot.
MAX_RESPONSE_BYTES = 32 * 1024 * 1024


class ResponseTooLarge(httpx.RemoteProtocolError):
    """The server sent more than ``MAX_RESPONSE_BYTES`` (on the wire or once decoded)."""


# zlib's window bits for each Content-Encoding decoded here: gzip's header, or zlib's or raw
# deflate for "deflate" (servers send both).
_WBITS = {
    "gzip": 16 + zlib.MAX_WBITS,
    "x-gzip": 16 + zlib.MAX_WBITS,
    "deflate": 32 + zlib.MAX_WBITS,
}


# How much of an error answer's (status 300 or more) compressed body is decoded: its status
# is what counts, and only its start is read (an excerpt, the server's message).
MAX_ERROR_BODY_BYTES = 64 * 1024


def _decoded(body: bytes, encoding: str, limit: int, *, truncate: bool = False) -> bytes:
    """``body`` decompressed, never past ``limit`` bytes: a 40 KB gzip body can decode to GBs.
    ``truncate``: its first ``limit`` bytes (an undecodable body empty) instead of raising, for
    an error answer's body, which must not turn the answer's status into a transport error."""
    cap = limit if truncate else limit + 1
    try:
        try:
            decoder = zlib.decompressobj(_WBITS[encoding])
            data = decoder.decompress(body, cap)
        except zlib.error:
            if encoding != "deflate":
                raise
            decoder = zlib.decompressobj(-zlib.MAX_WBITS)  # raw deflate, without zlib's header
            data = decoder.decompress(body, cap)
    except zlib.error as exc:
        if truncate:
            return b""
        raise httpx.DecodingError(f"cannot decode the {encoding} body: {exc}") from exc
    if len(data) > limit:
        raise ResponseTooLarge(f"the response is over {limit} bytes once decoded")
    return data


def _undone(body: bytes, header: str, limit: int, *, truncate: bool = False) -> tuple[bytes, bool]:
    """``body`` with a Content-Encoding list undone, last applied first, as httpx does; a value
    that is not a compression decoded here (``identity``, and ones servers mislabel a plain
    body with: ``utf-8``, ``none``) is passed through unchanged. True when anything was
    decoded."""
    decoded = False
    for token in reversed(header.split(",")):
        encoding = token.strip().lower()
        if encoding in _WBITS:
            body = _decoded(body, encoding, limit, truncate=truncate)
            decoded = True
    return body, decoded


class StdlibTransport(httpx.BaseTransport):
    """HTTP/1.1 with keep-alive over ``http.client``; thread-safe.

    The read timeout bounds the whole response (status line, headers and body), not only
    each wait for data: a server that dribbles its answer a byte at a time cannot hold a
    slot for longer than that.
    """

    def __init__(
        self,
        *,
        verify: ssl.SSLContext | bool = True,
        max_idle: int = 2,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        proxy: httpx.URL | None = None,
        proxy_variable: str = "the proxy variables",
    ) -> None:
        self._max_response_bytes = max_response_bytes
        self._proxy = proxy  # an http:// proxy every request goes through, or None
        self._proxy_headers = proxy_authorization(proxy)
        # How errors name the proxy: its address (never its credentials) and where it is set.
        self._proxy_named = (
            f"the proxy {shown(proxy)} (from {proxy_variable})" if proxy is not None else ""
        )
        self._proxy_variable = proxy_variable
        self._max_idle = max_idle  # kept per host; more in use at once are closed after use
        self._ssl: ssl.SSLContext | None = None
        self._verify = verify
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}
        self._closed = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        key = _origin(request.url)
        conn = self._checkout(key, timeouts.get("connect"))
        try:
            response = self._exchange(conn, request, timeouts)
        except BaseException:
            conn.close()
            raise
        if response.status == 407 and self._proxy is not None and key[0] == "http":
            conn.close()  # (through a tunnel, a 407 would be the server's own: left to it)
            raise self._proxy_refused(f"{request.method} {key[1]}:{key[2]}")
        if response.will_close or not response.body_sent:
            conn.close()
        else:
            self._checkin(key, conn)
        headers, content = self._decode(response)
        return httpx.Response(
            status_code=response.status,
            headers=[(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers],
            stream=httpx.ByteStream(content),
            extensions={
                "http_version": b"HTTP/1.1",
                "reason_phrase": response.reason.encode("ascii", errors="replace"),
            },
        )

    def _decode(self, response: _Received) -> tuple[list[tuple[str, str]], bytes]:
        """Headers and body with any Content-Encoding undone here, within the size cap (httpx
        would decode it with no limit, so it never sees the header)."""
        header = None
        for name, value in response.headers:
            if name.lower() == "content-encoding":
                header = value if header is None else f"{header},{value}"
        if header is None:
            return response.headers, response.content
        if response.status >= 300:  # only its start is read: decoded no further, never raising
            limit = min(self._max_response_bytes, MAX_ERROR_BODY_BYTES)
            content, decoded = _undone(response.content, header, limit, truncate=True)
        else:
            content, decoded = _undone(response.content, header, self._max_response_bytes)
        dropped = _ENCODING_HEADERS if decoded else _ENCODING_HEADER
        kept = [(k, v) for k, v in response.headers if k.lower() not in dropped]
        if decoded:
            kept.append(("Content-Length", str(len(content))))
        return kept, content

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle = [conn for conns in self._idle.values() for conn in conns]
            self._idle.clear()
        for conn in idle:
            conn.close()

    # -- connections -------------------------------------------------------------------

    def _checkout(
        self, key: tuple[str, str, int], connect_timeout: float | None
    ) -> http.client.HTTPConnection:
        while True:
            with self._lock:
                if self._closed:
                    raise RuntimeError("Cannot send a request, as the client has been closed.")
                idle = self._idle.get(key)
                conn = idle.pop() if idle else None
            if conn is None:
                return self._connect(key, connect_timeout)
            if not _closed_by_peer(conn):
                return conn
            conn.close()

    def _checkin(self, key: tuple[str, str, int], conn: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if not self._closed and len(idle) < self._max_idle:
                idle.append(conn)
                return
        conn.close()

    def _connect(
        self, key: tuple[str, str, int], timeout: float | None
    ) -> http.client.HTTPConnection:
        scheme, host, port = key
        conn = self._new_connection(scheme, host, port, timeout)
        # Through a proxy, a socket error is the proxy's (a tunnel names its own stages).
        where = f"{host}:{port}"
        if self._proxy is not None:
            where = f"{self._proxy_named} for {where}"
        try:
            conn.connect()
        except TimeoutError as exc:
            conn.close()
            raise httpx.ConnectTimeout(f"connecting to {where} timed out") from exc
        except OSError as exc:  # refused, unreachable, a certificate refused (ssl.SSLError)
            conn.close()
            raise httpx.ConnectError(f"cannot connect to {where}: {exc}") from exc
        except BaseException:  # a tunnel's own httpx errors
            conn.close()
            raise
        assert conn.sock is not None  # noqa: S101 - connect() succeeded
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _new_connection(
        self, scheme: str, host: str, port: int, timeout: float | None
    ) -> http.client.HTTPConnection:
        """A connection to the server, or to the proxy (through a tunnel for https)."""
        proxy = self._proxy
        address = (host, port) if proxy is None else (proxy.host, proxy.port or 80)
        if scheme != "https":
            return http.client.HTTPConnection(*address, timeout=timeout)
        if self._ssl is None:
            self._ssl = _ssl_context(self._verify)
        if proxy is None:
            return http.client.HTTPSConnection(*address, timeout=timeout, context=self._ssl)
        return TunnelConnection(
            host,
            port,
            timeout=timeout,
            context=self._ssl,
            proxy=address,
            proxy_headers=self._proxy_headers,
            proxy_named=self._proxy_named,
            refused=self._proxy_refused,
        )

    def _proxy_refused(self, what: str) -> ProxyAuthenticationRequired:
        sent = "were refused" if self._proxy_headers else "are missing (none in the URL)"
        return ProxyAuthenticationRequired(
            f"{self._proxy_named} answered 407 Proxy Authentication Required to {what}: its"
            f" credentials {sent}; fix the proxy credentials (user:password@) in"
            f" {self._proxy_variable}"
        )

    # -- one exchange ------------------------------------------------------------------

    def _exchange(
        self,
        conn: http.client.HTTPConnection,
        request: httpx.Request,
        timeouts: dict[str, float | None],
    ) -> _Received:
        try:
            self._send(conn, request, timeouts.get("write"))
        except httpx.WriteError as unsent:
            # A server may answer before reading the whole body (a 413 for a prompt too
            # large) and close: that answer is the one to act on, as httpcore does.
            try:
                answer = self._receive(conn, request, timeouts.get("read"))
            except httpx.HTTPError:
                raise unsent from None
            answer.body_sent = False  # the rest of the body would garble the next request
            return answer
        return self._receive(conn, request, timeouts.get("read"))

    def _receive(
        self, conn: http.client.HTTPConnection, request: httpx.Request, timeout: float | None
    ) -> _Received:
        assert conn.sock is not None  # noqa: S101 - still connected after the send
        _set_timeout(conn.sock, timeout)
        conn.response_class = response_class(timeout)
        try:
            response = conn.getresponse()
            return _Received(response, self._read_body(response))
        except TimeoutError as exc:
            # (each wait is cut at the deadline: any timeout means the whole call took that)
            raise httpx.ReadTimeout(f"the response took longer than {timeout}s") from exc
        except http.client.HTTPException as exc:
            # RemoteDisconnected, IncompleteRead, BadStatusLine, LineTooLong, ...
            raise httpx.RemoteProtocolError(
                f"{type(exc).__name__}: {exc}", request=request
            ) from exc
        except OSError as exc:
            raise httpx.ReadError(f"reading the response failed: {exc}") from exc

    def _read_body(self, response: http.client.HTTPResponse) -> bytes:
        """The body, read as it arrives, within the size limit (the deadline is the reads')."""
        limit = self._max_response_bytes
        if response.length is not None and response.length > limit:
            raise ResponseTooLarge(f"the response is {response.length} bytes, over {limit}")
        chunks: list[bytes] = []
        size = 0
        while chunk := response.read1(65536):
            size += len(chunk)
            if size > limit:
                raise ResponseTooLarge(f"the response is over {limit} bytes")
            chunks.append(chunk)
        if response.length:  # the connection ended before the announced length
            raise http.client.IncompleteRead(b"".join(chunks), response.length)
        if not response.isclosed():
            response.read()  # a body of known length, read to its end: release the connection
        return b"".join(chunks)

    def _send(
        self, conn: http.client.HTTPConnection, request: httpx.Request, timeout: float | None
    ) -> None:
        assert conn.sock is not None  # noqa: S101 - checked out connected
        _set_timeout(conn.sock, timeout)
        url = request.url
        target = url.raw_path.decode("ascii")
        # Through a proxy, plain http asks for the absolute URL (https goes through a tunnel).
        forwarded = self._proxy is not None and url.scheme == "http"
        if forwarded:
            target = f"http://{url.netloc.decode('ascii')}{target}"
        try:
            conn.putrequest(request.method, target, skip_host=True, skip_accept_encoding=True)
            for name, value in request.headers.raw:
                conn.putheader(name, value)
            for header, text in self._proxy_headers.items() if forwarded else ():
                conn.putheader(header, text)
            # httpx announces a body of unknown length as chunked; http.client encodes it.
            chunked = request.headers.get("transfer-encoding", "").lower() == "chunked"
            conn.endheaders(request.read() or None, encode_chunked=chunked)
        except TimeoutError as exc:
            raise httpx.WriteTimeout("sending the request timed out") from exc
        except (http.client.HTTPException, ValueError) as exc:  # a header http.client refuses
            raise httpx.LocalProtocolError(f"cannot send the request: {exc}") from exc
        except OSError as exc:
            raise httpx.WriteError(f"sending the request failed: {exc}") from exc


class _Received:
    """A response read to its end, so its connection can be reused at once."""

    def __init__(self, response: http.client.HTTPResponse, content: bytes) -> None:
        self.status = response.status
        self.reason = response.reason or ""
        self.will_close = bool(response.will_close)
        self.body_sent = True
        self.content = content
        self.headers = response.getheaders()


_ENCODING_HEADERS = frozenset({"content-encoding", "content-length"})
_ENCODING_HEADER = frozenset({"content-encoding"})


def _set_timeout(sock: socket.socket, timeout: float | None) -> None:
    # settimeout is a system call that lets go of the GIL: only when the value changes.
    if sock.gettimeout() != timeout:
        sock.settimeout(timeout)


def _origin(url: httpx.URL) -> tuple[str, str, int]:
    port = url.port or (443 if url.scheme == "https" else 80)
    return url.scheme, url.host, port
