"""Where an account's check starts: the UID to read above, and whether the mailbox must be
read again (a UIDVALIDITY change, or UIDs handed out again after a restore).

Also the cutoff before which a new account's first check records mail as seen, untriaged.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Literal

import structlog

from sokratos_worker.config import EmailAccountConfig
from sokratos_worker.email.imap import HEADER_BYTES_LIMIT, ImapRefused, ImapSession
from sokratos_worker.email.imap_answers import MailboxState, MessageRef
from sokratos_worker.email.parse import keyed_by_hash, message_key, parse_email
from sokratos_worker.store import email as store

log = structlog.get_logger(__name__)


Reset = Literal["uidvalidity", "uids_reused"]

# What an operator reads when a server hands out UIDs the checkpoint already passed.
_UIDS_REUSED_HINT = (
    "nothing for this check: the mailbox is read again from its first message, and mail"
    " already seen is not triaged again (processed_emails); a server restored from a backup"
    " does this, and if it recurs without one, ask the server's operator why UIDs go back"
)


def _uids_reused_warning(
    account: EmailAccountConfig, state: MailboxState, last_uid: int, what_happened: str
) -> None:
    log.warning(
        "email_uids_reused",
        account=account.name,
        mailbox=account.mailbox,
        uidvalidity=state.uidvalidity,
        last_uid=last_uid,
        uidnext=state.uidnext,
        what_happened=what_happened,
        what_to_do=_UIDS_REUSED_HINT,
    )


def _undecided(account: EmailAccountConfig, uid: int, why: str) -> bool:
    """The restore check cannot tell: not a restore (logged at debug only; it recurs)."""
    log.debug("email_restore_check_undecided", account=account.name, uid=uid, why=why)
    return False


def _key_at(session: ImapSession, account: EmailAccountConfig, uid: int) -> str | None:
    """The processed_emails key of the message now at ``uid`` from at most HEADER_BYTES_LIMIT
    bytes of its header block; None when it cannot be told that cheaply: the message is gone
    or refused, its header block is longer, it cannot be parsed, or its key hashes its body
    (no Message-ID), which is never fetched for this."""
    try:
        raw = session.header_block(uid, HEADER_BYTES_LIMIT)
    except ImapRefused:
        return None
    if raw is None or len(raw) >= HEADER_BYTES_LIMIT:
        return None
    try:
        parsed = parse_email(raw)
        if keyed_by_hash(account.name, parsed):
            return None
        return message_key(account.name, parsed)
    except Exception:  # a message the parser fails on was dead-lettered: it cannot be compared
        return None


def _listed_at(session: ImapSession, uid: int) -> MessageRef | None:
    """UID ``uid``'s size and arrival date, or None when it is gone or refused."""
    try:
        return session.listed(uid)
    except ImapRefused:
        return None


def _same_message(
    conn: store.Connection,
    session: ImapSession,
    account: EmailAccountConfig,
    state: MailboxState,
    listed: MessageRef,
) -> bool | None:
    """Whether the message at ``listed.uid`` is the one processed_emails recorded there (None:
    cannot tell).

    Its size and arrival date, from the check's listing, are compared with those recorded
    with the row: nothing more is fetched. Only for rows recorded before sql/0045 (or none
    at that UID, pruned) is its key compared, from a bounded header block; a key that
    matches stores the size and date, so the next check compares those.
    """
    uid = listed.uid
    rows = store.recorded_at_uid(conn, account.name, account.mailbox, state.uidvalidity, uid)
    if any(row.matches(listed.size, listed.internal_date) for row in rows):
        return True
    if rows and all(row.server_size is not None for row in rows):
        return False
    key = _key_at(session, account, uid)
    if key is None:
        return None
    known = store.known_at_uid(
        conn, account.name, account.mailbox, state.uidvalidity, uid=uid, key=key
    )
    if known and any(row.key == key for row in rows):
        store.note_fingerprint(conn, key, uid, listed.size, listed.internal_date)
    return known


