"""A reply nested past Python's recursion limit is an invalid reply, not a crash.

A small model in a repetition loop emits ``[[[[…`` up to max_tokens; json.loads raises
RecursionError (not a ValueError) past ~1000 levels.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.llm.embeddings import HttpEmbedder
from sokratos_worker.llm.reply import ReplyInvalid, parse_reply
from sokratos_worker.llm.types import EmbeddingsUnavailable
from sokratos_worker.testing.scripted_llm import CHAT, EMBEDDINGS, Reply, ScriptedLLM
from tests.llm.conftest import Scored, ask, backend

NESTED = b"[" * 3000


def test_a_nested_reply_text_is_invalid() -> None:
    with pytest.raises(ReplyInvalid, match="nested too deeply"):
        parse_reply(Scored, "[" * 3000)


def test_a_degenerate_bracket_loop_falls_through_to_the_next_backend(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    looping, healthy = servers(), servers()
    looping.on(CHAT, lambda request: Reply.chat("[" * 3000, finish_reason="length"))
    healthy.on(CHAT, lambda request: Reply.chat({"score": 4, "summary": "fine"}))
    client = make_client(backend(looping, "looping"), backend(healthy, "healthy"))

    result = ask(client)

    assert result.backend == "healthy"
    assert looping.count(CHAT) == 2  # the first reply and the one repair


def test_a_deeply_nested_http_body_is_a_malformed_response(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    broken, healthy = servers(), servers()
    broken.on(
        CHAT,
        lambda request: Reply(
            raw=b'{"choices":' + NESTED, headers={"Content-Type": "application/json"}
        ),
    )
    healthy.on(CHAT, lambda request: Reply.chat({"score": 4, "summary": "fine"}))
    client = make_client(backend(broken, "broken"), backend(healthy, "healthy"))

    result = ask(client)

    assert result.backend == "healthy"
    assert result.tried[0].reason.startswith("malformed_response: not JSON")


def test_a_deeply_nested_embedding_body_is_an_invalid_reply(
    servers: Callable[..., ScriptedLLM],
) -> None:
    server = servers(embed_dim=8)
    server.on(
        EMBEDDINGS,
        lambda request: Reply(raw=NESTED, headers={"Content-Type": "application/json"}),
    )
    embedder = HttpEmbedder(server.url, "scripted-embed", 8, sleep=lambda _: None)
    try:
        # The probe gets the same junk: the server is at fault, the attempt given back.
        with pytest.raises(EmbeddingsUnavailable, match="not in the OpenAI format"):
            embedder.embed(["hello"])
    finally:
        embedder.close()
