"""The local model server starts whatever surrounds the worker: a proxy in its environment.

The readiness check asks the worker's own child on 127.0.0.1; nothing in the worker's
environment may send it elsewhere.
"""

from __future__ import annotations

import pytest

from sokratos_worker.llm import local
from tests.llm.test_local_process import StandIn, _answers

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(120)]


def test_a_proxy_in_the_environment_does_not_hold_up_the_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With http_proxy set and 127.0.0.1 not in NO_PROXY, the readiness check went to the proxy:
    the start waited its whole timeout (120 s by default) and failed with "did not answer"
    while the server's own output said it was running."""
    unreachable_proxy = f"http://127.0.0.1:{local.free_port()}"
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, unreachable_proxy)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    server = StandIn(n_threads=1, startup_timeout=15)
    try:
        server.start()
        assert server._process is not None and server._process.poll() is None
        assert local.listens_on(server._process.pid, server.port)
    finally:
        server.stop()
    assert not _answers(server.port)
