"""End to end against a real model server: llama-cpp-python serving the bundled SmolLM2.

Skipped when the ``local`` extra is missing, except under ``CI=true`` where that is a failure.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from sokratos_worker.config import Settings
from sokratos_worker.llm.chat import FallbackChatClient
from sokratos_worker.llm.local import LOCAL_BACKEND_NAME, LocalModelServer, llama_cpp_installed
from sokratos_worker.llm.probe import probe_backends

pytestmark = [pytest.mark.local_model, pytest.mark.slow, pytest.mark.timeout(240)]


def _require_local_extra() -> None:
    if llama_cpp_installed():
        return
    message = "llama-cpp-python is not installed (the `local` extra)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message + " but CI=true: the end-to-end test must run")
    pytest.skip(message)


class Pet(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=30)


@pytest.fixture(scope="module")
def local_server() -> Iterator[LocalModelServer]:
    _require_local_extra()
    with LocalModelServer(startup_timeout=120) as server:
        yield server


def test_schema_valid_reply_through_json_object_mode(local_server: LocalModelServer):
    config = local_server.backend
    assert config.name == LOCAL_BACKEND_NAME
    assert config.structured_output == "json_object"
    client = FallbackChatClient([config])
    try:
        result = client.complete(
            response_model=Pet,
            system="You reply with JSON only.",
            user="Invent a pet: give its name and its age in years.",
            max_tokens=64,
            purpose="e2e",
        )
    finally:
        client.close()
    assert isinstance(result.value, Pet)
    assert result.backend == LOCAL_BACKEND_NAME
    assert result.completion_tokens is not None
    assert result.completion_tokens > 0


def test_the_health_probe_is_answered_by_a_real_server(local_server: LocalModelServer):
    """The one-token chat probe (no schema) is a request llama-cpp-python's server accepts."""
    client = FallbackChatClient([local_server.backend])
    try:
        assert client.probe() is True
    finally:
        client.close()


def test_check_line_for_the_local_backend(local_server: LocalModelServer):
    (line,) = probe_backends(Settings(), extra_backends=[local_server.backend])
    assert line.component == f"llm:{LOCAL_BACKEND_NAME}"
    assert line.ok, line.detail


def test_check_starts_the_local_model_itself_when_enabled():
    _require_local_extra()
    (line,) = probe_backends(Settings(local_model=True))
    assert line.component == f"llm:{LOCAL_BACKEND_NAME}"
    assert line.ok, line.detail


class Tag(BaseModel):
    word: str


class Note(BaseModel):
    kind: Literal["fact", "event", "preference"]
    save: bool
    salience: int = Field(ge=0, le=10)
    tag: Tag | None = None


def test_generated_gbnf_grammar_constrains_a_real_model(local_server: LocalModelServer):
    # llama-cpp-python's server also takes llama.cpp's `grammar` field: this proves our GBNF.
    config = local_server.backend.model_copy(
        update={"name": "local-grammar", "structured_output": "grammar"}
    )
    client = FallbackChatClient([config])
    try:
        result = client.complete(
            response_model=Note,
            system="You reply with JSON only.",
            user="Classify this message: I like green tea.",
            max_tokens=96,
            purpose="e2e",
        )
    finally:
        client.close()
    assert isinstance(result.value, Note)
    assert result.backend == "local-grammar"


def test_a_port_taken_before_the_server_binds_it_is_replaced(monkeypatch: pytest.MonkeyPatch):
    """free_port() can hand out a port another process binds first; the start tries anew."""
    import socket

    from sokratos_worker.llm import local

    _require_local_extra()
    real = local.free_port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])
        monkeypatch.setattr(local, "free_port", lambda: next(ports, None) or real())
        with LocalModelServer(startup_timeout=120) as server:
            assert server.port != taken.getsockname()[1]
            client = FallbackChatClient([server.backend])
            try:
                assert client.probe() is True
            finally:
                client.close()
