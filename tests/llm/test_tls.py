"""TLS: certificates verified by default, a CA file honoured, verification off only on request."""

from __future__ import annotations

import ssl
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import BaseModel

from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.llm.types import NoBackendReachable
from sokratos_worker.testing import ScriptedLLM, json_responder
from tests.llm.conftest import backend


class Ok(BaseModel):
    ok: bool


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.fixture
def tls_server(servers: Callable[..., ScriptedLLM], certificate: tuple[Path, Path]) -> ScriptedLLM:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*certificate)
    return servers(chat=json_responder({"ok": True}), ssl_context=context)


def ask(client: FallbackChatClient) -> str:
    return client.complete(
        response_model=Ok, system="s", user="u", max_tokens=8, purpose="t"
    ).backend


def test_self_signed_certificate_is_refused_by_default(
    tls_server: ScriptedLLM, make_client: Callable[..., FallbackChatClient]
):
    assert tls_server.url.startswith("https://")
    # Refused for its certificate (any unreachable server would raise the same type).
    with pytest.raises(NoBackendReachable, match="CERTIFICATE_VERIFY_FAILED") as refused:
        ask(make_client(backend(tls_server, "tls"), attempts=1))
    assert "set the backend's ca_file" in str(refused.value)
    assert tls_server.count() == 0


def test_ca_file_is_honoured(
    tls_server: ScriptedLLM,
    make_client: Callable[..., FallbackChatClient],
    certificate: tuple[Path, Path],
):
    client = make_client(backend(tls_server, "tls", ca_file=str(certificate[0])))
    assert ask(client) == "tls"


def test_verification_off_is_explicit(
    tls_server: ScriptedLLM, make_client: Callable[..., FallbackChatClient]
):
    assert ask(make_client(backend(tls_server, "tls", tls_verify=False))) == "tls"
