"""The SQL of email checks: checkpoints, processed_emails and the enqueue of triage items.

:func:`record_message` is the heart of it: one transaction that marks a message processed,
enqueues its triage item and advances the checkpoint, so a crash anywhere leaves either all
three or none (``durability.md`` "Email").
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeAlias

import psycopg

from sokratos_worker.store.connection import connect, translated
from sokratos_worker.store.failures import EMAIL_OP_TYPE
from sokratos_worker.store.status import SESSION_COLUMNS, session

Connection: TypeAlias = psycopg.Connection[Any]

__all__ = [
    "Checkpoint",
    "Connection",
    "MessageRecord",
    "PassedKeyTaken",
    "Recorded",
    "account_rows",
    "advisory_lock",
    "begin_first_check",
    "clear_refusal",
    "close_failures",
    "connect",
    "finish_check",
    "first_recorded_at",
    "forget_refusal",
    "known_at_uid",
    "load_checkpoint",
    "lock_holder",
    "note_fingerprint",
    "note_refusal",
    "passed_key",
    "prune_processed_emails",
    "record_error",
    "record_message",
    "record_passed",
    "recorded_at_uid",
    "release_lock",
    "reset_checkpoint",
]


class PassedKeyTaken(RuntimeError):
    """A message's key is held by a 'passed' row (which :func:`passed_key` rules out)."""


@dataclass(frozen=True)
class Checkpoint:
    """Where an account's mailbox was last read up to."""

    uidvalidity: int | None
    last_uid: int
    checked_at: datetime | None
    last_error: str | None
    last_error_at: datetime | None
    first_check_done: bool = False  # kept through UIDVALIDITY resets, unlike checked_at
    refused_uid: int | None = None  # the UID the server refused on the last checks, if any
    first_check_started_at: datetime | None = None  # when the first check's first attempt began


@dataclass(frozen=True)
class MessageRecord:
    """One fetched message to record; ``payload`` is None when it is seen but not triaged."""

    account: str
    mailbox: str
    uidvalidity: int
    uid: int
    key: str
    payload: dict[str, Any] | None
    # The message's RFC822.SIZE and INTERNALDATE in the listing (sql/0045), when known.
    server_size: int | None = None
    internal_date: datetime | None = None


@dataclass(frozen=True)
class Recorded:
    """A processed_emails row at one UID: its key, the size and arrival date the listing
    showed when it was recorded (None before sql/0045), and whether it marks a message the
    worker passed without recording it (dead-lettered)."""

    key: str
    server_size: int | None
    internal_date: datetime | None
    passed: bool

    def matches(self, size: int, internal_date: datetime | None) -> bool:
        """True when the listing's size and arrival date are the ones recorded."""
        if self.server_size is None or self.server_size != size:
            return False
        dates = (self.internal_date, internal_date)
        return None in dates or dates[0] == dates[1]


def database_now(conn: Connection) -> datetime:
    """The database's clock: the checkpoints' stamps are compared with the same clock."""
    with translated():
        row = conn.execute("SELECT now()").fetchone()
    assert row is not None  # noqa: S101 - SELECT now() returns a row
    return row[0]  # type: ignore[no-any-return]


def load_checkpoint(conn: Connection, account: str, mailbox: str) -> Checkpoint | None:
    """The account's checkpoint row, or None before its first check."""
    with translated():
        row = conn.execute(
            "SELECT uidvalidity, last_uid, checked_at, last_error, last_error_at,"
            " first_check_done, refused_uid, first_check_started_at"
            " FROM email_checkpoints WHERE account = %s AND mailbox = %s",
            (account, mailbox),
        ).fetchone()
    return Checkpoint(*row) if row else None


