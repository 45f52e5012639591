"""The circuit breaker alone (injected clock) and inside the chat client (real HTTP)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from pydantic import BaseModel

from sokratos_worker.llm.breaker import Admission, Circuit, CircuitBreaker
from sokratos_worker.llm.chat import FallbackChatClient, RetryPolicy
from sokratos_worker.llm.types import ChatFailed, LLMBackendsMisconfigured, NoBackendReachable
from sokratos_worker.testing import PROBE, Reply, ScriptedLLM, json_responder
from sokratos_worker.testing.scripted_llm import Request
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
        assert cb.admit() is Admission.TRIAL
        cb.record_failure("still down", trial=True)
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


def test_only_the_trial_decides_a_half_open_circuit(clock: FakeClock):
    """A call already in flight when the circuit went half-open is not the trial: its failure
    counts but neither re-opens the circuit nor doubles the cool-down."""
    cb = breaker(clock)
    for _ in range(3):
        cb.record_failure()
    clock.advance(120)
    assert cb.admit() is Admission.TRIAL
    assert cb.admit() is Admission.SKIP  # one trial at a time
    cb.record_failure("a call sent before the cool-down ended")
    assert cb.state is Circuit.HALF_OPEN
    assert cb.cooldown == 120
    cb.record_success()  # the trial
    assert cb.state is Circuit.CLOSED
    assert cb.admit() is Admission.CALL


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
    a.on(PROBE, lambda r: Reply.hang(10))
    result = client.complete(response_model=Ok, system="s", user="u", max_tokens=8, purpose="t")
    assert result.backend == "b"
    assert result.tried[0].reason == "circuit_open: half-open probe failed"
    assert (a.count(), a.count(PROBE)) == (9, 1)  # the trial is the short health probe
    assert client.breaker("a").state is Circuit.OPEN
    assert client.breaker("a").cooldown == 240

    clock.advance(240)
    a.on(PROBE, lambda r: Reply.chat("OK"))
    a.on("/v1/chat/completions", json_responder({"ok": True}))
    assert ask() == "a"
    assert client.breaker("a").state is Circuit.CLOSED


def test_circuit_closes_again_on_a_backend_slower_than_the_probe_timeout(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
):
    """The half-open trial is the one-token probe; the item's request keeps the backend's own
    timeout, so a CPU backend (a minute per answer, well inside its 120 s timeout, far over
    the 15 s probe timeout) closes its circuit again instead of re-opening it for ever.
    Scaled down: probe timeout 0.3 s, answers in 0.6 s, backend timeout 5 s."""
    a = servers()
    a.script(*[Reply.error(500, "model reloading")] * 3)  # one failed call opens (threshold 1)
    a.on("/v1/chat/completions", lambda r: Reply.chat({"ok": True}, delay=0.6))
    client = make_client(backend(a, "a", timeout=5), probe_timeout=0.3, breaker_threshold=1)

    def ask() -> str:
        return client.complete(
            response_model=Ok, system="s", user="u", max_tokens=8, purpose="t"
        ).backend

    with pytest.raises(ChatFailed):
        ask()  # the outage opens the circuit; the probe right after ends its cool-down
    assert client.breaker("a").state is Circuit.OPEN
    assert [ask() for _ in range(3)] == ["a", "a", "a"]
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


def test_a_backend_back_with_a_rotated_key_is_named_misconfigured_not_unreachable(
    servers: Callable[..., ScriptedLLM],
    make_client: Callable[..., FallbackChatClient],
    clock: FakeClock,
):
    """Its circuit opened in an outage; it comes back answering 401 to everything. The
    half-open trial and the pause's probe took the 401 for the outage going on: "no LLM
    backend reachable" and claiming paused for good, the key never named."""
    mode = {"now": "down"}

    def answer(_request: object) -> Reply:
        if mode["now"] == "down":
            return Reply.error(503, "Loading model")
        return Reply.error(401, "Incorrect API key provided", type="invalid_request_error")

    a = servers(chat=answer)
    a.on(PROBE, answer)
    client = make_client(backend(a, "a"), attempts=1)
    for _ in range(3):
        with pytest.raises(NoBackendReachable):
            client.complete(response_model=Ok, system="s", user="u", max_tokens=8, purpose="t")
    assert client.breaker("a").state is Circuit.OPEN
    mode["now"] = "key rotated"
    assert client.probe() is True  # up again: the item's next call says what is wrong
    clock.advance(121)  # (and the cool-down is over)
    with pytest.raises(LLMBackendsMisconfigured) as caught:
        client.complete(response_model=Ok, system="s", user="u", max_tokens=8, purpose="t")
    assert "api_key" in str(caught.value)
    assert client.probe() is False  # paused on the key now, until the minimal request is served
    assert client.breaker("a").state is Circuit.CLOSED


