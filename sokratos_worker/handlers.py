"""The interface between the queue runner and the pipelines that process items."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from sokratos_worker.config import Settings
from sokratos_worker.llm.types import ChatClient, Embedder
from sokratos_worker.model import Effects, Item, NewMemory, Queue
from sokratos_worker.store.connection import Database


class Handler(Protocol):
    """Processes the items of one queue.

    ``handle`` returns the :class:`Effects` to commit, or raises:
    :class:`~sokratos_worker.errors.InvalidPayload` (dead-lettered at once),
    :class:`~sokratos_worker.errors.BackendsUnavailable` (attempt given back, claiming paused),
    any other exception (a failed attempt: retried, dead-lettered on the last).
    It must not write to the database: the store commits its effects with the settle.
    """

    def handle(self, item: Item) -> Effects:
        """Decide what this item becomes."""
        ...

    def final_failure_memories(self, item: Item) -> tuple[NewMemory, ...]:
        """Memories to save with the failed_operations row (distillation's raw archive)."""
        ...

    def probe(self) -> bool:
        """True when the backends this handler needs answer again (ends a pause)."""
        ...


@dataclass(frozen=True)
class HandlerContext:
    """What a handler factory gets: configuration, the database and the backends."""

    settings: Settings
    database: Database
    chat: ChatClient | None
    embedder: Embedder | None


Handlers = Mapping[Queue, Handler]
# Builds the handlers for a process; queues without a handler are never claimed (items wait).
HandlerFactory = Callable[[HandlerContext], Handlers]
