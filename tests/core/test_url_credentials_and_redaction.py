"""A URL's credentials are found one way, shown nowhere; the worker's field names are kept.

1. A password starting with digits before a raw '/' (``alice:2024/Xq9secret@host``) read as
   host ``alice``, port 2024: accepted, and ``check`` printed it whole in its FAIL line.
2. A redirect to ``https://login.example.com?next=me@corp.com`` (an '@' in a query, no path)
   was shown as ``https://corp.com``: the hint named a URL to set that was never there.
3. Any '@' in a base URL urlsplit refused blamed the password, for a port out of range too.
4. Nested field names (``holder``'s ``user``, ``pruned``'s ``processed_emails``) were renamed
   by a common-word password, which showed the password by what went missing.
5. A database host starting with '@' (an abstract Unix socket) was called "an '@' in its
   password", and an unencoded '@' in the user name too.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import structlog
from pydantic import SecretStr

from sokratos_worker.config import ConfigError, load_settings
from sokratos_worker.config_validators import without_credentials
from sokratos_worker.llm.chat import FallbackChatClient, RetryPolicy
from sokratos_worker.llm.types import LLMBackendsMisconfigured
from sokratos_worker.logs import configure_logging, url_password
from sokratos_worker.testing import ScriptedLLM
from sokratos_worker.testing.scripted_llm import PROBE, Reply, Request
from tests.llm.conftest import FakeClock, ask, backend

ROOT = Path(__file__).resolve().parents[2]


def _refusal(env: dict[str, str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_settings(env)
    return info.value


def _backend_url(url: str) -> dict[str, str]:
    return {"SOKRATOS_LLM_BACKENDS": json.dumps([{"name": "gw", "url": url, "model": "m"}])}


def test_check_never_prints_a_password_that_starts_with_digits_before_a_slash() -> None:
    env = {
        **_backend_url("http://alice:2024/Xq9secret@127.0.0.1:9/v1"),
        "SOKRATOS_DATABASE_URL": "postgresql://u:p@127.0.0.1:1/x",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "sokratos_worker", "check"],
        cwd=ROOT,
        env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    said = proc.stdout + proc.stderr
    assert "Xq9secret" not in said and "2024" not in said, said
    assert proc.returncode == 78, said  # refused as configuration: it is no URL to reach
    assert "'http://...@127.0.0.1:9/v1' has an '@' after its host" in said, said
    assert "%2F" in said


@pytest.mark.parametrize(
    "url",
    [
        "http://alice:2024/Xq9secret@127.0.0.1:9/v1",  # reads as host alice, port 2024
        "http://alice:Xq9/secret@127.0.0.1:9/v1",
        "http://alice:Xq9?secret@127.0.0.1:9/v1",
        "alice:2024/Xq9secret@127.0.0.1:9/v1",  # no scheme
    ],
)
def test_no_part_of_a_password_with_a_raw_slash_or_query_mark_is_shown(url: str) -> None:
    error = _refusal(_backend_url(url))
    assert "Xq9" not in str(error) and "secret" not in str(error), str(error)
    assert "'@' after its host" in error.message, error.message


def test_what_is_masked_is_what_is_taken_out() -> None:
    """One reading of a URL's credentials serves the display and the masking of log lines:
    a password the display takes out is masked, one it leaves (there is none) is not."""
    url = "http://user:pass/word@proxy.example:3128/"
    assert without_credentials(url) == "http://proxy.example:3128/"
    assert url_password(url) == "pass/word"  # an environment's *_proxy value is not validated
    assert url_password("http://user:p%40ss@proxy.example/") == "p@ss"
    for valid in (
        "https://login.example.com?next=me@corp.com",
        "https://login.example.com:8443/auth?next=me@corp.com",
        "https://h/v1/a@b",
        "http://[fe80::1%25eth0]:8080/v1",
    ):
        assert without_credentials(valid) == valid
        assert url_password(valid) is None


def _redirect_to_a_login_page(request: Request) -> Reply:
    return Reply(
        status=302, raw=b"", headers={"Location": "https://login.example.com?next=me@corp.com"}
    )


def test_a_redirect_with_an_at_sign_in_its_query_names_the_real_target() -> None:
    server = ScriptedLLM(chat=_redirect_to_a_login_page).start()
    server.on(PROBE, _redirect_to_a_login_page)
    client = FallbackChatClient(
        [backend(server, "sso")], policy=RetryPolicy(), sleep=lambda _: None, clock=FakeClock()
    )
    try:
        with pytest.raises(LLMBackendsMisconfigured) as raised:
            ask(client)
    finally:
        client.close()
        server.close()

    assert "redirects to https://login.example.com?next=me@corp.com" in str(raised.value)
    assert "https://corp.com" not in str(raised.value)


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("http://user:Tr0ub4dor@host:99999/v1", "'http://host:99999/v1' is not a valid URL (Port"),
        ("http://user:Tr0ub4dor@[::1/v1", "'http://[::1/v1' is not a valid URL (Invalid IPv6"),
        # Only the credentials are at fault: urlsplit's words would quote them.
        ("http://us[er:Tr0ub4dor@host/v1", "'http://host/v1' is not a valid URL (its user name"),
    ],
)
def test_an_unparsable_url_says_what_is_wrong_without_the_password(url: str, words: str) -> None:
    error = _refusal(_backend_url(url))
    assert words in error.message, error.message
    assert "Tr0ub" not in str(error) and "percent-encoded (%2F" not in error.message


def _settings_with_passwords(*passwords: str) -> Any:
    accounts = [types.SimpleNamespace(password=SecretStr(p)) for p in passwords]
    return types.SimpleNamespace(
        embedding_url=None, llm_backends=[], email_accounts=accounts, database_url=None
    )


def _logged(capsys: pytest.CaptureFixture[str], event: str, **fields: Any) -> dict[str, Any]:
    configure_logging("info", "json", settings=_settings_with_passwords("user", "query", "emails"))
    try:
        structlog.get_logger("sokratos_worker.review").warning(event, **fields)
        (line,) = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x]
    finally:  # (not configure_logging again: it would keep capsys's stream, closed after)
        structlog.reset_defaults()
        logging.getLogger().handlers.clear()
    return line  # type: ignore[no-any-return]


def test_common_word_passwords_rename_no_nested_field(
    capsys: pytest.CaptureFixture[str],
) -> None:
    holder = {"pid": 1, "user": "sokratos", "query": "SELECT 1", "user name": "the user"}
    line = _logged(capsys, "email_account_lock_held", holder=holder)
    assert set(line["holder"]) == {"pid", "user", "query", "[redacted] name"}, line
    assert line["holder"]["user"] == "sokratos"  # values are masked, field names kept
    assert line["holder"]["[redacted] name"] == "the [redacted]"
    line = _logged(capsys, "maintenance_finished", pruned={"processed_emails": 3})
    assert line["pruned"] == {"processed_emails": 3}, line


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("postgresql:///db?host=@pgsock", "names an abstract Unix socket"),
        ("host=@pgsock dbname=db", "names an abstract Unix socket"),
        ("postgresql://w@corp:Tr0ub4dor@db.example/x", "an '@' in its user name or password"),
        ("postgresql://w@corp@db.example/x", "an '@' in its user name or password"),
        ("postgresql://w:Tr0ub@4dor@db.example/x", "an '@' in its user name or password"),
    ],
)
def test_an_at_sign_in_a_database_host_is_refused_for_its_true_reason(
    url: str, words: str
) -> None:
    error = _refusal({"SOKRATOS_DATABASE_URL": url})
    assert error.variable == "SOKRATOS_DATABASE_URL"
    assert words in error.message, error.message
    assert "4dor" not in str(error) and "corp" not in str(error)
