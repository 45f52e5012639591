"""A compressed reply is bounded once decoded, not only on the wire.

The client asks for ``Accept-Encoding: identity``; a server that compresses anyway is decoded
by the transport within MAX_RESPONSE_BYTES (a 40 KB gzip body can decode to 40 MB and more).
"""

from __future__ import annotations

import gzip
import json
import socket
import zlib
from collections.abc import Callable, Iterator

import httpx
import pytest

from sokratos_worker.llm.http import make_client
from sokratos_worker.llm.transport import MAX_RESPONSE_BYTES, ResponseTooLarge
from tests.support.rawserver import RawServer

REPLY = b'{"choices":[{"message":{"content":"' + b" " * 1000 + b'"}}]}'


def _answering(body: bytes, encoding: str) -> Callable[[socket.socket], None]:
    def answer(conn: socket.socket) -> None:
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            + f"Content-Encoding: {encoding}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )

    return answer


@pytest.fixture
def raw_servers() -> Iterator[Callable[[Callable[[socket.socket], None]], RawServer]]:
    started: list[RawServer] = []

    def start(answer: Callable[[socket.socket], None]) -> RawServer:
        started.append(RawServer(answer))
        return started[-1]

    yield start
    for server in started:
        server.close()


def _post(server: RawServer) -> httpx.Response:
    with make_client(name="b", timeout=10.0) as client:
        return client.post(f"{server.url}/chat/completions", json={"model": "m"})


def test_a_gzip_bomb_is_refused(
    raw_servers: Callable[[Callable[[socket.socket], None]], RawServer],
) -> None:
    decoded = REPLY.replace(b" " * 1000, b" " * (MAX_RESPONSE_BYTES + 8 * 1024 * 1024))
    bomb = gzip.compress(decoded, compresslevel=9)
    assert len(bomb) < 100_000  # tiny on the wire
    with pytest.raises(ResponseTooLarge, match="once decoded"):
        _post(raw_servers(_answering(bomb, "gzip")))


@pytest.mark.parametrize(
    ("encoding", "encode"),
    [
        ("gzip", gzip.compress),
        ("deflate", zlib.compress),
        ("deflate", lambda data: zlib.compress(data, wbits=-zlib.MAX_WBITS)),
    ],
    ids=["gzip", "deflate-zlib", "deflate-raw"],
)
def test_a_compressed_reply_within_the_cap_is_decoded(
    raw_servers: Callable[[Callable[[socket.socket], None]], RawServer],
    encoding: str,
    encode: Callable[[bytes], bytes],
) -> None:
    response = _post(raw_servers(_answering(encode(REPLY), encoding)))
    assert response.content == REPLY
    assert json.loads(response.content)["choices"]
    assert "content-encoding" not in response.headers


def test_an_encoding_not_decoded_here_is_passed_through(
    raw_servers: Callable[[Callable[[socket.socket], None]], RawServer],
) -> None:
    """As httpx does (without brotli): the body unchanged (test_content_encoding_passthrough)."""
    response = _post(raw_servers(_answering(b"\x00\x01", "br")))
    assert response.content == b"\x00\x01"


def test_the_client_asks_for_no_compression() -> None:
    with make_client(name="b", timeout=1.0) as client:
        assert client.headers["Accept-Encoding"] == "identity"
