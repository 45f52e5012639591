"""Fixtures for the LLM layer: scripted servers on 127.0.0.1 and clients that never sleep."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pydantic import BaseModel, Field

from sokratos_worker.config import BackendConfig
from sokratos_worker.llm.chat import FallbackChatClient, RetryPolicy
from sokratos_worker.testing import ScriptedLLM
from sokratos_worker.testing.scripted_llm import PROBE, Reply, Request, Responder


class FakeClock:
    """A monotonic clock tests move by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def sleeps() -> list[float]:
    """Every delay the retry loop asked for, in order (nothing really sleeps)."""
    return []


@pytest.fixture
def servers() -> Iterator[Callable[..., ScriptedLLM]]:
    """Start any number of scripted servers; all are closed after the test."""
    started: list[ScriptedLLM] = []

    def start(**kwargs: Any) -> ScriptedLLM:
        server = ScriptedLLM(**kwargs).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


def backend(server: ScriptedLLM, name: str, **overrides: Any) -> BackendConfig:
    """A backend config pointing at ``server``."""
    values: dict[str, Any] = {"name": name, "url": server.url, "model": "scripted", "timeout": 5}
    values.update(overrides)
    return BackendConfig(**values)


@pytest.fixture
def make_client(
    sleeps: list[float], clock: FakeClock
) -> Iterator[Callable[..., FallbackChatClient]]:
    clients: list[FallbackChatClient] = []

    def make(*configs: BackendConfig, **policy: Any) -> FallbackChatClient:
        client = FallbackChatClient(
            configs, policy=RetryPolicy(**policy), sleep=sleeps.append, clock=clock
        )
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


class Scored(BaseModel):
    """A small structured reply, like the triage verdict."""

    score: float = Field(ge=0, le=10)
    summary: str


def ask(client: FallbackChatClient) -> Any:
    """One structured call, as a pipeline makes it."""
    return client.complete(
        response_model=Scored, system="sys", user="user text", max_tokens=200, purpose="test"
    )


def scripted(servers: Callable[..., ScriptedLLM], responder: Responder) -> ScriptedLLM:
    """A scripted server answering chat requests and the probe with ``responder``, as a real
    server answers both the same way."""
    server = servers(chat=responder)
    server.on(PROBE, responder)
    return server


class Contradiction(BaseModel):
    """The contradiction check's reply: the request type some backends refuse."""

    contradicts: bool
    explanation: str


def schema_name(request: Request) -> str | None:
    """The name of the JSON schema a chat request asks for, if it asks for one."""
    body = request.body if isinstance(request.body, dict) else {}
    response_format = body.get("response_format")
    if isinstance(response_format, dict):
        name = response_format.get("json_schema", {}).get("name")
        return name if isinstance(name, str) else None
    return None


def refuses_contradiction(request: Request) -> Reply:
    """llama.cpp's 400 for a schema its grammar converter cannot take (Contradiction's); the
    minimal ``{"ok": bool}`` request and any other are served."""
    if schema_name(request) == "Contradiction":
        return Reply.error(400, "JSON schema conversion failed", type="invalid_request_error")
    return Reply.chat({"ok": True})


def switchable(state: dict[str, str]) -> Responder:
    """A backend whose ``state["mode"]`` the test changes: ``down`` (503 to everything), its
    key ``expired`` (401 to everything), ``refuses`` the Contradiction type, or ``serves``
    every request."""

    def answer(request: Request) -> Reply:
        if state["mode"] == "down":
            return Reply.error(503, "Loading model")
        if state["mode"] == "expired":
            return Reply.error(401, "invalid api key", type="authentication_error")
        if state["mode"] == "refuses":
            return refuses_contradiction(request)
        if schema_name(request) == "Contradiction":
            return Reply.chat({"contradicts": False, "explanation": "no"})
        return Reply.chat({"ok": True})

    return answer


def primary_and_fallback(
    servers: Callable[..., ScriptedLLM],
    make_client: Callable[..., FallbackChatClient],
    primary: Responder,
    fallback: Responder,
) -> FallbackChatClient:
    """A client with one attempt over two scripted backends, ``primary`` then ``fallback``."""
    return make_client(
        backend(scripted(servers, primary), "primary"),
        backend(scripted(servers, fallback), "fallback"),
        attempts=1,
    )


def ask_contradiction(client: FallbackChatClient, user: str = "u") -> object:
    """One contradiction check: its reply, or the exception it raised."""
    try:
        return client.complete(
            response_model=Contradiction, system="s", user=user, max_tokens=64, purpose="c"
        )
    except Exception as exc:
        return exc
