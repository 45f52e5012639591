"""The embedding client waits as long as the server's Retry-After says, within a cap; a
rate limit that outlasts the retries gives the item's attempt back."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from sokratos_worker.llm.embeddings import HttpEmbedder
from sokratos_worker.llm.types import EmbeddingFailed, EmbeddingsUnavailable
from sokratos_worker.testing import hash_embedding
from sokratos_worker.testing.scripted_llm import EMBEDDINGS, Reply, Request, ScriptedLLM

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
            embedder.embed(["hello"])  # a 429 gives the attempt back
    finally:
        embedder.close()

    assert slept == []
    assert server.count(EMBEDDINGS) == 1  # no retries, and no probe: a 429 is never the item's


def test_a_rate_limit_on_a_large_input_gives_the_attempt_back_while_a_probe_is_served(
    servers: Callable[..., ScriptedLLM],
) -> None:
    # A token-based rate limit (OpenAI's TPM, a LiteLLM budget) refuses a large input while a
    # 3-token probe fits: the item's attempt was charged and it was dead-lettered for load.
    def rate_limited(request: Request) -> Reply:
        texts = request.body["input"]
        if sum(len(t) for t in texts) > 100:  # the big input is over the tokens-per-minute budget
            return Reply.error(
                429,
                "Rate limit reached for text-embedding-3-small on tokens per min (TPM): Limit"
                " 1000000, Used 999990, Requested 600. Please try again in 1s.",
                type="tokens",
                code="rate_limit_exceeded",
                retry_after=1,
            )
        return Reply.embeddings([hash_embedding(t, 8) for t in texts])

    server = servers(embed_dim=8)
    server.on(EMBEDDINGS, rate_limited)
    text = "user: I moved to Lisbon and started at Example GmbH on Monday. " * 4
    embedder = HttpEmbedder(server.url, "embed", 8, timeout=5.0, sleep=lambda _: None)
    try:
        embedder.embed([text])
    except EmbeddingsUnavailable:
        pass  # the attempt is given back: right
    except EmbeddingFailed as exc:
        raise AssertionError(f"a 429 was charged to the item: {exc}") from exc
    else:
        raise AssertionError("a 429 every time cannot produce a vector")
    finally:
        embedder.close()
