"""A backend down (or its circuit open) while another refuses this request TYPE is an outage,
not the item's fault; once the down backend is back, it decides the item itself.

Backend A is down (connection refused, 503, or circuit open); backend B answers 400 to the
Contradiction schema (llama.cpp's grammar converter) but serves the minimal ``{"ok": bool}``
request. The minimal request decides only when EVERY backend refused: here B is asked in the
request's own form, refuses it, and the item is given back (durability.md: "What is not the
item's fault is not the item's attempt"), with probe() asking that form, so claiming stays paused
while A is down. It cannot loop for ever: once A answers (serving the form, or refusing it as
well), probe() resumes claiming and the item's next call is served, or refused everywhere and
judged by the minimal request (the item's attempt).
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from sokratos_worker.config import BackendConfig
from sokratos_worker.errors import BackendsUnavailable
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.llm.types import ChatFailed, NoBackendReachable, RequestRefused
from sokratos_worker.testing.scripted_llm import Reply, Request, ScriptedLLM
from tests.llm.conftest import (
    ask_contradiction,
    backend,
    primary_and_fallback,
    refuses_contradiction,
    scripted,
    switchable,
)


def _dead_primary() -> BackendConfig:
    """A primary backend nobody listens at (connection refused)."""
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return BackendConfig(name="primary", url=f"http://127.0.0.1:{port}/v1", model="m", timeout=2)


def test_primary_down_and_fallback_refusing_the_type_gives_the_attempt_back(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    b = scripted(servers, refuses_contradiction)
    client = make_client(_dead_primary(), backend(b, "fallback"), attempts=1)

    failure = ask_contradiction(client)
    assert isinstance(failure, BackendsUnavailable), (
        f"the primary is down; the item was charged an attempt: {type(failure).__name__}: {failure}"
    )
    assert isinstance(failure, NoBackendReachable)
    assert client.probe() is False  # B serves a plain probe, not this form: claiming stays paused


def test_primary_circuit_open_and_fallback_refusing_the_type_gives_the_attempt_back(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    b = scripted(servers, refuses_contradiction)
    client = make_client(_dead_primary(), backend(b, "fallback"), attempts=1, breaker_threshold=1)
    client.breaker("primary").record_failure("down")  # its circuit is open: skipped

    failure = ask_contradiction(client)
    assert isinstance(failure, BackendsUnavailable), f"{type(failure).__name__}: {failure}"
    assert client.probe() is False


def test_the_primary_back_and_serving_resumes_claiming_and_serves_the_item(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    state = {"mode": "down"}
    client = primary_and_fallback(servers, make_client, switchable(state), refuses_contradiction)

    assert isinstance(ask_contradiction(client), NoBackendReachable)
    assert client.probe() is False
    state["mode"] = "serves"
    assert client.probe() is True
    result = ask_contradiction(client)
    assert not isinstance(result, Exception), result
    assert client.probe() is True


def test_the_primary_back_but_refusing_too_ends_the_pause_and_uses_the_attempt(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    """No loop: once every backend answers the form (both refusing it), claiming resumes and
    the item is judged by the minimal request, which both serve: the item's attempt."""
    state = {"mode": "down"}
    client = primary_and_fallback(servers, make_client, switchable(state), refuses_contradiction)

    assert isinstance(ask_contradiction(client), NoBackendReachable)
    assert client.probe() is False
    state["mode"] = "refuses"
    assert client.probe() is True
    for _ in range(2):
        failure = ask_contradiction(client)
        assert isinstance(failure, RequestRefused), failure
        assert client.probe() is True  # never paused again for it


def test_a_fallback_refusing_only_this_input_while_the_primary_is_down_is_the_items_attempt(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    """B refuses this request (its input), but serves a request of its form: the item's."""

    def refuses_this_input(request: Request) -> Reply:
        messages = request.body.get("messages", []) if isinstance(request.body, dict) else []
        if any(m.get("content") == "poison" for m in messages):
            return Reply.error(400, "this input is refused")
        return Reply.chat({"contradicts": False, "explanation": "no"})

    b = scripted(servers, refuses_this_input)
    client = make_client(_dead_primary(), backend(b, "fallback"), attempts=1)
    failure = ask_contradiction(client, user="poison")
    assert isinstance(failure, ChatFailed), failure
    assert not isinstance(failure, RequestRefused)  # not every backend refused it
