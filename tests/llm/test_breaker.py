"""The circuit breaker alone (injected clock) and inside the chat client (real HTTP)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from pydantic import BaseModel

from sokratos_worker.llm.breaker import Circuit, CircuitBreaker
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.llm.types import NoBackendReachable
from sokratos_worker.testing import PROBE, Reply, ScriptedLLM, json_responder
from tests.llm.conftest import FakeClock, backend


class Ok(BaseModel):
    ok: bool


def breaker(clock: FakeClock, **kwargs: float) -> CircuitBreaker:
    return CircuitBreaker(
        "b", cooldown=120, max_cooldown=600, probe_deadline=30, clock=clock, **kwargs
    )  # type: ignore[arg-type]


def test_opens_after_three_consecutive_failures(clock: FakeClock):
    cb = breaker(clock)
    cb.record_failure("x")
    cb.record_failure("x")
    cb.record_success()
    cb.record_failure("x")
    cb.record_failure("x")
    assert cb.state is Circuit.CLOSED
    cb.record_failure("x")
    assert cb.state is Circuit.OPEN
    assert not cb.allow()


def test_one_half_open_probe_then_closed(clock: FakeClock):
    cb = breaker(clock)
    for _ in range(3):
        cb.record_failure()
    clock.advance(119)
    assert not cb.allow()
    clock.advance(1)
    assert cb.allow()
    assert cb.state is Circuit.HALF_OPEN
    assert not cb.allow()  # only one probe at a time
    cb.record_success()
    assert cb.state is Circuit.CLOSED
    assert cb.cooldown == 120


def test_failed_probe_doubles_the_cooldown_up_to_the_cap(clock: FakeClock):
    cb = breaker(clock)
    for _ in range(3):
        cb.record_failure()
    waits = []
    for _ in range(5):
        clock.advance(cb.retry_in())
        assert cb.allow()
        cb.record_failure("still down")
        waits.append(cb.cooldown)
    assert waits == [240, 480, 600, 600, 600]
    assert cb.state is Circuit.OPEN


def test_probe_that_never_reports_expires(clock: FakeClock):
    cb = breaker(clock)
    for _ in range(3):
        cb.record_failure()
    clock.advance(120)
    assert cb.allow()
    clock.advance(29)
    assert cb.state is Circuit.HALF_OPEN
    clock.advance(1)
    assert cb.state is Circuit.OPEN  # never stuck half-open
    assert cb.cooldown == 240
    clock.advance(240)
    assert cb.allow()


def test_client_breaker_skips_open_backend_and_probes_with_timeout(
    servers: Callable[..., ScriptedLLM],
    make_client: Callable[..., FallbackChatClient],
    clock: FakeClock,
):
    a, b = servers(), servers(chat=json_responder({"ok": True}))
    a.on("/v1/chat/completions", lambda r: Reply.error(500))
    client = make_client(backend(a, "a", timeout=5), backend(b, "b"), probe_timeout=0.3)

    def ask() -> str:
        return client.complete(
            response_model=Ok, system="s", user="u", max_tokens=8, purpose="t"
        ).backend

    for _ in range(3):
        assert ask() == "b"
    assert a.count() == 9  # three calls, three attempts each
    assert client.breaker("a").state is Circuit.OPEN
    assert client.states()[0].circuit == "open"

    assert ask() == "b"
    assert a.count() == 9  # open: a is skipped without a request

    clock.advance(120)
    a.on("/v1/chat/completions", lambda r: Reply.hang(10))
    result = client.complete(response_model=Ok, system="s", user="u", max_tokens=8, purpose="t")
    assert result.backend == "b"
    assert result.tried[0].reason == "timeout"
    assert a.count() == 10  # the probe is a single short attempt
    assert client.breaker("a").state is Circuit.OPEN
    assert client.breaker("a").cooldown == 240

    clock.advance(240)
    a.on("/v1/chat/completions", json_responder({"ok": True}))
    assert ask() == "a"
    assert client.breaker("a").state is Circuit.CLOSED


def test_all_circuits_open_is_no_backend_reachable_without_requests(
    servers: Callable[..., ScriptedLLM],
    make_client: Callable[..., FallbackChatClient],
):
    a = servers()
    a.on("/v1/chat/completions", lambda r: Reply.error(500))
    a.on(PROBE, lambda r: Reply.error(500))
    client = make_client(backend(a, "a"), attempts=1)
    for _ in range(3):
        with pytest.raises(NoBackendReachable):
            client.complete(response_model=Ok, system="s", user="u", max_tokens=8, purpose="t")
    assert a.count() == 3
    with pytest.raises(NoBackendReachable) as caught:
        client.complete(response_model=Ok, system="s", user="u", max_tokens=8, purpose="t")
    assert a.count() == 3
    assert caught.value.tried[0].reason == "circuit_open"


def test_health_probe_success_lets_the_next_call_probe_the_circuit(
    servers: Callable[..., ScriptedLLM],
    make_client: Callable[..., FallbackChatClient],
):
    a = servers()
    a.on("/v1/chat/completions", lambda r: Reply.error(500))
    a.on(PROBE, lambda r: Reply.error(500))
    client = make_client(backend(a, "a"), attempts=1)
    for _ in range(3):
        with pytest.raises(NoBackendReachable):
            client.complete(response_model=Ok, system="s", user="u", max_tokens=8, purpose="t")
    a.on(PROBE, lambda r: Reply.chat("OK"))
    a.on("/v1/chat/completions", json_responder({"ok": True}))
    assert client.probe() is True
    result = client.complete(response_model=Ok, system="s", user="u", max_tokens=8, purpose="t")
    assert result.backend == "a"
