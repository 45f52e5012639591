"""An https backend through an http:// proxy keeps its total deadline while the tunnel opens: a
proxy that drips its answer to ``CONNECT`` a byte at a time (never tripping a per-read
timeout) cannot hold the call past the backend's timeout, as it did through http.client's
``set_tunnel``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from sokratos_worker.config import BackendConfig
from sokratos_worker.llm.chat import FallbackChatClient
from tests.llm.conftest import ask
from tests.support.forward_proxy import ForwardProxy

STOP = threading.Event()


def _drip_connect_reply(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 Connection established\r\nX-Slow: ")
    for _ in range(40):  # 10 s at most per connection
        if STOP.wait(0.25):
            return
        conn.sendall(b"a")


@pytest.fixture
def dripping_proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[ForwardProxy]:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    STOP.clear()
    proxy = ForwardProxy(connect_answer=_drip_connect_reply)
    monkeypatch.setenv("HTTPS_PROXY", proxy.url())
    yield proxy
    STOP.set()
    proxy.close()


def test_a_proxy_dripping_its_connect_answer_cannot_hold_the_call(
    dripping_proxy: ForwardProxy, make_client: Callable[..., FallbackChatClient]
) -> None:
    config = BackendConfig(name="far", url="https://llm.test:443/v1", model="m", timeout=1.0)
    client = make_client(config, attempts=1)
    done = threading.Event()
    failures: list[Exception] = []

    def call() -> None:
        try:
            ask(client)
        except Exception as exc:  # failing is right; failing late is not
            failures.append(exc)
        done.set()

    started = time.monotonic()
    threading.Thread(target=call, daemon=True).start()
    finished = done.wait(8.0)
    took = time.monotonic() - started
    assert dripping_proxy.seen and dripping_proxy.seen[0].request_line.startswith("CONNECT")
    assert finished and took < 5.0, f"1 s timeout, but the call still ran after {took:.1f} s"
    (failure,) = failures
    assert "did not answer CONNECT llm.test:443 in time" in str(failure)
    assert f"127.0.0.1:{dripping_proxy.port} (from HTTPS_PROXY)" in str(failure)