def reset_checkpoint(conn: Connection, account: str, mailbox: str, uidvalidity: int) -> None:
    """Start a new UIDVALIDITY epoch: last_uid 0, and not yet completely checked."""
    with translated():
        conn.execute(
            "INSERT INTO email_checkpoints (account, mailbox, uidvalidity, last_uid)"
            " VALUES (%s, %s, %s, 0)"
            " ON CONFLICT (account, mailbox) DO UPDATE"
            " SET uidvalidity = EXCLUDED.uidvalidity, last_uid = 0, checked_at = NULL,"
            " refused_uid = NULL, refused_checks = 0",
            (account, mailbox, uidvalidity),
        )


def begin_first_check(conn: Connection, account: str, mailbox: str, started: datetime) -> datetime:
    """When the first check began: the time stored by an earlier attempt, else ``started``.

    Committed at once (autocommit), before any message is recorded, so an attempt killed
    part-way leaves the start for the next attempt to measure the lookback from.
    """
    with translated():
        row = conn.execute(
            "INSERT INTO email_checkpoints (account, mailbox, first_check_started_at)"
            " VALUES (%s, %s, %s)"
            " ON CONFLICT (account, mailbox) DO UPDATE SET first_check_started_at ="
            " COALESCE(email_checkpoints.first_check_started_at,"
            " EXCLUDED.first_check_started_at)"
            " RETURNING first_check_started_at",
            (account, mailbox, started),
        ).fetchone()
    return row[0] if row and row[0] is not None else started


def first_recorded_at(conn: Connection, account: str, mailbox: str) -> datetime | None:
    """When the mailbox's first message was recorded, or None when none was."""
    with translated():
        row = conn.execute(
            "SELECT min(seen_at) FROM processed_emails WHERE account = %s AND mailbox = %s",
            (account, mailbox),
        ).fetchone()
    return row[0] if row else None


def passed_key(account: str, mailbox: str, uidvalidity: int, uid: int) -> str:
    """The processed_emails key of a message passed unrecorded at ``uid``, ``<account>/passed/
    <sha256 of mailbox, UIDVALIDITY and UID>``: it fits the column (varchar(255)) like a hash
    key, and :func:`~sokratos_worker.email.parse.message_key` can never make it, as every key
    of a message starts ``<account>:`` (an account name has no ``:`` nor ``/``, the config
    refuses them) and this one has no ``:`` at all, whatever a Message-ID header says."""
    where = f"{mailbox}\x00{uidvalidity}\x00{uid}".encode("utf-8", errors="replace")
    return f"{account}/passed/{hashlib.sha256(where).hexdigest()}"


def record_passed(conn: Connection, record: MessageRecord) -> None:
    """Mark ``record.uid`` as passed without a record (status 'passed', no item), inside the
    caller's transaction: unlike its failed_operations row, retention never deletes it."""
    conn.execute(
        "INSERT INTO processed_emails"
        " (message_id, account, mailbox, uidvalidity, uid, server_size, internal_date, status)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s, 'passed')"
        " ON CONFLICT (message_id) DO UPDATE SET server_size = EXCLUDED.server_size,"
        " internal_date = EXCLUDED.internal_date",
        (
            passed_key(record.account, record.mailbox, record.uidvalidity, record.uid),
            record.account,
            record.mailbox,
            record.uidvalidity,
            record.uid,
            record.server_size,
            record.internal_date,
        ),
    )


def recorded_at_uid(
    conn: Connection, account: str, mailbox: str, uidvalidity: int, uid: int
) -> list[Recorded]:
    """The processed_emails rows of this epoch at ``uid`` (usually one)."""
    with translated():
        rows = conn.execute(
            "SELECT message_id, server_size, internal_date, status IS NOT DISTINCT FROM 'passed'"
            " FROM processed_emails"
            " WHERE account = %s AND mailbox = %s AND uidvalidity = %s AND uid = %s",
            (account, mailbox, uidvalidity, uid),
        ).fetchall()
    return [Recorded(*row) for row in rows]


