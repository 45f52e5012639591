"""A pause for one call's form ends when that form is served (or its awaited backends are
back), not when another form's call succeeds: the primary down, the fallback serving triage
but failing the contradiction form, a triage reply in another slot cleared the pause, the next
probe resumed claiming, and the contradiction item was claimed, failed and given back again
for as long as the primary was down (found by a review)."""

from __future__ import annotations

from typing import Any

from sokratos_worker.errors import BackendsUnavailable
from sokratos_worker.llm.chat import FallbackChatClient, RetryPolicy
from sokratos_worker.testing import Reply
from tests.llm.conftest import ask, ask_contradiction, backend, schema_name, scripted


def _fallback(request: Any) -> Reply:
    """Serves plain requests and the Scored form; fails the Contradiction form (500)."""
    if schema_name(request) == "Contradiction":
        return Reply.error(500, "json_schema with $defs unsupported", type="server_error")
    if schema_name(request) is None:
        return Reply.chat("OK", completion_tokens=1)
    return Reply.chat({"score": 5, "summary": "x", "ok": True})


def _client(servers: Any, primary: Any) -> FallbackChatClient:
    return FallbackChatClient(
        [
            backend(scripted(servers, primary), "primary", timeout=1),
            backend(scripted(servers, _fallback), "fallback", timeout=1),
        ],
        policy=RetryPolicy(attempts=1, probe_timeout=1, breaker_threshold=100),
        sleep=lambda s: None,
    )


def test_a_reply_in_another_form_does_not_end_the_pause(servers: Any) -> None:
    def down(request: Any) -> Reply:
        return Reply.error(503, "down", type="server_error")

    client = _client(servers, down)
    try:
        assert isinstance(ask_contradiction(client), BackendsUnavailable)
        assert client.probe() is False  # paused while the primary is down
        ask(client)  # another slot's item, in another form, served by the fallback
        assert client.probe() is False, "claiming resumed while the primary is still down"
    finally:
        client.close()


def test_a_pause_found_ended_by_the_probe_is_cleared(servers: Any) -> None:
    """A pause is cleared when probe() finds it ended: left set (when the item's next call is
    judged its own failure, its form is never served again), it held every later probe to its
    own test, long after it ended (found by a review)."""
    primary_state = {"down": True}

    def primary(request: Any) -> Reply:
        if primary_state["down"]:
            return Reply.error(503, "down", type="server_error")
        if schema_name(request) is None:
            return Reply.chat("OK", completion_tokens=1)
        return Reply.chat({"contradicts": False, "explanation": "no"})  # back

    client = _client(servers, primary)
    try:
        assert isinstance(ask_contradiction(client), BackendsUnavailable)
        assert client.probe() is False
        primary_state["down"] = False  # back
        assert client.probe() is True
        assert client._pause is None
    finally:
        client.close()
