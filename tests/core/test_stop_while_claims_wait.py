"""Claims that wait behind a lock: at a stop, and for the lease they grant.

A claim statement can wait behind a table or row lock (a migration, VACUUM FULL, a long
transaction, an admin's ``SELECT ... FOR UPDATE``: the cases RELEASE_STATEMENT_TIMEOUT_MS,
DISPATCHER_STALL_S and ``run --once``'s stop deadline exist for). durability.md: at SIGTERM
the worker stops claiming and releases the leases of what did not finish (attempt given
back); a crash costs an attempt only for items that were really running; and a claimed item
stays reserved for SOKRATOS_LEASE, so only a lease lost while the call ran lets another
worker take it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from sokratos_worker.model import Item, Queue
from sokratos_worker.runner import Runner
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import Database
from tests.support.db import count, enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings
from tests.support.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.postgres]


def _lock_waiters(db: psycopg.Connection) -> int:
    return count(
        db,
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )


def _wait_for(predicate: Any, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def _stop_while_a_claim_of_two_waits(
    db: psycopg.Connection, database_url: str
) -> tuple[Database, Runner, threading.Thread]:
    """Two items; the dispatcher's claim waits behind a table lock (a migration, a long
    transaction) when the stop comes, and lands once the lock ends. Returns the database, the
    runner and the thread running its shutdown (joined for up to 15 s)."""
    enqueue_many(db, 2, behaviour="skip")
    database = Database(database_url, size=6)
    runner = Runner(
        settings=fast_settings(concurrency=2, lease=300),
        database=database,
        handlers={Queue.TRIAGE: ScriptedHandler()},
        worker_id="stopped-worker",
    )
    with psycopg.connect(database_url) as locker:
        locker.execute("LOCK TABLE pending_triage IN EXCLUSIVE MODE")
        runner.start()
        assert _wait_for(lambda: _lock_waiters(db) == 1), "the dispatcher's claim never blocked"
        stopper = threading.Thread(target=runner.shutdown, args=(1,), daemon=True)
        stopper.start()  # SIGTERM: nothing in flight, so nothing to release
        assert _wait_for(runner._stop_claiming.is_set)
        time.sleep(0.3)
        locker.commit()  # the lock ends: the claim sent before the stop lands (2 items)
    stopper.join(15)
    return database, runner, stopper


def test_a_dispatcher_claim_blocked_at_the_stop_gives_its_items_back(
    db: psycopg.Connection, database_url: str
) -> None:
    """The claim lands after the stop: its items must not stay leased to a stopped worker
    with their attempt counted, waiting out the lease."""
    database, runner, stopper = _stop_while_a_claim_of_two_waits(db, database_url)
    dispatcher = runner._threads[-1]
    dispatcher.join(15)
    assert not stopper.is_alive() and not dispatcher.is_alive()
    time.sleep(0.5)  # (a slot that ran them would finish a 'skip' at once)
    leased = db.execute(
        "SELECT id, attempts, lease_owner FROM pending_triage WHERE lease_owner IS NOT NULL"
    ).fetchall()
    database.close()
    # Every item either finished or waits unleased with its attempt given back.
    assert leased == [], f"items leased to a worker that has stopped: {leased}"
    assert count(db, "SELECT count(*) FROM pending_triage WHERE attempts > 0") == 0


class Gated(ScriptedHandler):
    """Item ``gated_id`` waits for ``gate`` (the test takes a row lock meanwhile)."""

    def __init__(self, gated_id: int) -> None:
        super().__init__()
        self.gated_id = gated_id
        self.entered = threading.Event()
        self.gate = threading.Event()

    def handle(self, item: Item) -> Any:
        if item.id == self.gated_id:
            self.entered.set()
            assert self.gate.wait(30)
        return super().handle(item)


def test_the_next_item_a_settle_claims_as_the_grace_ends_is_given_back(
    db: psycopg.Connection, database_url: str
) -> None:
    """A slot's settle, which claims its next item in the same statement, lands after the
    stop: ``shutdown`` must not return with that item leased and its attempt counted."""
    (first,) = enqueue_many(db, 1, behaviour="skip", prefix="a")
    (second,) = enqueue_many(db, 1, behaviour="sleep:8", prefix="b")
    database = Database(database_url, size=6)
    handler = Gated(first)
    runner = Runner(
        settings=fast_settings(concurrency=1, lease=300),
        database=database,
        handlers={Queue.TRIAGE: handler},
        worker_id="stopped-worker",
    )
    runner.start()
    assert handler.entered.wait(15)
    with psycopg.connect(database_url) as locker:
        # Another session holds the first item's row a moment (a producer's check, an admin):
        # the slot's settle, which also claims its next item, waits for it.
        locker.execute("SELECT 1 FROM pending_triage WHERE id = %s FOR UPDATE", (first,))
        handler.gate.set()
        assert _wait_for(lambda: _lock_waiters(db) == 1), "the settle never blocked"
        stopper = threading.Thread(target=runner.shutdown, args=(1,), daemon=True)
        stopper.start()  # SIGTERM; at the end of the 1 s grace the release waits too
        assert _wait_for(lambda: _lock_waiters(db) == 2), "the release never blocked"
        locker.commit()
    stopper.join(15)
    assert not stopper.is_alive()
    # The settle landed first (deleting the first item, claiming the second); shutdown has
    # returned, and the process would exit now.
    assert _wait_for(
        lambda: count(db, "SELECT count(*) FROM pending_triage WHERE id = %s", first) == 0
    )
    _wait_for(lambda: handler.calls >= 2, timeout=3)
    row = db.execute(
        "SELECT attempts, lease_owner FROM pending_triage WHERE id = %s", (second,)
    ).fetchone()
    handler.gate.set()
    # Finished (row gone) or waiting unleased with its attempt given back.
    assert row is None or row == (0, None), (
        f"the item claimed with the settle after the stop is {row}: leased to a worker that"
        " has stopped, its attempt counted, though it never ran before the exit"
    )
    database.close()


@pytest.mark.slow
def test_a_claim_that_waited_behind_a_lock_still_reserves_the_item_for_the_lease(
    db: psycopg.Connection, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease runs from when the claim takes the row, not from when its statement
    started: one that waited longer than the lease used to grant a lease already over, and
    a second worker took the running item (it ran twice, its attempt counted twice)."""
    (item_id,) = enqueue_many(db, 1, behaviour="sleep:6")
    database = Database(database_url, size=6)
    runner = Runner(
        settings=fast_settings(concurrency=1, lease=2),
        database=database,
        handlers={Queue.TRIAGE: ScriptedHandler()},
        worker_id="w1",
    )
    # Without the renewer (every lease/3), the lease the claim itself granted is what is
    # looked at: with SOKRATOS_LEASE=5m it first comes round up to 100 s after the claim.
    monkeypatch.setattr(runner._renewer, "run", lambda: None)
    with psycopg.connect(database_url) as locker:
        locker.execute("LOCK TABLE pending_triage IN EXCLUSIVE MODE")
        runner.start()
        assert _wait_for(lambda: _lock_waiters(db) == 1), "the claim never waited for the lock"
        time.sleep(3)  # the lock is held longer than the 2 s lease
        locker.commit()
    assert _wait_for(
        lambda: count(db, "SELECT count(*) FROM pending_triage WHERE lease_owner = 'w1'") == 1
    )
    remaining = db.execute(
        "SELECT EXTRACT(EPOCH FROM lease_expires_at - now()) FROM pending_triage WHERE id = %s",
        (item_id,),
    ).fetchone()
    # Worker w1's slot is running the item now; a second worker looks for work.
    taken = store.claim(db, Queue.TRIAGE, owner="w2", limit=1, lease_s=2)
    runner.request_stop()
    runner.shutdown(0)
    database.close()
    assert remaining is not None and float(remaining[0]) > 1.0, (
        f"the lease w1 got ends {float(remaining[0]):.1f} s from now (granted for 2 s)"
    )
    assert taken == [], "a second worker claimed the item the first one had just claimed"