def note_fingerprint(
    conn: Connection, key: str, uid: int, size: int, internal_date: datetime | None
) -> None:
    """Store the size and arrival date of the message with ``key`` at ``uid``, recorded
    before sql/0045 and found there by its key: later checks compare those."""
    with translated():
        conn.execute(
            "UPDATE processed_emails SET server_size = %s, internal_date = %s"
            " WHERE message_id = %s AND uid = %s AND server_size IS NULL",
            (size, internal_date, key, uid),
        )


def known_at_uid(
    conn: Connection, account: str, mailbox: str, uidvalidity: int, *, uid: int, key: str
) -> bool | None:
    """Whether the message with ``key`` now at ``uid`` is the one recorded there.

    True when a processed_emails row of this epoch at ``uid`` has ``key``; False when rows
    there have other keys only, or (none there) when ``key`` is unknown to processed_emails
    and to the triage idempotency keys; None when it cannot be told: a message passed
    unrecorded at ``uid`` (a 'passed' row, or for one passed before sql/0045 its
    failed_operations row), whose key was never computed.
    """
    rows = recorded_at_uid(conn, account, mailbox, uidvalidity, uid)
    if any(row.key == key for row in rows):
        return True
    if any(row.passed for row in rows):
        return None
    if rows:
        return False
    with translated():
        # Nothing at this UID: a duplicate Message-ID moved its row to a later UID, the row
        # was pruned (its item's idempotency key stays), or the message was passed unrecorded.
        known = conn.execute(
            "SELECT EXISTS (SELECT 1 FROM processed_emails WHERE message_id = %s)"
            " OR EXISTS (SELECT 1 FROM sokratos_idempotency_keys"
            "   WHERE queue = 'pending_triage' AND key = %s)",
            (key, f"email:{key}"),
        ).fetchone()
        if known and known[0]:
            return True
        passed = conn.execute(
            "SELECT 1 FROM failed_operations WHERE op_type = %s"
            " AND context_data->>'account' = %s AND context_data->>'mailbox' = %s"
            " AND context_data->>'uidvalidity' = %s AND context_data->>'uid' = %s LIMIT 1",
            (EMAIL_OP_TYPE, account, mailbox, str(uidvalidity), str(uid)),
        ).fetchone()
    return None if passed else False


def _insert_processed(conn: Connection, record: MessageRecord) -> bool:
    """True when the key is new; a known key only learns its current UID (for pruning).

    A 'passed' row is never taken for the message's record, nor moved to its UID: its key
    cannot be a message's (:func:`passed_key`), and should a row hold one anyway, the
    message is not recorded (the check stops before it) rather than taken for one seen.
    """
    row = conn.execute(
        "INSERT INTO processed_emails"
        " (message_id, account, mailbox, uidvalidity, uid, server_size, internal_date)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s)"
        " ON CONFLICT (message_id) DO UPDATE"
        " SET mailbox = EXCLUDED.mailbox, uidvalidity = EXCLUDED.uidvalidity, uid = EXCLUDED.uid,"
        " server_size = EXCLUDED.server_size, internal_date = EXCLUDED.internal_date"
        " WHERE processed_emails.account IS NOT DISTINCT FROM EXCLUDED.account"
        " AND processed_emails.status IS DISTINCT FROM 'passed'"
        " RETURNING (xmax = 0) AS inserted",
        (
            record.key,
            record.account,
            record.mailbox,
            record.uidvalidity,
            record.uid,
            record.server_size,
            record.internal_date,
        ),
    ).fetchone()
    if row is None:
        marker = conn.execute(
            "SELECT 1 FROM processed_emails WHERE message_id = %s AND status = 'passed'",
            (record.key,),
        ).fetchone()
        if marker is not None:
            raise PassedKeyTaken(
                f"the key {record.key!r} of the message at UID {record.uid} is a 'passed'"
                " marker's: not recorded, so that it is not taken for a message already seen"
            )
    return bool(row and row[0])


def _key_known(conn: Connection, idempotency_key: str) -> bool:
    """True when sokratos_enqueue_triage would return an existing item for the key."""
    row = conn.execute(
        "SELECT 1 FROM sokratos_idempotency_keys WHERE queue = 'pending_triage' AND key = %s",
        (idempotency_key,),
    ).fetchone()
    return row is not None


