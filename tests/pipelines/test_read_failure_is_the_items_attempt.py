"""A pipeline read's database outage gives the attempt back, at most
DATABASE_GIVE_BACKS_PER_ITEM times per item; after that it is the item's attempt. Found by two
reviews: a read whose every run killed its own server process (57P01; 53200 out of memory,
40P01 a deadlock are classed alike) was given back for ever, 1,175 claims in 10 s with
SOKRATOS_MAX_ATTEMPTS=3 and never in failed_operations; the fix that followed (a SELECT 1 right
after decided) dead-lettered items on their last attempt for a PostgreSQL restart under ~10 s.
And a read the database answered (a full pool) is the item's attempt, not a default threshold
(it decided a salience-4 exchange SKIPPED where adaptive_params said 3)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from sokratos_worker.model import Queue
from sokratos_worker.runner import Runner
from sokratos_worker.settle import DATABASE_GIVE_BACKS_PER_ITEM
from sokratos_worker.store.connection import Database
from tests.pipelines.conftest import enqueue, outcome
from tests.pipelines.fakes import FakeChat
from tests.pipelines.test_read_outage_gives_back import (
    EXCHANGE,
    VERDICT,
    FirstReadFindsThePoolFull,
    _handler,
    _threshold_3,
)
from tests.support.daemon import wait_until
from tests.support.handlers import fast_settings

pytestmark = pytest.mark.postgres


class ReadKillsItsBackend:
    """The pipeline's reads kill their own server process (57P01, as a fast restart ends
    every session) while the server stays up: the first ``times`` reads (all by default)."""

    def __init__(self, real: Database, times: int | None = None) -> None:
        self.real = real
        self.left = times

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        with self.real.connection() as conn:
            if self.left is None or self.left > 0:
                self.left = None if self.left is None else self.left - 1
                conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
            yield conn


def _run_until_decided(
    db: psycopg.Connection,
    database: Database,
    reads: object,
    chat: FakeChat,
    item_id: int,
    *,
    max_attempts: int = 3,
) -> dict[str, int]:
    """Run the runner until the item has an outcome (20 s at most); its triage counts."""
    runner = Runner(
        settings=fast_settings(concurrency=1, max_attempts=max_attempts),
        database=database,
        handlers={Queue.TRIAGE: _handler(reads, chat)},
        worker_id="test",
    )
    runner.start()
    try:
        decided = wait_until(lambda: _attempts(db, item_id) is not None, timeout=20)
    finally:
        runner.shutdown(5)
    counts = dict(runner.take_stats().counts.get(Queue.TRIAGE.value, {}))
    assert decided, f"no outcome after 20 s: {counts}"
    return counts


def _attempts(db: psycopg.Connection, item_id: int) -> tuple[int, ...] | None:
    return db.execute(
        "SELECT attempts FROM work_outcomes WHERE queue = 'pending_triage' AND item_id = %s",
        (item_id,),
    ).fetchone()


def test_a_read_that_kills_its_own_backend_every_time_ends_in_failed_operations(
    db: psycopg.Connection, database: Database
) -> None:
    item_id = enqueue(
        db, "SELECT sokratos_enqueue_triage(%s::jsonb)", json.dumps({"exchange": EXCHANGE})
    )
    chat = FakeChat().script("conversation_triage", *([VERDICT] * 100))
    counts = _run_until_decided(db, database, ReadKillsItsBackend(database), chat, item_id)
    assert counts.get("given_back") == DATABASE_GIVE_BACKS_PER_ITEM, counts
    assert counts.get("retried") == 2, counts
    kind, _, detail = outcome(db, "pending_triage", item_id)
    assert kind == "failed", detail
    assert _attempts(db, item_id) == (3,)
    failed = db.execute(
        "SELECT error_message FROM failed_operations WHERE source_queue = 'pending_triage'"
        " AND item_id = %s",
        (item_id,),
    ).fetchone()
    assert failed is not None and "terminating connection" in failed[0], failed


def test_a_read_that_finds_the_pool_full_is_the_items_attempt_not_a_default(
    db: psycopg.Connection, database: Database
) -> None:
    _threshold_3(db)
    item_id = enqueue(
        db, "SELECT sokratos_enqueue_triage(%s::jsonb)", json.dumps({"exchange": EXCHANGE})
    )
    chat = FakeChat().script("conversation_triage", VERDICT, VERDICT)
    counts = _run_until_decided(
        db, database, FirstReadFindsThePoolFull(database), chat, item_id
    )
    assert counts.get("given_back", 0) == 0 and counts.get("retried") == 1, counts
    kind, memory_ids, detail = outcome(db, "pending_triage", item_id)
    # Decided on adaptive_params (3), not on the default 5 that would skip salience 4.
    assert kind == "saved" and len(memory_ids) == 1, (kind, detail)
    assert "threshold 3" in detail, detail
    assert _attempts(db, item_id) == (2,)  # the full pool's attempt counted


def test_a_read_cut_by_a_restart_on_the_last_attempt_is_given_back_not_dead_lettered(
    db: psycopg.Connection, database: Database
) -> None:
    """A fast restart (pg_ctl -m fast: every session ends with 57P01, the server back in under
    a second) while the read ran: not the item's fault, even on its last attempt (review:
    the SELECT 1 rule dead-lettered it, the server being back by the probe)."""
    _threshold_3(db)
    item_id = enqueue(
        db, "SELECT sokratos_enqueue_triage(%s::jsonb)", json.dumps({"exchange": EXCHANGE})
    )
    chat = FakeChat().script("conversation_triage", VERDICT, VERDICT)
    counts = _run_until_decided(
        db, database, ReadKillsItsBackend(database, times=1), chat, item_id, max_attempts=1
    )
    assert counts.get("given_back") == 1 and counts.get("retried", 0) == 0, counts
    kind, memory_ids, detail = outcome(db, "pending_triage", item_id)
    assert kind == "saved" and len(memory_ids) == 1, (kind, detail)
    assert _attempts(db, item_id) == (1,)
    assert db.execute("SELECT count(*) FROM failed_operations").fetchone() == (0,)
