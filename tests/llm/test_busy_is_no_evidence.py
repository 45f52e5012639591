"""A probe that found every slot of its backend taken (Probed.BUSY) was never sent: it is no
evidence either way, and each caller decides as if it had not been made (review)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import pytest
from pydantic import BaseModel
from structlog.testing import capture_logs

from sokratos_worker.llm.breaker import Circuit
from sokratos_worker.llm.chat import FallbackChatClient, RetryPolicy
from sokratos_worker.llm.types import (
    BackendsMisconfigured,
    NoBackendReachable,
    RequestRefused,
)
from sokratos_worker.testing import PROBE, Reply, ScriptedLLM
from sokratos_worker.testing.scripted_llm import CHAT, Request
from tests.llm.conftest import Contradiction, backend, schema_name


class Ok(BaseModel):
    ok: bool


def _client(server: ScriptedLLM) -> FallbackChatClient:
    """One single-slot backend whose circuit opens at the first failure and may be tried
    0.2 s later; its trial's probe waits at most 1 s for the slot."""
    return FallbackChatClient(
        [backend(server, "a", timeout=3, max_concurrency=1)],
        policy=RetryPolicy(
            attempts=1, probe_timeout=1, breaker_threshold=1, breaker_cooldown=0.2
        ),
        sleep=lambda s: None,
    )


def _in_flight(client: FallbackChatClient) -> threading.Thread:
    """An item's call admitted while the circuit was closed, holding the one slot."""
    call = threading.Thread(target=_call_quietly, args=(client,))
    call.start()
    time.sleep(0.3)  # it holds the slot now
    return call


def _call_quietly(client: FallbackChatClient) -> None:
    # A hung server's timeout is counted by the breaker, as any call's failure.
    with contextlib.suppress(NoBackendReachable):
        client.complete(response_model=Ok, system="s", user="u", max_tokens=8, purpose="t")


def test_a_trial_that_finds_the_slot_held_by_a_call_to_a_hung_server_decides_nothing(
    servers: Callable[..., ScriptedLLM],
):
    """The server accepts and never answers; the call in flight holds the one slot. The trial
    took BUSY for up: circuit_closed was logged though nothing answered, the cool-down reset,
    and the item's call queued for the slot and went to the hung server."""
    hung = servers(chat=lambda r: Reply.hang(6))
    hung.on(PROBE, lambda r: Reply.hang(6))
    client = _client(hung)
    try:
        b = client.breaker("a")
        call = _in_flight(client)
        b.record_failure("timeout")  # the outage seen by earlier calls: open
        cooldown = b.cooldown
        time.sleep(0.3)  # the cool-down is over: the next call is the trial
        sent = hung.count(CHAT)
        started = time.monotonic()
        with capture_logs() as logs, pytest.raises(NoBackendReachable) as caught:
            client.complete(response_model=Ok, system="s", user="u", max_tokens=8, purpose="t")
        assert time.monotonic() - started < 2.5  # the trial's 1 s wait, not the hung call
        assert hung.count(CHAT) == sent  # the item's request was not sent to the hung server
        assert "every slot in use" in caught.value.tried[0].reason
        events = [e["event"] for e in logs]
        assert "circuit_closed" not in events, events
        assert "circuit_trial_inconclusive" in events
        assert b.state is Circuit.OPEN and b.cooldown == cooldown  # open, not doubled
        call.join()
        assert b.state is Circuit.OPEN  # the call in flight failed: still no success
    finally:
        client.close()


def test_a_healthy_backend_busy_with_its_own_calls_closes_when_they_end(
    servers: Callable[..., ScriptedLLM],
):
    """a348f03's purpose kept: the slot is held by a slow call that will be answered; the
    trial that finds no slot neither re-opens the circuit nor doubles its cool-down, and the
    call's answer closes it."""
    slow = servers(chat=lambda r: Reply.chat({"ok": True}, delay=2.0))
    client = _client(slow)
    try:
        b = client.breaker("a")
        call = _in_flight(client)
        b.record_failure("timeout")  # open while the slow call is in flight
        time.sleep(0.3)
        with pytest.raises(NoBackendReachable):
            client.complete(response_model=Ok, system="s", user="u", max_tokens=8, purpose="t")
        assert b.state is Circuit.OPEN and b.cooldown == 0.2
        call.join()
        assert b.state is Circuit.CLOSED, b.last_error  # the call in flight decided
        assert "overran" not in b.last_error
        answered = client.complete(
            response_model=Ok, system="s", user="u", max_tokens=8, purpose="t"
        )
        assert answered.backend == "a"
    finally:
        client.close()


def test_a_minimal_probe_that_found_no_free_slot_is_not_a_refusal_of_it(
    servers: Callable[..., ScriptedLLM],
):
    """Both backends refuse the Contradiction schema (a 400) and serve any other request;
    while the call is at the second one, another item's long call takes the first one's only
    slot. Its minimal probe found no slot and was taken for "refused": the item was given back
    as misconfigured ("check a's api_key and model") though the server got no probe, and
    would be again for as long as the slot is busy at that moment."""
    held = threading.Event()
    first: dict[str, FallbackChatClient] = {}

    def hold_a_slot() -> None:
        slots = first["client"]._backend("a").slots
        slots.acquire()  # free: the call is at b now
        held.set()
        time.sleep(3)  # another item's generation, longer than a's 1 s timeout
        slots.release()

    def refuses_it(request: Request) -> Reply:
        if schema_name(request) == "Contradiction":
            return Reply.error(400, "JSON schema conversion failed", type="invalid_request_error")
        return Reply.chat({"ok": True})

    def b_refuses_it(request: Request) -> Reply:
        if schema_name(request) == "Contradiction" and not held.is_set():
            threading.Thread(target=hold_a_slot).start()
            held.wait(2)
        return refuses_it(request)

    a = servers(chat=refuses_it)
    a.on(PROBE, refuses_it)
    b = servers(chat=b_refuses_it)
    b.on(PROBE, b_refuses_it)
    client = FallbackChatClient(
        [backend(a, "a", timeout=1, max_concurrency=1), backend(b, "b", timeout=1)],
        policy=RetryPolicy(attempts=1),
        sleep=lambda s: None,
    )
    first["client"] = client
    try:
        with pytest.raises(RequestRefused) as caught:
            client.complete(
                response_model=Contradiction, system="s", user="u", max_tokens=64, purpose="c"
            )
        message = str(caught.value)
        assert not isinstance(caught.value, BackendsMisconfigured)
        assert a.count(PROBE) == 0  # a was sent no minimal request ...
        assert "refused too" not in message and "api_key" not in message
        assert "a had every slot in use" in message and "b served one" in message  # ... said so
    finally:
        client.close()
