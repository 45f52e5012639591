"""Found by breaking the code on purpose (mutation testing), which no test noticed: boundaries and give-backs no other test held the code to.

Each test names the mutation it kills. Real PostgreSQL; assertions on the rows.
"""

from __future__ import annotations

import random

import psycopg
import pytest
from structlog.testing import capture_logs

from sokratos_worker.client import _distillable
from sokratos_worker.config import EmailAccountConfig
from sokratos_worker.email.checkpoint import start_uid
from sokratos_worker.email.imap_answers import MailboxState
from sokratos_worker.errors import InvalidPayload
from sokratos_worker.model import Queue
from sokratos_worker.pipelines.archive import archive_from_payload
from sokratos_worker.pipelines.distill import MAX_ARCHIVE_BYTES, _bounded
from sokratos_worker.policy import retry_delay
from sokratos_worker.runner import Runner
from sokratos_worker.store import email as email_store
from sokratos_worker.store import queue as store
from sokratos_worker.store.connection import Database
from tests.support.db import count, enqueue_many
from tests.support.handlers import ScriptedHandler, fast_settings


def test_backends_unavailable_on_the_last_attempt_still_gives_it_back(
    db: psycopg.Connection, database_url: str
) -> None:
    """Kills: ``after_failure`` dead-lettering a BackendsUnavailable once the attempts are
    used up. What is not the item's fault is not the item's attempt, on the last one too
    (durability.md): the item waits, it does not land in failed_operations."""
    enqueue_many(db, 1, behaviour="unavailable")
    db.execute("UPDATE pending_triage SET attempts = 2")  # two failed attempts before this one
    handler = ScriptedHandler(probe_ok=False)
    database = Database(database_url, size=4)
    runner = Runner(
        settings=fast_settings(concurrency=1, max_attempts=3),
        database=database,
        handlers={Queue.TRIAGE: handler},
        worker_id="w",
    )
    with capture_logs():
        runner.start(drain_only=True, budget_s=1.0)
        assert runner.wait_drained(20)
        runner.shutdown(1)
    database.close()
    assert handler.calls == 1
    assert db.execute("SELECT attempts, lease_owner FROM pending_triage").fetchall() == [(2, None)]
    assert count(db, "SELECT count(*) FROM failed_operations") == 0
    assert count(db, "SELECT count(*) FROM work_outcomes") == 0


def test_renew_extends_only_the_callers_own_leases(db: psycopg.Connection) -> None:
    """Kills: the renew without ``lease_owner = %(owner)s``. A worker whose lease was taken
    over must learn it (the id is not returned) and must not extend the new owner's lease."""
    enqueue_many(db, 1)
    (old,) = store.claim(db, Queue.TRIAGE, owner="old", limit=1, lease_s=60)
    db.execute("UPDATE pending_triage SET lease_expires_at = now() - interval '1 second'")
    store.claim(db, Queue.TRIAGE, owner="new", limit=1, lease_s=5)
    before = db.execute("SELECT lease_expires_at FROM pending_triage").fetchone()
    assert store.renew(db, Queue.TRIAGE, owner="old", ids=[old.id], lease_s=600) == set()
    after = db.execute("SELECT lease_expires_at, lease_owner FROM pending_triage").fetchone()
    assert after == (before[0] if before else None, "new")
    assert store.renew(db, Queue.TRIAGE, owner="new", ids=[old.id], lease_s=600) == {old.id}


def test_the_first_retry_waits_the_base_delay() -> None:
    """Kills: an off-by-one in the backoff exponent. ``base * 4**(attempt-1)``, ±20 %: after
    attempt 1 the defaults (30 s base) wait 24-36 s, after attempt 2 96-144 s, capped."""
    rng = random.Random(7)
    for _ in range(50):
        assert 24.0 <= retry_delay(1, base_s=30, max_s=1800, rng=rng) <= 36.0
        assert 96.0 <= retry_delay(2, base_s=30, max_s=1800, rng=rng) <= 144.0
        assert retry_delay(9, base_s=30, max_s=1800, rng=rng) <= 1800 * 1.2


def _account() -> EmailAccountConfig:
    return EmailAccountConfig(name="acct", host="imap.invalid", username="u", password="p")


def test_uidnext_equal_to_the_checkpoint_resets_it(db: psycopg.Connection) -> None:
    """Kills: ``uidnext <= last_uid`` weakened to ``<``. UIDNEXT 10 with last_uid 10 means the
    next mail gets UID 10, which reading above the checkpoint never fetches: lost mail."""
    account = _account()
    db.execute(
        "INSERT INTO email_checkpoints (account, mailbox, uidvalidity, last_uid)"
        " VALUES (%s, %s, 7, 10)",
        (account.name, account.mailbox),
    )
    checkpoint = email_store.load_checkpoint(db, account.name, account.mailbox)
    assert checkpoint is not None and checkpoint.last_uid == 10
    with capture_logs():
        start = start_uid(db, account, checkpoint, MailboxState(7, exists=10, uidnext=10))
    assert start == (0, "uids_reused")
    row = db.execute("SELECT uidvalidity, last_uid FROM email_checkpoints").fetchone()
    assert row == (7, 0)
    # One above is the normal case: read on from the checkpoint.
    db.execute("UPDATE email_checkpoints SET last_uid = 10")
    checkpoint = email_store.load_checkpoint(db, account.name, account.mailbox)
    state = MailboxState(7, exists=10, uidnext=11)
    assert start_uid(db, account, checkpoint, state) == (10, None)


def test_the_checkpoint_never_moves_back_within_one_uidvalidity(db: psycopg.Connection) -> None:
    """Kills: ``advance_checkpoint`` without GREATEST (its docstring: never back, should two
    checks of one account overlap)."""
    account = _account()

    def record(uid: int) -> None:
        email_store.record_message(
            db,
            email_store.MessageRecord(
                account=account.name,
                mailbox=account.mailbox,
                uidvalidity=7,
                uid=uid,
                key=f"<m{uid}@example>",
                payload=None,
            ),
        )

    record(10)
    record(5)  # a slower, overlapping check records an older message last
    assert db.execute("SELECT last_uid FROM email_checkpoints").fetchone() == (10,)


def test_an_archive_of_exactly_the_limit_is_distilled_as_the_client_accepted_it(
    db: psycopg.Connection,
) -> None:
    """Kills: ``size > MAX_ARCHIVE_BYTES`` turned ``>=`` in the distiller. "At most 512 kB are
    distilled": the client accepts an archive of exactly the limit, so the worker must not
    dead-letter it as too long (an item accepted at enqueue, refused by the worker)."""
    exact = {"archive_text": "é" * (MAX_ARCHIVE_BYTES // 2)}  # 2 bytes each: the limit exactly
    _distillable(exact)  # the client accepts it
    store.enqueue(db, Queue.DISTILLATION, exact, idempotency_key="exact")
    (item,) = store.claim(db, Queue.DISTILLATION, owner="w", limit=1, lease_s=60)
    archive = _bounded(item, archive_from_payload(item.payload, item.created_at))
    assert len(archive.text.encode()) == MAX_ARCHIVE_BYTES
    over = {"archive_text": exact["archive_text"] + "x"}
    with pytest.raises(InvalidPayload):
        _distillable(over)
    with pytest.raises(InvalidPayload):
        _bounded(item, archive_from_payload(over, item.created_at))
