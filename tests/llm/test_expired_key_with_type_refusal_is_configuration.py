"""A backend refusing even the minimal request (an expired key: 401 to everything) while another
refuses this request TYPE is the configuration's problem, not the item's.

Every backend refused the request, so the minimal ``{"ok": bool}`` request in each backend's
form decides: only when EVERY backend that refused serves it is the request (or its schema)
refused, the item's attempt (:class:`RequestRefused`). Here the primary refuses it too: once its
key is renewed it may serve this request, so the attempt is given back
(:class:`LLMBackendsMisconfigured`, durability.md "What is not the item's fault is not the
item's attempt"), and probe() asks the primary for the minimal request, so claiming stays paused
(the fallback serving it changes nothing for the item) until the primary serves it. No loop:
once it does, the item is decided by the backends' real answers.
"""

from __future__ import annotations

from collections.abc import Callable

from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.llm.types import LLMBackendsMisconfigured, RequestRefused
from sokratos_worker.testing.scripted_llm import ScriptedLLM
from tests.llm.conftest import (
    ask_contradiction,
    primary_and_fallback,
    refuses_contradiction,
    switchable,
)


def test_an_expired_key_gives_the_attempt_back_and_pauses_until_renewed(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    state = {"mode": "expired"}
    client = primary_and_fallback(servers, make_client, switchable(state), refuses_contradiction)

    for _ in range(2):
        failure = ask_contradiction(client)
        assert not isinstance(failure, RequestRefused), failure
        assert isinstance(failure, LLMBackendsMisconfigured), f"{type(failure).__name__}: {failure}"
        assert "primary" in str(failure) and "api_key" in str(failure)
        # The fallback serves the minimal request (and a plain probe): that resumes nothing,
        # the item would only be given back again.
        assert client.probe() is False

    state["mode"] = "serves"  # the key renewed
    assert client.probe() is True
    result = ask_contradiction(client)
    assert not isinstance(result, Exception), result
    assert client.probe() is True


def test_the_key_renewed_but_the_type_refused_everywhere_is_then_the_items_attempt(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    """No loop: once the primary serves the minimal request, claiming resumes, and every
    backend refusing the request while serving the minimal one is the item's attempt."""
    state = {"mode": "expired"}
    client = primary_and_fallback(servers, make_client, switchable(state), refuses_contradiction)

    assert isinstance(ask_contradiction(client), LLMBackendsMisconfigured)
    assert client.probe() is False
    state["mode"] = "refuses"
    assert client.probe() is True
    for _ in range(2):
        failure = ask_contradiction(client)
        assert isinstance(failure, RequestRefused), failure
        assert client.probe() is True  # never paused again for it


def test_every_key_expired_resumes_once_one_is_renewed(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    """Both refuse the minimal request: claiming resumes once either serves it, and the item is
    then decided by what each answers (here: the other still expired, so given back again)."""
    first, second = {"mode": "expired"}, {"mode": "expired"}
    client = primary_and_fallback(servers, make_client, switchable(first), switchable(second))

    assert isinstance(ask_contradiction(client), LLMBackendsMisconfigured)
    assert client.probe() is False
    second["mode"] = "refuses"  # the fallback's key renewed; it refuses the type
    assert client.probe() is True
    failure = ask_contradiction(client)
    assert isinstance(failure, LLMBackendsMisconfigured), failure  # the primary's key, still
    assert "primary" in str(failure)
    assert client.probe() is False
    first["mode"] = "serves"
    assert client.probe() is True
    assert not isinstance(ask_contradiction(client), Exception)
