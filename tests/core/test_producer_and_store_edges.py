"""Edges of the producer side and the store that no other test pinned (found by planting
mutants): what the Python client and the spool accept and store, next_ready_in, a replay
racing a producer for its key, purge past one batch, email items replayed as email, memory
origins and the embedding model. Each test names the mutant it kills. Real PostgreSQL;
assertions on the rows where they apply.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from sokratos_worker import client
from sokratos_worker.errors import InvalidPayload
from sokratos_worker.model import Effects, NewMemory, Outcome, Queue
from sokratos_worker.spool import import_spool
from sokratos_worker.store import failures
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import Database
from sokratos_worker.store.memories import write_effects
from sokratos_worker.store.sanitize import MAX_DEPTH
from tests.support.db import enqueue_many


def _nested(depth: int) -> Any:
    value: Any = "deepest"
    for _ in range(depth):
        value = [value]
    return value


def test_a_tuple_in_a_python_payload_is_stored_as_an_array(database_url: str) -> None:
    """Kills: sanitize walking ``list`` only. A producer's tuple (a natural Python sequence)
    is a JSON array to json.dumps; refusing it would turn a valid enqueue into an error."""
    done = client.enqueue(
        database_url,
        Queue.DISTILLATION,
        {"archive_text": "user: hi\nassistant: hello", "tags": ("a", "b")},
        key="tuple-1",
    )
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT payload -> 'tags' FROM pending_distillation WHERE id = %s",
            (done.item_id,),
        ).fetchone()
    assert row == (["a", "b"],)


def test_a_payload_nested_exactly_max_depth_is_accepted(database_url: str) -> None:
    """Kills: ``depth >= MAX_DEPTH`` in sanitize. The limit is inclusive: a payload nested
    MAX_DEPTH levels below its top is stored whole; one level more is refused by name."""
    deep = {"archive_text": "x", "extra": _nested(MAX_DEPTH - 1)}  # "extra" is depth 1
    done = client.enqueue(database_url, Queue.DISTILLATION, deep, key="deep-ok")
    assert done.item_id is not None
    with pytest.raises(InvalidPayload, match="nested deeper than 64 levels"):
        client.enqueue(
            database_url,
            Queue.DISTILLATION,
            {"archive_text": "x", "extra": _nested(MAX_DEPTH)},
            key="deep-too",
        )
    with psycopg.connect(database_url) as conn:
        keys = conn.execute("SELECT idempotency_key FROM pending_distillation").fetchall()
    assert keys == [("deep-ok",)]


def test_an_empty_triage_source_is_refused_not_taken_as_conversation(
    database_url: str,
) -> None:
    """Kills: "" admitted as a triage source. store.enqueue maps a falsy source to
    conversation, so an email producer passing an empty variable would have its item read
    as a conversation exchange instead of being refused."""
    exchange = {"exchange": "user: hi\nassistant: hello"}
    with pytest.raises(InvalidPayload, match="source"):
        client.enqueue(database_url, Queue.TRIAGE, exchange, source="", key="e1")
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM pending_triage").fetchone() == (0,)


def test_next_ready_in_waits_for_a_live_lease_and_never_goes_negative(
    db: psycopg.Connection,
) -> None:
    """Kills: next_ready_in reading ``run_after`` only, and without its ``max(0.0, ...)``. A
    leased item is not claimable before its lease expires (the runner would spin on it), and
    an item overdue is ready now (0), not a negative wait."""
    (item_id,) = enqueue_many(db, 1)
    db.execute(
        "UPDATE pending_triage SET run_after = now() - interval '1 hour',"
        " lease_owner = 'w', lease_expires_at = now() + interval '100 seconds' WHERE id = %s",
        (item_id,),
    )
    waiting = store.next_ready_in(db, [Queue.TRIAGE, Queue.DISTILLATION])
    assert waiting is not None
    assert 90.0 < waiting <= 100.0
    db.execute(
        "UPDATE pending_triage SET lease_owner = NULL, lease_expires_at = NULL WHERE id = %s",
        (item_id,),
    )
    assert store.next_ready_in(db, [Queue.TRIAGE]) == 0.0
    assert store.next_ready_in(db, [Queue.DISTILLATION]) is None


def test_purge_deletes_every_old_failure_past_one_batch(
    db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kills: purge stopping when a batch is exactly full (``rowcount <= PURGE_BATCH``). A
    purge that returns after one full batch leaves old failures behind and under-counts."""
    monkeypatch.setattr(failures, "PURGE_BATCH", 2)
    for age in (40, 40, 40, 40, 1):
        db.execute(
            "INSERT INTO failed_operations (op_type, label, error_message, context_data,"
            " created_at) VALUES ('t', 'l', 'e', '{}', now() - make_interval(days => %s))",
            (age,),
        )
    assert failures.purge_failures(db, older_than_days=30) == 4
    left = db.execute("SELECT count(*) FROM failed_operations").fetchone()
    assert left == (1,)


