"""LLM chat and embedding backends over OpenAI-compatible HTTP (the only httpx users).

Pipelines code against :mod:`sokratos_worker.llm.types`; these factories build the HTTP
implementations from the settings.
"""

from __future__ import annotations

from collections.abc import Sequence

from sokratos_worker.config import BackendConfig, Settings
from sokratos_worker.llm.chat import FallbackChatClient, RetryPolicy
from sokratos_worker.llm.embeddings import HttpEmbedder
from sokratos_worker.llm.types import ChatClient, Embedder


def build_chat_client(
    settings: Settings, extra_backends: Sequence[BackendConfig] = ()
) -> ChatClient | None:
    """The fallback client over the configured backends (then ``extra_backends``, e.g. the
    local model), or None when there are none."""
    backends = [*settings.llm_backends, *extra_backends]
    if not backends:
        return None
    return FallbackChatClient(backends)


def build_embedder(settings: Settings) -> Embedder | None:
    """The pinned embedding model, or None when none is configured."""
    if not settings.embedding_url or not settings.embedding_model or not settings.embedding_dim:
        return None
    return HttpEmbedder(
        settings.embedding_url,
        settings.embedding_model,
        settings.embedding_dim,
        suffix=settings.embedding_suffix,
        timeout=settings.embedding_timeout,
    )


__all__ = [
    "FallbackChatClient",
    "HttpEmbedder",
    "RetryPolicy",
    "build_chat_client",
    "build_embedder",
]
