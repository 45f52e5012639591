"""Both queues get slots while both have ready items (queue_shares.py), and the pure rules."""

from __future__ import annotations

import time
from collections import Counter

import psycopg
import pytest

from sokratos_worker.model import Effects, Outcome, Queue
from sokratos_worker.queue_shares import EMPTY_FOR_S, QueueShares
from sokratos_worker.runner import Runner
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import Database
from tests.support.handlers import ScriptedHandler, fast_settings

T, D = Queue.TRIAGE, Queue.DISTILLATION


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_settle_claims_from_the_queue_with_fewest_items_in_flight() -> None:
    shares = QueueShares([T, D], Clock())
    # Four triage items in flight, one of them settling: distillation has none.
    assert shares.for_settle(T, Counter({T: 4})) is D
    # Two and three (the settling one not counted): the item's own queue.
    assert shares.for_settle(T, Counter({T: 3, D: 3})) is T
    assert shares.for_settle(D, Counter({T: 3, D: 3})) is D
    # A tie goes to the other queue: a single slot (or the odd one) alternates.
    assert shares.for_settle(T, Counter({T: 1})) is D
    assert shares.for_settle(D, Counter({D: 1})) is T
    assert shares.for_settle(T, Counter({T: 3, D: 2})) is D


def test_a_queue_found_empty_is_left_alone_for_a_while() -> None:
    clock = Clock()
    shares = QueueShares([T, D], clock)
    shares.found_empty(D)
    assert shares.for_settle(T, Counter({T: 4})) is T
    clock.now += EMPTY_FOR_S + 0.01
    assert shares.for_settle(T, Counter({T: 4})) is D
    shares.found_empty(D)
    shares.found_items(D)  # a claim got what it asked for: more may be there
    assert shares.for_settle(T, Counter({T: 4})) is D


def test_one_queue_always_claims_from_itself() -> None:
    assert QueueShares([T]).for_settle(T, Counter({T: 8})) is T


def test_free_slots_are_split_equally_the_first_queues_taking_the_rest() -> None:
    shares = QueueShares([T, D])
    assert shares.split(5, [D, T]) == [(D, 3), (T, 2)]
    assert shares.split(1, [T, D]) == [(T, 1), (D, 0)]
    assert shares.split(0, [T, D]) == [(T, 0), (D, 0)]


def _backlog(db: psycopg.Connection, triage: int, distillation: int) -> None:
    """Ready items enqueued over the last week, every triage item older than any archive."""
    db.execute(
        """INSERT INTO pending_triage (payload, idempotency_key, created_at, run_after)
           SELECT jsonb_build_object('exchange', 'user: t' || i || E'\\nassistant: ok',
                                     'behaviour', 'noop'), 'fair-t-' || i, c, c
           FROM (SELECT i, now() - interval '7 days' + i * interval '1 second' AS c
                 FROM generate_series(1, %s) AS i) AS g""",
        (triage,),
    )
    db.execute(
        """INSERT INTO pending_distillation (payload, idempotency_key, created_at, run_after)
           SELECT jsonb_build_object('archive_text', 'archive ' || i, 'behaviour', 'noop'),
                  'fair-d-' || i, c, c
           FROM (SELECT i, now() - interval '1 day' + i * interval '1 second' AS c
                 FROM generate_series(1, %s) AS i) AS g""",
        (distillation,),
    )


def _run_until_outcomes(
    db: psycopg.Connection, database_url: str, *, slots: int, outcomes: int, within_s: float
) -> None:
    """A runner with ``slots`` slots on both queues until ``outcomes`` are recorded (or the
    time is up), then stopped."""
    database = Database(database_url, size=slots + 2)
    handler = ScriptedHandler()
    runner = Runner(
        settings=fast_settings(concurrency=slots),
        database=database,
        handlers={T: handler, D: handler},
        worker_id=f"shares-{slots}",
    )
    runner.start()
    try:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            done = db.execute("SELECT count(*) FROM work_outcomes").fetchone()[0]  # type: ignore[index]
            if done >= outcomes:
                break
            time.sleep(0.05)
    finally:
        runner.request_stop()
        runner.shutdown(5)
        database.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("slots", [1, 4])
