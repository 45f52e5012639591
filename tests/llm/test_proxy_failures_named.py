"""When the environment's http:// proxy is what fails, the error names the proxy (its address,
credentials left out) and the variable it came from, never the proxy password; a 407 (to
``CONNECT`` or to a forwarded plain-http request) is configuration: the attempt is given back
and the message says to fix the proxy credentials.

They used to blame the backend: "cannot connect to api.example.com:443" for a proxy that was
down, "check each backend's url and model" for a 407 on plain http, "no LLM backend reachable"
(an outage) for a 407 answering ``CONNECT``.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import pytest

from sokratos_worker.config import BackendConfig
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.llm.embeddings import HttpEmbedder
from sokratos_worker.llm.types import (
    EmbeddingsMisconfigured,
    LLMBackendsMisconfigured,
    NoBackendReachable,
)
from tests.llm.conftest import ask
from tests.support.forward_proxy import ForwardProxy
from tests.support.rawserver import RawServer

PASSWORD = "Sup3rSecretProxyPw"
PAGE = b"<html>Proxy Authentication Required</html>\n"
DENIED = (
    b"HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm=corp\r\n"
    b"Content-Type: text/html\r\nContent-Length: %d\r\n\r\n" % len(PAGE) + PAGE
)


def _deny(conn: socket.socket) -> None:
    conn.sendall(DENIED)


@pytest.fixture(autouse=True)
def _no_proxy_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)


@pytest.fixture
def closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    sock.close()
    return port


@pytest.fixture
def denying_raw() -> Iterator[RawServer]:
    server = RawServer(_deny)
    yield server
    server.close()


@pytest.fixture
def denying_connect() -> Iterator[ForwardProxy]:
    proxy = ForwardProxy(connect_answer=_deny)
    yield proxy
    proxy.close()


def _failure(client: FallbackChatClient) -> Exception:
    with pytest.raises(Exception) as caught:
        ask(client)
    return caught.value


def _check(text: str, proxy_address: str, variable: str) -> None:
    assert PASSWORD not in text
    assert proxy_address in text, f"the proxy {proxy_address} is not named: {text}"
    assert f"(from {variable})" in text, f"{variable} is not named: {text}"


def test_a_proxy_that_is_down_is_named(
    closed_port: int,
    make_client: Callable[..., FallbackChatClient],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("https_proxy", f"http://corp:{PASSWORD}@127.0.0.1:{closed_port}")
    config = BackendConfig(name="cloud", url="https://api.example.com/v1", model="m", timeout=2)
    failure = _failure(make_client(config, attempts=1))
    assert isinstance(failure, NoBackendReachable)  # an outage of the proxy: given back
    _check(str(failure), f"127.0.0.1:{closed_port}", "https_proxy")
    assert "cannot connect to the proxy http://127.0.0.1:" in str(failure)
    assert PASSWORD not in capsys.readouterr().out


def test_a_407_from_the_proxy_on_a_plain_http_backend_is_configuration(
    denying_raw: RawServer,
    make_client: Callable[..., FallbackChatClient],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    address = denying_raw.url.removeprefix("http://").removesuffix("/v1")
    monkeypatch.setenv("HTTP_PROXY", f"http://corp:{PASSWORD}@{address}")
    config = BackendConfig(name="gpu", url="http://gpu.internal:8080/v1", model="m", timeout=2)
    client = make_client(config, attempts=1)
    failure = _failure(client)
    assert isinstance(failure, LLMBackendsMisconfigured), failure
    _check(str(failure), address, "HTTP_PROXY")
    assert "fix the proxy credentials" in str(failure)
    assert client.probe() is False  # claiming stays paused until the proxy lets it through


def test_a_407_answer_to_connect_is_configuration(
    denying_connect: ForwardProxy,
    make_client: Callable[..., FallbackChatClient],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ALL_PROXY", denying_connect.url(f"corp:{PASSWORD}"))
    config = BackendConfig(name="cloud", url="https://api.example.com/v1", model="m", timeout=2)
    failure = _failure(make_client(config, attempts=1))
    assert isinstance(failure, LLMBackendsMisconfigured), failure
    _check(str(failure), f"127.0.0.1:{denying_connect.port}", "ALL_PROXY")
    assert "fix the proxy credentials" in str(failure)
    assert denying_connect.seen[0].headers.get("proxy-authorization", "").startswith("Basic ")


def test_a_407_to_the_embedding_server_is_configuration(
    denying_connect: ForwardProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", denying_connect.url(f"corp:{PASSWORD}"))
    embedder = HttpEmbedder("https://emb.example/v1", "e", 8, timeout=2, sleep=lambda _: None)
    try:
        with pytest.raises(EmbeddingsMisconfigured) as raised:
            embedder.embed(["x"])
    finally:
        embedder.close()
    _check(str(raised.value), f"127.0.0.1:{denying_connect.port}", "HTTPS_PROXY")
    assert "fix the proxy credentials" in str(raised.value)
