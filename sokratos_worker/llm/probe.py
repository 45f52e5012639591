"""``sokratos-worker check`` for the model side: one line per backend and the embeddings.

Per backend: reachable, the model listed by ``GET {url}/models`` when the server offers the
list, and a tiny structured call through the real client path; for embeddings, one vector of
``SOKRATOS_EMBEDDING_DIM`` dimensions.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import httpx
from pydantic import BaseModel

from sokratos_worker import jsontext
from sokratos_worker.config import BackendConfig, Settings
from sokratos_worker.errors import BackendsUnavailable
from sokratos_worker.llm.chat import RUN_CHECK, FallbackChatClient, RetryPolicy
from sokratos_worker.llm.embeddings import HttpEmbedder
from sokratos_worker.llm.http import describe_connection_error, make_client, without_credentials
from sokratos_worker.llm.local import LOCAL_BACKEND_NAME, LocalModelError, start_local_server
from sokratos_worker.llm.types import ChatFailed, EmbeddingFailed, EmbeddingsUnavailable
from sokratos_worker.model import CheckLine

PROBE_TIMEOUT = 10.0


class _Ping(BaseModel):
    """The tiny structured reply every backend must manage."""

    ok: bool


def probe_backends(
    settings: Settings, extra_backends: Sequence[BackendConfig] = ()
) -> list[CheckLine]:
    """One line per chat backend (``llm:<name>``), the local model when enabled, and one
    for ``embeddings`` when an embedding model is configured (the caller reports its absence
    and the absence of any backend)."""
    lines = [probe_chat_backend(b) for b in [*settings.llm_backends, *extra_backends]]
    if settings.local_model and not any(b.name == LOCAL_BACKEND_NAME for b in extra_backends):
        lines.append(probe_local_model())
    if settings.embeddings_enabled:
        lines.append(probe_embeddings(settings))
    return lines


def probe_local_model() -> CheckLine:
    """Start the bundled model for the length of the check and ask it once."""
    try:
        server = start_local_server()
    except LocalModelError as exc:
        return CheckLine(f"llm:{LOCAL_BACKEND_NAME}", False, str(exc))
    try:
        return probe_chat_backend(server.backend)
    finally:
        server.stop()


def probe_chat_backend(config: BackendConfig) -> CheckLine:
    """Reachable, model present, and a schema-valid answer to a tiny request."""
    component = f"llm:{config.name}"
    problem = _check_models(config)
    if problem:
        return CheckLine(component, False, problem)
    client = FallbackChatClient(
        [config], policy=RetryPolicy(attempts=1, probe_timeout=min(config.timeout, 60.0))
    )
    started = time.perf_counter()
    try:
        client.complete(
            response_model=_Ping,
            system='Reply with the JSON object {"ok": true} and nothing else.',
            user="Are you there?",
            max_tokens=32,
            purpose="check",
        )
    except (ChatFailed, BackendsUnavailable) as exc:
        return CheckLine(component, False, _call_failed(config, exc))
    finally:
        client.close()
    ms = round((time.perf_counter() - started) * 1000)
    return CheckLine(component, True, f"model {config.model} answered a structured call in {ms} ms")


def _call_failed(config: BackendConfig, exc: ChatFailed | BackendsUnavailable) -> str:
    """What the structured call's failure means for this backend's settings: a 404 or an
    HTML page almost always is a ``url`` without its ``/v1``, which the bare reason hides."""
    reasons = [a.reason for a in getattr(exc, "tried", ()) if a.result == "failed"]
    endpoint = f"{without_credentials(config.url)}/chat/completions"
    fix = (
        f'check "url" in SOKRATOS_LLM_BACKENDS for {config.name!r} (the OpenAI-compatible'
        f' base, usually ending in /v1) and "model"'
    )
    if reasons and all(r.startswith("http_404") for r in reasons):
        return f"404 Not Found at {endpoint}: {fix} ({reasons[0]})"
    if reasons and all("malformed_response" in r and "text/html" in r for r in reasons):
        return f"answered an HTML page, not the OpenAI API, at {endpoint}: {fix} ({reasons[0]})"
    return f"structured call failed: {str(exc).replace(RUN_CHECK, '')}"


def _check_models(config: BackendConfig) -> str | None:
    """A problem description, or None when reachable and the model is listed (or no list)."""
    key = config.api_key.get_secret_value() if config.api_key else None
    client = make_client(
        name=config.name,
        timeout=min(config.timeout, PROBE_TIMEOUT),
        api_key=key,
        ca_file=config.ca_file,
        tls_verify=config.tls_verify,
    )
    try:
        response = client.get(f"{config.url}/models")
    except httpx.HTTPError as exc:
        shown = without_credentials(config.url)
        return f"unreachable at {shown}: {describe_connection_error(exc)}"
    finally:
        client.close()
    if response.status_code in (401, 403):
        return f"refused ({response.status_code}): check api_key"
    if response.status_code != 200:
        return None  # not every server offers the list; the structured call decides
    try:
        listed = jsontext.loads(response.content).get("data")
        # Ollama lists no model as null (before any is pulled): nothing listed, nothing decided.
        ids = [str(m.get("id")) for m in listed] if isinstance(listed, list) else []
    except (ValueError, AttributeError):
        return None
    if ids and not any(_same_model(config.model, i) for i in ids):
        return f"model {config.model!r} not offered (server has: {', '.join(ids[:5])})"
    return None


def _same_model(wanted: str, offered: str) -> bool:
    # Ollama lists "llama3.2:latest" for "llama3.2"; llama.cpp lists a file path.
    return offered in (wanted, f"{wanted}:latest") or offered.rsplit("/", 1)[-1] == wanted


def probe_embeddings(settings: Settings) -> CheckLine:
    """The embedding model answers with ``SOKRATOS_EMBEDDING_DIM`` dimensions."""
    if not settings.embedding_url or not settings.embedding_model or not settings.embedding_dim:
        return CheckLine(
            "embeddings", True, "not configured: memories are saved without embeddings"
        )
    embedder = HttpEmbedder(
        settings.embedding_url,
        settings.embedding_model,
        settings.embedding_dim,
        suffix=settings.embedding_suffix,
        timeout=settings.embedding_timeout,  # (what the worker allows it, not the probe's 10 s)
    )
    try:
        embedder.embed(["sokratos-worker check"])
    except (EmbeddingFailed, EmbeddingsUnavailable) as exc:
        return CheckLine("embeddings", False, str(exc))
    finally:
        embedder.close()
    return CheckLine(
        "embeddings",
        True,
        f"model {settings.embedding_model} answered with {settings.embedding_dim} dimensions",
    )


__all__ = ["probe_backends", "probe_chat_backend", "probe_embeddings", "probe_local_model"]
