"""A 4xx or 3xx that every request gets is configuration: the attempt is given back.

durability.md, what counts as an attempt: a 4xx *for this request* uses the attempt; a refusal
every request gets (the probe in the request's own form too) is a configuration problem.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from sokratos_worker.errors import BackendsUnavailable
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.llm.types import ChatFailed, LLMBackendsMisconfigured
from sokratos_worker.testing.scripted_llm import CHAT, PROBE, Reply, Request, ScriptedLLM
from tests.llm.conftest import ask, backend, scripted

UNSUPPORTED_MAX_TOKENS = (
    "Unsupported parameter: 'max_tokens' is not supported with this model. "
    "Use 'max_completion_tokens' instead."
)


def _body(request: Request) -> dict[str, object]:
    return request.body if isinstance(request.body, dict) else {}


def _openai_reasoning_model(request: Request) -> Reply:
    """OpenAI's o-series: every request carrying max_tokens gets a 400, the probe's too."""
    if "max_tokens" in _body(request):
        return Reply.error(
            400, UNSUPPORTED_MAX_TOKENS, type="invalid_request_error", code="unsupported_parameter"
        )
    return Reply.chat({"score": 1, "summary": "ok"})


def _lm_studio(request: Request) -> Reply:
    """LM Studio refuses response_format json_object, whatever the request."""
    response_format = _body(request).get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_object":
        return Reply.text(
            "{\"error\":\"'response_format.type' must be 'json_schema' or 'text'\"}", 400
        )
    return Reply.chat("OK")


def _redirect_to_https(request: Request) -> Reply:
    return Reply(status=308, raw=b"", headers={"Location": "https://127.0.0.1/v1/chat/completions"})


@pytest.mark.parametrize(
    ("responder", "overrides"),
    [
        (_openai_reasoning_model, {}),
        (_lm_studio, {"structured_output": "json_object"}),
        (_redirect_to_https, {}),
    ],
    ids=["openai-reasoning-400", "lmstudio-json_object-400", "http-to-https-308"],
)
def test_a_refusal_every_request_gets_gives_the_attempt_back(
    servers: Callable[..., ScriptedLLM],
    make_client: Callable[..., FallbackChatClient],
    responder: Callable[[Request], Reply],
    overrides: dict[str, str],
) -> None:
    a, b = scripted(servers, responder), scripted(servers, responder)
    client = make_client(backend(a, "a", **overrides), backend(b, "b", **overrides))

    with pytest.raises(BackendsUnavailable) as raised:
        ask(client)

    assert isinstance(raised.value, LLMBackendsMisconfigured)


def test_the_reason_quotes_the_server_for_a_400(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    server = scripted(servers, _openai_reasoning_model)
    client = make_client(backend(server, "openai"))

    with pytest.raises(LLMBackendsMisconfigured) as raised:
        ask(client)

    assert "http_400: Unsupported parameter: 'max_tokens'" in str(raised.value)


def test_a_redirect_names_the_url_to_configure(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    server = scripted(servers, _redirect_to_https)
    client = make_client(backend(server, "moved"))

    with pytest.raises(LLMBackendsMisconfigured) as raised:
        ask(client)

    assert (
        "http_308: redirects to https://127.0.0.1/v1/chat/completions: set the backend's url"
        " to https://127.0.0.1/v1"
    ) in str(raised.value)


def test_a_400_only_this_request_gets_uses_the_attempt(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    server = servers()
    server.on(CHAT, lambda request: Reply.error(400, "bad input", type="invalid_request_error"))
    server.on(PROBE, lambda request: Reply.chat({"score": 1, "summary": "ok"}))
    client = make_client(backend(server, "a"))

    with pytest.raises(ChatFailed) as raised:
        ask(client)

    assert "http_400: bad input" in str(raised.value)


def test_after_a_refused_form_the_probe_asks_in_that_form(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    """A plain probe would succeed and resume claiming, only for every item to be refused."""
    server = scripted(servers, _lm_studio)
    client = make_client(backend(server, "lmstudio", structured_output="json_object"))

    with pytest.raises(LLMBackendsMisconfigured):
        ask(client)

    assert not client.probe()
