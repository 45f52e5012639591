"""Dead letters of payloads nested about as deeply as Python's json can follow: the worker read
the payload at claim, so `failed show` and `failed retry` must read its dead letter back."""

from __future__ import annotations

import psycopg

from sokratos_worker.model import Item, Queue
from sokratos_worker.store import failures
from sokratos_worker.store import queue as store
from tests.support.db import count


def nested(depth: int) -> str:
    """A triage payload whose ``deep`` field is ``depth`` objects deep."""
    deep = '{"a": ' * depth + "1" + "}" * depth
    return '{"exchange": "user: hi\\nassistant: ok", "deep": ' + deep + "}"


def claim_the_deepest_payload_python_reads(db: psycopg.Connection) -> Item:
    """Claim the deepest payload this thread's json still reads (the depth depends on the
    stack it is called from): its dead letter's context is one level deeper."""
    for depth in range(1100, 0, -1):
        db.execute("INSERT INTO pending_triage (payload) VALUES (%s::jsonb)", (nested(depth),))
        (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
        if store.UNPARSABLE_KEY not in item.payload:
            return item
        db.execute("DELETE FROM pending_triage")
    raise AssertionError("no payload was readable")


def test_a_payload_read_at_claim_is_retried_from_its_dead_letter_exactly(
    db: psycopg.Connection,
) -> None:
    item = claim_the_deepest_payload_python_reads(db)
    assert store.dead_letter(db, item, owner="w", error="scripted failure").settled
    (failure_id,) = failures.retryable_ids(db, op_type=None)
    # It said "no stored payload": the context, one level deeper, did not parse any more.
    result = failures.retry_failure(db, failure_id)
    assert result.item_id is not None, result.message
    assert result.message == f"re-enqueued as pending_triage item {result.item_id}"
    same = db.execute(
        "SELECT p.payload = f.context_data->'payload', p.idempotency_key, p.source"
        " FROM pending_triage p, failed_operations f WHERE p.id = %s AND f.id = %s",
        (result.item_id, failure_id),
    ).fetchone()
    assert same == (True, f"failed_operations:{failure_id}#retry-1", "conversation")
    recorded = db.execute(
        "SELECT retried_at IS NOT NULL, retried_as FROM failed_operations WHERE id = %s",
        (failure_id,),
    ).fetchone()
    assert recorded == (True, result.item_id)
    again = failures.retry_failure(db, failure_id)
    assert again.item_id == result.item_id and "nothing done" in again.message
    assert count(db, "SELECT count(*) FROM pending_triage") == 1
