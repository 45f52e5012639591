"""A failed attempt whose settle is abandoned (the database away past the lease): the item's
newer claim, adopted while it ran, stays tracked, and nothing is counted as given back.

Found by reading (2026-12-06): the abandoned settle untracked the item, which handed the
adopted claim to a slot, and then the failure path untracked it again, dropping that newer
claim from the registry while it ran: no renewal, and the renewer's orphan release could
give its lease back mid-run. And a give-back that never landed (abandoned, or fenced by
another worker's claim) was counted as given_back in tick_finished.
"""

from __future__ import annotations

import psycopg
import structlog

from sokratos_worker.errors import BackendsUnavailable, ItemError
from sokratos_worker.model import Queue
from sokratos_worker.runner import Runner
from sokratos_worker.settle import ABANDONED
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import Database
from tests.support.db import enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings
from tests.support.ports import unused_port


def _runner_without_database(lease: float = 1) -> tuple[Runner, Database, ScriptedHandler]:
    """A runner whose database is down: every settle waits until 0.8 x lease, then gives up."""
    down = Database(f"postgresql://nobody@127.0.0.1:{unused_port()}/x?connect_timeout=2", size=1)
    handler = ScriptedHandler()
    runner = Runner(
        settings=fast_settings(lease=lease),
        database=down,
        handlers={Queue.TRIAGE: handler},
        worker_id="w",
    )
    return runner, down, handler


def test_the_claim_adopted_while_it_ran_stays_tracked(db: psycopg.Connection) -> None:
    """Claimed, its lease ran out, claimed again by the same worker (adopted); the first
    run's failure cannot be written: the second claim is still in flight afterwards."""
    enqueue_many(db, 1)
    [first] = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    db.execute("UPDATE pending_triage SET lease_expires_at = now() - interval '1 second'")
    [again] = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    assert (again.id, again.attempt) == (first.id, 2)
    runner, down, handler = _runner_without_database()
    try:
        assert runner._track_claimed([first]) == [first]
        assert runner._track_claimed([again]) == []  # adopted by the run in progress
        bound = structlog.get_logger().bind(item_id=first.id)
        ended = runner._settler.fail(first, ItemError("scripted"), handler, bound)
    finally:
        down.close()
    assert ended == ABANDONED
    assert runner.inflight_count() == 1  # the newer claim, handed to a slot, is tracked
    assert runner._handoff.get_nowait() == again


def test_a_give_back_that_never_landed_is_not_counted(db: psycopg.Connection) -> None:
    """Every backend down, and the database too: the item stays leased (its lease runs out),
    so tick_finished must not say it was given back."""
    enqueue_many(db, 1)
    [item] = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    runner, down, handler = _runner_without_database()
    try:
        runner._track_claimed([item])
        bound = structlog.get_logger().bind(item_id=item.id)
        ended = runner._settler.fail(item, BackendsUnavailable("every backend down"), handler, bound)
    finally:
        down.close()
    assert ended == ABANDONED
    assert "given_back" not in runner.take_stats().counts[Queue.TRIAGE]
    assert db.execute("SELECT lease_owner, attempts FROM pending_triage").fetchall() == [("w", 1)]


def test_a_give_back_fenced_by_another_workers_claim_is_not_counted(
    db: psycopg.Connection, database_url: str
) -> None:
    """The lease ran out and another worker holds the item: our give-back changes nothing."""
    enqueue_many(db, 1)
    [item] = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    db.execute("UPDATE pending_triage SET lease_expires_at = now() - interval '1 second'")
    store.claim(db, Queue.TRIAGE, owner="other", limit=1, lease_s=60)
    database = Database(database_url, size=1)
    handler = ScriptedHandler()
    runner = Runner(
        settings=fast_settings(), database=database, handlers={Queue.TRIAGE: handler},
        worker_id="w",
    )
    try:
        runner._track_claimed([item])
        bound = structlog.get_logger().bind(item_id=item.id)
        ended = runner._settler.fail(item, BackendsUnavailable("every backend down"), handler, bound)
    finally:
        database.close()
    assert ended == "lease_lost"
    assert "given_back" not in runner.take_stats().counts[Queue.TRIAGE]
    assert db.execute("SELECT lease_owner, attempts FROM pending_triage").fetchall() == [
        ("other", 2)
    ]
