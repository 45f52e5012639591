"""A key the server echoes back is masked; configured secrets are redacted from every log line.

contract.md: secrets are never logged. LiteLLM answers a key of the wrong form with
``… Received=<the key>, expected to start with 'sk-'.``
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import pytest
import structlog

from sokratos_worker.config import BackendConfig, EmailAccountConfig, load_settings
from sokratos_worker.errors import BackendsUnavailable
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.logs import SecretRedactor, configure_logging, secret_values
from sokratos_worker.testing.scripted_llm import CHAT, PROBE, Reply, ScriptedLLM
from tests.llm.conftest import ask, backend

SECRET = "prod-key-7f3a9c2e5b1d4e8f"


def _litellm(request: object) -> Reply:
    return Reply.error(
        401,
        f"Authentication Error, LiteLLM Virtual Key expected. Received={SECRET}, "
        "expected to start with 'sk-'.",
        type="auth_error",
        code="401",
    )


def test_an_echoed_api_key_is_neither_logged_nor_in_the_error(
    servers: Callable[..., ScriptedLLM],
    make_client: Callable[..., FallbackChatClient],
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = servers()
    server.on(CHAT, _litellm)
    server.on(PROBE, _litellm)
    configure_logging("info", "json")  # no settings: the client masks its own key
    try:
        client = make_client(backend(server, "proxy", api_key=SECRET))
        with pytest.raises(BackendsUnavailable) as raised:
            ask(client)
        stderr = capsys.readouterr().err
    finally:
        structlog.reset_defaults()

    assert SECRET not in stderr
    assert SECRET not in str(raised.value)
    assert "Received=[redacted], expected to start with 'sk-'" in str(raised.value)


def test_configured_secrets_are_redacted_from_any_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = load_settings(
        {},
        database_url="postgresql://worker:db-pass-123456@db.example:5432/sokratos",
        llm_backends=[BackendConfig(name="a", url="http://127.0.0.1:1/v1", model="m", api_key=SECRET)],
    )
    configure_logging("info", "json", settings=settings)
    try:
        structlog.get_logger("t").warning("said", detail=f"key {SECRET}", errors=[SECRET], n=3)
        logging.getLogger("library").warning("connect failed: password=db-pass-123456")
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    finally:
        structlog.reset_defaults()
        logging.getLogger().handlers.clear()

    assert lines[0]["detail"] == "key [redacted]"
    assert lines[0]["errors"] == ["[redacted]"]  # the list kept, its string masked
    assert lines[0]["n"] == 3
    assert lines[1]["event"] == "library_message"
    assert lines[1]["message"] == "connect failed: password=[redacted]"


def test_the_secrets_come_from_every_credential_in_the_settings() -> None:
    settings = load_settings(
        {},
        database_url="postgresql://worker:db-pass-123456@db.example/sokratos",
        embedding_url="http://user:embed-pass-1234@emb.example/v1",
        embedding_model="e",
        embedding_dim=8,
        llm_backends=[
            BackendConfig(name="a", url="http://u:url-pass-1234@h.example/v1", model="m"),
            BackendConfig(name="b", url="http://h.example/v1", model="m", api_key=SECRET),
        ],
        email_accounts=[
            EmailAccountConfig(name="m", host="imap.example", username="u", password="imap-pass-99")
        ],
    )
    assert set(secret_values(settings)) == {
        "db-pass-123456",
        "embed-pass-1234",
        "url-pass-1234",
        SECRET,
        "imap-pass-99",
    }


def test_without_secrets_the_processor_leaves_the_event_alone() -> None:
    event = {"event": "x", "value": object()}
    assert SecretRedactor(["abc"])(None, "info", event) is event  # under 4 characters: none
    assert event["event"] == "x"
