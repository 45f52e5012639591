"""A 402 Payment Required (OpenRouter's "Insufficient credits") is the account's refusal, like a
401 or OpenAI's 429 ``insufficient_quota``: the misconfiguration it causes points at the key's
account. It was taken as a refusal of this one request, so a backend out of credits was
reported as "check each backend's url and model". Real HTTP servers on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.llm.http import Verdict, classify
from sokratos_worker.llm.types import LLMBackendsMisconfigured
from sokratos_worker.testing import Reply, ScriptedLLM
from tests.llm.conftest import ask, backend, scripted

NO_CREDITS = "Insufficient credits. Add more using https://openrouter.ai/settings/credits"


def test_a_402_is_the_accounts_refusal() -> None:
    assert classify(402, '{"error": {"message": "Insufficient credits", "code": 402}}') is (
        Verdict.REFUSED
    )


def test_a_backend_out_of_credits_names_the_api_key_not_the_url(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    server = scripted(servers, lambda r: Reply.error(402, NO_CREDITS, type="payment_required"))
    client = make_client(backend(server, "openrouter"), attempts=1)

    with pytest.raises(LLMBackendsMisconfigured) as caught:
        ask(client)

    message = str(caught.value)
    assert "http_402: Insufficient credits" in message
    assert "check each backend's api_key and model" in message
    assert "url and model" not in message
    assert server.count() == 1  # a permanent answer: not retried
