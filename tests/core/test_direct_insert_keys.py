"""Rows the main application inserts directly keep their idempotency key's promise (contract §4)."""

from __future__ import annotations

import json
import threading
import time

import psycopg
import pytest

from sokratos_worker.model import Effects, Outcome, Queue
from sokratos_worker.store import failures
from sokratos_worker.store import queue as store
from tests.support.db import count

PAYLOAD = json.dumps({"exchange": "user: my sister moved to Porto\nassistant: noted"})


def _enqueue(db: psycopg.Connection, key: str) -> int:
    row = db.execute("SELECT sokratos_enqueue_triage(%s::jsonb, %s)", (PAYLOAD, key)).fetchone()
    assert row is not None
    return int(row[0])


def test_a_key_inserted_directly_is_one_item_while_pending_and_after_it_finished(
    db: psycopg.Connection,
) -> None:
    row = db.execute(
        "INSERT INTO pending_triage (payload, idempotency_key) VALUES (%s::jsonb, 'go-1')"
        " RETURNING id",
        (PAYLOAD,),
    ).fetchone()
    assert row is not None
    direct = int(row[0])
    # It used to raise a unique violation here, and to enqueue a second item after the settle.
    assert _enqueue(db, "go-1") == direct
    assert count(db, "SELECT count(*) FROM pending_triage") == 1
    (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    store.settle_success(db, item, Effects(Outcome.SKIPPED), owner="w")
    assert _enqueue(db, "go-1") == direct
    assert count(db, "SELECT count(*) FROM pending_triage") == 0
    assert count(db, "SELECT count(*) FROM work_outcomes") == 1


def test_rows_inserted_without_a_key_are_not_remembered(db: psycopg.Connection) -> None:
    db.execute('INSERT INTO pending_distillation (payload) VALUES (\'{"archive_text": "a"}\')')
    assert count(db, "SELECT count(*) FROM sokratos_idempotency_keys") == 0
    assert _enqueue(db, "k") != _enqueue(db, "k2")
    assert count(db, "SELECT count(*) FROM sokratos_idempotency_keys") == 2


def _direct(db: psycopg.Connection, key: str) -> int:
    row = db.execute(
        "INSERT INTO pending_triage (payload, idempotency_key) VALUES (%s::jsonb, %s) RETURNING id",
        (PAYLOAD, key),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_direct_insert_of_a_finished_key_is_refused_as_a_unique_violation(
    db: psycopg.Connection,
) -> None:
    # The Go application retrying an INSERT whose COMMIT landed but whose answer was lost
    # must not get the work done (and a memory written) twice.
    first = _direct(db, "go-7")
    (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    assert store.settle_success(db, item, Effects(Outcome.SKIPPED), owner="w")[0].settled
    with pytest.raises(psycopg.errors.UniqueViolation) as refused:
        _direct(db, "go-7")
    message = refused.value.diag.message_primary or ""
    assert '"go-7"' in message and f"item {first}" in message, message
    assert count(db, "SELECT count(*) FROM pending_triage") == 0
    assert _enqueue(db, "go-7") == first  # the SQL function still answers with the original


def test_a_direct_insert_of_a_pending_key_is_refused_as_a_unique_violation(
    db: psycopg.Connection,
) -> None:
    _enqueue(db, "go-8")
    with pytest.raises(psycopg.errors.UniqueViolation):
        _direct(db, "go-8")
    assert count(db, "SELECT count(*) FROM pending_triage") == 1


def test_a_direct_insert_on_conflict_do_nothing_of_a_known_key(db: psycopg.Connection) -> None:
    """A producer's usual retry: skipped while the item is queued (the queue's own index), and
    refused with 23505 once it finished (a key is accepted once)."""
    first = _enqueue(db, "go-10")
    retry = (
        "INSERT INTO pending_triage (payload, idempotency_key) VALUES (%s::jsonb, 'go-10')"
        " ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING"
    )
    assert db.execute(retry, (PAYLOAD,)).rowcount == 0
    assert count(db, "SELECT count(*) FROM pending_triage") == 1
    (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    assert store.settle_success(db, item, Effects(Outcome.SKIPPED), owner="w")[0].settled
    with pytest.raises(psycopg.errors.UniqueViolation) as refused:
        db.execute(retry, (PAYLOAD,))
    assert f"item {first}" in (refused.value.diag.message_primary or "")
    assert count(db, "SELECT count(*) FROM pending_triage") == 0


@pytest.mark.parametrize("queue", ["pending_triage", "pending_distillation"])
def test_on_conflict_naming_the_key_column_alone_skips_a_queued_key(
    db: psycopg.Connection, queue: str
) -> None:
    """The plain form, without the predicate, failed with 42P10 while the key index was partial
    (sql/0047): a conflict target infers a partial index only when it repeats the predicate."""
    payload = (
        PAYLOAD if queue == "pending_triage" else '{"archive_text": "user: hi\\nassistant: hello"}'
    )
    insert = (
        f"INSERT INTO {queue} (payload, idempotency_key) VALUES (%s::jsonb, 'go-12')"
        " ON CONFLICT (idempotency_key) DO NOTHING RETURNING id"
    )
    assert db.execute(insert, (payload,)).fetchone() is not None
    assert db.execute(insert, (payload,)).fetchone() is None
    without_key = f"INSERT INTO {queue} (payload) VALUES (%s::jsonb)"
    db.execute(without_key, (payload,))
    db.execute(without_key, (payload,))  # rows without a key never conflict
    assert count(db, f"SELECT count(*) FROM {queue}") == 3


def test_an_item_finishing_while_a_direct_insert_checks_its_key_lets_no_second_item_in(
    db: psycopg.Connection, database_url: str
) -> None:
    """A settle already deleting the key's item makes the INSERT wait for it at the queue's
    index, then a refusal."""
    first = _enqueue(db, "go-11")
    (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    with psycopg.connect(database_url) as settling:
        assert store.settle_success(settling, item, Effects(Outcome.SKIPPED), owner="w")[0].settled
        # (not committed yet: the item's row is being deleted)
        with psycopg.connect(database_url) as producer:
            thread, result = _start(producer, DIRECT.replace("'race'", "'go-11'"))
            _waiting_for(db, producer.info.backend_pid, "transactionid")
            settling.commit()
            thread.join(timeout=30)
            assert not thread.is_alive()
    (refused,) = result
    assert isinstance(refused, psycopg.errors.UniqueViolation), refused
    assert f"item {first}" in (refused.diag.message_primary or "")
    assert count(db, "SELECT count(*) FROM pending_triage") == 0


def test_keyed_enqueues_and_a_keyed_failed_retry_still_insert_their_rows(
    db: psycopg.Connection,
) -> None:
    item_id = _enqueue(db, "go-9")
    (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    assert item.id == item_id
    assert store.dead_letter(db, item, owner="w", error="boom").settled
    (failure_id,) = failures.retryable_ids(db, op_type=None)
    retried = failures.retry_failure(db, failure_id)
    assert retried.item_id is not None and retried.item_id != item_id, retried.message
    row = db.execute("SELECT idempotency_key FROM pending_triage").fetchone()
    assert row == ("go-9#retry-1",)


def test_the_key_triggers_still_run_with_their_owners_rights(db: psycopg.Connection) -> None:
    rows = db.execute(
        "SELECT proname, prosecdef, proconfig FROM pg_proc"
        " WHERE proname IN ('sokratos_remember_key', 'sokratos_check_key') ORDER BY proname"
    ).fetchall()
    assert [r[0] for r in rows] == ["sokratos_check_key", "sokratos_remember_key"], rows
    for _, definer, config in rows:
        assert definer is True and any("search_path" in c for c in config), rows


# -- a direct INSERT and sokratos_enqueue racing on one key ---------------------------------

PAUSE_LOCK = 4711  # the advisory lock a paused session waits for until the test releases it

# Test-only triggers that pause the session asking for it (sokratos_test.pause = 'before' or
# 'after') in the middle of its INSERT into pending_triage: just before the row is written
# (sokratos_enqueue has recorded the key by then), or just after it. "a_…" fires before the
# queue's own "sokratos_…" triggers.
PAUSE_TRIGGERS = f"""
CREATE FUNCTION test_pause() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('sokratos_test.pause', true) = lower(TG_WHEN) THEN
        PERFORM pg_advisory_xact_lock_shared({PAUSE_LOCK});
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER a_test_pause_before BEFORE INSERT ON pending_triage
    FOR EACH ROW EXECUTE FUNCTION test_pause();
CREATE TRIGGER a_test_pause_after AFTER INSERT ON pending_triage
    FOR EACH ROW EXECUTE FUNCTION test_pause();
"""
ENQUEUE = "SELECT sokratos_enqueue_triage(%s::jsonb, 'race')"
DIRECT = (
    "INSERT INTO pending_triage (payload, idempotency_key) VALUES (%s::jsonb, 'race') RETURNING id"
)


def _waiting_for(db: psycopg.Connection, pid: int, lock: str) -> None:
    """Until session ``pid`` waits for a lock of this type (advisory, transactionid)."""
    for _ in range(200):
        row = db.execute(
            "SELECT wait_event FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'",
            (pid,),
        ).fetchone()
        if row == (lock,):
            return
        time.sleep(0.05)
    raise AssertionError(f"session {pid} never waited for a {lock} lock")


def _start(conn: psycopg.Connection, query: str) -> tuple[threading.Thread, list[object]]:
    """Run ``query`` and commit, in a thread; the list receives the id or the error."""
    result: list[object] = []

    def run() -> None:
        try:
            row = conn.execute(query, (PAYLOAD,)).fetchone()
            conn.commit()
            result.append(row[0] if row else None)
        except psycopg.Error as exc:
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def _race(
    db: psycopg.Connection, database_url: str, leader: str, pause: str, follower: str
) -> tuple[object, object]:
    """``leader`` pauses mid-INSERT at ``pause``; ``follower`` runs until it waits for the
    leader; then the leader goes on. Returns what each got."""
    db.execute(PAUSE_TRIGGERS)
    with (
        psycopg.connect(database_url, autocommit=True) as gate,
        psycopg.connect(database_url, options=f"-c sokratos_test.pause={pause}") as first,
        psycopg.connect(database_url) as second,
    ):
        gate.execute("SELECT pg_advisory_lock(%s)", (PAUSE_LOCK,))
        lead = _start(first, leader)
        _waiting_for(db, first.info.backend_pid, "advisory")
        follow = _start(second, follower)
        _waiting_for(db, second.info.backend_pid, "transactionid")
        gate.execute("SELECT pg_advisory_unlock(%s)", (PAUSE_LOCK,))
        for thread, _ in (lead, follow):
            thread.join(timeout=30)
            assert not thread.is_alive()
    return lead[1][0], follow[1][0]


def test_an_enqueue_paused_before_its_row_and_a_direct_insert_of_its_key_do_not_deadlock(
    db: psycopg.Connection, database_url: str
) -> None:
    # The direct INSERT wrote its row, then (AFTER trigger) waited for the enqueue's key; the
    # enqueue, writing its row, waited for the INSERT's row: SQLSTATE 40P01.
    enqueued, direct = _race(db, database_url, ENQUEUE, "before", DIRECT)
    assert isinstance(enqueued, int), enqueued
    assert isinstance(direct, psycopg.errors.UniqueViolation), direct  # as for any known key
    assert db.execute("SELECT id FROM pending_triage").fetchall() == [(enqueued,)]
    assert count(db, "SELECT item_id FROM sokratos_idempotency_keys") == enqueued


def test_a_direct_insert_paused_after_its_row_and_an_enqueue_of_its_key_do_not_deadlock(
    db: psycopg.Connection, database_url: str
) -> None:
    # The enqueue recorded the key and waited for the INSERT's row; the INSERT's AFTER trigger
    # waited for the enqueue's key: SQLSTATE 40P01.
    direct, enqueued = _race(db, database_url, DIRECT, "after", ENQUEUE)
    assert isinstance(direct, int), direct
    assert enqueued == direct  # the function answers with the original id
    assert db.execute("SELECT id FROM pending_triage").fetchall() == [(direct,)]
    assert count(db, "SELECT item_id FROM sokratos_idempotency_keys") == direct


RETRY = (
    "INSERT INTO pending_triage (payload, idempotency_key) VALUES (%s::jsonb, %s)"
    " ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING"
)


def test_a_producers_skipped_retry_does_not_hold_up_the_settle_of_the_queued_item(
    db: psycopg.Connection, database_url: str
) -> None:
    """The key's queued item is not locked for the producer's transaction: its settle neither
    waits for that transaction nor deadlocks with it (with the item locked, the settle-and-claim
    claimed the next item and waited for the producer, whose retry of that next item's key then
    waited for the settle: 40P01)."""
    first, second = _enqueue(db, "go-12"), _enqueue(db, "go-13")
    (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    assert item.id == first
    with (
        psycopg.connect(database_url) as producer,
        psycopg.connect(database_url, autocommit=True, options="-c lock_timeout=5s") as worker,
    ):
        assert producer.execute(RETRY, (PAYLOAD, "go-12")).rowcount == 0  # (not committed)
        settled, claimed = store.settle_success(
            worker, item, Effects(Outcome.SKIPPED), owner="w", claim_from=item.queue
        )
        assert settled.settled and [c.id for c in claimed] == [second]
        assert producer.execute(RETRY, (PAYLOAD, "go-13")).rowcount == 0
        producer.commit()
    assert db.execute("SELECT id FROM pending_triage").fetchall() == [(second,)]


def test_an_item_finishing_after_a_direct_insert_found_it_queued_lets_no_second_item_in(
    db: psycopg.Connection, database_url: str
) -> None:
    """Settled (deleted, committed) between the key's check and the queue's index: the row
    written then is refused as for a finished key, also under ON CONFLICT DO NOTHING."""
    first = _enqueue(db, "go-14")
    (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    # Pauses after the key triggers checked the key ("z_…" fires after "sokratos_…").
    db.execute(PAUSE_TRIGGERS.replace("a_test_pause_before", "z_test_pause_before"))
    retry = RETRY.replace("%s)", "'go-14')") + " RETURNING id"
    with (
        psycopg.connect(database_url, autocommit=True) as gate,
        psycopg.connect(database_url, options="-c sokratos_test.pause=before") as producer,
    ):
        gate.execute("SELECT pg_advisory_lock(%s)", (PAUSE_LOCK,))
        thread, result = _start(producer, retry)
        _waiting_for(db, producer.info.backend_pid, "advisory")
        assert store.settle_success(db, item, Effects(Outcome.SKIPPED), owner="w")[0].settled
        gate.execute("SELECT pg_advisory_unlock(%s)", (PAUSE_LOCK,))
        thread.join(timeout=30)
        assert not thread.is_alive()
    (refused,) = result
    assert isinstance(refused, psycopg.errors.UniqueViolation), refused
    assert f"item {first}" in (refused.diag.message_primary or "")
    assert count(db, "SELECT count(*) FROM pending_triage") == 0
