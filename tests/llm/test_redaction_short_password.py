"""Passwords (IMAP, database, a URL's user:password@) shorter than 8 characters are masked too.

The 8-character floor is for API-key placeholders local servers accept ("ollama", "none");
passwords are masked from 4 characters (shorter ones would blank out letters in every line).
contract.md: "Secrets are never logged."
"""

from __future__ import annotations

import json
import logging
import types
from typing import Any

import pytest
import structlog
from pydantic import SecretStr

from sokratos_worker.config import BackendConfig
from sokratos_worker.logs import configure_logging, secret_values

PASSWORD = "hunter2"


def test_a_short_mailbox_password_is_still_masked(capsys: pytest.CaptureFixture[str]) -> None:
    account = types.SimpleNamespace(password=SecretStr(PASSWORD))
    settings: Any = types.SimpleNamespace(
        embedding_url=None, llm_backends=[], email_accounts=[account], database_url=None
    )
    configure_logging("info", "json", settings=settings)
    try:
        structlog.get_logger("sokratos_worker.review").warning(
            "email_login_failed", error=f"AUTHENTICATE failed: bad password '{PASSWORD}'"
        )
        (line,) = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x]
    finally:  # (not configure_logging again: it would keep capsys's stream, closed after)
        structlog.reset_defaults()
        logging.getLogger().handlers.clear()
    assert PASSWORD not in line["error"], line


def test_the_floor_is_per_kind_of_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):  # their passwords are secrets too
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    monkeypatch.setenv("https_proxy", "http://corp:proxy-pw@127.0.0.1:3128")
    settings: Any = types.SimpleNamespace(
        embedding_url="http://u:pw4x@emb.example/v1",
        llm_backends=[
            BackendConfig(name="local", url="http://127.0.0.1:1/v1", model="m", api_key="ollama"),
            BackendConfig(name="cloud", url="http://u:abc@h.example/v1", model="m"),
        ],
        email_accounts=[types.SimpleNamespace(password=SecretStr(PASSWORD))],
        database_url=SecretStr("postgresql://worker:dbpw5@db.example/sokratos"),
    )
    # "ollama": an API-key placeholder (under 8); "abc": a password under 4, which would blank
    # out those letters in every line.
    assert set(secret_values(settings)) == {PASSWORD, "pw4x", "dbpw5", "proxy-pw"}
