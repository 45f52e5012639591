"""A Content-Encoding the transport does not decode is passed through, as httpx does: servers
and fronting proxies that mislabel a plain body (``utf-8``, ``none``) still answer, and a list
(``gzip, identity``) is undone token by token, last applied first, within the size cap.
"""

from __future__ import annotations

import gzip
import socket
from collections.abc import Callable, Iterator

import pytest

from sokratos_worker.config import BackendConfig
from sokratos_worker.llm.chat import FallbackChatClient
from tests.llm.conftest import ask
from tests.support.rawserver import RawServer

BODY = (
    b'{"choices":[{"index":0,"message":{"role":"assistant","content":"{\\"score\\": 1, '
    b'\\"summary\\": \\"x\\"}"},"finish_reason":"stop"}]}'
)


def _answer(encoding: str, body: bytes) -> Callable[[socket.socket], None]:
    def answer(conn: socket.socket) -> None:
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            + f"Content-Encoding: {encoding}\r\nContent-Length: {len(body)}\r\n".encode()
            + b"Connection: close\r\n\r\n"
            + body
        )

    return answer


@pytest.fixture(autouse=True)
def _no_proxy_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)


@pytest.fixture
def raw_servers() -> Iterator[Callable[..., RawServer]]:
    started: list[RawServer] = []

    def start(answer: Callable[[socket.socket], None]) -> RawServer:
        server = RawServer(answer)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


@pytest.mark.parametrize(
    ("encoding", "body"),
    [
        ("utf-8", BODY),
        ("none", BODY),
        ("gzip, identity", gzip.compress(BODY)),
        ("identity, gzip", gzip.compress(BODY)),
        ("gzip, gzip", gzip.compress(gzip.compress(BODY))),
        ("x-unknown, gzip", gzip.compress(BODY)),
    ],
    ids=["utf-8", "none", "gzip-then-identity", "identity-then-gzip", "gzip-twice", "unknown-then-gzip"],
)
def test_a_mislabelled_or_listed_content_encoding_still_answers(
    encoding: str,
    body: bytes,
    raw_servers: Callable[..., RawServer],
    make_client: Callable[..., FallbackChatClient],
) -> None:
    server = raw_servers(_answer(encoding, body))
    client = make_client(
        BackendConfig(name="only", url=server.url, model="m", timeout=3.0), attempts=1
    )
    result = ask(client)
    assert result.value.score == 1
