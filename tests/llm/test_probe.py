"""``probe_backends``: one check line per backend and for the embeddings, over real HTTP."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from pydantic import BaseModel
from structlog.testing import capture_logs

from sokratos_worker.config import Settings
from sokratos_worker.llm import FallbackChatClient, HttpEmbedder, build_chat_client, build_embedder
from sokratos_worker.llm.http import without_credentials
from sokratos_worker.llm.probe import probe_backends
from sokratos_worker.testing import Reply, ScriptedLLM, json_responder

Servers = Callable[..., ScriptedLLM]


def settings(backends: list[dict[str, object]], **kwargs: object) -> Settings:
    return Settings(llm_backends=backends, **kwargs)  # type: ignore[arg-type]


def test_every_backend_and_the_embeddings_get_a_line(servers: Servers):
    good = servers(chat=json_responder({"ok": True}), models=["qwen"])
    wrong_model = servers(chat=json_responder({"ok": True}), models=["other"])
    broken = servers(models=["qwen"])
    broken.on("/v1/chat/completions", lambda r: Reply.chat("not json"))
    embed = servers(embed_dim=16)
    lines = probe_backends(
        settings(
            [
                {"name": "good", "url": good.url, "model": "qwen"},
                {"name": "wrong", "url": wrong_model.url, "model": "qwen"},
                {"name": "broken", "url": broken.url, "model": "qwen"},
                {"name": "down", "url": "http://127.0.0.1:9/v1", "model": "qwen", "timeout": 2},
            ],
            embedding_url=embed.url,
            embedding_model="e",
            embedding_dim=16,
        )
    )
    by_name = {line.component: line for line in lines}
    assert list(by_name) == ["llm:good", "llm:wrong", "llm:broken", "llm:down", "embeddings"]
    assert by_name["llm:good"].ok
    assert not by_name["llm:wrong"].ok
    assert "not offered" in by_name["llm:wrong"].detail
    assert not by_name["llm:broken"].ok
    assert "structured call failed" in by_name["llm:broken"].detail
    assert not by_name["llm:down"].ok
    assert "unreachable" in by_name["llm:down"].detail
    assert by_name["embeddings"].ok
    assert wrong_model.count() == 0  # no structured call when the model is missing
    assert json.dumps(good.bodies()[0]["response_format"])  # a structured call was made


def test_embedding_dimension_mismatch_fails_the_check(servers: Servers):
    embed = servers(embed_dim=8)
    lines = probe_backends(
        settings([], embedding_url=embed.url, embedding_model="e", embedding_dim=16)
    )
    assert [(line.component, line.ok) for line in lines] == [("embeddings", False)]
    assert "SOKRATOS_EMBEDDING_DIM is 16" in lines[0].detail


def test_unauthorised_backend_names_the_key(servers: Servers):
    srv = servers()
    srv.on("/v1/models", lambda r: Reply.error(401, "no key"))
    (line,) = probe_backends(settings([{"name": "x", "url": srv.url, "model": "m"}]))
    assert not line.ok
    assert "api_key" in line.detail


def test_factories(servers: Servers):
    srv = servers(embed_dim=4)
    assert build_chat_client(settings([])) is None
    assert build_embedder(settings([])) is None
    client = build_chat_client(settings([{"name": "a", "url": srv.url, "model": "m"}]))
    embedder = build_embedder(
        settings([], embedding_url=srv.url, embedding_model="e", embedding_dim=4)
    )
    assert isinstance(client, FallbackChatClient)
    assert isinstance(embedder, HttpEmbedder)
    assert len(embedder.embed(["hello"])[0]) == 4
    client.close()
    embedder.close()


def test_tls_verify_off_is_logged(servers: Servers):
    srv = servers()
    with capture_logs() as logs:
        client = build_chat_client(
            settings([{"name": "a", "url": srv.url, "model": "m", "tls_verify": False}])
        )
    assert isinstance(client, FallbackChatClient)
    client.close()
    assert {"event": "tls_verification_disabled", "backend": "a", "log_level": "warning"} in logs


@pytest.mark.parametrize("secret", ["sk-very-secret"])
def test_logs_never_carry_prompts_replies_or_keys(servers: Servers, secret: str):
    srv = servers()
    srv.script(Reply.chat("PRIVATE-REPLY"), Reply.error(500, "x"))
    srv.on("/v1/chat/completions", json_responder({"ok": True}))
    client = build_chat_client(
        settings([{"name": "a", "url": srv.url, "model": "m", "api_key": secret}])
    )
    assert isinstance(client, FallbackChatClient)

    class Ok(BaseModel):
        ok: bool

    with capture_logs() as logs:
        client.complete(
            response_model=Ok,
            system="PRIVATE-SYSTEM",
            user="PRIVATE-USER",
            max_tokens=8,
            purpose="t",
        )
    client.close()
    text = repr(logs)
    for private in ("PRIVATE", secret):
        assert private not in text
    assert any(e["event"] == "llm_call_finished" for e in logs)


def test_an_unreachable_backend_says_why_without_its_url_credentials() -> None:
    [line] = probe_backends(
        settings(
            [
                {
                    "name": "proxy",
                    "url": "http://bob:SECRETPW@127.0.0.1:9/v1",
                    "model": "qwen",
                    "timeout": 2,
                }
            ]
        )
    )[:1]
    assert not line.ok
    assert "SECRETPW" not in line.detail and "bob" not in line.detail
    assert line.detail.startswith("unreachable at http://127.0.0.1:9/v1: ConnectError: ")
    assert "refused" in line.detail.lower()  # the reason, not the class alone


def test_without_credentials_keeps_everything_else() -> None:
    assert without_credentials("https://u:p@h:8/v1/x") == "https://h:8/v1/x"
    assert without_credentials("https://h/v1?a=b@c") == "https://h/v1?a=b@c"
    assert without_credentials("http://h:8") == "http://h:8"


def test_a_login_page_instead_of_a_completion_says_what_came_back(servers: Servers):
    srv = servers(models=["m"])
    page = Reply(raw=b"<html><title>Sign in</title></html>", headers={"Content-Type": "text/html"})
    for path in ("/v1/chat/completions", "probe"):
        srv.on(path, lambda r: page)
    (line,) = probe_backends(settings([{"name": "x", "url": srv.url, "model": "m"}]))
    assert not line.ok
    assert "not JSON (text/html: '<html><title>Sign in</title></html>')" in line.detail, line
