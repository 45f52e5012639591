"""One rule for a call no backend answered validly (FallbackChatClient._judge): a backend that
could not be asked or did not answer makes it an outage for the item (the attempt given back,
as that backend may serve it later); only when every backend answered do the minimal request
and the re-ask in the call's form decide; BUSY is never "this form fails"; and a pause ends
when any backend serves the call's form (review3 findings 2, 3 and 6).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from sokratos_worker.errors import BackendsUnavailable
from sokratos_worker.llm.chat import FallbackChatClient, RetryPolicy
from sokratos_worker.llm.types import (
    LLMBackendsMisconfigured,
    NoBackendReachable,
    RequestRefused,
)
from sokratos_worker.testing import Reply, ScriptedLLM
from sokratos_worker.testing.scripted_llm import Request
from tests.llm.conftest import ask_contradiction, backend, schema_name, scripted


def _down_until(state: dict[str, bool]) -> Callable[[Request], Reply]:
    """503 to everything until ``state["up"]``, then every request served."""

    def respond(request: Request) -> Reply:
        if not state["up"]:
            return Reply.error(503, "maintenance", type="server_error")
        if schema_name(request) is None:
            return Reply.chat("OK", completion_tokens=1)
        if schema_name(request) == "Contradiction":
            return Reply.chat({"contradicts": False, "explanation": "no"})
        return Reply.chat({"ok": True})

    return respond


def _client(*servers: tuple[ScriptedLLM, str]) -> FallbackChatClient:
    return FallbackChatClient(
        [backend(server, name, timeout=2) for server, name in servers],
        policy=RetryPolicy(attempts=1, probe_timeout=1, breaker_threshold=100),
        sleep=lambda s: None,
    )


def test_a_pause_ends_when_the_primary_that_was_down_serves_the_form(
    servers: Callable[..., ScriptedLLM],
) -> None:
    """Finding 2: the primary is down, the fallback fails every structured request (500) and
    serves plain ones. The pause awaited only the fallback: the primary back and serving, the
    worker stayed paused until an operator fixed the fallback."""
    state = {"up": False}

    def structured_500(request: Request) -> Reply:
        if schema_name(request) is not None:
            return Reply.error(500, "json_schema is not supported", type="server_error")
        return Reply.chat("OK", completion_tokens=1)

    client = _client(
        (scripted(servers, _down_until(state)), "primary"),
        (scripted(servers, structured_500), "fallback"),
    )
    try:
        failure = ask_contradiction(client)
        assert isinstance(failure, BackendsUnavailable), failure  # given back
        assert client.probe() is False  # no loop while the primary is down
        state["up"] = True
        assert client.probe() is True
        served = ask_contradiction(client)
        assert not isinstance(served, Exception), served
        # The primary was down: an outage (it may serve the item), not the fallback's setup.
        assert isinstance(failure, NoBackendReachable), failure
    finally:
        client.close()


@pytest.mark.parametrize("status", [400, 500])
def test_a_fallback_failing_the_schema_while_the_primary_is_down_gives_the_attempt_back(
    servers: Callable[..., ScriptedLLM], status: int
) -> None:
    """Finding 3: with a 500 for this schema from the fallback (a 400 was given back already)
    the attempt was used, and the item dead-lettered during the primary's maintenance."""
    state = {"up": False}

    def fails_the_schema(request: Request) -> Reply:
        if schema_name(request) == "Contradiction":
            return Reply.error(status, "schema not supported", type="server_error")
        if schema_name(request) is None:
            return Reply.chat("OK", completion_tokens=1)
        return Reply.chat({"ok": True})

    client = _client(
        (scripted(servers, _down_until(state)), "primary"),
        (scripted(servers, fails_the_schema), "fallback"),
    )
    try:
        failure = ask_contradiction(client)
        assert isinstance(failure, BackendsUnavailable), f"{type(failure).__name__}: {failure}"
        assert not isinstance(failure, RequestRefused)
        assert client.probe() is False
        state["up"] = True
        assert client.probe() is True
        served = ask_contradiction(client)
        assert not isinstance(served, Exception), served
    finally:
        client.close()