def test_an_email_item_is_spooled_checked_for_its_text_not_an_exchange(
    tmp_path: Path, db: psycopg.Connection, database_url: str
) -> None:
    """Kills: the offline check asking every triage item for ``exchange``. An email item
    carries ``text``: spooled while the database is down, it must be kept and imported as an
    email item; one without ``text`` is refused before the spool, as the database would."""
    spool = tmp_path / "spool"
    done = client.spool(spool, Queue.TRIAGE, {"text": "Subject: hi"}, source="email", key="m1")
    assert done.spooled is not None
    with pytest.raises(InvalidPayload, match=r"payload\.text"):
        client.spool(spool, Queue.TRIAGE, {"exchange": "user: hi"}, source="email", key="m2")
    database = Database(database_url, size=1)
    try:
        import_spool(spool, database)
    finally:
        database.close()
    rows = db.execute(
        "SELECT idempotency_key, source, payload ->> 'text' FROM pending_triage"
    ).fetchall()
    assert rows == [("m1", "email", "Subject: hi")]
    assert db.execute("SELECT count(*) FROM failed_operations").fetchone() == (0,)


def test_the_python_client_enqueues_an_email_item_as_email(database_url: str) -> None:
    """Kills: store.enqueue passing "conversation" whatever the source. An email producer's
    item must keep its source (the triage pipeline reads ``text`` for it), not be refused or
    read as a conversation."""
    done = client.enqueue(
        database_url,
        Queue.TRIAGE,
        {"text": "Subject: lunch"},
        source="email",
        key="mail-1",
    )
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT source, payload ->> 'text' FROM pending_triage WHERE id = %s",
            (done.item_id,),
        ).fetchone()
    assert row == ("email", "Subject: lunch")


@pytest.mark.parametrize("point", [0xD800, 0xDBFF, 0xDC80])
def test_a_lone_surrogate_of_either_half_is_stored_escaped(database_url: str, point: int) -> None:
    """Kills: clean_text escaping low surrogates only. A lone high surrogate (a producer's
    string cut between a pair) cannot be encoded as UTF-8 either: it is stored as its six
    characters, not refused with an encoding error (the item lost)."""
    lone = chr(point)
    done = client.enqueue(
        database_url,
        Queue.TRIAGE,
        {"exchange": f"user: a{lone}b\nassistant: ok"},
        key="s1",
    )
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT payload ->> 'exchange' FROM pending_triage WHERE id = %s",
            (done.item_id,),
        ).fetchone()
    assert row == (f"user: a\\u{point:04x}b\nassistant: ok",)


def test_a_nul_in_a_payload_key_is_stored_escaped(database_url: str) -> None:
    """Kills: sanitize cleaning values but not object keys. jsonb cannot hold a NUL in a key
    either: the key is stored with the six characters ``\\u0000``, not refused by PostgreSQL
    (the enqueue lost)."""
    done = client.enqueue(
        database_url,
        Queue.DISTILLATION,
        {"archive_text": "x", "no\x00te": 1},
        key="nul-key",
    )
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT payload ? 'no\\u0000te' FROM pending_distillation WHERE id = %s",
            (done.item_id,),
        ).fetchone()
    assert row == (True,)