def test_a_claim_landing_after_the_stop_is_counted_as_claimed(
    db: psycopg.Connection, database_url: str
) -> None:
    """tick_finished (run --once reports after its shutdown) must show every claim the database
    made: a claim that lands after the stop is given back, and still counted as claimed."""
    database, runner, stopper = _stop_while_a_claim_of_two_waits(db, database_url)
    runner._threads[-1].join(15)
    assert not stopper.is_alive()
    stats = runner.take_stats()
    database.close()
    # (given back: the database counted the claim, then un-counted the attempt)
    assert count(db, "SELECT count(*) FROM pending_triage WHERE lease_owner IS NULL") == 2
    counts = stats.counts.get("pending_triage", {})
    claimed = counts.get("claimed", 0)
    assert claimed == 2, f"the claim of 2 items that landed after the stop is counted {claimed}"
    assert counts.get("given_back", 0) == 2


def test_a_stop_whose_cancel_cannot_reach_the_server_ends_within_grace_5_2(
    db: psycopg.Connection, database_url: str
) -> None:
    """The network is gone as the stop comes: the wait for claims (5 s) and the cancel that
    cannot be sent (2 s) bound the stop; no cancel reached the claim, so it is not waited for
    again (it took grace + 9 s)."""
    enqueue_many(db, 1, behaviour="skip")
    proxy = TcpProxy(database_url)
    database = Database(proxy.url, size=4)
    runner = Runner(
        settings=fast_settings(concurrency=1, lease=300),
        database=database,
        handlers={Queue.TRIAGE: ScriptedHandler()},
        worker_id="partitioned-worker",
    )
    locker = psycopg.connect(database_url)
    elapsed = None
    try:
        locker.execute("LOCK TABLE pending_triage IN EXCLUSIVE MODE")
        runner.start()
        assert _wait_for(lambda: _lock_waiters(db) == 1), "the dispatcher's claim never blocked"
        proxy.blackhole()  # the network goes: the claim's answer and any cancel are lost
        result: list[float] = []

        def stop() -> None:
            started = time.monotonic()
            runner.shutdown(0)
            result.append(time.monotonic() - started)

        stopper = threading.Thread(target=stop, daemon=True)
        stopper.start()
        stopper.join(20)
        elapsed = result[0] if result else None
    finally:
        proxy.close()  # the dispatcher's connection breaks: its thread ends
        locker.rollback()
        locker.close()
        database.close()
    assert elapsed is not None, "shutdown did not return within 20 s"
    assert elapsed <= 0 + 5 + 2 + 0.5, (
        f"shutdown(grace=0) took {elapsed:.1f} s: 5 s for the claims, 2 s for the cancel that"
        " timed out, and 2 s more waiting for a claim that no cancel reached"
    )
