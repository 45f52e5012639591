"""The queue's SQL against a real PostgreSQL: claims, fences, retries, dead letters, keys."""

from __future__ import annotations

from datetime import datetime

import psycopg
import pytest

from sokratos_worker.model import Effects, NewMemory, Outcome, Queue
from sokratos_worker.store import failures
from sokratos_worker.store import queue as store
from sokratos_worker.store.migrations import load_migrations
from sokratos_worker.store.status import queue_stats
from tests.support.db import count, enqueue_many


def test_two_workers_claiming_at_once_get_disjoint_items(
    db: psycopg.Connection, database_url: str
) -> None:
    enqueue_many(db, 10)
    with psycopg.connect(database_url) as a, psycopg.connect(database_url) as b:
        # Both claims run inside open transactions, so a's row locks are held while b claims.
        first = store.claim(a, Queue.TRIAGE, owner="a", limit=6, lease_s=60)
        second = store.claim(b, Queue.TRIAGE, owner="b", limit=6, lease_s=60)
        a.commit()
        b.commit()
    ids_a, ids_b = {i.id for i in first}, {i.id for i in second}
    assert len(ids_a) == 6 and len(ids_b) == 4
    assert not ids_a & ids_b
    assert all(i.attempt == 1 for i in first + second)


def test_claim_counts_the_attempt_and_sets_the_lease(db: psycopg.Connection) -> None:
    (item_id,) = enqueue_many(db, 1)
    (item,) = store.claim(db, Queue.TRIAGE, owner="w1", limit=5, lease_s=60)
    row = db.execute(
        "SELECT attempts, lease_owner, lease_expires_at > now() FROM pending_triage"
    ).fetchone()
    assert item.id == item_id and row == (1, "w1", True)
    assert store.claim(db, Queue.TRIAGE, owner="w2", limit=5, lease_s=60) == []


def _expire(db: psycopg.Connection) -> None:
    db.execute("UPDATE pending_triage SET lease_expires_at = now() - interval '1 second'")


def test_expired_lease_is_claimed_again_and_the_old_owner_is_fenced(db: psycopg.Connection) -> None:
    enqueue_many(db, 1)
    (old,) = store.claim(db, Queue.TRIAGE, owner="dead", limit=1, lease_s=60)
    _expire(db)  # the rows a killed worker leaves
    (new,) = store.claim(db, Queue.TRIAGE, owner="alive", limit=1, lease_s=60)
    assert new.id == old.id and new.attempt == 2
    assert store.lease_owner(db, old) == (True, "alive")  # what the old owner's log names
    effects = Effects(
        Outcome.SAVED, memories=(NewMemory(origin=old.origin(0), summary="x", salience=5),)
    )
    # The old owner can neither settle, retry, give back nor dead-letter.
    assert not store.settle_success(db, old, effects, owner="dead")[0].settled
    assert not store.schedule_retry(db, old, owner="dead", error="e", delay_s=1)
    assert not store.give_back(db, old, owner="dead")
    assert not store.dead_letter(db, old, owner="dead", error="e").settled
    assert count(db, "SELECT count(*) FROM memories") == 0
    assert count(db, "SELECT count(*) FROM failed_operations") == 0
    # The new owner finishes it.
    result, _ = store.settle_success(db, new, effects, owner="alive")
    assert result.settled and len(result.memory_ids) == 1
    assert count(db, "SELECT count(*) FROM pending_triage") == 0
    assert count(db, "SELECT count(*) FROM work_outcomes WHERE outcome = 'saved'") == 1
    assert store.lease_owner(db, old) == (False, None)
    assert store.outcome_of(db, old)[:2] == ("saved", new.attempt)