def _wait_until_waiting_on_a_lock(db: psycopg.Connection, pid: int) -> None:
    """Returns once the backend ``pid`` waits on a lock (bounded: 30 s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        row = db.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
        if row is not None and row[0] == "Lock":
            return
        time.sleep(0.02)
    raise AssertionError(f"backend {pid} never waited on the producer's key")


def test_a_batch_replay_whose_key_a_producer_took_meanwhile_is_enqueued_again(
    db: psycopg.Connection, database_url: str
) -> None:
    """Kills: _replay_into not re-enqueueing a replay its transaction did not insert. A
    producer committing ``chat-7#retry-1`` while `failed retry --all` runs makes the enqueue
    answer with the producer's item: the replay must go again under the next key, else its
    payload is lost and the failure marked retried as someone else's item."""
    db.execute(
        "SELECT sokratos_enqueue_triage(%s, 'chat-7')",
        (Jsonb({"exchange": "user: the failed one\nassistant: ok"}),),
    )
    (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    assert store.dead_letter(db, item, owner="w", error="model said no").settled
    (failure_id,) = db.execute("SELECT id FROM failed_operations").fetchone()
    results: dict[int, list[failures.RetryResult]] = {}
    with (
        psycopg.connect(database_url, autocommit=True) as producer,
        psycopg.connect(database_url, autocommit=True) as operator,
    ):
        operator.execute("SET lock_timeout = 20000")
        with producer.transaction():
            row = producer.execute(
                "SELECT sokratos_enqueue_triage(%s, 'chat-7#retry-1')",
                (Jsonb({"exchange": "user: the producer's own\nassistant: ok"}),),
            ).fetchone()
            assert row is not None
            producers_item = int(row[0])
            other = threading.Thread(
                target=lambda: results.__setitem__(0, failures.retry_batch(operator, [failure_id]))
            )
            other.start()
            _wait_until_waiting_on_a_lock(db, operator.info.backend_pid)
        other.join(30)
    (result,) = results[0]
    assert result.item_id is not None and result.item_id != producers_item
    rows = db.execute(
        "SELECT idempotency_key, payload ->> 'exchange' FROM pending_triage ORDER BY id"
    ).fetchall()
    assert rows == [
        ("chat-7#retry-1", "user: the producer's own\nassistant: ok"),
        ("chat-7#retry-2", "user: the failed one\nassistant: ok"),
    ]
    marked = db.execute("SELECT retried_as FROM failed_operations").fetchone()
    assert marked == (result.item_id,)


def test_failed_retry_replays_an_email_item_as_email(db: psycopg.Connection) -> None:
    """Kills: the replay enqueueing every triage failure as a conversation. A dead-lettered
    email item keeps its source in the failure's context: `failed retry` must re-enqueue it
    as email (its payload has ``text``, no ``exchange``), not have it refused."""
    db.execute(
        "SELECT sokratos_enqueue_triage(%s, 'mail-9', 'email')",
        (Jsonb({"text": "Subject: dinner on Friday"}),),
    )
    (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    assert store.dead_letter(db, item, owner="w", error="model said no").settled
    (failure_id,) = db.execute("SELECT id FROM failed_operations").fetchone()
    result = failures.retry_failure(db, failure_id)
    assert result.item_id is not None, result.message
    row = db.execute(
        "SELECT source, idempotency_key, payload ->> 'text' FROM pending_triage WHERE id = %s",
        (result.item_id,),
    ).fetchone()
    assert row == ("email", "mail-9#retry-1", "Subject: dinner on Friday")


def test_a_retried_settle_keeps_its_own_earlier_chunk_and_records_the_embedding_model(
    db: psycopg.Connection,
) -> None:
    """Kills: the near-duplicate check at the settle counting the item's own memories (own
    origin pattern built from the whole origin), and the insert dropping ``embedding_model``.
    A chunk an earlier attempt of the same item wrote is no duplicate: the draft is written,
    with the model that embedded it (readers compare only vectors of one model)."""
    vec = (1.0, 0.0, 0.0, 0.0)

    def chunk(origin: str, *, head: bool) -> NewMemory:
        return NewMemory(
            origin=origin,
            summary=f"text of {origin}",
            salience=5,
            embedding=vec,
            embedding_model="embed-a",
            duplicate_check=head,
        )

    with db.transaction():
        write_effects(
            db,
            Effects(Outcome.SAVED, memories=(chunk("pending_triage:5:0", head=False),)),
        )
    with db.transaction():
        written = write_effects(
            db,
            Effects(Outcome.SAVED, memories=(chunk("pending_triage:5:1", head=True),)),
        )
    assert written.duplicate_of == ()
    rows = db.execute("SELECT origin, embedding_model FROM memories ORDER BY id").fetchall()
    assert rows == [
        ("pending_triage:5:0", "embed-a"),
        ("pending_triage:5:1", "embed-a"),
    ]
