"""tick_finished's counts say what happened to each claim: every item counted as claimed
has its ending counted too, and a settle that changed nothing tells the queue shares nothing.

Found by a reader (2026-12-06): items released at the end of the stop's grace were never
counted as given_back; claims given back because a pause began were counted as given_back but
never as claimed; a retry or give-back whose answer was lost was not counted (and one by the
worker that took the item over was taken for ours); a fenced settle (which claims nothing) marked the queue it would have
claimed from as empty for a second.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest
import structlog

from sokratos_worker.errors import BackendsUnavailable, ItemError
from sokratos_worker.model import Effects, Item, NewMemory, Outcome, Queue
from sokratos_worker.runner import Runner
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import Database
from tests.support.db import enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings


@pytest.fixture
def database(database_url: str) -> Iterator[Database]:
    pool = Database(database_url, size=4)
    yield pool
    pool.close()


def _runner(database: Database, *queues: Queue, concurrency: int = 4) -> Runner:
    handler = ScriptedHandler()
    return Runner(
        settings=fast_settings(concurrency=concurrency),
        database=database,
        handlers=dict.fromkeys(queues or (Queue.TRIAGE,), handler),
        worker_id="w",
    )


def _counts(runner: Runner, queue: Queue = Queue.TRIAGE) -> dict[str, int]:
    return dict(runner.take_stats().counts.get(queue.value, {}))


def test_an_item_still_running_at_the_end_of_the_grace_is_counted_as_given_back(
    db: psycopg.Connection, database: Database
) -> None:
    enqueue_many(db, 1, behaviour="sleep:3")
    runner = _runner(database, concurrency=1)
    runner.start(drain_only=True, budget_s=5)
    deadline = time.monotonic() + 10
    while runner.inflight_count() == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert runner.shutdown(0.2) == 1
    assert _counts(runner) == {"claimed": 1, "given_back": 1}
    assert db.execute("SELECT attempts, lease_owner FROM pending_triage").fetchall() == [
        (0, None)
    ]
    time.sleep(3.5)  # the slot's run ends; its settle is fenced and counts nothing
    assert _counts(runner) == {}


def test_claims_given_back_because_a_pause_began_are_counted_as_claimed(
    db: psycopg.Connection, database: Database
) -> None:
    """The dispatcher's claim and a settle's next-item claim, both after the pause began."""
    enqueue_many(db, 3)
    runner = _runner(database)
    runner._worker_state.pause("every backend unreachable")
    assert runner._claim_for_idle_slots() == (4, 0)
    assert _counts(runner) == {"claimed": 3, "given_back": 3}

    [item] = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    assert runner._track_claimed([item]) == [item]
    runner.take_stats()
    next_item, _ = runner._settle_and_claim(
        item, Effects(Outcome.SKIPPED), structlog.get_logger().bind(), time.monotonic(),
        claim_from=Queue.TRIAGE,
    )
    assert next_item is None
    assert _counts(runner) == {"skipped": 1, "claimed": 1, "given_back": 1}


def test_a_fenced_settle_does_not_mark_the_other_queue_empty(
    db: psycopg.Connection, database: Database
) -> None:
    """Another worker took the item over: the settle with effects rolls back and claims
    nothing, so it says nothing about whether the distillation queue has items."""
    enqueue_many(db, 1)
    enqueue_many(db, 3, queue="pending_distillation", prefix="d")
    runner = _runner(database, Queue.TRIAGE, Queue.DISTILLATION)
    [item] = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    runner._track_claimed([item])
    db.execute("UPDATE pending_triage SET lease_expires_at = now() - interval '1 second'")
    store.claim(db, Queue.TRIAGE, owner="other", limit=1, lease_s=60)
    memory = NewMemory(origin=item.origin(0), summary="m", salience=5)
    next_item, kind = runner._settle_and_claim(
        item, Effects(Outcome.SAVED, memories=(memory,)), structlog.get_logger().bind(),
        time.monotonic(), claim_from=Queue.DISTILLATION,
    )
    assert (next_item, kind) == (None, "lease_lost")
    assert runner._shares._empty_until.get(Queue.DISTILLATION, 0.0) <= time.monotonic()


def _fail(runner: Runner, item: Item, exc: Exception) -> str:
    return runner._settler.fail(item, exc, ScriptedHandler(), structlog.get_logger().bind())


def test_a_retry_or_give_back_that_landed_before_its_answer_was_lost_is_counted(
    db: psycopg.Connection, database: Database
) -> None:
    """The write committed, the connection dropped before its answer: the settle, tried
    again, is fenced, finds the row released under this attempt, and counts it."""
    enqueue_many(db, 2)
    runner = _runner(database)
    first, second = store.claim(db, Queue.TRIAGE, owner="w", limit=2, lease_s=60)
    runner._track_claimed([first, second])
    runner.take_stats()
    assert store.schedule_retry(db, first, owner="w", error="x", delay_s=60)
    assert _fail(runner, first, ItemError("scripted")) == "retry"
    assert store.give_back(db, second, owner="w")
    assert _fail(runner, second, BackendsUnavailable("every backend down")) == "released"
    assert _counts(runner) == {"retried": 1, "given_back": 1}


def test_a_release_by_the_worker_that_took_the_item_over_is_not_counted_as_ours(
    db: psycopg.Connection, database: Database
) -> None:
    """Our lease ran out, another worker claimed the item (attempt 2) and scheduled a retry:
    our failed attempt's settle is fenced and says the lease was lost, counting nothing."""
    enqueue_many(db, 1)
    runner = _runner(database)
    [ours] = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    runner._track_claimed([ours])
    runner.take_stats()
    db.execute("UPDATE pending_triage SET lease_expires_at = now() - interval '1 second'")
    [theirs] = store.claim(db, Queue.TRIAGE, owner="other", limit=1, lease_s=60)
    assert store.schedule_retry(db, theirs, owner="other", error="x", delay_s=60)
    assert _fail(runner, ours, ItemError("scripted")) == "lease_lost"
    assert _counts(runner) == {}