def _enqueue(conn: Connection, record: MessageRecord) -> tuple[int, bool]:
    """The triage item, keyed by account and message so a replay returns the same id.

    Returns ``(item_id, created)``: the function returns the existing id for a known key
    (mail triaged before its processed row was pruned) without saying so, hence the lookup.
    """
    assert record.payload is not None  # noqa: S101 - callers only enqueue with a payload
    idempotency_key = f"email:{record.key}"
    known = _key_known(conn, idempotency_key)
    row = conn.execute(
        "SELECT sokratos_enqueue_triage(%s::jsonb, %s, 'email')",
        (json.dumps(record.payload, ensure_ascii=False), idempotency_key),
    ).fetchone()
    assert row is not None  # noqa: S101 - the function always returns a row
    item_id = int(row[0])
    conn.execute(
        "UPDATE processed_emails SET item_id = %s WHERE message_id = %s", (item_id, record.key)
    )
    return item_id, not known


def advance_checkpoint(conn: Connection, record: MessageRecord) -> None:
    """Move last_uid forward (never back, should two checks of one account overlap)."""
    conn.execute(
        "INSERT INTO email_checkpoints (account, mailbox, uidvalidity, last_uid)"
        " VALUES (%s, %s, %s, %s)"
        " ON CONFLICT (account, mailbox) DO UPDATE SET"
        " last_uid = CASE WHEN email_checkpoints.uidvalidity = EXCLUDED.uidvalidity"
        "   THEN GREATEST(email_checkpoints.last_uid, EXCLUDED.last_uid)"
        "   ELSE EXCLUDED.last_uid END,"
        " uidvalidity = EXCLUDED.uidvalidity",
        (record.account, record.mailbox, record.uidvalidity, record.uid),
    )


def close_failures(
    conn: Connection, record: MessageRecord, item_id: int | None
) -> list[tuple[int, int | None]]:
    """Mark the open email_message failures of ``record``'s UID retried (as ``item_id``, else
    the item its key was triaged as), inside the caller's transaction; ``(failure id, item
    id)`` of each.

    The message was passed unrecorded and is now recorded (the operator ran the failure's
    ``what_to_do``): its failure is done with, so ``failed list`` and ``failed retry --all``
    stop offering it, the way a replayed dead letter is marked. Only when the UID's 'passed'
    row shows this message (its size and arrival date, where both are known): after a
    restore reused the UID for other mail, the failure stays open; and without a 'passed'
    row (the usual case) failed_operations is not searched at all, so a failure recorded
    before sql/0045 added those rows stays open (docs/email.md: purge it).
    """
    passed = [
        row
        for row in recorded_at_uid(
            conn, record.account, record.mailbox, record.uidvalidity, record.uid
        )
        if row.passed
    ]
    if not any(_same_message(row, record) for row in passed):
        return []
    rows = conn.execute(
        "UPDATE failed_operations SET retried_at = now(), retried_as = coalesce(%(item)s::bigint,"
        " (SELECT item_id FROM processed_emails WHERE message_id = %(key)s))"
        " WHERE op_type = %(op)s AND retried_at IS NULL"
        " AND context_data->>'account' = %(account)s AND context_data->>'mailbox' = %(mailbox)s"
        " AND context_data->>'uidvalidity' = %(uidvalidity)s AND context_data->>'uid' = %(uid)s"
        " RETURNING id, retried_as",
        {
            "item": item_id,
            "key": record.key,
            "op": EMAIL_OP_TYPE,
            "account": record.account,
            "mailbox": record.mailbox,
            "uidvalidity": str(record.uidvalidity),
            "uid": str(record.uid),
        },
    ).fetchall()
    return sorted((int(row[0]), row[1]) for row in rows)


