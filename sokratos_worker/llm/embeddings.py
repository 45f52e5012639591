"""The embeddings client: one pinned model and dimension over ``POST {url}/embeddings``.

Never falls back to another model (vectors of different models are not comparable).
Sokratos's protocol (behaviour reference §3.3): a suffix appended to every input,
L2-normalised vectors (OpenAI's base64 form read too), and a text the server finds too
large (a body saying "too large", a 413, a context-length error) split and embedded in parts.
A transient failure (connection error, 408, 429, 5xx) is retried a few times with backoff (or
after the server's Retry-After) before it counts, so one 503 while the model loads costs no
attempt of the item; a 408 or 429 that outlasts the retries gives the attempt back even when
a tiny probe is served (a token-based rate limit refuses a large input and lets a 3-token
probe through).
"""

from __future__ import annotations

import base64
import binascii
import functools
import math
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import structlog
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    retry_if_not_exception_type,
    wait_exponential,
    wait_random,
)

from sokratos_worker import jsontext
from sokratos_worker.config import without_credentials
from sokratos_worker.llm.http import (
    ClientPerThread,
    ProxyAuthenticationRequired,
    context_too_long,
    excerpt,
    make_client,
    retry_after_seconds,
    tls_verification,
)
from sokratos_worker.llm.types import (
    EmbeddingDimensionMismatch,
    EmbeddingFailed,
    EmbeddingReplyInvalid,
    EmbeddingsMisconfigured,
    EmbeddingsUnavailable,
)
from sokratos_worker.logs import mask_secrets, maskable, url_password

log = structlog.get_logger(__name__)

TOO_LARGE = "too large"
MIN_SPLIT_BYTES = 100
_NUMBERS = (int, float)  # what a vector component may be (a bool is neither here)
_BUSY = (408, 429)  # the server's load, never the input's: no probe can make them the item's


