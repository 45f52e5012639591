"""Fakes of the LLM protocols (llm/types.py) for pipeline tests: scripted replies, fixed vectors."""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel

from sokratos_worker.llm.types import BackendState, ChatResult

T = TypeVar("T", bound=BaseModel)
DIM = 8


@dataclass
class Call:
    purpose: str
    system: str
    user: str
    max_tokens: int


@dataclass
class FakeChat:
    """Answers each purpose from its own queue of replies (a dict, or an exception to raise)."""

    replies: dict[str, deque[Any]] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    backend: str = "fake"
    healthy: bool = True

    def script(self, purpose: str, *replies: Any) -> FakeChat:
        self.replies.setdefault(purpose, deque()).extend(replies)
        return self

    def complete(
        self, *, response_model: type[T], system: str, user: str, max_tokens: int, purpose: str
    ) -> ChatResult[T]:
        self.calls.append(Call(purpose, system, user, max_tokens))
        queue = self.replies.get(purpose)
        if not queue:
            raise AssertionError(f"no scripted reply for {purpose}")
        reply = queue.popleft()
        if isinstance(reply, BaseException):
            raise reply
        return ChatResult(value=response_model.model_validate(reply), backend=self.backend)

    def probe(self) -> bool:
        return self.healthy

    def states(self) -> list[BackendState]:
        return [BackendState(self.backend, "closed")]

    def purposes(self) -> list[str]:
        return [c.purpose for c in self.calls]


def unit(values: Sequence[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in values))
    return [v / norm for v in values]


def hashed_vector(text: str) -> list[float]:
    """A deterministic vector far (on average) from other texts' vectors."""
    digest = hashlib.sha256(text.encode()).digest()
    return unit([b - 127.5 for b in digest[:DIM]])


def near(base: Sequence[float], distance: float) -> list[float]:
    """A unit vector at roughly ``distance`` cosine distance from unit vector ``base``."""
    other = [0.0] * len(base)
    # A direction orthogonal to base: rotate within the plane of base and an axis.
    axis = min(range(len(base)), key=lambda i: abs(base[i]))
    other[axis] = 1.0
    dot = sum(a * b for a, b in zip(base, other, strict=True))
    ortho = unit([o - dot * b for o, b in zip(other, base, strict=True)])
    cos = 1.0 - distance
    sin = math.sqrt(max(0.0, 1.0 - cos * cos))
    return [cos * b + sin * o for b, o in zip(base, ortho, strict=True)]


@dataclass
class FakeEmbedder:
    """Vectors from a table (by exact text, or by a prefix ending in '*'), else hashed."""

    vectors: dict[str, list[float]] = field(default_factory=dict)
    model: str = "fake-embed"
    dim: int = DIM
    error: BaseException | None = None
    embedded: list[str] = field(default_factory=list)

    def vector(self, text: str) -> list[float]:
        if text in self.vectors:
            return self.vectors[text]
        for key, vec in self.vectors.items():
            if key.endswith("*") and text.startswith(key[:-1]):
                return vec
        return hashed_vector(text)

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        if self.error is not None:
            raise self.error
        self.embedded.extend(texts)
        return [self.vector(t) for t in texts]

    def embed_splitting(self, text: str) -> list[tuple[str, list[float]]]:
        return [(text, self.embed([text])[0])]

    def probe(self) -> bool:
        return self.error is None
