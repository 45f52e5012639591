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

from pydantic import BaseModel

from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.llm.types import LLMBackendsMisconfigured, RequestRefused
from sokratos_worker.testing.scripted_llm import PROBE, Reply, Request, ScriptedLLM
from tests.llm.conftest import backend


class Contradiction(BaseModel):
    contradicts: bool
    explanation: str


def _schema_name(request: Request) -> str | None:
    body = request.body if isinstance(request.body, dict) else {}
    rf = body.get("response_format")
    return rf.get("json_schema", {}).get("name") if isinstance(rf, dict) else None


def _refuses_contradiction(request: Request) -> Reply:
    if _schema_name(request) == "Contradiction":
        return Reply.error(400, "JSON schema conversion failed", type="invalid_request_error")
    return Reply.chat({"ok": True})


def _switchable(state: dict[str, str]) -> Callable[[Request], Reply]:
    """A backend whose key is ``expired`` (401 to everything), that ``serves`` every request,
    or that ``refuses`` the Contradiction type."""

    def answer(request: Request) -> Reply:
        if state["mode"] == "expired":
            return Reply.error(401, "invalid api key", type="authentication_error")
        if state["mode"] == "refuses":
            return _refuses_contradiction(request)
        if _schema_name(request) == "Contradiction":
            return Reply.chat({"contradicts": False, "explanation": "no"})
        return Reply.chat({"ok": True})

    return answer


def _ask(client: FallbackChatClient) -> object:
    try:
        return client.complete(
            response_model=Contradiction, system="s", user="u", max_tokens=64, purpose="c"
        )
    except Exception as exc:
        return exc


def _setup(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> tuple[dict[str, str], FallbackChatClient]:
    state = {"mode": "expired"}
    a = servers(chat=_switchable(state))
    a.on(PROBE, _switchable(state))
    b = servers(chat=_refuses_contradiction)
    b.on(PROBE, _refuses_contradiction)
    return state, make_client(backend(a, "primary"), backend(b, "fallback"), attempts=1)


def test_an_expired_key_gives_the_attempt_back_and_pauses_until_renewed(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    state, client = _setup(servers, make_client)

    for _ in range(2):
        failure = _ask(client)
        assert not isinstance(failure, RequestRefused), failure
        assert isinstance(failure, LLMBackendsMisconfigured), f"{type(failure).__name__}: {failure}"
        assert "primary" in str(failure) and "api_key" in str(failure)
        # The fallback serves the minimal request (and a plain probe): that resumes nothing,
        # the item would only be given back again.
        assert client.probe() is False

    state["mode"] = "serves"  # the key renewed
    assert client.probe() is True
    result = _ask(client)
    assert not isinstance(result, Exception), result
    assert client.probe() is True


def test_the_key_renewed_but_the_type_refused_everywhere_is_then_the_items_attempt(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    """No loop: once the primary serves the minimal request, claiming resumes, and every
    backend refusing the request while serving the minimal one is the item's attempt."""
    state, client = _setup(servers, make_client)

    assert isinstance(_ask(client), LLMBackendsMisconfigured)
    assert client.probe() is False
    state["mode"] = "refuses"
    assert client.probe() is True
    for _ in range(2):
        failure = _ask(client)
        assert isinstance(failure, RequestRefused), failure
        assert client.probe() is True  # never paused again for it


def test_every_key_expired_resumes_once_one_is_renewed(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    """Both refuse the minimal request: claiming resumes once either serves it, and the item is
    then decided by what each answers (here: the other still expired, so given back again)."""
    first, second = {"mode": "expired"}, {"mode": "expired"}
    a = servers(chat=_switchable(first))
    a.on(PROBE, _switchable(first))
    b = servers(chat=_switchable(second))
    b.on(PROBE, _switchable(second))
    client = make_client(backend(a, "primary"), backend(b, "fallback"), attempts=1)

    assert isinstance(_ask(client), LLMBackendsMisconfigured)
    assert client.probe() is False
    second["mode"] = "refuses"  # the fallback's key renewed; it refuses the type
    assert client.probe() is True
    failure = _ask(client)
    assert isinstance(failure, LLMBackendsMisconfigured), failure  # the primary's key, still
    assert "primary" in str(failure)
    assert client.probe() is False
    first["mode"] = "serves"
    assert client.probe() is True
    assert not isinstance(_ask(client), Exception)
