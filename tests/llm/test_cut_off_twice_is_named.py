"""A reply cut off at ``max_tokens`` (``finish_reason: length``) again when asked for a shorter one
fails with a reason that says so. It said only "the reply is not a JSON object (Unterminated
string ...)", so the error kept in the item's history and in failed_operations read as a
model writing broken JSON, while the reply simply did not fit: a token limit, or a context
left too small by the input. Real HTTP servers on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.llm.types import ChatFailed
from sokratos_worker.testing import Reply, ScriptedLLM
from tests.llm.conftest import ask, backend, scripted

CUT = '{"score": 3, "summary": "a very long'


def test_a_reply_cut_off_twice_says_it_was_cut_off(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    server = scripted(servers, lambda r: Reply.chat({"ok": True}))
    server.script(Reply.chat(CUT, finish_reason="length"), Reply.chat(CUT, finish_reason="length"))
    client = make_client(backend(server, "small"), attempts=1)

    with pytest.raises(ChatFailed) as caught:
        ask(client)

    reason = caught.value.tried[0].reason
    assert reason.startswith("invalid_reply: cut off at the 200-token limit"), reason
    assert "also when asked for a shorter reply" in reason
    assert "cut off at the 200-token limit" in str(caught.value)


def test_a_second_reply_that_is_invalid_but_complete_gets_the_plain_reason(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    server = scripted(servers, lambda r: Reply.chat({"ok": True}))
    server.script(Reply.chat(CUT, finish_reason="length"), Reply.chat({"score": 3}))
    client = make_client(backend(server, "small"), attempts=1)

    with pytest.raises(ChatFailed) as caught:
        ask(client)

    reason = caught.value.tried[0].reason
    assert reason.startswith("invalid_reply: summary: Field required"), reason
    assert "cut off" not in reason
