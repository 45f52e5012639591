"""Two replays whose next free `#retry-N` key is the same, at the same time: each must be
re-enqueued. The key is chosen from the committed keys, so two transactions both picked
`chat-42#retry-2`; the second enqueue waited for the first, then answered with the first's
item (ON CONFLICT DO NOTHING): the second failure was marked retried as the other failure's
item, its own payload never re-enqueued (lost; `retry --all` would not offer it again)."""

from __future__ import annotations

import threading
import time

import psycopg
from psycopg.types.json import Jsonb

from sokratos_worker.model import Queue
from sokratos_worker.store import failures
from sokratos_worker.store import queue as store


def dead_letter_keyed(db: psycopg.Connection, key: str, text: str) -> int:
    db.execute("SELECT sokratos_enqueue_triage(%s, %s)", (Jsonb({"exchange": text}), key))
    (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    assert store.dead_letter(db, item, owner="w", error="model said no").settled
    row = db.execute("SELECT id FROM failed_operations WHERE item_id = %s", (item.id,)).fetchone()
    return int(row[0])


def test_concurrent_retries_picking_the_same_free_key_both_replay(
    db: psycopg.Connection, database_url: str
) -> None:
    # A producer's own keys (README: "a producer's own chat-42#retry-1 gets its own archive").
    f1 = dead_letter_keyed(db, "chat-42", "user: first conversation\nassistant: ok")
    f2 = dead_letter_keyed(db, "chat-42#retry-1", "user: second conversation\nassistant: ok")
    results = {}
    with psycopg.connect(database_url, autocommit=True) as a, psycopg.connect(
        database_url, autocommit=True
    ) as b:
        b.execute("SET lock_timeout = 20000")
        with a.transaction():
            results[f1] = failures._retry_once(a, f1)  # `failed retry F1`, not committed yet
            other = threading.Thread(
                target=lambda: results.__setitem__(f2, failures.retry_failure(b, f2))
            )
            other.start()  # `failed retry F2` in another terminal
            time.sleep(1.0)
        other.join(30)
    assert results[f1].item_id is not None and results[f2].item_id is not None
    replayed = {
        r[0] for r in db.execute("SELECT payload ->> 'exchange' FROM pending_triage")
    }
    assert replayed == {
        "user: first conversation\nassistant: ok",
        "user: second conversation\nassistant: ok",
    }, (results, replayed)
    assert results[f1].item_id != results[f2].item_id


def test_retry_racing_a_producer_enqueue_of_the_retry_key_replays_and_links_nothing_foreign(
    db: psycopg.Connection, database_url: str
) -> None:
    """`_free_retry_key` exists so a producer's own `chat-42#retry-1` is not answered instead of
    the replay; a producer transaction that enqueues that key while the retry runs still is."""
    f1 = dead_letter_keyed(db, "chat-42", "user: first conversation\nassistant: ok")
    results = {}
    with psycopg.connect(database_url, autocommit=True) as producer, psycopg.connect(
        database_url, autocommit=True
    ) as operator:
        operator.execute("SET lock_timeout = 20000")
        with producer.transaction():
            row = producer.execute(
                "SELECT sokratos_enqueue_triage(%s, 'chat-42#retry-1')",
                (Jsonb({"exchange": "user: the producer's own retry\nassistant: ok"}),),
            ).fetchone()
            producers_item = int(row[0])
            other = threading.Thread(
                target=lambda: results.__setitem__(f1, failures.retry_failure(operator, f1))
            )
            other.start()
            time.sleep(1.0)
        other.join(30)
    replayed = sorted(
        r[0] for r in db.execute("SELECT payload ->> 'exchange' FROM pending_triage")
    )
    assert replayed == [
        "user: first conversation\nassistant: ok",
        "user: the producer's own retry\nassistant: ok",
    ], (results, replayed)
    assert results[f1].item_id != producers_item
    link = db.execute(
        "SELECT replay_of FROM pending_triage WHERE id = %s", (producers_item,)
    ).fetchone()
    assert link == (None,)
