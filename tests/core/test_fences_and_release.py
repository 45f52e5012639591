"""Found by breaking the code on purpose (mutation testing), which no test noticed: promises no other test held the code to.

Each test names the mutation it kills. Real PostgreSQL; assertions on the rows.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import psycopg

from sokratos_worker.model import Effects, NewMemory, Outcome, Queue
from sokratos_worker.runner import Runner
from sokratos_worker.spool import import_spool, spool_enqueue
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import Database
from tests.support.db import count, enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings


def _expire(db: psycopg.Connection) -> None:
    db.execute("UPDATE pending_triage SET lease_expires_at = now() - interval '1 second'")


def _saved(item_origin: str) -> Effects:
    return Effects(
        Outcome.SAVED, memories=(NewMemory(origin=item_origin, summary="x", salience=5),)
    )


def test_a_lease_taken_over_and_given_back_still_fences_the_old_owner(
    db: psycopg.Connection,
) -> None:
    """Kills: the fence without ``lease_owner = %(owner)s`` (attempts alone). The new owner
    gave the attempt back, so the row's attempts equal the old owner's again: only the
    owner tells the stale settle apart (durability.md: every settle is fenced)."""
    enqueue_many(db, 1)
    (old,) = store.claim(db, Queue.TRIAGE, owner="dead", limit=1, lease_s=60)
    _expire(db)
    (new,) = store.claim(db, Queue.TRIAGE, owner="alive", limit=1, lease_s=60)
    assert new.attempt == 2
    assert store.give_back(db, new, owner="alive")  # no backend: attempt given back
    assert db.execute("SELECT attempts, lease_owner FROM pending_triage").fetchone() == (1, None)
    assert not store.settle_success(db, old, _saved(old.origin(0)), owner="dead")[0].settled
    assert not store.schedule_retry(db, old, owner="dead", error="e", delay_s=60)
    assert not store.dead_letter(db, old, owner="dead", error="e").settled
    assert count(db, "SELECT count(*) FROM memories") == 0
    assert count(db, "SELECT count(*) FROM work_outcomes") == 0
    assert count(db, "SELECT count(*) FROM failed_operations") == 0
    row = db.execute("SELECT attempts, lease_owner, run_after <= now() FROM pending_triage")
    assert row.fetchone() == (1, None, True)


def test_the_same_worker_claiming_its_expired_item_again_fences_its_first_attempt(
    db: psycopg.Connection,
) -> None:
    """Kills: the fence without ``attempts = %(attempt)s`` (owner alone). Two slots of one
    process share the worker id: the first slot's lease ran out (renewal failed), the
    dispatcher claimed the item again; the first slot's late settle must change nothing."""
    enqueue_many(db, 1)
    (first,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    _expire(db)
    (second,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    assert second.id == first.id and second.attempt == 2
    assert not store.schedule_retry(db, first, owner="w", error="stale", delay_s=60)
    assert not store.give_back(db, first, owner="w")
    assert not store.dead_letter(db, first, owner="w", error="stale").settled
    assert not store.settle_success(db, first, _saved(first.origin(0)), owner="w")[0].settled
    row = db.execute("SELECT attempts, lease_owner, last_error FROM pending_triage")
    assert row.fetchone() == (2, "w", None)
    assert count(db, "SELECT count(*) FROM work_outcomes") == 0
    # The running claim settles it.
    assert store.settle_success(db, second, _saved(second.origin(0)), owner="w")[0].settled
    assert db.execute("SELECT outcome, attempts FROM work_outcomes").fetchall() == [("saved", 2)]


def test_a_settle_after_its_own_lease_ran_out_lands_and_does_not_claim_the_item_again(
    db: psycopg.Connection,
) -> None:
    """Kills: ``settle_claim`` without ``id <> %(id)s``. Nobody took the expired lease over,
    so the settle is still the item's; its claim-next part must not pick the row it deletes
    (it did: the settle was lost and the item ran again with one more attempt counted)."""
    enqueue_many(db, 1)
    (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    _expire(db)
    effects = Effects(Outcome.SKIPPED, detail="scripted skip")
    result, next_items = store.settle_success(db, item, effects, owner="w", claim_from=item.queue)
    assert result.settled and next_items == []
    assert count(db, "SELECT count(*) FROM pending_triage") == 0
    assert db.execute("SELECT outcome, attempts FROM work_outcomes").fetchall() == [("skipped", 1)]


def test_items_still_running_at_the_end_of_the_grace_are_released_with_the_attempt_given_back(
    db: psycopg.Connection, database_url: str
) -> None:
    """Kills: the shutdown release doing anything but ``give_back`` (e.g. a retry, which
    keeps the attempt). durability.md: SIGTERM, still running at the end of the grace:
    released, attempt given back, run_after unchanged."""
    enqueue_many(db, 2, behaviour="sleep:3")
    database = Database(database_url, size=4)
    runner = Runner(
        settings=fast_settings(concurrency=2),
        database=database,
        handlers={Queue.TRIAGE: ScriptedHandler()},
        worker_id="test",
    )
    runner.start(drain_only=True)
    leased = "SELECT count(*) FROM pending_triage WHERE lease_owner IS NOT NULL"
    deadline = time.monotonic() + 30
    while count(db, leased) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert count(db, leased) == 2
    assert runner.shutdown(0.2) == 2
    rows = db.execute(
        "SELECT attempts, lease_owner, lease_expires_at, run_after <= now(), last_error"
        " FROM pending_triage ORDER BY id"
    ).fetchall()
    assert rows == [(0, None, None, True, None)] * 2
    time.sleep(3.5)  # the handlers finish; their settles are fenced (the lease was given back)
    database.close()
    assert count(db, "SELECT count(*) FROM pending_triage WHERE attempts = 0") == 2
    assert count(db, "SELECT count(*) FROM work_outcomes") == 0
    assert count(db, "SELECT count(*) FROM memories") == 0


def test_a_spooled_enqueue_without_a_key_is_imported_exactly_once(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """Kills: the spool writing the producer's key as is (None) instead of a generated one.
    The file must carry a key so a re-import (crash after the commit, before the unlink) is
    a no-op; a keyless file is even refused by the import (the enqueue lost)."""
    spool = tmp_path / "spool"
    path = spool_enqueue(
        spool,
        Queue.TRIAGE,
        {"exchange": "user: hi\nassistant: hello"},
        idempotency_key=None,
        source=None,
    )
    record = json.loads(path.read_text())
    assert isinstance(record["idempotency_key"], str) and record["idempotency_key"].strip()
    database = Database(database_url, size=2)
    try:
        assert import_spool(spool, database) == 1
        (spool / "again.json").write_text(json.dumps(record))  # the file a crash left behind
        assert import_spool(spool, database) == 1
    finally:
        database.close()
    assert not list(spool.glob("*.json"))
    assert count(db, "SELECT count(*) FROM pending_triage") == 1
    assert count(db, "SELECT count(*) FROM failed_operations") == 0