def _same_message(passed: Recorded, record: MessageRecord) -> bool:
    """Whether the message passed at a UID is ``record``'s: the same size and arrival date,
    or, where a listing lacked the size, whatever the UID holds (only the UID can tell)."""
    if passed.server_size is None or record.server_size is None:
        return True
    return passed.matches(record.server_size, record.internal_date)


def record_message(
    conn: Connection, record: MessageRecord
) -> tuple[bool, int | None, list[tuple[int, int | None]]]:
    """Processed mark, triage item, checkpoint and the close of the UID's open failures in
    one transaction.

    Returns ``(new, item_id, closed)``: ``new`` is False when the key was already processed
    (a duplicate Message-ID or a re-fetch after a crash or UIDVALIDITY change), or when its
    triage item already existed (``item_id`` is then that item's); ``closed`` lists the
    failed_operations rows of this UID it marked retried, with the item each names (see
    :func:`close_failures`).
    """
    item_id: int | None = None
    with translated(), conn.transaction():
        new = _insert_processed(conn, record)
        if new and record.payload is not None:
            item_id, new = _enqueue(conn, record)
        advance_checkpoint(conn, record)
        closed = close_failures(conn, record, item_id)
    return new, item_id, closed


def finish_check(
    conn: Connection, account: str, mailbox: str, uidvalidity: int, now: datetime
) -> None:
    """A complete check: stamp checked_at, clear the last error and any refused UID."""
    with translated():
        conn.execute(
            "INSERT INTO email_checkpoints"
            " (account, mailbox, uidvalidity, checked_at, first_check_done)"
            " VALUES (%s, %s, %s, %s, true)"
            " ON CONFLICT (account, mailbox) DO UPDATE SET uidvalidity = EXCLUDED.uidvalidity,"
            " checked_at = EXCLUDED.checked_at, last_error = NULL, last_error_at = NULL,"
            " first_check_done = true, refused_uid = NULL, refused_checks = 0",
            (account, mailbox, uidvalidity, now),
        )


def note_refusal(conn: Connection, record: MessageRecord) -> int:
    """Count one more check on which the server refused ``record.uid``; returns the count.

    Consecutive refusals of the same UID in the same UIDVALIDITY add up; another UID starts
    again at 1. Committed at once (autocommit), since the check fails right after.
    """
    with translated():
        row = conn.execute(
            "INSERT INTO email_checkpoints"
            " (account, mailbox, uidvalidity, last_uid, refused_uid, refused_checks)"
            " VALUES (%s, %s, %s, 0, %s, 1)"
            " ON CONFLICT (account, mailbox) DO UPDATE SET"
            " refused_checks = CASE WHEN email_checkpoints.refused_uid = EXCLUDED.refused_uid"
            "   AND email_checkpoints.uidvalidity IS NOT DISTINCT FROM EXCLUDED.uidvalidity"
            "   THEN email_checkpoints.refused_checks + 1 ELSE 1 END,"
            " refused_uid = EXCLUDED.refused_uid,"
            " uidvalidity = COALESCE(email_checkpoints.uidvalidity, EXCLUDED.uidvalidity)"
            " RETURNING refused_checks",
            (record.account, record.mailbox, record.uidvalidity, record.uid),
        ).fetchone()
    return int(row[0]) if row else 1


def clear_refusal(conn: Connection, record: MessageRecord) -> None:
    """Forget the refused UID (it was recorded and passed); inside the caller's transaction."""
    conn.execute(
        "UPDATE email_checkpoints SET refused_uid = NULL, refused_checks = 0"
        " WHERE account = %s AND mailbox = %s",
        (record.account, record.mailbox),
    )


def forget_refusal(conn: Connection, account: str, mailbox: str, uid: int) -> None:
    """The server returned ``uid``: end its refusal count, so a later refusal starts at 1.

    Committed at once (autocommit), before the message is recorded, since that may fail.
    """
    with translated():
        conn.execute(
            "UPDATE email_checkpoints SET refused_uid = NULL, refused_checks = 0"
            " WHERE account = %s AND mailbox = %s AND refused_uid = %s",
            (account, mailbox, uid),
        )


