"""SOKRATOS_EMBEDDING_TIMEOUT bounds one embedding batch's answer (10 s before, fixed: a CPU
embedding server answering 32 texts in more than 10 s failed every item's embeddings, and no
setting could help). Real parts: the worker's embedder built from its settings, a scripted
OpenAI-compatible server on 127.0.0.1 that answers late.
"""

from __future__ import annotations

import pytest

from sokratos_worker.config import Settings, load_settings
from sokratos_worker.llm import build_embedder
from sokratos_worker.llm.probe import probe_embeddings
from sokratos_worker.llm.types import EmbeddingFailed, EmbeddingsUnavailable
from sokratos_worker.testing.scripted_llm import ScriptedLLM


def _settings(url: str, timeout: str | None) -> Settings:
    env = {
        "SOKRATOS_EMBEDDING_URL": url,
        "SOKRATOS_EMBEDDING_MODEL": "scripted",
        "SOKRATOS_EMBEDDING_DIM": "8",
    }
    if timeout is not None:
        env["SOKRATOS_EMBEDDING_TIMEOUT"] = timeout
    return load_settings(env)


def test_a_slow_embedding_server_is_waited_for_as_long_as_the_setting_says() -> None:
    with ScriptedLLM(embed_dim=8, latency=1.0) as server:
        settings = _settings(server.url, "5s")
        embedder = build_embedder(settings)
        assert embedder is not None
        try:
            [vector] = embedder.embed(["slow but fine"])
        finally:
            embedder.close()
        assert len(vector) == 8
        assert probe_embeddings(settings).ok

        short = build_embedder(_settings(server.url, "0.3s"))
        assert short is not None
        try:
            with pytest.raises((EmbeddingFailed, EmbeddingsUnavailable)):
                short.embed(["too slow for 0.3 s"])
        finally:
            short.close()


def test_the_default_is_ten_seconds() -> None:
    assert load_settings({}).embedding_timeout == 10.0