def test_a_probe_waits_for_a_slot_of_a_single_slot_backend_busy_with_a_call(
    servers: Callable[..., ScriptedLLM],
    make_client: Callable[..., FallbackChatClient],
):
    """llama.cpp -np 1 queues what it cannot serve: a probe sent beside a slow generation
    waited behind it and timed out, so a busy, healthy backend was judged down."""
    serving = threading.Lock()  # the server's one slot

    def one_at_a_time(request: Request) -> Reply:
        if not serving.acquire(blocking=False):
            return Reply.hang(5)  # queued behind the generation: longer than the probe waits
        try:
            if request.path == PROBE:
                return Reply.chat("OK", completion_tokens=1)
            time.sleep(1.0)  # a slow generation
            return Reply.chat({"ok": True})
        finally:
            serving.release()

    a = servers(chat=one_at_a_time)
    a.on(PROBE, one_at_a_time)
    client = make_client(backend(a, "a", max_concurrency=1), attempts=1, probe_timeout=0.5)
    call = threading.Thread(
        target=client.complete,
        kwargs={"response_model": Ok, "system": "s", "user": "u", "max_tokens": 8, "purpose": "t"},
    )
    call.start()
    time.sleep(0.3)  # the call holds the backend's one slot
    assert client.probe() is True
    call.join()
    assert a.max_in_flight == 1


def test_a_trial_waiting_for_a_slot_is_bounded_inside_its_deadline(
    servers: Callable[..., ScriptedLLM],
):
    """The half-open trial waits for a slot at most its probe's timeout, and its deadline
    counts that wait and the probe: a trial queued behind a long generation overran a deadline
    of the probe's timeout + 5 s while it was still waiting or probing ("half-open probe
    overran its deadline", the cool-down doubled) (review). A probe timeout above 5 s, the slot
    freed just inside the wait and a probe answered just inside its timeout: 13 s, over that
    deadline (12 s), inside this one (19 s). A watcher reads the state meanwhile, as other
    calls' admissions do."""
    a = servers(chat=json_responder({"ok": True}))
    a.on(PROBE, lambda r: Reply.chat("OK", delay=6.4))
    client = FallbackChatClient(
        [backend(a, "a", timeout=30, max_concurrency=1)],
        policy=RetryPolicy(attempts=1, probe_timeout=7, breaker_threshold=1, breaker_cooldown=0.2),
        sleep=lambda s: None,
    )
    try:
        b = client.breaker("a")
        b.record_failure("outage")  # open
        time.sleep(0.3)  # its cool-down is over: the next call is the trial
        slots = client._backend("a").slots
        slots.acquire()  # an earlier call's long generation holds the one slot
        release = threading.Timer(6.6, slots.release)  # just inside the trial's 7 s wait
        release.start()
        seen: list[str] = []
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.05):
                seen.append(f"{b.state}: {b.last_error}")

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            result = client.complete(
                response_model=Ok, system="s", user="u", max_tokens=8, purpose="t"
            )
        finally:
            done.set()
            watcher.join()
        assert not [s for s in seen if "overran" in s], seen
        assert result.backend == "a" and b.state is Circuit.CLOSED
        assert b.cooldown == 0.2  # never doubled
        release.join()
    finally:
        client.close()