class _TakenOnce:
    """A backend's slots; once ``take`` is set, the next acquire finds the slot held by another
    item's call for its whole wait (the probe is BUSY)."""

    def __init__(self, inner: threading.BoundedSemaphore) -> None:
        self.inner, self.take = inner, False

    def acquire(self, timeout: float | None = None) -> bool:
        if self.take:
            self.take = False
            time.sleep(timeout or 0)
            return False
        return self.inner.acquire(timeout=timeout)

    def release(self) -> None:
        self.inner.release()


def test_a_reask_that_finds_no_free_slot_is_not_this_forms_failure(
    servers: Callable[..., ScriptedLLM],
) -> None:
    """Finding 6: a proxy's burst of 502 ends by the minimal probe; another item's call then
    takes the only slot, so the re-ask in the call's form is never sent. It was read as "this
    request type's schema fails there": RequestRefused, about a request never sent."""
    state = {"burst": True}
    slots: dict[str, _TakenOnce] = {}

    def respond(request: Request) -> Reply:
        name = schema_name(request)
        if name == "Contradiction" and state["burst"]:
            return Reply.error(502, "bad gateway", type="server_error")
        if name == "_Probe":  # the burst is over now; another call takes the slot next
            state["burst"] = False
            slots["a"].take = True
            return Reply.chat({"ok": True})
        if name is None:
            return Reply.chat("OK", completion_tokens=1)
        return Reply.chat({"contradicts": False, "explanation": "no"})

    client = FallbackChatClient(
        [backend(scripted(servers, respond), "a", timeout=1, max_concurrency=1)],
        policy=RetryPolicy(attempts=1, probe_timeout=1),
        sleep=lambda s: None,
    )
    a = client._backend("a")
    a.slots = slots["a"] = _TakenOnce(a.slots)  # type: ignore[assignment]
    try:
        failure = ask_contradiction(client)
        assert isinstance(failure, NoBackendReachable), f"{type(failure).__name__}: {failure}"
        assert "schema" not in str(failure)
        assert client.probe() is True
        assert not isinstance(ask_contradiction(client), Exception)
    finally:
        client.close()


def test_a_backend_failing_every_structured_request_is_named_and_a_fixed_one_resumes(
    servers: Callable[..., ScriptedLLM],
) -> None:
    """Every backend answered: the primary refuses this schema (400) and serves the minimal
    request, the fallback fails every structured request (500) and serves plain ones. That is
    the fallback's structured_output (it was "no LLM backend reachable", both being up), and
    the pause ends as soon as any backend serves the call's form (rule c): here the primary."""
    state = {"fixed": False}

    def refuses_the_schema(request: Request) -> Reply:
        if schema_name(request) == "Contradiction" and not state["fixed"]:
            return Reply.error(400, "JSON schema conversion failed", type="invalid_request_error")
        if schema_name(request) == "Contradiction":
            return Reply.chat({"contradicts": False, "explanation": "no"})
        return Reply.chat({"ok": True})

    def structured_500(request: Request) -> Reply:
        if schema_name(request) is not None:
            return Reply.error(500, "json_schema is not supported", type="server_error")
        return Reply.chat("OK", completion_tokens=1)

    client = _client(
        (scripted(servers, refuses_the_schema), "primary"),
        (scripted(servers, structured_500), "fallback"),
    )
    try:
        failure = ask_contradiction(client)
        assert isinstance(failure, LLMBackendsMisconfigured), f"{type(failure).__name__}: {failure}"
        assert "structured_output" in str(failure) and "fallback" in str(failure)
        assert client.probe() is False
        state["fixed"] = True
        assert client.probe() is True
        assert not isinstance(ask_contradiction(client), Exception)
    finally:
        client.close()

