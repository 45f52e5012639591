"""A backend given an api_key and a URL with user:password@ is named at start-up: httpx sends
the URL's credentials as Basic authorization in place of the key (one Authorization header),
and nothing said so: a 401 named the key, which was never sent. Real parts: the command as an
operator runs it, a scripted OpenAI-compatible server on 127.0.0.1 that records the headers.
"""

from __future__ import annotations

import json
from pathlib import Path

from sokratos_worker.config import keys_replaced_by_url_credentials, load_settings
from sokratos_worker.testing.scripted_llm import Reply, ScriptedLLM
from tests.core.test_cli import cli, env_for


def test_a_url_with_credentials_beside_an_api_key_is_named(
    database_url: str, tmp_path: Path
) -> None:
    with ScriptedLLM(chat=lambda request: Reply.chat({"ok": True})) as server:
        with_credentials = server.url.replace("http://", "http://proxyuser:proxypass@", 1)
        backends = [
            {"name": "primary", "url": with_credentials, "model": "m", "api_key": "sk-secret"},
            {"name": "plain", "url": server.url, "model": "m", "api_key": "sk-secret"},
        ]
        proc = cli(
            "check", env=env_for(database_url, tmp_path, SOKRATOS_LLM_BACKENDS=json.dumps(backends))
        )
        sent = {r.headers.get("authorization", "") for r in server.requests}
    warnings = [
        json.loads(line) for line in proc.stderr.splitlines() if '"api_key_not_sent"' in line
    ]
    assert len(warnings) == 1, proc.stderr
    assert warnings[0]["backends"] == ["primary"], warnings
    assert "proxypass" not in proc.stderr and "sk-secret" not in proc.stderr
    # What the warning says is what happens: the first backend got Basic, never the key.
    assert any(a.startswith("Basic ") for a in sent) and "Bearer sk-secret" in sent, sent


def test_a_user_without_a_password_counts_too() -> None:
    """userinfo as httpx reads it: ``user@`` alone is sent as Basic authorization as well."""
    backends = [
        {"name": "plain", "url": "http://127.0.0.1:9/v1", "model": "m", "api_key": "k"},
        {"name": "user", "url": "http://someone@127.0.0.1:9/v1", "model": "m", "api_key": "k"},
        {"name": "keyless", "url": "http://someone@127.0.0.1:9/v1", "model": "m"},
    ]
    settings = load_settings({"SOKRATOS_LLM_BACKENDS": json.dumps(backends)})
    assert keys_replaced_by_url_credentials(settings) == ["user"]
