"""After a sequence reset, a direct INSERT whose id (the default's or an explicit one) is held by
a row still queued gets a fresh id (sql/0042_fresh_item_ids.sql, sokratos_fresh_id), as the
enqueue functions' ids do. Left to the primary key, the new row was refused (23505) or, under
``INSERT … ON CONFLICT DO NOTHING``, dropped without an error, with its key recorded for the
unrelated queued item, so the work could never be enqueued. A producer's retry of the same keyed
row still stays one item: the key, not the id, deduplicates it."""

from __future__ import annotations

import json

import psycopg
import pytest

from tests.support.db import count

PAYLOAD = json.dumps({"exchange": "user: I adopted a cat named Miso\nassistant: lovely"})
OTHER = json.dumps({"exchange": "user: an earlier conversation, still queued\nassistant: ok"})


def _queue_three_keyless(db: psycopg.Connection) -> list[int]:
    ids = [
        int(db.execute("SELECT sokratos_enqueue_triage(%s::jsonb)", (OTHER,)).fetchone()[0])
        for _ in range(3)
    ]
    # The sequence is reset while they are still queued (a restore, a setval by an operator).
    db.execute("SELECT setval(pg_get_serial_sequence('pending_triage', 'id'), 1, false)")
    return ids


def _miso_ids(db: psycopg.Connection) -> list[int]:
    rows = db.execute(
        "SELECT id FROM pending_triage WHERE payload->>'exchange' LIKE '%%Miso%%' ORDER BY id"
    ).fetchall()
    return [int(r[0]) for r in rows]


def test_a_keyed_direct_insert_on_conflict_do_nothing_after_a_reset_is_queued(
    db: psycopg.Connection,
) -> None:
    queued = _queue_three_keyless(db)
    rows = db.execute(
        "INSERT INTO pending_triage (payload, idempotency_key) VALUES (%s::jsonb, 'go-miso')"
        " ON CONFLICT DO NOTHING RETURNING id",
        (PAYLOAD,),
    ).fetchall()
    (stored,) = _miso_ids(db)
    assert rows == [(stored,)] and stored not in queued
    (key_item,) = db.execute(
        "SELECT item_id FROM sokratos_idempotency_keys WHERE key = 'go-miso'"
    ).fetchone()
    (again,) = db.execute(
        "SELECT sokratos_enqueue_triage(%s::jsonb, 'go-miso')", (PAYLOAD,)
    ).fetchone()
    assert key_item == stored == again
    assert count(db, "SELECT count(*) FROM pending_triage") == 4


def test_a_plain_direct_insert_after_a_reset_is_not_refused(db: psycopg.Connection) -> None:
    queued = _queue_three_keyless(db)
    try:
        (new_id,) = db.execute(
            "INSERT INTO pending_triage (payload) VALUES (%s::jsonb) RETURNING id", (PAYLOAD,)
        ).fetchone()
    except psycopg.errors.UniqueViolation as exc:
        pytest.fail(f"a new direct row was refused after a sequence reset: {exc.diag.message_primary}")
    assert new_id not in queued and _miso_ids(db) == [new_id]


def test_an_explicit_id_held_by_a_queued_row_gets_a_fresh_one(db: psycopg.Connection) -> None:
    (held,) = db.execute("SELECT sokratos_enqueue_triage(%s::jsonb)", (OTHER,)).fetchone()
    (new_id,) = db.execute(
        "INSERT INTO pending_triage (id, payload) VALUES (%s, %s::jsonb) RETURNING id",
        (held, PAYLOAD),
    ).fetchone()
    assert new_id != held and _miso_ids(db) == [new_id]


@pytest.mark.parametrize("same_id", [False, True], ids=["default-id", "first-rows-id"])
def test_a_producers_retry_of_the_same_keyed_row_stays_one_item(
    db: psycopg.Connection, same_id: bool
) -> None:
    """The answer to the first INSERT was lost and the producer sends it again, with a new
    default id or with the id the first row got: the key is recorded for the queued first row,
    so the queue's unique index on the key skips the retry (or refuses it, 23505)."""
    (first,) = db.execute(
        "INSERT INTO pending_triage (payload, idempotency_key) VALUES (%s::jsonb, 'tg:7')"
        " RETURNING id",
        (PAYLOAD,),
    ).fetchone()
    columns, values = ("id, ", "%(id)s, ") if same_id else ("", "")
    insert = (
        f"INSERT INTO pending_triage ({columns}payload, idempotency_key)"
        f" VALUES ({values}%(p)s::jsonb, 'tg:7')"
    )
    params = {"id": first, "p": PAYLOAD}
    assert db.execute(insert + " ON CONFLICT DO NOTHING RETURNING id", params).fetchall() == []
    with pytest.raises(psycopg.errors.UniqueViolation), db.transaction():
        db.execute(insert, params)
    assert _miso_ids(db) == [first]
    assert db.execute(
        "SELECT item_id FROM sokratos_idempotency_keys WHERE key = 'tg:7'"
    ).fetchone() == (first,)
