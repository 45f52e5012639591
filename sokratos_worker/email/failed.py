"""A message that cannot be turned into a triage item: a failed_operations row, then past it.

``durability.md`` "Bad input": bad input gets a clear error and a failed_operations row, and
never stops the worker. For email that means one message must not hold an account's
checkpoint back forever: the row (what is known of the message, and what to do) and the
checkpoint's move past its UID commit together, like the processed mark of a normal message.
The message itself stays on the server, untouched.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import structlog

from sokratos_worker.config import EmailAccountConfig
from sokratos_worker.email.imap_answers import FetchedMessage, MessageRef, Refused
from sokratos_worker.store import email as store
from sokratos_worker.store.connection import translated
from sokratos_worker.store.failures import EMAIL_OP_TYPE, record_failure
from sokratos_worker.store.sanitize import clean_text

log = structlog.get_logger(__name__)

OP_TYPE = EMAIL_OP_TYPE
# Enough of the header block to find the message in a mail client; never the body.
HEADERS_LIMIT = 4000


def _headers(raw: bytes) -> str:
    """The message's header block as storable text (bytes that are not UTF-8 replaced)."""
    end = min((i for i in (raw.find(b"\r\n\r\n"), raw.find(b"\n\n")) if i >= 0), default=-1)
    block = raw[:end] if end >= 0 else raw
    return clean_text(block[:HEADERS_LIMIT].decode("utf-8", errors="replace"))


def _literal(text: str) -> str:
    """An SQL string literal, for a statement shown to the operator (never executed here)."""
    return "'" + text.replace("'", "''") + "'"


def what_to_do(account: EmailAccountConfig, uidvalidity: int, uid: int) -> str:
    """The operator's next step, with the statement that fetches the message again."""
    return (
        f"the message is still on the server (mailbox {account.mailbox!r}, UID {uid});"
        " read it there, or once the cause is fixed fetch it again with"
        f" UPDATE email_checkpoints SET last_uid = {uid - 1}"
        f" WHERE account = {_literal(account.name)} AND mailbox = {_literal(account.mailbox)}"
        f" AND uidvalidity = {uidvalidity};"
        " mail already seen is not triaged again"
    )


# What to do about a message the server cannot return, before and after it is passed.
REPAIR_HINT = (
    "the server could not return this message (a damaged mail store, a file it cannot read):"
    " see the server's log and repair the mailbox (Dovecot: doveadm force-resync)"
)


def refused_what_to_do(account: EmailAccountConfig, uidvalidity: int, uid: int) -> str:
    """The operator's next step for a message the server refused and that was passed."""
    return f"{REPAIR_HINT}; then {what_to_do(account, uidvalidity, uid)}"


def record_refused_message(
    conn: store.Connection,
    account: EmailAccountConfig,
    uidvalidity: int,
    ref: MessageRef,
    *,
    refused: Refused,
    checks: int,
) -> int:
    """Record a message the server refused (or left out of its answers) on ``checks`` checks in
    failed_operations and move the checkpoint past it, in one transaction; the row's id."""
    error = (
        f"email account {account.name!r}: UID {ref.uid} (UIDVALIDITY {uidvalidity}) was"
        f" {refused.what} on {checks} consecutive checks: {refused.answer}"
    )
    return _record_and_pass(
        conn,
        account,
        uidvalidity,
        ref.uid,
        error=error,
        hint=refused_what_to_do(account, uidvalidity, ref.uid),
        # (A message the listing left out too has no size nor date known.)
        listed=(None, None) if ref.unlisted else (ref.size, ref.internal_date),
        details={
            "internal_date": ref.internal_date.isoformat() if ref.internal_date else None,
            "size": None if ref.unlisted else ref.size,
            "server_answer": clean_text(refused.answer),
            "refused_checks": checks,
        },
    )


def no_record(account: EmailAccountConfig, uidvalidity: int, uid: int) -> store.MessageRecord:
    """The checkpoint's move past ``uid``, without a processed mark."""
    return store.MessageRecord(
        account=account.name,
        mailbox=account.mailbox,
        uidvalidity=uidvalidity,
        uid=uid,
        key="",
        payload=None,
    )


def record_failed_message(
    conn: store.Connection,
    account: EmailAccountConfig,
    uidvalidity: int,
    message: FetchedMessage,
    exc: Exception,
    *,
    listed: MessageRef | None = None,
) -> int:
    """Record ``message`` in failed_operations and move the checkpoint past it; the row's id.

    ``listed`` is the message as the check's listing showed it (its size and arrival date,
    kept on the 'passed' row for the restore check)."""
    error = (
        f"email account {account.name!r}: UID {message.uid} (UIDVALIDITY {uidvalidity})"
        f" could not be handled: {type(exc).__name__}: {exc}"
    )
    return _record_and_pass(
        conn,
        account,
        uidvalidity,
        message.uid,
        error=error,
        hint=what_to_do(account, uidvalidity, message.uid),
        listed=(
            (listed.size, listed.internal_date)
            if listed is not None
            else (message.server_size or None, message.internal_date)
        ),
        details={
            "internal_date": message.internal_date.isoformat() if message.internal_date else None,
            "size": message.size,
            "headers": _headers(message.raw),
        },
    )


def _record_and_pass(
    conn: store.Connection,
    account: EmailAccountConfig,
    uidvalidity: int,
    uid: int,
    *,
    error: str,
    hint: str,
    listed: tuple[int | None, datetime | None],
    details: dict[str, Any],
) -> int:
    """The failed_operations row, a 'passed' processed_emails row (which retention keeps,
    unlike the failure) and the checkpoint's move past ``uid``, in one transaction (any
    refusal count ends with it); logs ``email_message_failed``; the row's id."""
    error = clean_text(error)
    context: dict[str, Any] = {
        "account": account.name,
        "mailbox": account.mailbox,
        "uidvalidity": uidvalidity,
        "uid": uid,
        **details,
        "what_to_do": hint,
    }
    record = no_record(account, uidvalidity, uid)
    size, internal_date = listed
    passed = store.MessageRecord(
        account=account.name,
        mailbox=account.mailbox,
        uidvalidity=uidvalidity,
        uid=uid,
        key=store.passed_key(account.name, account.mailbox, uidvalidity, uid),
        payload=None,
        server_size=size,
        internal_date=internal_date,
    )
    with translated(), conn.transaction():
        failure_id = record_failure(
            conn, op_type=OP_TYPE, label=f"{account.name} UID {uid}", error=error, context=context
        )
        # No processed mark under the message's key, so a later fetch (see what_to_do) is not
        # taken for a duplicate; the 'passed' row says only that this UID was passed.
        store.record_passed(conn, passed)
        store.advance_checkpoint(conn, record)
        store.clear_refusal(conn, record)
    log.error(
        "email_message_failed",
        account=account.name,
        mailbox=account.mailbox,
        uid=uid,
        failure_id=failure_id,
        error=error,
        what_to_do=hint,
        refused_checks=details.get("refused_checks"),  # (None: not a refused message)
    )
    return failure_id
