"""With proxy variables set, every call keeps its total deadline and size cap.

Hosts NO_PROXY exempts go straight through StdlibTransport; the others go through the proxy,
spoken to by StdlibTransport too (an http:// proxy), so a reply dripping a few bytes at a time
cannot hold a call past its timeout either way.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from sokratos_worker.config import BackendConfig
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.llm.http import EnvironmentProxies
from tests.llm.conftest import ask
from tests.support.rawserver import RawServer

BODY = (
    b'{"choices":[{"index":0,"message":{"role":"assistant","content":"{\\"score\\": 1, '
    b'\\"summary\\": \\"x\\"}"},"finish_reason":"stop"}]}'
)
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")


def _drip(conn: socket.socket) -> None:
    conn.sendall(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(BODY)}\r\n\r\n".encode()
    )
    for i in range(0, len(BODY), 4):  # 4 bytes every 0.3 s: ~9 s in all
        time.sleep(0.3)
        conn.sendall(BODY[i : i + 4])


@pytest.fixture
def dripping() -> Iterator[RawServer]:
    server = RawServer(_drip)
    yield server
    server.close()


@pytest.fixture(autouse=True)
def _no_proxy_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)


def _took(client: FallbackChatClient) -> float:
    started = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - failing is right; failing late is not
        ask(client)
    return time.monotonic() - started


def test_a_dripping_backend_exempt_from_the_proxy_still_times_out(
    dripping: RawServer,
    make_client: Callable[..., FallbackChatClient],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("NO_PROXY", "localhost,127.0.0.1")
    config = BackendConfig(name="local", url=dripping.url, model="m", timeout=1.0)

    # 1 s timeout, one attempt: the call ends within a few seconds (two 1 s probes follow, in
    # its form and then plain), not after the ~9 s drip.
    assert _took(make_client(config, attempts=1)) < 5.0


def test_a_dripping_proxy_still_times_out(
    dripping: RawServer,
    make_client: Callable[..., FallbackChatClient],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HTTP_PROXY", dripping.url.removesuffix("/v1"))
    config = BackendConfig(name="far", url="http://backend.invalid/v1", model="m", timeout=1.0)

    assert _took(make_client(config, attempts=1)) < 5.0  # (as above)
    assert dripping.requests >= 1  # it went through the proxy


class _Named(httpx.BaseTransport):
    def __init__(self, name: str) -> None:
        self.name = name


@pytest.mark.parametrize(
    ("no_proxy", "url", "direct"),
    [
        ("gpu.lan,10.0.0.5", "http://10.0.0.5:8080/v1", True),  # (loopback: always direct)
        ("gpu.lan,10.0.0.5", "http://10.0.0.6:8080/v1", False),
        (".example.com", "https://llm.example.com/v1", True),
        ("example.com", "https://example.com/v1", True),
        ("example.com", "https://notexample.com/v1", False),
        ("*", "https://api.openai.com/v1", True),
        ("gpu:8080", "http://gpu:8080/v1", True),
        ("gpu:8080", "http://gpu:9090/v1", False),
        ("fd00::5", "http://[fd00::5]:8080/v1", True),
        ("fd00::5", "http://[fd00::6]:8080/v1", False),
        ("", "https://api.openai.com/v1", False),
    ],
)
def test_no_proxy_is_read_as_urllib_reads_it(no_proxy: str, url: str, direct: bool) -> None:
    router = EnvironmentProxies(
        _Named("direct"), {"http": _Named("proxy"), "https": _Named("proxy")}, no_proxy
    )
    chosen = router.route(httpx.URL(url))
    assert isinstance(chosen, _Named)
    assert (chosen.name == "direct") is direct
