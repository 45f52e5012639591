"""A claim past SOKRATOS_MAX_ATTEMPTS says honestly why the item ends unrun: "worker died" only
when the claim took over an expired lease of an earlier attempt (durability.md)."""

from __future__ import annotations

import json

import psycopg
import pytest

from sokratos_worker.model import Effects, Outcome, Queue
from sokratos_worker.runner import Runner
from sokratos_worker.settle import ATTEMPTS_USED_UP, WORKER_DIED
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import Database
from tests.support.db import count, enqueue_many, outcomes
from tests.support.handlers import ScriptedHandler, fast_settings

PAYLOAD = json.dumps({"exchange": "user: hi\nassistant: hello", "behaviour": "ok"})


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


def _dead_letter(db: psycopg.Connection) -> tuple[str, int, str, list[dict[str, object]]]:
    row = db.execute(
        "SELECT error_message, attempts, context_data->'payload'->>'exchange',"
        " context_data->'attempts' FROM failed_operations"
    ).fetchone()
    assert row is not None
    return row[0], row[1], row[2], row[3]


def test_the_claim_says_whether_it_took_over_an_expired_lease(db: psycopg.Connection) -> None:
    first, second = enqueue_many(db, 2)
    (item,) = store.claim(db, Queue.TRIAGE, owner="w1", limit=1, lease_s=60)
    assert item.id == first and not item.took_over_lease
    db.execute("UPDATE pending_triage SET lease_expires_at = now() - interval '1 s'")
    (again,) = store.claim(db, Queue.TRIAGE, owner="w2", limit=1, lease_s=60)
    assert again.id == first and again.took_over_lease and again.attempt == 2
    # The slot's next item claimed with a settle says it too (the other claim statement).
    _, (fresh,) = store.settle_success(
        db, again, Effects(Outcome.SKIPPED), owner="w2", claim_from=again.queue, lease_s=60
    )
    assert fresh.id == second and not fresh.took_over_lease
    db.execute("UPDATE pending_triage SET lease_expires_at = now() - interval '1 s'")
    enqueue_many(db, 1, prefix="third")
    item3 = store.claim(db, Queue.TRIAGE, owner="w3", limit=1, lease_s=60)[0]
    assert item3.id == second and item3.took_over_lease
    _, (taken,) = store.settle_success(
        db, item3, Effects(Outcome.SKIPPED), owner="w3", claim_from=item3.queue, lease_s=60
    )
    assert not taken.took_over_lease  # the third item, never leased
    store.give_back(db, taken, owner="w3")  # a released lease is no lease
    assert not store.claim(db, Queue.TRIAGE, owner="w4", limit=1, lease_s=60)[0].took_over_lease


def test_a_row_inserted_with_attempts_preset_is_not_reported_as_a_dead_worker(
    db: psycopg.Connection, database_url: str
) -> None:
    # It was dead-lettered as "worker died during the last attempt": no worker had run it.
    db.execute("INSERT INTO pending_triage (payload, attempts) VALUES (%s::jsonb, 5)", (PAYLOAD,))
    handler = _drain(database_url, max_attempts=3)
    assert handler.calls == 0  # attempts are the worker's bookkeeping: they are kept
    error, attempts, exchange, history = _dead_letter(db)
    assert error == (
        "attempts used up: 5 of SOKRATOS_MAX_ATTEMPTS=3 before this claim (inserted with"
        " attempts preset, or the limit was lowered); the item never ran in this attempt"
    )
    assert attempts == 5 and exchange == "user: hi\nassistant: hello"  # the payload is kept
    assert [entry["error"] for entry in history] == [error]
    assert list(outcomes(db).values()) == ["failed"]
    assert count(db, "SELECT count(*) FROM pending_triage") == 0


@pytest.mark.parametrize(
    ("owner", "expiry"),
    [("'old'", "NULL"), ("NULL", "now() - interval '1 hour'")],
    ids=["owner-without-expiry", "expiry-without-owner"],
)
def test_a_row_with_half_a_lease_is_not_reported_as_a_dead_worker(
    db: psycopg.Connection, database_url: str, owner: str, expiry: str
) -> None:
    """A lease is an owner and an expiry (a claim sets both, every release clears both): a row
    copied back with its ``lease_owner`` but no expiry, or the other way round, held none, so
    no attempt of it died. It was dead-lettered as "worker died during the last attempt"."""
    db.execute(
        "INSERT INTO pending_triage (payload, attempts, lease_owner, lease_expires_at)"
        f" VALUES (%s::jsonb, 5, {owner}, {expiry})",
        (PAYLOAD,),
    )
    handler = _drain(database_url, max_attempts=3)
    assert handler.calls == 0
    error, attempts, _, _ = _dead_letter(db)
    assert error.startswith(f"{ATTEMPTS_USED_UP}: 5 of SOKRATOS_MAX_ATTEMPTS=3"), error
    assert attempts == 5


def test_items_backing_off_when_the_limit_is_lowered_say_so(
    db: psycopg.Connection, database_url: str
) -> None:
    (item_id,) = enqueue_many(db, 1)
    for attempt in (1, 2, 3):  # three failed attempts under SOKRATOS_MAX_ATTEMPTS=5
        (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
        assert item.attempt == attempt
        assert store.schedule_retry(db, item, owner="w", error=f"boom {attempt}", delay_s=0)
    handler = _drain(database_url, max_attempts=2)  # the operator lowered the limit
    assert handler.calls == 0
    error, attempts, _, history = _dead_letter(db)
    assert error.startswith("attempts used up: 3 of SOKRATOS_MAX_ATTEMPTS=2 before this claim")
    assert WORKER_DIED not in error and attempts == 3
    # One entry per attempt: the claim past the limit is none (its reason is error_message's).
    assert [entry["error"] for entry in history] == ["boom 1", "boom 2", "boom 3"]
    assert outcomes(db) == {item_id: "failed"}


def test_an_expired_lease_with_no_attempts_left_is_still_a_dead_worker(
    db: psycopg.Connection, database_url: str
) -> None:
    enqueue_many(db, 1)
    for _ in range(3):  # the third attempt's worker is killed: its lease runs out
        (item,) = store.claim(db, Queue.TRIAGE, owner="dead", limit=1, lease_s=60)
        if item.attempt < 3:
            assert store.schedule_retry(db, item, owner="dead", error="boom", delay_s=0)
    db.execute("UPDATE pending_triage SET lease_expires_at = now() - interval '1 s'")
    handler = _drain(database_url, max_attempts=3)
    assert handler.calls == 0
    error, attempts, _, _ = _dead_letter(db)
    assert error == WORKER_DIED and attempts == 3


def test_a_row_inserted_with_attempts_below_the_limit_runs(
    db: psycopg.Connection, database_url: str
) -> None:
    db.execute("INSERT INTO pending_triage (payload, attempts) VALUES (%s::jsonb, 2)", (PAYLOAD,))
    handler = _drain(database_url, max_attempts=3)
    assert handler.calls == 1 and list(outcomes(db).values()) == ["saved"]