def reused_at(
    conn: store.Connection,
    session: ImapSession,
    account: EmailAccountConfig,
    state: MailboxState,
    *,
    last_uid: int,
    at_or_below: MessageRef | None,
    above: list[MessageRef],
) -> bool:
    """True when the UIDs already read hold other messages now (a mailbox restored from a
    backup that got more new mail than it went back by, or a server without UIDNEXT).

    The message at the highest UID at or below the checkpoint is compared with what
    processed_emails recorded at that UID: new mail after a restore takes exactly those
    UIDs. ``at_or_below`` comes from the listing (``last_uid:*`` shows UID ``last_uid``, or
    the highest message when it is below), with its size and arrival date; only when UID
    ``last_uid`` is gone and mail is above it does a UID SEARCH find the UID to compare (and
    one small UID FETCH its size and date). Whatever cannot be told (a message gone, refused
    or unparsable) is not a restore: the check goes on.
    """
    listed = at_or_below
    if listed is None and above:
        uid = session.highest_uid_up_to(last_uid)
        if uid is not None:
            listed = _listed_at(session, uid)
            if listed is None:
                return _undecided(account, uid, "the message is gone or refused")
    if listed is None:
        return False  # no message at or below the checkpoint: no UID was handed out again
    same = _same_message(conn, session, account, state, listed)
    if same is None:
        return _undecided(
            account,
            listed.uid,
            "recorded without its size and date, and its key cannot be computed from a"
            " bounded header block (no Message-ID, gone, refused or unparsable), or the"
            " message was passed before sql/0045",
        )
    if same:
        return False
    _uids_reused_warning(
        account,
        state,
        last_uid,
        f"UID {listed.uid}, at or below the last UID already read, now holds a message never"
        " recorded, under the same UIDVALIDITY: the server hands out UIDs again (a mailbox"
        " restored from a backup?)",
    )
    return True


def start_uid(
    conn: store.Connection,
    account: EmailAccountConfig,
    checkpoint: store.Checkpoint | None,
    state: MailboxState,
) -> tuple[int, Reset | None]:
    """The UID to read above, and why the checkpoint was reset to read the mailbox again."""
    if checkpoint is None:
        return 0, None
    if checkpoint.uidvalidity not in (None, state.uidvalidity):
        log.warning(
            "email_uidvalidity_changed",
            account=account.name,
            mailbox=account.mailbox,
            old=checkpoint.uidvalidity,
            new=state.uidvalidity,
        )
        store.reset_checkpoint(conn, account.name, account.mailbox, state.uidvalidity)
        return 0, "uidvalidity"
    if state.uidnext is not None and state.uidnext <= checkpoint.last_uid:
        # RFC 3501 forbids it, but a mailbox restored from a backup keeps its UIDVALIDITY and
        # gives new mail UIDs at or below the checkpoint, which reading above it never fetches.
        _uids_reused_warning(
            account,
            state,
            checkpoint.last_uid,
            "the server's next UID is not above the last UID already read, under the same"
            " UIDVALIDITY: it hands out UIDs again (a mailbox restored from a backup?)",
        )
        store.reset_checkpoint(conn, account.name, account.mailbox, state.uidvalidity)
        return 0, "uids_reused"
    return checkpoint.last_uid, None


def lookback_cutoff(
    conn: store.Connection,
    account: EmailAccountConfig,
    checkpoint: store.Checkpoint | None,
    *,
    lookback_s: float,
    now: datetime,
) -> datetime | None:
    """Mail that arrived before this is seen without triage; None once a first check completed.

    Only a new account's first check has a cutoff: after a UIDVALIDITY change or reused UIDs,
    processed_emails alone tells seen from unseen, whatever a message's date. The cutoff is
    the configured lookback before the first attempt's start (stored by that attempt), so a
    resumed first check keeps its window however late it resumes, and a lookback changed
    meanwhile applies.
    """
    if checkpoint is not None and checkpoint.first_check_done:
        return None
    if checkpoint is not None and checkpoint.first_check_started_at is not None:
        started = checkpoint.first_check_started_at
    else:
        started = now
        if checkpoint is not None:
            # A first attempt made before starts were stored began about when it recorded a
            # message.
            recorded = store.first_recorded_at(conn, account.name, account.mailbox)
            started = min(now, recorded) if recorded is not None else now
        started = store.begin_first_check(conn, account.name, account.mailbox, started)
    return started - timedelta(seconds=lookback_s)
