"""What crosses module boundaries: queue items, handler results, memories. No I/O here.

An item's life (``../shared/design/durability.md``)::

    enqueue ─► ready ─claim─► leased ─effects + outcome + delete (one tx)─► gone
                 ▲               │
                 ├─ run_after ◄──┤ failure, attempts < max
                 ├───────────────┤ given back (no backend): the attempt is not counted
                 │               └─► failed_operations + outcome 'failed' or 'archived'
                 │                   + delete (one tx): last attempt, or invalid payload
                 └─ lease expired (the worker died): claimable again, the attempt counted
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import StrEnum
from typing import Any

# `failed retry` enqueues a replay under the original key plus ``#retry-N`` (N counts up).
RETRY_KEY_SUFFIX = re.compile(r"#retry-(\d+)$")
# How a triage detail ends when the model flagged a life-altering event: the main application
# looks for it there (docs/production.md), so whatever is added to a detail goes before it.
PARADIGM_SHIFT_FLAG = "; paradigm shift flagged"


class Queue(StrEnum):
    """The two work queues; the value is the table name."""

    TRIAGE = "pending_triage"
    DISTILLATION = "pending_distillation"


class Outcome(StrEnum):
    """The one recorded end of every item (``work_outcomes.outcome``)."""

    SAVED = "saved"
    SKIPPED = "skipped"
    ARCHIVED = "archived"
    FAILED = "failed"


@dataclass(frozen=True)
class Item:
    """A claimed queue row; ``attempt`` is the attempt this claim counted (1-based)."""

    queue: Queue
    id: int
    payload: dict[str, Any]
    attempt: int
    source: str
    idempotency_key: str | None
    created_at: datetime | None  # None: the producer wrote a time no datetime can hold
    errors: tuple[dict[str, Any], ...] = ()
    # The claim took over an expired lease: an earlier attempt was running when it ended.
    took_over_lease: bool = False

    @property
    def op_type(self) -> str:
        """The failed_operations op_type this item would be recorded under."""
        if self.queue is Queue.DISTILLATION:
            return "distillation"
        return "email_triage" if self.source == "email" else "conversation_triage"

    @property
    def outcome_source(self) -> str:
        """``work_outcomes.source``: conversation, email or distillation (a triage source
        a producer made up is recorded as conversation, as its op_type is)."""
        if self.queue is Queue.DISTILLATION:
            return "distillation"
        return "email" if self.source == "email" else "conversation"

    def origin(self, chunk: int) -> str:
        """The stable identity of the memory chunk this item writes (replays write nothing)."""
        return f"{self.queue.value}:{self.id}:{chunk}"


@dataclass(frozen=True)
class NewMemory:
    """One row for ``memories``; ``origin`` makes the insert idempotent."""

    origin: str
    summary: str
    salience: float
    memory_type: str = "general"
    source: str = "conversation"
    tags: tuple[str, ...] = ()
    embedding: tuple[float, ...] | None = None
    embedding_model: str | None = None
    source_date: datetime | None = None
    pipeline_id: int | None = None
    entities: tuple[str, ...] | None = None
    # The first chunk of a draft: the settle skips it, and the chunks after it that carry no
    # flag, when another item committed a near-duplicate since the handler looked.
    duplicate_check: bool = False
    # With duplicate_check, distillation's wider rule too: any memory within 0.15 (a known fact).
    fact_check: bool = False


@dataclass(frozen=True)
class Supersession:
    """Mark ``old_memory_id`` superseded by the memory written under ``new_origin``."""

    old_memory_id: int
    new_origin: str


@dataclass(frozen=True)
class DraftSupersession:
    """Mark the memory written under ``old_origin``, planned earlier in the same item, superseded
    by the one written under ``new_origin``: neither is in the table before the settle."""

    old_origin: str
    new_origin: str


@dataclass(frozen=True)
class Effects:
    """What a handler decided for one item; the store writes it in one transaction.

    ``existing_memory_ids`` lists memories the item matched without writing (a
    near-duplicate, or a known fact), so ``work_outcomes.memory_ids`` can point at them.
    """

    outcome: Outcome
    detail: str = ""
    memories: tuple[NewMemory, ...] = ()
    supersessions: tuple[Supersession, ...] = ()
    existing_memory_ids: tuple[int, ...] = ()
    backend: str | None = None
    # A later fact of the item contradicting an earlier one: applied after ``supersessions``.
    draft_supersessions: tuple[DraftSupersession, ...] = ()
    # The backends passed over on the way to ``backend``'s answer: the recorded detail ends
    # with it, whatever the settle does to the detail (a near-duplicate found meanwhile).
    passed_over: str = ""

    def noted(self, passed_over: str) -> Effects:
        """These effects with what was passed over ("" notes nothing)."""
        return replace(self, passed_over=passed_over) if passed_over else self

    def recorded_detail(self, detail: str | None = None) -> str:
        """``detail`` (default: this detail), then what was passed over: the outcome's text."""
        text = self.detail if detail is None else detail
        if not self.passed_over:
            return text
        return f"{text}; {self.passed_over}" if text else self.passed_over


@dataclass(frozen=True)
class SettleResult:
    """What a settle did: ``settled`` is False when the lease had been lost."""

    settled: bool
    memory_ids: tuple[int, ...] = field(default_factory=tuple)
    failure_id: int | None = None  # the failed_operations row a dead letter wrote
    outcome: Outcome | None = None  # what was recorded, when the settle changed the handler's


@dataclass(frozen=True)
class CheckLine:
    """One line of ``sokratos-worker check``: what was checked, whether it passed, and why."""

    component: str
    ok: bool
    detail: str