def record_error(conn: Connection, account: str, mailbox: str, error: str, now: datetime) -> None:
    """Remember why the last check failed (shown by ``status``); the checkpoint stays."""
    with translated():
        conn.execute(
            "INSERT INTO email_checkpoints (account, mailbox, last_error, last_error_at)"
            " VALUES (%s, %s, %s, %s)"
            " ON CONFLICT (account, mailbox) DO UPDATE"
            " SET last_error = EXCLUDED.last_error, last_error_at = EXCLUDED.last_error_at",
            (account, mailbox, error, now),
        )


def account_rows(conn: Connection) -> list[dict[str, Any]]:
    """Every checkpoint row, by account name."""
    with translated():
        rows = conn.execute(
            "SELECT account, mailbox, uidvalidity, last_uid, checked_at, last_error, last_error_at"
            " FROM email_checkpoints ORDER BY account, mailbox"
        ).fetchall()
    keys = ("account", "mailbox", "uidvalidity", "last_uid", "checked_at", "last_error")
    return [dict(zip((*keys, "last_error_at"), row, strict=True)) for row in rows]


def advisory_lock(conn: Connection, account: str) -> bool:
    """Try the account's session lock, so two workers never check one account at once."""
    with translated():
        row = conn.execute(
            "SELECT pg_try_advisory_lock(hashtext('sokratos-email'), hashtext(%s))", (account,)
        ).fetchone()
    return bool(row and row[0])


def lock_holder(conn: Connection, account: str) -> dict[str, Any] | None:
    """The session holding the account's lock (:func:`advisory_lock`), if any: its pid,
    application, user, state and how long its transaction has been open."""
    with translated():
        row = conn.execute(
            f"""SELECT a.pid, {SESSION_COLUMNS}
                FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
                  AND l.classid::bigint = (hashtext('sokratos-email')::bigint & 4294967295)
                  AND l.objid::bigint = (hashtext(%s)::bigint & 4294967295)
                LIMIT 1""",
            (account,),
        ).fetchone()
    return session(row) if row is not None else None


def release_lock(conn: Connection, account: str) -> None:
    """Release the lock taken by :func:`advisory_lock`."""
    with translated():
        conn.execute(
            "SELECT pg_advisory_unlock(hashtext('sokratos-email'), hashtext(%s))", (account,)
        )


def prune_processed_emails(conn: Connection, ttl_days: int) -> int:
    """Delete processed_emails rows older than ``ttl_days``; returns how many.

    A worker row goes only when its account's checkpoint is past it (same mailbox and
    UIDVALIDITY, ``last_uid >= uid``, and a completed check), or when it belongs to an older
    UIDVALIDITY epoch the current one has completely re-checked: a pruned key can then never
    be fetched again. A worker row of mail seen without triage (``item_id`` NULL: older than
    the lookback on an account's first check) is never pruned: after a UIDVALIDITY change it
    alone keeps that mail from being triaged, and only a first check makes such rows, so
    they are bounded. Nor is a 'passed' row (no item either): it alone tells the restore
    check that the worker passed that UID once failed_operations forgot it; there is one per
    dead-lettered message. A triaged row may go: its item's idempotency key
    (sokratos_idempotency_keys) keeps a second item out. Rows without an account
    (Sokratos's own) go by age alone, as in Sokratos.
    """
    if ttl_days <= 0:
        return 0
    with translated():
        cur = conn.execute(
            "DELETE FROM processed_emails p"
            " WHERE p.seen_at < now() - make_interval(days => %s)"
            " AND (p.account IS NULL OR p.item_id IS NOT NULL AND EXISTS ("
            "   SELECT 1 FROM email_checkpoints c"
            "   WHERE c.account = p.account AND c.mailbox = p.mailbox"
            "     AND c.checked_at IS NOT NULL"
            "     AND (c.uidvalidity <> p.uidvalidity OR c.last_uid >= p.uid)))",
            (ttl_days,),
        )
    return cur.rowcount
