"""A 4xx for one request type, from a backend that serves others, is that request's problem.

llama.cpp answers 400 for a schema its grammar converter cannot take. durability.md: "a request
that breaks a healthy server is the item's own problem, and must not loop forever"; only a
refusal every request gets is configuration. This used to give the item back (paused claiming,
attempt unused); any other request type's success or the plain probe resumed claiming, and the
same item was given back again, for ever.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel

from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.llm.types import LLMBackendsMisconfigured, RequestRefused
from sokratos_worker.testing.scripted_llm import CHAT, Reply, Request, ScriptedLLM
from tests.llm.conftest import Contradiction, Scored, backend, schema_name, scripted


def _refuses_one_schema(request: Request) -> Reply:
    if schema_name(request) == "Contradiction":
        return Reply.error(
            400,
            "JSON schema conversion failed: unsupported schema for Contradiction",
            type="invalid_request_error",
        )
    return Reply.chat({"score": 1, "summary": "ok"})


def _ask(client: FallbackChatClient, model: type[BaseModel]) -> object:
    try:
        return client.complete(
            response_model=model, system="s", user="u", max_tokens=64, purpose=model.__name__
        )
    except Exception as exc:
        return exc


def test_a_schema_refused_everywhere_uses_the_items_attempt(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    server = scripted(servers, _refuses_one_schema)
    client = make_client(backend(server, "only", structured_output="json_schema"), attempts=1)

    for _ in range(3):  # every time the item is claimed: its attempt is used, never given back
        failed = _ask(client, Contradiction)
        # (a ChatFailed callers must not take for "no valid reply this time")
        assert isinstance(failed, RequestRefused), failed
        assert "unsupported schema for Contradiction" in str(failed)
        assert client.probe() is True  # claiming never paused for it
        assert not isinstance(_ask(client, Scored), Exception)  # other request types served


def test_a_form_every_request_type_gets_refused_in_stays_configuration(
    servers: Callable[..., ScriptedLLM], make_client: Callable[..., FallbackChatClient]
) -> None:
    """Every json_schema request refused (a server without that mode): the minimal request in
    that form is refused too, so it is configuration, and the probe asks in that form."""

    def no_json_schema(request: Request) -> Reply:
        if schema_name(request) is not None:
            return Reply.error(400, "response_format json_schema is not supported")
        return Reply.chat("OK")

    server = scripted(servers, no_json_schema)
    client = make_client(backend(server, "only", structured_output="json_schema"), attempts=1)

    assert isinstance(_ask(client, Contradiction), LLMBackendsMisconfigured)
    assert isinstance(_ask(client, Scored), LLMBackendsMisconfigured)
    assert client.probe() is False  # a plain probe would pass: claiming stays paused
    assert server.count(CHAT) >= 2
