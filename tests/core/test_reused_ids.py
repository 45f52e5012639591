"""An item id is handed out once (sql/0042_fresh_item_ids.sql): a reset sequence or an explicit
id never gives a new item the id of one whose outcome is recorded, so every item settles."""

from __future__ import annotations

import json
import threading
import time

import psycopg
from structlog.testing import capture_logs

from sokratos_worker.model import Queue
from sokratos_worker.runner import Runner
from sokratos_worker.store.connection import Database
from sokratos_worker.store.migrations import load_migrations
from tests.support.db import count, enqueue_many, outcomes
from tests.support.handlers import ScriptedHandler, fast_settings

PAYLOAD = json.dumps({"exchange": "user: my sister moved to Porto\nassistant: noted"})


def _drain(database_url: str, **overrides: object) -> ScriptedHandler:
    handler = ScriptedHandler()
    database = Database(database_url, size=6)
    runner = Runner(
        settings=fast_settings(**overrides),
        database=database,
        handlers={Queue.TRIAGE: handler, Queue.DISTILLATION: handler},
        worker_id="test",
    )
    try:
        runner.start(drain_only=True, budget_s=8.0)
        assert runner.wait_drained(30)
        runner.shutdown(1)
    finally:
        database.close()
    return handler


def _finish(db: psycopg.Connection, database_url: str, n: int, prefix: str) -> list[int]:
    """``n`` items enqueued and saved by the worker, their ids."""
    ids = enqueue_many(db, n, prefix=prefix)
    _drain(database_url)
    assert set(outcomes(db)) >= set(ids)
    return ids


