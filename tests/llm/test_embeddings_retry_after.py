"""The embedding client waits as long as the server's Retry-After says, within a cap."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from sokratos_worker.llm.embeddings import HttpEmbedder
from sokratos_worker.llm.types import EmbeddingsUnavailable
from sokratos_worker.testing.scripted_llm import EMBEDDINGS, Reply, ScriptedLLM

RATE_LIMITED = "Rate limit reached for requests"


def test_retry_after_is_honoured_between_embedding_attempts(
    servers: Callable[..., ScriptedLLM],
) -> None:
    server = servers(embed_dim=8)
    server.script(
        Reply.error(429, RATE_LIMITED, type="rate_limit_exceeded", retry_after=5),
        path=EMBEDDINGS,
    )
    slept: list[float] = []
    embedder = HttpEmbedder(server.url, "scripted-embed", 8, sleep=slept.append)
    try:
        vectors = embedder.embed(["hello"])
    finally:
        embedder.close()

    assert len(vectors) == 1
    assert slept == [5.0]


def test_a_retry_after_past_the_cap_stops_waiting(servers: Callable[..., ScriptedLLM]) -> None:
    server = servers(embed_dim=8)
    server.on(
        EMBEDDINGS,
        lambda request: Reply.error(429, RATE_LIMITED, type="rate_limit_exceeded", retry_after=3600),
    )
    slept: list[float] = []
    embedder = HttpEmbedder(server.url, "scripted-embed", 8, sleep=slept.append)
    try:
        with pytest.raises(EmbeddingsUnavailable, match="429"):
            embedder.embed(["hello"])  # the probe is limited too: the attempt is given back
    finally:
        embedder.close()

    assert slept == []
    assert server.count(EMBEDDINGS) == 2  # the call and the probe, no retries
