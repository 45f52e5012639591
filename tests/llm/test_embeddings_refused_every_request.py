"""A redirect (3xx) or another 4xx that the embedding server gives EVERY request is configuration,
not each item's fault; one that only this input gets is the item's.

SOKRATOS_EMBEDDING_URL is ``http://`` and the server redirects every request (301 to the https
URL; httpx does not follow), or Ollama answers 400 "does not support embeddings" for a chat
model configured as SOKRATOS_EMBEDDING_MODEL: every item's attempt was used with no hint. Now
the tiny probe is asked; the same answer is ``EmbeddingsMisconfigured`` (attempt given back,
claiming paused), naming the redirect's target or quoting the server; a probe that is served
leaves it ``EmbeddingFailed``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from sokratos_worker.llm.embeddings import HttpEmbedder
from sokratos_worker.llm.types import EmbeddingFailed, EmbeddingsMisconfigured
from sokratos_worker.testing.scripted_llm import EMBEDDINGS, Reply, Request, ScriptedLLM


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (
            Reply(status=301, headers={"Location": "https://embed.example/v1/embeddings"}, raw=b""),
            "set SOKRATOS_EMBEDDING_URL to https://embed.example/v1",
        ),
        (
            Reply.error(400, '"scripted" does not support embeddings'),
            '"scripted" does not support embeddings',
        ),
    ],
    ids=["301-redirect", "400-not-an-embedding-model"],
)
def test_every_request_refused_is_configuration(
    servers: Callable[..., ScriptedLLM], answer: Reply, says: str
) -> None:
    server = servers()
    server.on(EMBEDDINGS, lambda request: answer)
    embedder = HttpEmbedder(server.url, "scripted", 4, sleep=lambda s: None)
    try:
        with pytest.raises(EmbeddingsMisconfigured) as raised:
            embedder.embed(["a memory"])
        assert says in str(raised.value)
        assert embedder.probe() is False  # claiming stays paused until it is fixed
    finally:
        embedder.close()


def test_a_4xx_only_this_input_gets_is_the_items_attempt(
    servers: Callable[..., ScriptedLLM],
) -> None:
    def refuses_one(request: Request) -> Reply:
        body = request.body if isinstance(request.body, dict) else {}
        if any("poison" in text for text in body.get("input", [])):
            return Reply.error(422, "unprocessable input")
        return Reply(status=200, json_body={"data": [{"embedding": [1.0, 0.0, 0.0, 0.0], "index": 0}]})

    server = servers()
    server.on(EMBEDDINGS, refuses_one)
    embedder = HttpEmbedder(server.url, "scripted", 4, sleep=lambda s: None)
    try:
        with pytest.raises(EmbeddingFailed) as raised:
            embedder.embed(["poison"])
        assert not isinstance(raised.value, EmbeddingsMisconfigured)
        assert "unprocessable input" in str(raised.value)
    finally:
        embedder.close()
