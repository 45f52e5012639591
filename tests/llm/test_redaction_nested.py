"""A configured secret is masked inside nested log values and in field names.

A dict or a list (a parsed error body, the backends tried) used to be searched through its
repr, where a backslash is doubled and quotes may be escaped: a password with a backslash was
not found there and was logged. Keys were not looked at. contract.md: "Secrets are never
logged."
"""

from __future__ import annotations

import json
import logging
import types
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from pydantic import SecretStr

from sokratos_worker.logs import configure_logging

SECRET = r"Tr0ub4dor\&3-horse"  # an IMAP password with a backslash


def _settings() -> Any:
    account = types.SimpleNamespace(password=SecretStr(SECRET))
    return types.SimpleNamespace(
        embedding_url=None, llm_backends=[], email_accounts=[account], database_url=None
    )


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for key, inner in value.items():
            yield str(key)
            yield from _strings(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from _strings(inner)
    else:
        yield str(value)


@pytest.mark.parametrize(
    "fields",
    [
        {"detail": {"error": {"message": f"login failed: {SECRET}"}}},
        {"tried": [f"imap: login failed {SECRET}"]},
        {f"token_{SECRET}": 1},
        {"detail": {f"user {SECRET}": [("x", {"deep": SECRET})]}},
        {"error": ValueError(f"login failed '{SECRET}'")},
        {"reason": "server said: " + json.dumps({"password": SECRET})},
    ],
    ids=["nested-dict", "list", "key-name", "nested-key-and-tuple", "exception", "json-text"],
)
def test_a_secret_never_reaches_the_log_line(
    capsys: pytest.CaptureFixture[str], fields: dict[str, Any]
) -> None:
    configure_logging("info", "json", settings=_settings())
    try:
        structlog.get_logger("sokratos_worker.review").warning("review_event", **fields)
        (line,) = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x]
    finally:  # (not configure_logging again: it would keep capsys's stream, closed after)
        structlog.reset_defaults()
        logging.getLogger().handlers.clear()
    leaked = [s for s in _strings(line) if SECRET in s or SECRET.replace("\\", "\\\\") in s]
    assert not leaked, f"the secret was logged: {leaked}"
    assert "[redacted]" in json.dumps(line)


def test_a_nested_value_without_secrets_is_left_as_it_is() -> None:
    from sokratos_worker.logs import SecretRedactor

    detail = {"error": {"message": "no secret here"}, "tried": ["a", ("b", 1)]}
    event = {"event": "x", "detail": detail, "n": 1}
    assert SecretRedactor([SECRET])(None, "info", event)["detail"] is detail