def test_settle_is_one_transaction_with_effects_and_replay_writes_nothing_twice(
    db: psycopg.Connection,
) -> None:
    enqueue_many(db, 1)
    (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    memory = NewMemory(origin=item.origin(0), summary="fact", salience=6)
    # A crash after the memory commit is impossible (same tx); simulate an earlier replay that
    # already wrote the origin: the settle must reuse it, not insert a second row.
    replayed = db.execute(
        "INSERT INTO memories (summary, origin) VALUES ('fact', %s) RETURNING id", (item.origin(0),)
    ).fetchone()
    assert replayed is not None
    result, _ = store.settle_success(
        db, item, Effects(Outcome.SAVED, memories=(memory,)), owner="w"
    )
    assert result.settled
    assert count(db, "SELECT count(*) FROM memories WHERE origin = %s", item.origin(0)) == 1
    row = db.execute("SELECT outcome, memory_ids FROM work_outcomes").fetchone()
    assert row == ("saved", [replayed[0]])  # the outcome lists the row the replay wrote
    assert list(result.memory_ids) == [replayed[0]]
    assert count(db, "SELECT count(*) FROM pending_triage") == 0


def test_three_failed_attempts_become_one_failed_operation_with_the_whole_payload(
    db: psycopg.Connection,
) -> None:
    (item_id,) = enqueue_many(db, 1, behaviour="fail")
    for attempt in (1, 2):
        (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
        assert store.schedule_retry(db, item, owner="w", error=f"boom {attempt}", delay_s=0)
    (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    assert item.attempt == 3
    result = store.dead_letter(db, item, owner="w", error="boom 3")
    assert result.settled
    rows = db.execute(
        "SELECT op_type, context_data, attempts, item_id, id FROM failed_operations"
    ).fetchall()
    assert len(rows) == 1
    op_type, context, attempts, failed_item, failure_id = rows[0]
    assert result.failure_id == failure_id  # what item_dead_lettered names for `failed retry`
    assert op_type == "conversation_triage" and attempts == 3 and failed_item == item_id
    assert context["payload"]["exchange"].startswith("user: item 0")
    assert [a["error"] for a in context["attempts"]] == ["boom 1", "boom 2", "boom 3"]
    assert count(db, "SELECT count(*) FROM work_outcomes WHERE outcome = 'failed'") == 1
    assert count(db, "SELECT count(*) FROM pending_triage") == 0


def test_every_attempt_in_a_dead_letters_history_has_an_at(db: psycopg.Connection) -> None:
    # contract §3: context_data.attempts is [{"at", "error", "backend"?}]; the last had no "at".
    enqueue_many(db, 1, behaviour="fail")
    (first,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    assert store.schedule_retry(db, first, owner="w", error="first", delay_s=0)
    (last,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    assert store.dead_letter(db, last, owner="w", error="last", backend="b").settled
    row = db.execute("SELECT context_data->'attempts' FROM failed_operations").fetchone()
    assert row is not None
    first_entry, last_entry = row[0]
    assert (first_entry["error"], last_entry["error"]) == ("first", "last")
    assert last_entry["backend"] == "b"
    at = [datetime.fromisoformat(e["at"]) for e in (first_entry, last_entry)]
    assert at[0] <= at[1] and at[1].tzinfo is not None


def test_a_dead_letter_keeps_a_payload_too_deep_to_write_back_as_its_text(
    db: psycopg.Connection,
) -> None:
    # Readable by json.loads, but not writable by json.dumps once nested in the context:
    # the dead letter raised RecursionError, and the item looped for ever.
    depth = 985
    text = '{"x": ' + "[" * depth + "]" * depth + "}"
    db.execute("INSERT INTO pending_triage (payload) VALUES (%s::jsonb)", (text,))
    stored = db.execute("SELECT payload::text FROM pending_triage").fetchone()
    (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    assert store.dead_letter(db, item, owner="w", error="boom").settled
    row = db.execute("SELECT context_data->'payload' FROM failed_operations").fetchone()
    assert row is not None and stored is not None
    assert row[0] == {store.UNPARSABLE_KEY: stored[0]}
    assert count(db, "SELECT count(*) FROM work_outcomes WHERE outcome = 'failed'") == 1
    assert count(db, "SELECT count(*) FROM pending_triage") == 0


def test_failed_retry_replays_exactly_once_even_when_run_twice(db: psycopg.Connection) -> None:
    enqueue_many(db, 1, behaviour="fail", prefix="orig")
    (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    store.dead_letter(db, item, owner="w", error="boom")
    (failure_id,) = [r[0] for r in db.execute("SELECT id FROM failed_operations")]
    first = failures.retry_failure(db, failure_id)
    second = failures.retry_failure(db, failure_id)
    assert first.item_id is not None and second.item_id == first.item_id
    assert "already retried" in second.message
    rows = db.execute(
        "SELECT id, idempotency_key, payload->>'behaviour' FROM pending_triage"
    ).fetchall()
    assert rows == [(first.item_id, "orig0#retry-1", "fail")]
    assert failures.retry_key("orig0#retry-1", 1) == "orig0#retry-2"


def test_retry_refuses_a_failure_without_a_payload(db: psycopg.Connection) -> None:
    db.execute(
        "INSERT INTO failed_operations (op_type, label, error_message) VALUES ('memory_save', 'x', 'y')"
    )
    (failure_id,) = [r[0] for r in db.execute("SELECT id FROM failed_operations")]
    result = failures.retry_failure(db, failure_id)
    assert result.item_id is None and "no stored payload" in result.message


def test_retry_refuses_a_payload_that_cannot_be_enqueued_and_goes_on(
    db: psycopg.Connection,
) -> None:
    # Dead letters of payloads the enqueue function refuses: inserted behind its back, and
    # jsonb nested deeper than Python parses (kept as a marker holding the text).
    deep = "[" * 5000 + "]" * 5000
    db.execute("INSERT INTO pending_triage (payload) VALUES ('{\"exchange\": 42}')")
    db.execute(f"INSERT INTO pending_triage (payload) VALUES ('{deep}')")
    enqueue_many(db, 1, behaviour="fail", prefix="fine")
    for item in store.claim(db, Queue.TRIAGE, owner="w", limit=3, lease_s=60):
        store.dead_letter(db, item, owner="w", error="boom")
    ids = failures.retryable_ids(db, op_type=None)
    results = [failures.retry_failure(db, failure_id) for failure_id in ids]
    refused = [r for r in results if r.item_id is None]
    assert len(refused) == 2 and len(ids) == 3
    for result in refused:
        assert result.message.startswith("refused: the stored payload cannot be enqueued")
        assert f"failed show {result.failure_id}" in result.message
    assert "exchange" in refused[0].message  # names the field the enqueue function refused
    replayed = db.execute("SELECT idempotency_key, payload->>'behaviour' FROM pending_triage")
    assert replayed.fetchall() == [("fine0#retry-1", "fail")]  # only the valid one, once
    assert count(db, "SELECT count(*) FROM failed_operations WHERE retried_at IS NULL") == 2


def test_retry_all_leaves_out_payloads_the_worker_found_invalid(db: psycopg.Connection) -> None:
    enqueue_many(db, 2, behaviour="fail", prefix="f")
    items = store.claim(db, Queue.TRIAGE, owner="w", limit=2, lease_s=60)
    store.dead_letter(db, items[0], owner="w", error="invalid payload: tools_used must be a bool")
    store.dead_letter(db, items[1], owner="w", error="ChatFailed: no LLM backend gave a reply")
    invalid, other = (r[0] for r in db.execute("SELECT id FROM failed_operations ORDER BY id"))
    assert failures.retryable_ids(db, op_type=None) == [other]
    assert failures.invalid_payload_count(db, op_type=None) == 1
    # By ID it is still replayed (an upgrade may accept it): the operator asked for it.
    assert failures.retry_failure(db, invalid).item_id is not None
    assert failures.invalid_payload_count(db, op_type=None) == 0


def test_same_idempotency_key_is_one_item_even_after_it_finished(db: psycopg.Connection) -> None:
    payload = {"exchange": "user: hello there\nassistant: hi"}
    first = store.enqueue(db, Queue.TRIAGE, payload, idempotency_key="same")
    again = store.enqueue(db, Queue.TRIAGE, payload, idempotency_key="same")
    assert first == again and count(db, "SELECT count(*) FROM pending_triage") == 1
    (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    store.settle_success(db, item, Effects(Outcome.SKIPPED), owner="w")
    assert store.enqueue(db, Queue.TRIAGE, payload, idempotency_key="same") == first
    assert count(db, "SELECT count(*) FROM pending_triage") == 0


def test_give_back_returns_the_attempt(db: psycopg.Connection) -> None:
    enqueue_many(db, 1)
    (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    assert store.give_back(db, item, owner="w")
    row = db.execute("SELECT attempts, lease_owner FROM pending_triage").fetchone()
    assert row == (0, None)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"tools_used": True}, "payload.exchange is required"),
        ({"exchange": 42}, "payload.exchange is required and must be a string"),
    ],
)
def test_enqueue_rejects_a_payload_naming_the_field(
    db: psycopg.Connection, payload: dict[str, object], message: str
) -> None:
    from sokratos_worker.errors import InvalidPayload

    with pytest.raises(InvalidPayload) as info:
        store.enqueue(db, Queue.TRIAGE, payload)
    assert message in str(info.value)


def test_distillation_queue_uses_the_same_code(db: psycopg.Connection) -> None:
    enqueue_many(db, 2, queue="pending_distillation")
    items = store.claim(db, Queue.DISTILLATION, owner="w", limit=5, lease_s=60)
    assert [i.source for i in items] == ["distillation", "distillation"]
    archive = (
        NewMemory(
            origin=items[0].origin(0), summary="raw", salience=3, source="conversation_archive"
        ),
    )
    assert store.dead_letter(db, items[0], owner="w", error="no model", memories=archive).settled
    row = db.execute("SELECT outcome, memory_ids FROM work_outcomes").fetchone()
    assert row is not None and row[0] == "archived" and len(row[1]) == 1
    assert count(db, "SELECT count(*) FROM failed_operations WHERE op_type = 'distillation'") == 1


def test_queue_stats_counts_each_state_and_owner_in_one_pass(db: psycopg.Connection) -> None:
    ids = enqueue_many(db, 7)
    states = [
        ("NULL", "now() - interval '1 minute'", "NULL"),  # ready
        ("NULL", "now() - interval '2 minutes'", "NULL"),  # ready (oldest: created 2 min ago)
        ("NULL", "now() + interval '1 hour'", "NULL"),  # backing off
        ("'w1'", "now() - interval '1 minute'", "now() + interval '5 minutes'"),  # leased
        ("'w1'", "now() - interval '1 minute'", "now() + interval '5 minutes'"),  # leased
        ("'w2'", "now() - interval '1 minute'", "now() + interval '5 minutes'"),  # leased
        ("'w3'", "now() + interval '1 hour'", "now() - interval '1 second'"),  # expired: backing off
    ]
    for item_id, (owner, run_after, expires) in zip(ids, states, strict=True):
        db.execute(
            f"UPDATE pending_triage SET lease_owner = {owner}, run_after = {run_after},"
            f" lease_expires_at = {expires}, created_at = {run_after} WHERE id = %s",
            (item_id,),
        )
    stats = queue_stats(db)["pending_triage"]
    assert {k: v for k, v in stats.items() if k != "oldest_ready_age_s"} == {
        "ready": 2,
        "backing_off": 2,
        "leased": 3,
        "leased_by": {"w1": 2, "w2": 1},
    }
    assert 115 <= stats["oldest_ready_age_s"] <= 130
    assert queue_stats(db)["pending_distillation"] == {
        "ready": 0,
        "backing_off": 0,
        "leased": 0,
        "leased_by": {},
        "oldest_ready_age_s": None,
    }


def test_a_number_python_cannot_read_is_dead_lettered_not_a_stuck_claim(
    db: psycopg.Connection,
) -> None:
    """jsonb takes an integer of 5,000 digits; Python refuses over 4,300. The claim used to
    raise after leasing the batch (every item in it leased and counted, none run); now the
    payload becomes the marker holding its text, and the item fails with a clear error."""
    db.execute(
        "INSERT INTO pending_triage (payload) VALUES (jsonb_build_object('exchange', 'x',"
        " 'n', ('1' || repeat('0', 5000))::numeric))"
    )
    enqueue_many(db, 1, prefix="fine")
    items = store.claim(db, Queue.TRIAGE, owner="w", limit=2, lease_s=60)
    assert len(items) == 2
    problem = store.payload_problem(items[0])
    assert problem is not None and "a number too long" in str(problem)
    assert store.payload_problem(items[1]) is None
    store.dead_letter(db, items[0], owner="w", error=str(problem))
    [(text,)] = db.execute("SELECT context_data->'payload'->>'__unparsable_json__' FROM failed_operations")
    assert text.startswith('{"n": 1000') and len(text) > 5000


def test_a_dead_letter_keeps_every_digit_of_the_payloads_numbers(db: psycopg.Connection) -> None:
    """The payload is stored as the queue held it (jsonb to jsonb), not through Python floats,
    so a replay is exact: 3.14159265358979323846 used to come back as 3.141592653589793."""
    db.execute(
        "INSERT INTO pending_triage (payload) VALUES"
        " ('{\"exchange\": \"x\", \"pi\": 3.14159265358979323846, \"big\": 12345678901234567890123}')"
    )
    [item] = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    store.dead_letter(db, item, owner="w", error="boom")
    [(same,)] = db.execute(
        "SELECT context_data->'payload' = '{\"exchange\": \"x\", \"pi\": 3.14159265358979323846,"
        " \"big\": 12345678901234567890123}'::jsonb FROM failed_operations"
    )
    assert same is True


def _archive(item_id: int, texts: list[str]) -> tuple[NewMemory, ...]:
    return tuple(
        NewMemory(
            origin=f"pending_distillation:{item_id}:{i}",
            summary=text,
            salience=3,
            source="conversation_archive",
            tags=("conversation_archive",),
        )
        for i, text in enumerate(texts)
    )


def test_a_retried_distillation_failing_again_keeps_one_raw_archive(
    db: psycopg.Connection,
) -> None:
    """The replay of a dead letter is a new item with new origins: failing again, it used to
    save the raw archive a second time. Its chunks are listed from the first save instead, all
    of them and only them, even when this version would cut the same payload into other chunks
    (here a third): the replay's payload is the first one's, and the first save holds it."""
    db.execute("SELECT sokratos_enqueue_distillation('{\"archive_text\": \"a\"}', 'conv-7')")
    outcomes = []
    for round_ in range(3):
        (item,) = store.claim(db, Queue.DISTILLATION, owner="w", limit=1, lease_s=60)
        texts = ["chunk one", "chunk two"] + (["chunk three"] if round_ == 2 else [])
        archive = _archive(item.id, texts)
        assert store.dead_letter(db, item, owner="w", error="boom", memories=archive).settled
        outcomes.append(
            db.execute(
                "SELECT outcome, memory_ids FROM work_outcomes WHERE item_id = %s", (item.id,)
            ).fetchone()
        )
        (failure_id,) = db.execute(
            "SELECT id FROM failed_operations WHERE item_id = %s", (item.id,)
        ).fetchone()
        if round_ < 2:
            assert failures.retry_failure(db, failure_id).item_id is not None
    first, second, third = outcomes
    assert first[0] == second[0] == third[0] == "archived"
    assert second[1] == first[1] and len(first[1]) == 2
    assert sorted(third[1]) == sorted(first[1])
    rows = db.execute(
        "SELECT summary, count(*) FROM memories GROUP BY summary ORDER BY summary"
    ).fetchall()
    assert rows == [("chunk one", 1), ("chunk two", 1)]


def test_an_unrelated_distillation_with_the_same_text_gets_its_own_archive(
    db: psycopg.Connection,
) -> None:
    """Only the item's own replay chain is reused: two conversations that read alike are two."""
    db.execute("SELECT sokratos_enqueue_distillation('{\"archive_text\": \"a\"}', 'conv-a')")
    db.execute("SELECT sokratos_enqueue_distillation('{\"archive_text\": \"a\"}', 'conv-b')")
    for item in store.claim(db, Queue.DISTILLATION, owner="w", limit=2, lease_s=60):
        archive = _archive(item.id, ["same"])
        assert store.dead_letter(db, item, owner="w", error="boom", memories=archive).settled
    assert count(db, "SELECT count(*) FROM memories WHERE summary = 'same'") == 2


def test_a_producer_key_ending_in_retry_n_does_not_borrow_another_items_archive(
    db: psycopg.Connection,
) -> None:
    """Keys are the producer's: its own ``chat-42#retry-1`` is no ``failed retry`` replay of
    ``chat-42``. Only links the worker made (replay_of, failed_operations.retried_as) lead to
    an earlier archive; a key's shape reused the first one's, and the second conversation was
    never saved."""
    db.execute("SELECT sokratos_enqueue_distillation('{\"archive_text\": \"a\"}', 'chat-42')")
    db.execute(
        "SELECT sokratos_enqueue_distillation('{\"archive_text\": \"a\"}', 'chat-42#retry-1')"
    )
    first, second = store.claim(db, Queue.DISTILLATION, owner="w", limit=2, lease_s=60)
    for item in (first, second):
        archive = _archive(item.id, ["same"])
        assert store.dead_letter(db, item, owner="w", error="boom", memories=archive).settled
    assert count(db, "SELECT count(*) FROM failed_operations WHERE retried_as IS NOT NULL") == 0
    rows = db.execute(
        "SELECT item_id, idempotency_key, memory_ids FROM work_outcomes ORDER BY item_id"
    ).fetchall()
    assert count(db, "SELECT count(*) FROM memories WHERE summary = 'same'") == 2, (
        f"the second conversation's archive is the first one's memory: {rows}"
    )


def test_failed_retry_links_the_replay_and_its_dead_letter_keeps_the_link(
    db: psycopg.Connection,
) -> None:
    """``failed retry`` sets the replay's ``replay_of`` in its own transaction; the replay's
    dead letter copies it into work_outcomes, where it outlives the failure row. Items a
    producer enqueues, and outcomes of successes, carry none."""
    (original,) = db.execute(
        "SELECT sokratos_enqueue_distillation('{\"archive_text\": \"a\"}')"
    ).fetchone()
    (item,) = store.claim(db, Queue.DISTILLATION, owner="w", limit=1, lease_s=60)
    failure_id = store.dead_letter(db, item, owner="w", error="boom").failure_id
    assert failure_id is not None
    replay = failures.retry_failure(db, failure_id).item_id
    assert db.execute(
        "SELECT replay_of FROM pending_distillation WHERE id = %s", (replay,)
    ).fetchone() == (original,)
    (item,) = store.claim(db, Queue.DISTILLATION, owner="w", limit=1, lease_s=60)
    assert store.dead_letter(db, item, owner="w", error="boom again").settled
    rows = db.execute("SELECT item_id, replay_of FROM work_outcomes ORDER BY item_id").fetchall()
    assert rows == [(original, None), (replay, original)]


def test_a_replay_under_a_retry_key_the_producer_already_used_is_still_enqueued(
    db: psycopg.Connection,
) -> None:
    """``chat-42#retry-1`` is a key the producer used itself: the replay of ``chat-42`` took
    it, the enqueue answered with the producer's item and enqueued nothing. The replay counts
    on to a free key, and only the replay is linked."""
    db.execute("SELECT sokratos_enqueue_distillation('{\"archive_text\": \"a\"}', 'chat-42')")
    (first,) = store.claim(db, Queue.DISTILLATION, owner="w", limit=1, lease_s=60)
    failure_id = store.dead_letter(db, first, owner="w", error="boom").failure_id
    assert failure_id is not None
    (producers,) = db.execute(
        "SELECT sokratos_enqueue_distillation('{\"archive_text\": \"b\"}', 'chat-42#retry-1')"
    ).fetchone()
    replay = failures.retry_failure(db, failure_id).item_id
    assert replay is not None and replay != producers
    rows = db.execute(
        "SELECT id, idempotency_key, replay_of FROM pending_distillation ORDER BY id"
    ).fetchall()
    assert rows == [(producers, "chat-42#retry-1", None), (replay, "chat-42#retry-2", first.id)]


def test_a_replay_enqueued_before_the_link_existed_follows_the_failure_row(
    db: psycopg.Connection,
) -> None:
    """A replay ``failed retry`` enqueued before migration 0044 has no ``replay_of``: while
    its failure row is kept, failed_operations.retried_as still leads to the first archive."""
    db.execute("SELECT sokratos_enqueue_distillation('{\"archive_text\": \"a\"}', 'conv-9')")
    (item,) = store.claim(db, Queue.DISTILLATION, owner="w", limit=1, lease_s=60)
    result = store.dead_letter(db, item, owner="w", error="boom", memories=_archive(item.id, ["x"]))
    assert result.failure_id is not None
    replay = failures.retry_failure(db, result.failure_id).item_id
    db.execute("UPDATE pending_distillation SET replay_of = NULL WHERE id = %s", (replay,))
    (item,) = store.claim(db, Queue.DISTILLATION, owner="w", limit=1, lease_s=60)
    again = store.dead_letter(db, item, owner="w", error="boom", memories=_archive(item.id, ["x"]))
    assert again.memory_ids == result.memory_ids
    assert count(db, "SELECT count(*) FROM memories WHERE summary = 'x'") == 1


def test_the_migration_writes_the_links_failed_operations_holds(db: psycopg.Connection) -> None:
    """Replays made before migration 0044 get their ``replay_of`` from retried_as when it is
    applied (queued ones and dead-lettered ones), so a later purge loses nothing."""
    (original,) = db.execute(
        "SELECT sokratos_enqueue_distillation('{\"archive_text\": \"a\"}')"
    ).fetchone()
    (item,) = store.claim(db, Queue.DISTILLATION, owner="w", limit=1, lease_s=60)
    failure = store.dead_letter(db, item, owner="w", error="boom").failure_id
    assert failure is not None
    replay = failures.retry_failure(db, failure).item_id
    (item,) = store.claim(db, Queue.DISTILLATION, owner="w", limit=1, lease_s=60)
    second = store.dead_letter(db, item, owner="w", error="boom").failure_id
    assert second is not None
    queued = failures.retry_failure(db, second).item_id
    # As before 0044: no replay_of anywhere.
    db.execute("UPDATE pending_distillation SET replay_of = NULL")
    db.execute("UPDATE work_outcomes SET replay_of = NULL")
    (migration,) = [m for m in load_migrations() if m.name == "0044_replay_links"]
    db.execute(migration.sql.encode())  # idempotent: as if applied now
    assert db.execute("SELECT id, replay_of FROM pending_distillation").fetchall() == [
        (queued, replay)
    ]
    rows = db.execute("SELECT item_id, replay_of FROM work_outcomes ORDER BY item_id").fetchall()
    assert rows == [(original, None), (replay, original)]