class _Throttled(EmbeddingsUnavailable):
    """A transient answer (408, 429, 5xx) that may say when to ask again (Retry-After)."""

    def __init__(self, message: str, status: int, retry_after: float | None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class _TooLarge(EmbeddingFailed):
    """The server finds this input too large: ``embed_splitting`` embeds it in parts."""


class _Refused(EmbeddingFailed):
    """A redirect (3xx) or a 4xx that is neither configuration (401/403/404) nor transient:
    this input's problem, or every request's when the tiny probe gets the same answer."""

    def __init__(self, message: str, status: int, hint: str) -> None:
        super().__init__(message)
        self.status = status
        self.hint = hint  # what to set or check when every request gets it


class HttpEmbedder:
    """:class:`~sokratos_worker.llm.types.Embedder` over HTTP; thread-safe."""

    def __init__(
        self,
        url: str,
        model: str,
        dim: int,
        *,
        suffix: str = "",
        api_key: str | None = None,
        timeout: float = 10.0,
        batch_size: int = 32,
        ca_file: str | None = None,
        tls_verify: bool = True,
        attempts: int = 3,
        backoff_base: float = 0.5,
        retry_after_max: float = 30.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.url = url.rstrip("/")
        self._embeddings_url = httpx.URL(f"{self.url}/embeddings")  # parsed once, not per call
        self.attempts = attempts  # HTTP attempts per batch for transient errors
        self._backoff = wait_exponential(multiplier=backoff_base, max=8.0) + wait_random(0, 1)
        self._retry_after_max = retry_after_max  # a longer Retry-After: stop, give back
        self._sleep = sleep
        self.model = model
        self.dim = dim
        self.suffix = suffix
        self.batch_size = batch_size
        self._secrets = tuple(maskable([api_key], [url_password(url)]))
        self._clients = ClientPerThread(
            functools.partial(
                make_client,
                name="embeddings",
                timeout=timeout,
                api_key=api_key,
                verify=tls_verification(name="embeddings", ca_file=ca_file, tls_verify=tls_verify),
            )
        )

    def close(self) -> None:
        """Close the HTTP client."""
        self._clients.close()

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """One L2-normalised vector per text, in order, in batches of ``batch_size``."""
        try:
            return self._embed_all(texts)
        except _Refused as exc:
            # A redirect or a 4xx the tiny probe gets too (an http:// URL moved to https://, a
            # chat model as SOKRATOS_EMBEDDING_MODEL) is every item's: the configuration's.
            probed = self._probe_failure()
            if isinstance(probed, _Refused) and probed.status == exc.status:
                raise EmbeddingsMisconfigured(
                    f"{exc}; a tiny probe got the same answer: {exc.hint}"
                ) from exc
            if isinstance(probed, EmbeddingsUnavailable):
                raise probed from exc  # the server is down or refuses everything now
            raise
        except EmbeddingReplyInvalid as exc:
            # Junk for this input only is the item's problem; junk for the probe too (NaN,
            # no vectors, the wrong model's dimensions) is the server's, and every item
            # would fail the same way: pause instead of dead-lettering the queue.
            if self._healthy():
                raise
            if isinstance(exc, EmbeddingDimensionMismatch):
                raise EmbeddingsMisconfigured(
                    f"{exc}: check SOKRATOS_EMBEDDING_MODEL and SOKRATOS_EMBEDDING_DIM"
                ) from exc
            raise EmbeddingsUnavailable(
                f"{exc} (for a probe too: the server is at fault, not this input)"
            ) from exc
        except EmbeddingsUnavailable as exc:
            # A healthy server that fails only this input is the item's problem, not an outage
            # (durability.md): giving the attempt back would loop the item and pause claiming.
            # A 408 or 429 is the server's load whatever a tiny probe gets (a tokens-per-minute
            # limit refuses a large input only): the attempt is given back, without a probe.
            if isinstance(exc, _Throttled) and exc.status in _BUSY:
                raise
            if self._healthy():
                raise EmbeddingFailed(f"{exc} (the server is healthy: this input failed)") from exc
            raise

    def _embed_all(self, texts: Sequence[str], attempts: int | None = None) -> list[list[float]]:
        retrying = Retrying(
            stop=functools.partial(self._stop, attempts or self.attempts),
            wait=self._wait,
            retry=retry_if_exception_type(EmbeddingsUnavailable)
            & retry_if_not_exception_type(EmbeddingsMisconfigured),  # the answer will not change
            sleep=self._sleep,
            reraise=True,
        )
        vectors: list[list[float]] = []
        for start in range(0, len(texts), self.batch_size):
            vectors.extend(retrying(self._embed_batch, texts[start : start + self.batch_size]))
        return vectors

    def _wait(self, state: RetryCallState) -> float:
        """The server's Retry-After when it gave one, else backoff with jitter."""
        retry_after = _retry_after(state)
        return self._backoff(state) if retry_after is None else retry_after

    def _stop(self, attempts: int, state: RetryCallState) -> bool:
        # Waiting out a long rate limit would hold the slot: give the attempt back instead.
        too_long = (_retry_after(state) or 0.0) > self._retry_after_max
        return state.attempt_number >= attempts or too_long

    def embed_splitting(self, text: str) -> list[tuple[str, list[float]]]:
        """Embed ``text``; when the server says it is too large, embed its halves instead."""
        try:
            return [(text, self.embed([text])[0])]
        except _TooLarge:
            if len(text.encode()) <= MIN_SPLIT_BYTES:
                raise
        first, second = split_text(text)
        log.info("embedding_split", bytes=len(text.encode()))
        parts: list[tuple[str, list[float]]] = []
        for half in (first, second):
            if half:
                parts.extend(self.embed_splitting(half))
        return parts

    def probe(self) -> bool:
        """True when the server embeds a tiny text with the right dimension now."""
        return self._healthy()

    def _healthy(self) -> bool:
        return self._probe_failure() is None

    def _probe_failure(self) -> EmbeddingFailed | EmbeddingsUnavailable | None:
        """Why a tiny embedding fails now, or None when it is served."""
        try:
            self._embed_all(["sokratos-worker probe"], attempts=1)  # a probe answers now
        except (EmbeddingFailed, EmbeddingsUnavailable) as exc:
            return exc
        return None

    def _embed_batch(self, texts: Sequence[str]) -> list[list[float]]:
        body = {"model": self.model, "input": [t + self.suffix for t in texts]}
        started = time.perf_counter()
        try:
            response = self._clients.get().post(self._embeddings_url, json=body)
        except ProxyAuthenticationRequired as exc:  # every request through it: configuration
            log.warning("embedding_failed", reason="proxy_auth_required", count=len(texts))
            raise EmbeddingsMisconfigured(f"embedding server not reached: {exc}") from exc
        except httpx.HTTPError as exc:
            log.warning("embedding_failed", reason=type(exc).__name__, count=len(texts))
            raise EmbeddingsUnavailable(f"embedding server unreachable: {exc!r}") from exc
        duration_ms = round((time.perf_counter() - started) * 1000, 1)
        body_start = excerpt(response) if response.status_code != 200 else ""
        if _too_large(response.status_code, body_start):
            log.warning("embedding_failed", status=response.status_code, reason="too_large")
            raise _TooLarge(f"embedding server returned {response.status_code}: {body_start}")
        if response.status_code >= 500 or response.status_code in _BUSY:
            log.warning("embedding_failed", status=response.status_code, count=len(texts))
            raise _Throttled(
                f"embedding server returned {response.status_code}: {body_start}",
                response.status_code,
                retry_after_seconds(response.headers.get("Retry-After")),
            )
        if response.status_code in (401, 403, 404):
            # A rotated key or a model never pulled: every item would fail the same way.
            log.warning("embedding_failed", status=response.status_code, reason="configuration")
            raise EmbeddingsMisconfigured(
                f"embedding server returned {response.status_code}: {body_start}; check"
                " SOKRATOS_EMBEDDING_URL, SOKRATOS_EMBEDDING_MODEL and the API key"
            )
        if 300 <= response.status_code < 500:
            log.warning("embedding_failed", status=response.status_code, count=len(texts))
            raise self._refused(response, body_start)
        if response.status_code != 200:
            log.warning("embedding_failed", status=response.status_code, count=len(texts))
            raise EmbeddingFailed(f"embedding server returned {response.status_code}: {body_start}")
        vectors = self._vectors(response, len(texts))
        log.debug("embedding_finished", count=len(texts), duration_ms=duration_ms)
        return vectors

    def _refused(self, response: httpx.Response, body_start: str) -> _Refused:
        """A 3xx naming where it points (httpx does not follow redirects), or another 4xx
        quoting what the server says, with what to fix should every request get it."""
        status = response.status_code
        if status < 400:
            location = response.headers.get("Location")
            if not location:
                where = "a redirect without a Location"
                hint = "check SOKRATOS_EMBEDDING_URL"
            else:
                target = without_credentials(str(response.url.join(location)))
                where = f"redirects to {target}"
                hint = f"set SOKRATOS_EMBEDDING_URL to {target.removesuffix('/embeddings')}"
            return _Refused(f"embedding server returned {status}: {where}", status, hint)
        says = mask_secrets(" ".join(_server_message(response, body_start).split()), self._secrets)
        return _Refused(
            f"embedding server returned {status}: {_bounded(says, 200)}",
            status,
            "check SOKRATOS_EMBEDDING_URL and that SOKRATOS_EMBEDDING_MODEL is an embedding"
            " model the server serves",
        )

    def _vectors(self, response: httpx.Response, expected: int) -> list[list[float]]:
        try:
            payload: Any = jsontext.loads(response.content)
            data = payload["data"]
            raw = [d["embedding"] for d in data]
            indices = [d.get("index") for d in data]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise EmbeddingReplyInvalid("embedding response is not in the OpenAI format") from exc
        if len(raw) != expected:
            raise EmbeddingReplyInvalid(
                f"embedding server returned {len(raw)} vectors for {expected}"
            )
        return [self._checked(vector) for vector in _in_index_order(raw, indices)]

    def _checked(self, vector: Any) -> list[float]:
        if isinstance(vector, str):
            vector = _from_base64(vector)
        # (type(), not isinstance(): JSON's true and false are not components)
        if not isinstance(vector, list) or not all(type(x) in _NUMBERS for x in vector):
            # llama-cpp-python's server returns per-token vectors for a chat model.
            raise EmbeddingReplyInvalid("embedding is not a flat list of numbers (no pooling?)")
        if len(vector) != self.dim:
            raise EmbeddingDimensionMismatch(
                f"embedding model {self.model!r} returned {len(vector)} dimensions, "
                f"SOKRATOS_EMBEDDING_DIM is {self.dim}"
            )
        try:
            return l2_normalise([float(x) for x in vector])
        except OverflowError as exc:  # an integer of hundreds of digits
            raise EmbeddingReplyInvalid("embedding server returned a non-finite vector") from exc


def _from_base64(encoded: str) -> list[float]:
    """OpenAI's ``encoding_format: base64`` vector (little-endian float32s), which a server or
    proxy defaulting to it answers even though the worker never asks for it."""
    try:
        raw = base64.b64decode(encoded, validate=True)
    except binascii.Error as exc:
        raise EmbeddingReplyInvalid(
            "embedding is a string but not base64 (expected a list of numbers)"
        ) from exc
    if len(raw) % 4:
        raise EmbeddingReplyInvalid(
            f"embedding is base64 of {len(raw)} bytes, not a whole number of float32s"
        )
    return [float(x) for x in struct.unpack(f"<{len(raw) // 4}f", raw)]


def _too_large(status: int, body_start: str) -> bool:
    """Whether the server finds the input too large: llama.cpp's 500 "too large" (over its
    batch size), any 413 (Hugging Face TEI: "`inputs` must have less than 512 tokens"), or
    the context-length 400 of OpenAI and vLLM ("maximum context length")."""
    return status == 413 or TOO_LARGE in body_start.lower() or context_too_long(status, body_start)


def _server_message(response: httpx.Response, body_start: str) -> str:
    """An OpenAI-style error body's message (Ollama's too), else the body's first bytes."""
    try:
        error = jsontext.loads(response.content).get("error")
    except (ValueError, AttributeError):
        return body_start
    message = error.get("message") if isinstance(error, dict) else error
    return message if isinstance(message, str) and message.strip() else body_start


def _retry_after(state: RetryCallState) -> float | None:
    """The Retry-After of the attempt that just failed, if it had one."""
    exc = state.outcome.exception() if state.outcome else None
    return exc.retry_after if isinstance(exc, _Throttled) else None


def _in_index_order(vectors: list[Any], indices: list[Any]) -> list[Any]:
    """Each vector in the slot its ``index`` names; the reply's order when none has one.

    A proxy can answer with repeated indices (LiteLLM mixing cached and fresh inputs):
    sorting would then hand one text another's vector, so anything but each index of
    ``range(len(vectors))`` exactly once is refused.
    """
    if all(index is None for index in indices):
        return vectors
    slots: list[Any] = [None] * len(vectors)
    taken = [False] * len(vectors)
    for position, (vector, index) in enumerate(zip(vectors, indices, strict=True)):
        slot = _slot(index, position, indices)
        if taken[slot]:
            raise _bad_indices(indices, f"index {slot} is given twice")
        slots[slot] = vector
        taken[slot] = True
    return slots


def _slot(index: Any, position: int, indices: list[Any]) -> int:
    """The input ``index`` names. A JSON number that is a whole one counts (some proxies
    write 0 as 0.0); a boolean does not (``True`` is an ``int`` in Python)."""
    if index is None:
        raise _bad_indices(indices, f"vector {position} has no index while others have one")
    if type(index) not in _NUMBERS:
        raise _bad_indices(indices, f"index {_bounded(repr(index), 40)} is not a number")
    if isinstance(index, float) and not index.is_integer():
        raise _bad_indices(indices, f"index {_bounded(repr(index), 40)} is not a whole number")
    if not 0 <= index < len(indices):
        raise _bad_indices(
            indices, f"index {_bounded(repr(index), 40)} is outside 0..{len(indices) - 1}"
        )
    return int(index)


def _bounded(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters: a reply's values end up in ``last_error``."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def _bad_indices(indices: list[Any], problem: str) -> EmbeddingReplyInvalid:
    return EmbeddingReplyInvalid(
        f"embedding server returned the indices {_bounded(repr(indices))} for {len(indices)}"
        f" inputs: {problem}; refused rather than risk giving a text another text's"
        " vector"
    )


def l2_normalise(vector: Sequence[float]) -> list[float]:
    """The unit vector in ``vector``'s direction; a zero or non-finite vector is an error."""
    if not all(map(math.isfinite, vector)) or max(map(abs, vector), default=0.0) == 0.0:
        raise EmbeddingReplyInvalid("embedding server returned a zero or non-finite vector")
    norm = math.sqrt(sum(x * x for x in vector))
    if norm == 0.0 or math.isinf(norm):
        # The squares under- or overflowed (components near 1e-160 or 1e154): scale first.
        scale = max(map(abs, vector))
        return l2_normalise([x / scale for x in vector])
    return [x / norm for x in vector]


def split_text(text: str) -> tuple[str, str]:
    """Split at the byte midpoint, moved back to just after the last newline before it."""
    data = text.encode()
    middle = len(data) // 2
    while middle > 0 and (data[middle] & 0xC0) == 0x80:
        middle -= 1  # never cut inside a UTF-8 sequence
    newline = data.rfind(b"\n", 0, middle)
    if newline > 0:
        middle = newline + 1
    return data[:middle].decode().strip(), data[middle:].decode().strip()


__all__ = ["HttpEmbedder", "l2_normalise", "split_text"]
