"""Rows the main application inserts directly keep their idempotency key's promise (contract §4)."""

from __future__ import annotations

import json

import psycopg

from sokratos_worker.model import Effects, Outcome, Queue
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
