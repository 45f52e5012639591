"""Rows the main application inserts directly keep their idempotency key's promise (contract §4)."""

from __future__ import annotations

import json

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


def test_the_key_trigger_still_runs_with_its_owners_rights(db: psycopg.Connection) -> None:
    row = db.execute(
        "SELECT prosecdef, proconfig FROM pg_proc WHERE proname = 'sokratos_remember_key'"
    ).fetchone()
    assert row is not None and row[0] is True and any("search_path" in c for c in row[1]), row