def _direct(db: psycopg.Connection, columns: str, values: str, *params: object) -> int:
    row = db.execute(
        f"INSERT INTO pending_triage ({columns}) VALUES ({values}) RETURNING id", params
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_after_truncate_restart_identity_a_new_item_gets_a_fresh_id_and_settles(
    db: psycopg.Connection, database_url: str
) -> None:
    old = _finish(db, database_url, 3, "first")
    db.execute("TRUNCATE pending_triage RESTART IDENTITY")
    # It got id 1 and looped for ever: each settle hit work_outcomes' unique (queue, item_id).
    (new,) = enqueue_many(db, 1, prefix="second")
    assert new not in old
    _drain(database_url, max_attempts=2)
    assert count(db, "SELECT count(*) FROM pending_triage") == 0
    assert outcomes(db) == dict.fromkeys([*old, new], "saved")
    origins = {r[0] for r in db.execute("SELECT origin FROM memories")}
    assert origins == {f"pending_triage:{i}:0" for i in [*old, new]}  # none shared
    keys = dict(db.execute("SELECT key, item_id FROM sokratos_idempotency_keys").fetchall())
    assert keys == {"first0": old[0], "first1": old[1], "first2": old[2], "second0": new}


def test_a_direct_insert_never_gets_an_id_that_has_an_outcome(
    db: psycopg.Connection, database_url: str
) -> None:
    old = _finish(db, database_url, 2, "first")
    db.execute("SELECT setval(pg_get_serial_sequence('pending_triage', 'id'), 1, false)")
    by_default = _direct(db, "payload", "%s::jsonb", PAYLOAD)
    explicit = _direct(db, "id, payload, idempotency_key", "%s, %s::jsonb, 'go-7'", old[0], PAYLOAD)
    assert len({by_default, explicit, *old}) == 4
    # The key is recorded under the id the row got (the trigger runs before 0041's).
    assert count(
        db, "SELECT item_id FROM sokratos_idempotency_keys WHERE key = 'go-7'"
    ) == explicit
    row = db.execute("SELECT sokratos_enqueue_triage(%s::jsonb, 'go-7')", (PAYLOAD,)).fetchone()
    assert row == (explicit,)
    _drain(database_url, max_attempts=2)
    assert outcomes(db) == dict.fromkeys([*old, by_default, explicit], "saved")


def test_an_id_whose_key_is_recorded_for_a_vanished_item_is_not_handed_out(
    db: psycopg.Connection,
) -> None:
    # Items truncated while pending left their keys: a new item under their ids would inherit
    # them (enqueueing the old key returned the new, unrelated item).
    old = enqueue_many(db, 2, prefix="old")
    db.execute("TRUNCATE pending_triage RESTART IDENTITY")
    (new,) = enqueue_many(db, 1, prefix="new")
    direct = _direct(db, "payload, idempotency_key", "%s::jsonb, 'go-1'", PAYLOAD)
    assert new not in old and direct not in old and new != direct
    row = db.execute("SELECT sokratos_enqueue_triage(%s::jsonb, 'old0')", (PAYLOAD,)).fetchone()
    assert row == (old[0],)
    assert count(db, "SELECT count(*) FROM pending_triage") == 2


def test_the_sequence_moves_once_past_the_highest_used_id(db: psycopg.Connection) -> None:
    db.execute(
        "INSERT INTO work_outcomes (queue, item_id, source, outcome)"
        " SELECT 'pending_triage', g, 'conversation', 'skipped' FROM generate_series(1, 5000) g"
    )
    db.execute("SELECT setval(pg_get_serial_sequence('pending_triage', 'id'), 1, false)")
    first, second = enqueue_many(db, 2)
    assert 5000 < first < second <= 5000 + 1002
    # One setval: the sequence did not walk the 5000 used ids one by one.
    assert count(db, "SELECT last_value FROM pending_triage_id_seq") == second
    # The other queue's ids are its own.
    (distilled,) = enqueue_many(db, 1, queue="pending_distillation")
    assert distilled == 1


def test_two_inserts_needing_the_move_at_once_get_distinct_fresh_ids(
    db: psycopg.Connection, database_url: str
) -> None:
    db.execute(
        "INSERT INTO work_outcomes (queue, item_id, source, outcome)"
        " SELECT 'pending_triage', g, 'conversation', 'skipped' FROM generate_series(1, 100) g"
    )
    db.execute("SELECT setval(pg_get_serial_sequence('pending_triage', 'id'), 1, false)")
    got: list[int] = []
    with psycopg.connect(database_url) as first, psycopg.connect(database_url) as second:
        # The first producer moves the sequence and keeps its transaction open.
        got.append(_direct(first, "payload", "%s::jsonb", PAYLOAD))
        # A second reset meanwhile: the second producer also needs the move, waits for the
        # first one's transaction, then moves the sequence past the first one's row.
        db.execute("SELECT setval(pg_get_serial_sequence('pending_triage', 'id'), 1, false)")

        def produce() -> None:
            got.append(_direct(second, "payload", "%s::jsonb", PAYLOAD))
            second.commit()

        waiter = threading.Thread(target=produce)
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive() and len(got) == 1
        first.commit()
        waiter.join(10)
        assert not waiter.is_alive()
    assert len(set(got)) == 2 and min(got) > 100, got
    assert sorted(r[0] for r in db.execute("SELECT id FROM pending_triage")) == sorted(got)


def test_many_inserts_at_once_after_a_restart_all_commit_with_distinct_ids(
    db: psycopg.Connection, database_url: str
) -> None:
    _finish(db, database_url, 20, "first")
    db.execute("TRUNCATE pending_triage RESTART IDENTITY")
    got: list[int] = []
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def produce(n: int) -> None:
        try:
            with psycopg.connect(database_url) as conn:
                start.wait()
                for i in range(5):
                    row = conn.execute(
                        "SELECT sokratos_enqueue_triage(%s::jsonb, %s)", (PAYLOAD, f"p{n}-{i}")
                    ).fetchone()
                    assert row is not None
                    got.append(int(row[0]))
                    time.sleep(0.01)
        except BaseException as exc:  # reported below: a thread's assertion is lost otherwise
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    assert len(set(got)) == 30 and min(got) > 20
    _drain(database_url, max_attempts=2, concurrency=4)
    assert len(outcomes(db)) == 50 and count(db, "SELECT count(*) FROM pending_triage") == 0


def test_the_migration_gives_rows_looping_on_a_used_id_a_fresh_one(
    db: psycopg.Connection, database_url: str
) -> None:
    old = _finish(db, database_url, 1, "first")
    # Queued as before 0042: the row holds a finished item's id, its key recorded under it.
    db.execute("ALTER TABLE pending_triage DISABLE TRIGGER sokratos_fresh_id")
    stuck = _direct(db, "id, payload, idempotency_key", "%s, %s::jsonb, 'go-2'", old[0], PAYLOAD)
    db.execute("ALTER TABLE pending_triage ENABLE TRIGGER sokratos_fresh_id")
    assert stuck == old[0]
    (migration,) = [m for m in load_migrations() if m.name == "0042_fresh_item_ids"]
    db.execute(migration.sql.encode())  # the migration is idempotent: as if applied now
    (fresh,) = [int(r[0]) for r in db.execute("SELECT id FROM pending_triage")]
    assert fresh != old[0]
    assert count(
        db, "SELECT item_id FROM sokratos_idempotency_keys WHERE key = 'go-2'"
    ) == fresh
    _drain(database_url, max_attempts=2)
    assert outcomes(db) == {old[0]: "saved", fresh: "saved"}


def test_a_settle_refused_by_a_used_id_says_why_and_what_to_do(
    db: psycopg.Connection, database_url: str
) -> None:
    # Rows that bypass the trigger (a disabled trigger, session_replication_role = replica)
    # can still collide: the worker must say so at every attempt, not loop silently.
    old = _finish(db, database_url, 1, "first")
    db.execute("ALTER TABLE pending_triage DISABLE TRIGGER sokratos_fresh_id")
    _direct(db, "id, payload", "%s, %s::jsonb", old[0], PAYLOAD)
    with capture_logs() as logs:
        for _ in range(3):  # ticks: the retry backs off 10-20 ms
            _drain(database_url, max_attempts=2)
            time.sleep(0.05)
    reused = [e for e in logs if e["event"] == "item_id_reused"]
    # The success settle of attempt 1, then of attempt 2 and its dead letter.
    assert len(reused) == 3, [e["event"] for e in logs]
    assert "work_outcomes_queue_item_id_key" in reused[0]["error"]
    hint = reused[0]["hint"]
    fix = f"UPDATE pending_triage SET id = sokratos_next_item_id('pending_triage') WHERE id = {old[0]}"
    assert fix in hint
    assert not [e for e in logs if e["event"] == "settle_failed"]
    # The fix the hint names works (as the tables' owner).
    db.execute("ALTER TABLE pending_triage ENABLE TRIGGER sokratos_fresh_id")
    db.execute(fix.replace("SET id", "SET lease_expires_at = now(), id"))
    _drain(database_url, max_attempts=3)
    assert count(db, "SELECT count(*) FROM pending_triage") == 0
    assert sorted(outcomes(db).values()) == ["saved", "saved"]
