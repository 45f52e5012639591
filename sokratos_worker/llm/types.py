"""The public face of the LLM layer: what pipelines call and what they get back.

Pipelines depend only on these protocols and errors; ``sokratos_worker.llm.chat`` and
``sokratos_worker.llm.embeddings`` implement them over HTTP, and tests may pass fakes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from pydantic import BaseModel

from sokratos_worker.errors import BackendsMisconfigured, BackendsUnavailable, ItemError

T = TypeVar("T", bound=BaseModel)


@dataclass(frozen=True)
class BackendAttempt:
    """One backend's part in a call: ``answered``, ``failed`` or ``skipped``, and why."""

    backend: str
    result: str
    reason: str = ""
    duration_ms: float = 0.0


def passed_over(tried: Sequence[BackendAttempt]) -> str:
    """What the outcome says of the backends tried before the one that answered, or "".

    For example ``passed over primary (failed: http_500)``: the outcome row, not only the
    log, shows that a fallback answered and why (durability.md).
    """
    names = [
        f"{t.backend} ({t.result}: {t.reason})" if t.reason else f"{t.backend} ({t.result})"
        for t in tried
        if t.result != "answered"
    ]
    return f"passed over {', '.join(names)}" if names else ""


@dataclass(frozen=True)
class ChatResult(Generic[T]):
    """A validated reply, which backend gave it, and what happened on the way."""

    value: T
    backend: str
    tried: tuple[BackendAttempt, ...] = ()
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


@dataclass(frozen=True)
class BackendState:
    """A backend's circuit as ``status`` shows it: closed, open or half_open."""

    name: str
    circuit: str
    detail: dict[str, object] = field(default_factory=dict)


class ChatClient(Protocol):
    """Chat completions with structured output, across the backends in fallback order."""

    def complete(
        self,
        *,
        response_model: type[T],
        system: str,
        user: str,
        max_tokens: int,
        purpose: str,
    ) -> ChatResult[T]:
        """A reply validated against ``response_model``.

        Raises :class:`ContextTooLong` when a backend said the input is over its model's
        context (the next backends are not sent the same oversize input: shorten it first),
        :class:`NoBackendReachable` when a backend could not be asked or did not answer (a
        health probe right after failed too, or it had no free slot; :class:`LLMBackendsBusy`
        when every backend's slots stayed taken), as it may serve the request later, and
        :class:`ChatFailed` for anything else (:class:`RequestRefused` when every backend
        refused or kept failing this request while serving a minimal one: not "no valid reply
        this time", so a caller must not go on without it).
        """
        ...

    def probe(self) -> bool:
        """True when at least one backend answers its health check now."""
        ...

    def states(self) -> list[BackendState]:
        """Every backend's circuit state, for ``status`` and metrics."""
        ...


class Embedder(Protocol):
    """One pinned embedding model; vectors are L2-normalised and of ``dim`` dimensions."""

    model: str
    dim: int

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """One vector per text, in order. Raises :class:`EmbeddingsUnavailable` or
        :class:`EmbeddingFailed`."""
        ...

    def embed_splitting(self, text: str) -> list[tuple[str, list[float]]]:
        """Embed ``text``; if the server says it is too large, split it and embed the parts."""
        ...

    def probe(self) -> bool:
        """True when the embedding server answers now."""
        ...


class ChatFailed(ItemError):
    """Every backend was tried and none gave a valid reply for this request."""

    def __init__(
        self,
        message: str,
        *,
        backend: str | None = None,
        tried: tuple[BackendAttempt, ...] = (),
    ) -> None:
        super().__init__(message, backend=backend)
        self.tried = tried


class RequestRefused(ChatFailed):
    """Every backend refused this request (a 4xx/3xx for its schema, a parameter, this input;
    or a 5xx or timeout for this request's form that persists while the minimal form is served)
    while serving the minimal structured request: the backends are up and configured, so the
    item's attempt is used, and a caller must not take it for "no valid reply" (no verdict this
    time) and go on without it: it propagates, the item is retried and ends in
    failed_operations, where the operator sees it."""


class ContextTooLong(ChatFailed):
    """The input is longer than the backends' context; the caller may shorten it."""


class NoBackendReachable(BackendsUnavailable):
    """A chat backend could not be asked or did not answer (connect errors, circuits open, 5xx
    with a failing health probe, no free slot), or its 5xx burst ended meanwhile: the attempt
    is given back (the rule: ``FallbackChatClient._judge``)."""

    def __init__(self, message: str, *, tried: tuple[BackendAttempt, ...] = ()) -> None:
        super().__init__(message)
        self.tried = tried


class LLMBackendsBusy(NoBackendReachable):
    """Every chat backend's ``max_concurrency`` slots stayed taken for its whole timeout: the
    backends are overloaded by this worker, not unreachable (the attempt is given back too)."""


class LLMBackendsMisconfigured(BackendsMisconfigured):
    """Every chat backend refused with 401/403/404 (or no quota or credits: 429
    ``insufficient_quota``, 402): fix the configuration."""

    def __init__(self, message: str, *, tried: tuple[BackendAttempt, ...] = ()) -> None:
        super().__init__(message)
        self.tried = tried


class EmbeddingFailed(ItemError):
    """The embedding server rejected this input (not an outage)."""


class EmbeddingReplyInvalid(EmbeddingFailed):
    """The server answered 200 with something that is not the vectors asked for."""


class EmbeddingDimensionMismatch(EmbeddingReplyInvalid):
    """The server's vectors do not have ``SOKRATOS_EMBEDDING_DIM`` dimensions."""


class EmbeddingsUnavailable(BackendsUnavailable):
    """The embedding server cannot be reached."""


class EmbeddingsMisconfigured(EmbeddingsUnavailable, BackendsMisconfigured):
    """The embedding server refused with 401/403/404: a key or model name to fix, not the item."""
