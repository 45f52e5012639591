"""An error answer's compressed body is decoded only as far as its excerpt needs: its status
stays what it is.

A backend (or a proxy/WAF in front of it) answers ``401`` with a gzip-encoded error body that
decodes to more than MAX_RESPONSE_BYTES (32 MiB; nginx error pages with gzip on, a hostile
server). The transport decoded the whole error body before the status was looked at and raised
ResponseTooLarge, which the chat client counted as a transient ``connection_error``: retried,
the circuit charged, and the call ended as NoBackendReachable instead of
LLMBackendsMisconfigured naming the 401, after inflating 32 MiB per retry. For a status of 300
or more, at most MAX_ERROR_BODY_BYTES are decoded now, and an undecodable body is empty: the
status is kept either way. A 2xx body is still decoded whole within the cap.
"""

from __future__ import annotations

import gzip
import socket
from collections.abc import Callable

import httpx
import pytest

from sokratos_worker.config import BackendConfig
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.llm.http import make_client as http_client
from sokratos_worker.llm.transport import MAX_ERROR_BODY_BYTES, MAX_RESPONSE_BYTES
from sokratos_worker.llm.types import LLMBackendsMisconfigured
from tests.llm.conftest import ask
from tests.support.rawserver import RawServer

BODY = gzip.compress(
    b'{"error": {"message": "invalid api key", "type": "auth"}}'
    + b" " * (MAX_RESPONSE_BYTES + 1024),
    compresslevel=9,
)


def _answering(status: bytes, body: bytes) -> Callable[[socket.socket], None]:
    def answer(conn: socket.socket) -> None:
        conn.sendall(
            b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
            + f"Content-Encoding: gzip\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )

    return answer


def test_gzip_bombed_401_is_still_a_refusal(
    make_client: Callable[..., FallbackChatClient],
) -> None:
    server = RawServer(_answering(b"401 Unauthorized", BODY))
    try:
        client = make_client(
            BackendConfig(name="only", url=server.url, model="m", timeout=5), attempts=1
        )
        with pytest.raises(LLMBackendsMisconfigured) as raised:
            ask(client)
        assert "http_401" in str(raised.value)
        assert client.breaker("only").consecutive_failures == 0  # not charged as an outage
    finally:
        server.close()


@pytest.mark.parametrize(
    ("body", "starts"),
    [(BODY, b'{"error": {"message": "invalid api key"'), (b"not gzip at all", b"")],
    ids=["bomb", "undecodable"],
)
def test_an_error_body_is_decoded_only_as_far_as_needed(body: bytes, starts: bytes) -> None:
    server = RawServer(_answering(b"502 Bad Gateway", body))
    client = http_client(name="t", timeout=5)
    try:
        response = client.post(f"{server.url}/chat/completions", json={})
        assert response.status_code == 502
        assert len(response.content) <= MAX_ERROR_BODY_BYTES
        assert response.content.startswith(starts)
        assert "content-encoding" not in response.headers
    finally:
        client.close()
        server.close()


def test_a_gzip_bombed_2xx_is_still_too_large() -> None:
    server = RawServer(_answering(b"200 OK", BODY))
    client = http_client(name="t", timeout=5)
    try:
        with pytest.raises(httpx.RemoteProtocolError, match="once decoded"):
            client.post(f"{server.url}/chat/completions", json={})
    finally:
        client.close()
        server.close()
