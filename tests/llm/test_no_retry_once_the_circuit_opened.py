"""A call retrying a backend stops once that backend's circuit has opened meanwhile (other calls'
failures): it moves on to the next backend instead of spending its remaining attempts, each up
to the backend's whole timeout, on a server the breaker already skips for every new call.
Real HTTP servers on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Callable

from sokratos_worker.llm.breaker import Circuit
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.testing import Reply, ScriptedLLM
from sokratos_worker.testing.scripted_llm import Request
from tests.llm.conftest import ask, backend


def test_a_retry_loop_stops_when_the_circuit_opened_meanwhile(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    clients: list[FallbackChatClient] = []

    def down_and_others_notice(request: Request) -> Reply:
        # Meanwhile, other slots' calls to this backend fail and open its circuit.
        breaker = clients[0].breaker("primary")
        for _ in range(breaker.threshold):
            breaker.record_failure("http_503: Loading model")
        return Reply.error(503, "Loading model")

    primary = servers(chat=down_and_others_notice)
    fallback = servers()
    fallback.script(Reply.chat({"score": 5, "summary": "ok"}))
    client = make_client(backend(primary, "primary"), backend(fallback, "fallback"), attempts=3)
    clients.append(client)

    result = ask(client)

    assert result.backend == "fallback"
    assert primary.count() == 1, "retried a backend whose circuit had opened"
    assert result.tried[0].reason == "http_503: Loading model"
    assert client.breaker("primary").state is Circuit.OPEN


def test_a_closed_circuit_still_gets_every_attempt(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    primary = servers(chat=lambda r: Reply.error(503, "Loading model"))
    fallback = servers()
    fallback.script(Reply.chat({"score": 5, "summary": "ok"}))
    client = make_client(backend(primary, "primary"), backend(fallback, "fallback"), attempts=3)

    assert ask(client).backend == "fallback"
    assert primary.count() == 3
