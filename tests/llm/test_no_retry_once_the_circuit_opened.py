"""A call whose try got no answer (a timeout) stops retrying that backend once its circuit has
opened meanwhile (other calls' failures): it moves on to the next backend instead of waiting
out the backend's whole timeout again on a server the breaker already skips for every new
call. A quick 5xx is still retried, and so is any try once the circuit is half-open: with one
backend, a transient 503 while others opened the circuit cost the item its attempt (found by
a review). Real HTTP servers on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Callable

from sokratos_worker.llm.breaker import Circuit
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.testing import Reply, ScriptedLLM
from sokratos_worker.testing.scripted_llm import Request
from tests.llm.conftest import FakeClock, ask, backend

GOOD = {"score": 5, "summary": "ok"}


def test_a_retry_loop_after_a_timeout_stops_when_the_circuit_opened_meanwhile(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    clients: list[FallbackChatClient] = []

    def hangs_and_others_notice(request: Request) -> Reply:
        # Meanwhile, other slots' calls to this backend fail and open its circuit.
        breaker = clients[0].breaker("primary")
        for _ in range(breaker.threshold):
            breaker.record_failure("timeout")
        return Reply.hang(2)

    primary = servers(chat=hangs_and_others_notice)
    fallback = servers()
    fallback.script(Reply.chat(GOOD))
    client = make_client(
        backend(primary, "primary", timeout=0.3), backend(fallback, "fallback"), attempts=3
    )
    clients.append(client)

    result = ask(client)

    assert result.backend == "fallback"
    assert primary.count() == 1, "waited out the timeout again on a backend whose circuit opened"
    assert result.tried[0].reason.startswith("timeout: no answer within"), result.tried
    assert client.breaker("primary").state is Circuit.OPEN


def test_a_closed_circuit_still_gets_every_attempt(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    primary = servers(chat=lambda r: Reply.error(503, "Loading model"))
    fallback = servers()
    fallback.script(Reply.chat(GOOD))
    client = make_client(backend(primary, "primary"), backend(fallback, "fallback"), attempts=3)

    assert ask(client).backend == "fallback"
    assert primary.count() == 3


def _one_backend_503_then_served(
    servers: Callable[..., ScriptedLLM],
    make_client: Callable[..., FallbackChatClient],
    clock: FakeClock,
    *,
    half_open: bool,
) -> str:
    clients: list[FallbackChatClient] = []
    seen = [0]

    def responder(request: Request) -> Reply:
        seen[0] += 1
        if seen[0] == 1:
            breaker = clients[0].breaker("only")
            for _ in range(breaker.threshold):
                breaker.record_failure("http_503: Loading model")
            if half_open:  # another call is the half-open trial right now
                clock.advance(breaker.cooldown + 1)
                breaker.admit()
            return Reply.error(503, "Loading model")
        return Reply.chat(GOOD)

    only = servers(chat=responder)
    client = make_client(backend(only, "only"), attempts=3)
    clients.append(client)
    return ask(client).backend


def test_a_quick_503_is_retried_though_others_opened_the_circuit(
    servers: Callable[..., ScriptedLLM],
    make_client: Callable[..., FallbackChatClient],
    clock: FakeClock,
) -> None:
    assert _one_backend_503_then_served(servers, make_client, clock, half_open=False) == "only"


def test_any_try_is_retried_while_another_calls_trial_is_in_flight(
    servers: Callable[..., ScriptedLLM],
    make_client: Callable[..., FallbackChatClient],
    clock: FakeClock,
) -> None:
    assert _one_backend_503_then_served(servers, make_client, clock, half_open=True) == "only"