def test_a_triage_backlog_does_not_keep_distillation_from_every_slot(
    db: psycopg.Connection, database_url: str, slots: int
) -> None:
    """Under load a slot claims its next item with its settle; it used to claim from its own
    queue only, so 2,000 older triage items took all 4 slots and 200 archives got none
    (a review's daemon run: 0 of 4,053 outcomes) until triage was empty. One slot (one local
    model) alternates: a tie kept its own queue, and archives got none either."""
    _backlog(db, triage=2000, distillation=200)
    _run_until_outcomes(db, database_url, slots=slots, outcomes=400, within_s=90)
    by_queue = dict(db.execute("SELECT queue, count(*) FROM work_outcomes GROUP BY 1").fetchall())
    total = sum(by_queue.values())
    assert total >= 400, by_queue
    # About half each while both have items; a quarter is the least a handled queue gets.
    assert by_queue.get("pending_distillation", 0) >= total // 4, by_queue
    # Nothing lost or doubled on the way: every item is either done or still queued.
    left = db.execute(
        "SELECT (SELECT count(*) FROM pending_triage) + (SELECT count(*) FROM pending_distillation)"
    ).fetchone()[0]  # type: ignore[index]
    assert left + total == 2200


def test_a_settle_claims_across_tables(db: psycopg.Connection) -> None:
    """The settle of one queue's item claiming the next from the other queue (review R3): an
    item with the same id in the other table is claimable (``id <>`` is for one table), each
    keeps its own source, and a lease taken over records the attempt that died."""
    db.execute(
        "INSERT INTO pending_triage (id, payload, idempotency_key, source) VALUES"
        " (7, '{\"exchange\": \"user: a\\nassistant: b\"}', 't7', 'email'),"
        " (8, '{\"exchange\": \"user: a\\nassistant: b\"}', 't8', 'conversation')"
    )
    db.execute(
        "INSERT INTO pending_distillation (id, payload, idempotency_key, attempts, lease_owner,"
        " lease_expires_at) VALUES (7, '{\"archive_text\": \"x\"}', 'd7', 1, 'dead',"
        " now() - interval '1 minute')"
    )
    [t7] = store.claim(db, T, owner="w", limit=1, lease_s=30)
    assert t7.id == 7
    result, [d7] = store.settle_success(
        db, t7, Effects(Outcome.SKIPPED), owner="w", claim_from=D
    )
    assert result.settled
    assert (d7.queue, d7.id, d7.source, d7.attempt, d7.took_over_lease) == (
        D, 7, "distillation", 2, True,
    )  # fmt: skip
    assert store.died_in(d7, 1)
    result, [t8] = store.settle_success(
        db, d7, Effects(Outcome.SKIPPED), owner="w", claim_from=T
    )
    assert result.settled
    assert (t8.queue, t8.id, t8.source, t8.attempt) == (T, 8, "conversation", 1)
    rows = db.execute(
        "SELECT queue, item_id, source, attempts FROM work_outcomes ORDER BY id"
    ).fetchall()
    assert rows == [("pending_triage", 7, "email", 1), ("pending_distillation", 7, "distillation", 2)]
    assert db.execute("SELECT lease_owner, attempts FROM pending_triage WHERE id = 8").fetchone() == (
        "w",
        1,
    )


@pytest.mark.timeout(60)
def test_a_slot_whose_claim_finds_nothing_is_refilled_from_the_other_queue_at_once(
    db: psycopg.Connection, database_url: str
) -> None:
    """One slot, and a settle's claim that finds nothing (the other queue's archive is not
    ready yet; later triage runs out while the archive, its backoff over, is ready: no
    NOTIFY): the dispatcher fills the slot at once from whichever queue has an item, not
    after its idle wait of 5 s."""
    for i in range(3):
        db.execute(
            "SELECT sokratos_enqueue_triage(%s::jsonb, %s)",
            (f'{{"exchange": "user: {i}\\nassistant: ok", "behaviour": "sleep:0.3"}}', f"t{i}"),
        )
    db.execute(
        "INSERT INTO pending_distillation (payload, idempotency_key, run_after)"
        " VALUES ('{\"archive_text\": \"x\", \"behaviour\": \"noop\"}', 'd0',"
        " now() + interval '0.5 seconds')"
    )
    _run_until_outcomes(db, database_url, slots=1, outcomes=4, within_s=30)
    [(count, first, last)] = db.execute(
        "SELECT count(*), min(decided_at), max(decided_at) FROM work_outcomes"
    ).fetchall()
    assert count == 4, count
    # Four items, about 1 s of work and waiting in all; each idle wait was 5 s.
    span = (last - first).total_seconds()
    assert span < 2.5, span
