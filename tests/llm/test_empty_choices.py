"""A 2xx whose ``choices`` list is empty holds no reply: it is the server's fault (a broken proxy,
an upstream that answered nothing), not an invalid reply of the item's. Before, it was read as
an empty reply: a repair request was sent back to it, the call failed as "the reply is not a
JSON object" (the item's attempt used), and the one-token probe counted it as served, so a
server answering nothing to every request burnt the attempts of every item in the queue.
Real HTTP servers on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.llm.types import ChatFailed, NoBackendReachable
from sokratos_worker.testing import Reply, ScriptedLLM
from sokratos_worker.testing.scripted_llm import Request
from tests.llm.conftest import ask, backend, scripted

Servers = Callable[..., ScriptedLLM]
MakeClient = Callable[..., FallbackChatClient]

NO_CHOICE = Reply(
    json_body={"id": "chatcmpl-x", "object": "chat.completion", "model": "m", "choices": []}
)


def no_choice(request: Request) -> Reply:
    return NO_CHOICE


def test_a_server_answering_no_choice_to_everything_is_down_not_the_items_fault(
    servers: Servers, make_client: MakeClient
) -> None:
    server = scripted(servers, no_choice)
    client = make_client(backend(server, "empty"), attempts=2)

    with pytest.raises(NoBackendReachable) as caught:
        ask(client)

    (attempt,) = caught.value.tried
    assert attempt.result == "failed"
    assert attempt.reason.startswith("malformed_response:"), attempt.reason
    assert "choices" in attempt.reason and "empty" in attempt.reason
    # No repair request: there was no reply to repair.
    assert not any("previous reply" in str(r.body) for r in server.requests)
    assert client.probe() is False


def test_no_choice_for_one_request_only_moves_on_to_the_fallback(
    servers: Servers, make_client: MakeClient
) -> None:
    primary = servers()
    primary.script(NO_CHOICE)
    fallback = servers()
    fallback.script(Reply.chat({"score": 3, "summary": "ok"}))
    client = make_client(backend(primary, "primary"), backend(fallback, "fallback"), attempts=1)

    result = ask(client)

    assert result.backend == "fallback"
    assert result.value.score == 3
    assert result.tried[0].reason.startswith("malformed_response:")
    assert primary.count() == 1  # no repair request sent to the empty answer


def test_no_choice_for_this_request_while_the_server_serves_others_is_the_items(
    servers: Servers, make_client: MakeClient
) -> None:
    """A content filter's empty answer to this input: the probe right after is served."""
    server = scripted(servers, lambda r: Reply.chat({"ok": True}))
    server.script(NO_CHOICE)
    client = make_client(backend(server, "filtering"), attempts=1)

    with pytest.raises(ChatFailed) as caught:
        ask(client)

    assert not isinstance(caught.value, NoBackendReachable)
    assert caught.value.tried[0].reason.startswith("malformed_response:")
