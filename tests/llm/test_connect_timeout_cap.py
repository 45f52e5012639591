"""A backend whose host never answers the connection (a firewall dropping SYNs, a full accept
queue) is given up after the 10 s connect cap, not after the backend's whole ``timeout``: the
cap was set on each HTTP client, but every call passed its own ``timeout=``, which replaced it,
so with the default 120 s three attempts held an item 6 minutes before the fallback was asked.
A real listening socket on 127.0.0.1 whose accept queue is full (its SYNs go unanswered)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import pytest

from sokratos_worker.config import BackendConfig
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.testing import Reply, ScriptedLLM
from tests.llm.conftest import ask, backend


@pytest.fixture
def unanswering_url() -> Iterator[str]:
    """An http:// base URL whose connections never complete: one connection fills the
    listener's accept queue (backlog 0, never accepted), so the kernel drops later SYNs."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", port), timeout=5)
    probe = socket.socket()
    probe.settimeout(0.5)
    try:
        probe.connect(("127.0.0.1", port))
        pytest.skip("this kernel completes connections past a full accept queue")
    except TimeoutError:
        pass
    finally:
        probe.close()
    yield f"http://127.0.0.1:{port}/v1"
    filler.close()
    listener.close()


def test_an_unanswered_connection_moves_on_after_the_connect_cap_not_the_whole_timeout(
    unanswering_url: str,
    servers: Callable[..., ScriptedLLM],
    make_client: Callable[..., FallbackChatClient],
) -> None:
    fallback = servers()
    fallback.script(Reply.chat({"score": 2, "summary": "ok"}))
    silent = BackendConfig(name="silent", url=unanswering_url, model="m", timeout=40)
    client = make_client(silent, backend(fallback, "fallback"), attempts=1)

    started = time.monotonic()
    result = ask(client)
    took = time.monotonic() - started

    assert result.backend == "fallback"
    (skipped, _) = result.tried
    assert skipped.reason.startswith("timeout: ConnectTimeout"), skipped.reason
    # The cap is 10 s; the backend's timeout is 40 s (generous bound for a busy machine).
    assert took < 30, f"the fallback was asked only after {took:.0f} s"
