"""Fixtures for the LLM layer: scripted servers on 127.0.0.1 and clients that never sleep."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pydantic import BaseModel, Field

from sokratos_worker.config import BackendConfig
from sokratos_worker.llm.chat import FallbackChatClient, RetryPolicy
from sokratos_worker.testing import ScriptedLLM


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
