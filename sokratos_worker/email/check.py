"""Email checks: fetch what is above each account's checkpoint and enqueue its triage.

For each message, :func:`sokratos_worker.store.email.record_message` commits the processed
mark, the triage item and the new checkpoint together, so mail is never marked processed
before its triage is durably queued (Sokratos hazard 1) and the checkpoint never passes a
message that was not fetched (hazard 2). Messages are handled one by one, in UID order
(hazard 3). A message that cannot be turned into a triage item (a parser failure, or a
record the database refuses for its content) goes to failed_operations
(:mod:`sokratos_worker.email.failed`) and the check carries on past it; so does a message
the server refuses on REFUSALS_BEFORE_PASSING consecutive checks (before that, it stops the
check, after the mail before it was recorded), and so does one its answers keep leaving out
while the mailbox still lists it.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import structlog

from sokratos_worker.config import EmailAccountConfig, Settings
from sokratos_worker.email.checkpoint import lookback_cutoff, reused_at, start_uid
from sokratos_worker.email.failed import (
    REPAIR_HINT,
    no_record,
    record_failed_message,
    record_refused_message,
)
from sokratos_worker.email.imap import (
    HEADER_BYTES_LIMIT,
    SERVED_TRIES,
    ConnectionFailed,
    ImapAborted,
    ImapDeadlineExceeded,
    ImapError,
    ImapServerState,
    ImapSession,
    MailboxNotOpened,
    MessagesNotReturned,
    UidvalidityChangedWhileReading,
)
from sokratos_worker.email.imap_answers import (
    FetchedMessage,
    MailboxState,
    MessageRef,
    Refused,
    plan_batches,
    server_state,
)
from sokratos_worker.email.imap_sessions import OpenSessions
from sokratos_worker.email.parse import (
    HEADER_LIMIT_BYTES,
    format_email_summary,
    keyed_by_hash,
    message_key,
    parse_email,
    truncate_bytes,
)
from sokratos_worker.errors import DatabaseUnavailable, WorkerError
from sokratos_worker.logs import as_echoed_by_imap, mask_secrets, maskable
from sokratos_worker.model import CheckLine
from sokratos_worker.store import email as store
from sokratos_worker.store.connection import refused_for_its_content
from sokratos_worker.store.sanitize import clean_text

log = structlog.get_logger(__name__)

# A silent server must not hold up the tick: every socket read gives up after this (a server
# that trickles is cut by the session's deadline, SOKRATOS_EMAIL_CHECK_DEADLINE).
IMAP_TIMEOUT_S = 30.0


# A message the server refuses on this many consecutive checks is recorded and passed.
REFUSALS_BEFORE_PASSING = 3


class MessageRefused(ImapError):
    """The server refused one message; the check stops before it (names the UID)."""


class MessageNotReturned(ImapError):
    """The server's answer left out one message its mailbox still lists; the check stops
    before it (names the UID)."""


class MessageNotRecorded(WorkerError):
    """The database refused one message's record; the check stops before it (names the UID)."""


@dataclass(frozen=True)
class AccountReport:
    """What one account's check did; ``error`` is set when it failed.

    A failure is recorded in ``email_checkpoints``, except a check cut short because the worker
    is stopping: the account is not to blame, and the next start checks it again.
    """

    name: str
    checked: bool = False
    fetched: int = 0
    enqueued: int = 0
    seen_without_triage: int = 0
    duplicates: int = 0
    failed: int = 0
    uidvalidity_reset: bool = False
    # The server hands out UIDs the checkpoint already passed (UIDNEXT at or below it, or
    # another message at the last UID read): the mailbox was re-read.
    uids_reused: bool = False
    skipped_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True unless the check failed."""
        return self.error is None


@dataclass
class _Counts:
    fetched: int = 0
    enqueued: int = 0
    seen_without_triage: int = 0
    duplicates: int = 0
    failed: int = 0


def is_due(checkpoint: store.Checkpoint | None, interval_s: float, now: datetime) -> bool:
    """Due when neither the last check nor the last failure is within the interval."""
    if checkpoint is None:
        return True
    stamps = [t for t in (checkpoint.checked_at, checkpoint.last_error_at) if t is not None]
    return not stamps or max(stamps) <= now - timedelta(seconds=interval_s)


def build_payload(
    account: EmailAccountConfig, uidvalidity: int, message: FetchedMessage
) -> tuple[str, dict[str, Any]]:
    """The processed_emails key and the triage payload of contract §4 (email shape)."""
    parsed = parse_email(message.raw)
    payload: dict[str, Any] = {
        "account": account.name,
        "mailbox": account.mailbox,
        "uidvalidity": uidvalidity,
        "uid": message.uid,
        "message_id": parsed.message_id,
        "from": truncate_bytes(parsed.from_, HEADER_LIMIT_BYTES),
        "to": truncate_bytes(parsed.to, HEADER_LIMIT_BYTES),
        "cc": truncate_bytes(parsed.cc, HEADER_LIMIT_BYTES),
        "subject": truncate_bytes(parsed.subject, HEADER_LIMIT_BYTES),
        "date": parsed.date.isoformat() if parsed.date else None,
        "internal_date": message.internal_date.isoformat() if message.internal_date else None,
        "attachments": [{"name": a.name, "size": a.size} for a in parsed.attachments],
        "text": format_email_summary(parsed),
        "size": message.size,
        "notes": [*parsed.notes, *_truncation_note(message)],
    }
    key = message_key(account.name, parsed)
    # What psycopg would refuse (a lone surrogate) fails here, as this message's own problem.
    json.dumps([key, payload], ensure_ascii=False).encode("utf-8")
    return key, payload


def _truncation_note(message: FetchedMessage) -> list[str]:
    """Says that only the first MESSAGE_BYTES_LIMIT bytes of a larger message were read."""
    if not message.truncated:
        return []
    return [
        f"message of {message.size} bytes: only its first {len(message.raw)} bytes were read"
        " (text and attachments after them are left out)"
    ]


def _is_old(internal_date: datetime | None, cutoff: datetime | None) -> bool:
    """Before the initial-lookback cutoff (a missing INTERNALDATE counts as new)."""
    return cutoff is not None and internal_date is not None and internal_date < cutoff


def _needs_body(account: str, headers: bytes) -> bool:
    """When the key hashes the body (no Message-ID, or a key too long), or the header fetch
    was cut (HEADER_BYTES_LIMIT: a Message-ID may follow), fetch it all."""
    if len(headers) >= HEADER_BYTES_LIMIT:
        return True
    try:
        return keyed_by_hash(account, parse_email(headers))
    except Exception:  # the full fetch reports what is wrong with this message
        return True


def _messages(
    session: ImapSession, refs: list[MessageRef], cutoff: datetime | None
) -> Iterator[tuple[FetchedMessage | Refused, bool]]:
    """``(message, old)`` in UID order; old mail is fetched as headers only when it can be.

    Old mail is only recorded as seen, so its body is needed just for the hash key of a
    message keyed by hash: a ten-year-old mailbox is not downloaded in full. A message the
    server refuses comes as :class:`Refused`.
    """
    name = session.account.name
    listed = [ref.uid for ref in refs]
    place = {uid: i for i, uid in enumerate(listed)}

    def after(uid: int) -> list[int]:
        """The UIDs listed next: whether the server returns them tells whether an answer
        with its state (RFC 5530) is its own or one message's (ImapSession.fetch_each)."""
        return listed[place[uid] + 1 : place[uid] + 1 + SERVED_TRIES]

    for old, group in itertools.groupby(refs, key=lambda r: _is_old(r.internal_date, cutoff)):
        for uids in plan_batches(list(group), headers_only=old):
            for item in session.fetch_each(uids, headers_only=old, later=after(uids[-1])):
                if old and isinstance(item, FetchedMessage) and _needs_body(name, item.raw):
                    for full in session.fetch_each([item.uid], later=after(item.uid)):
                        yield full, old
                elif not old and isinstance(item, FetchedMessage):
                    # Its own arrival date decides for a message listed without one (left out
                    # of the listing: fetched whole, and old mail is still only recorded).
                    yield item, _is_old(item.internal_date, cutoff)
                else:
                    yield item, old


def _as_listed(ref: MessageRef, message: FetchedMessage) -> MessageRef:
    """``ref``, or for a message the listing left out, its size and arrival date as its own
    fetch returned them (kept for the restore check)."""
    if not ref.unlisted:
        return ref
    return MessageRef(uid=ref.uid, size=message.size, internal_date=message.internal_date)


def _refused(
    conn: store.Connection,
    account: EmailAccountConfig,
    state: MailboxState,
    ref: MessageRef,
    refused: Refused,
) -> None:
    """Count the refusal (or the answer leaving it out); stop the check before it, or past the
    limit record it and go on."""
    record = no_record(account, state.uidvalidity, ref.uid)
    checks = store.note_refusal(conn, record)
    if checks >= REFUSALS_BEFORE_PASSING:
        record_refused_message(
            conn, account, state.uidvalidity, ref, refused=refused, checks=checks
        )
        return
    happened = "checks leaving it out" if refused.left_out else "refusals"
    hint = (
        f"{REPAIR_HINT}; it is tried again at the next check, and after"
        f" {REFUSALS_BEFORE_PASSING} consecutive {happened} recorded in failed_operations and"
        " passed, so that the mail after it is not held back"
    )
    log.warning(
        "email_message_refused",
        account=account.name,
        mailbox=account.mailbox,
        uid=ref.uid,
        refused_checks=checks,
        answer=refused.answer,
        what_to_do=hint,
    )
    kind = MessageNotReturned if refused.left_out else MessageRefused
    raise kind(
        f"UID {ref.uid} (UIDVALIDITY {state.uidvalidity}) was {refused.what}"
        f" ({refused.answer}) on {checks} consecutive check(s); the check stops before it,"
        f" and after {REFUSALS_BEFORE_PASSING} it is recorded in failed_operations and passed"
    )


def _record(
    conn: store.Connection,
    account: EmailAccountConfig,
    state: MailboxState,
    message: FetchedMessage,
    *,
    listed: MessageRef,
    old: bool,
    counts: _Counts,
) -> None:
    try:
        key, payload = build_payload(account, state.uidvalidity, message)
    except Exception as exc:  # parsing should never raise, but one message must not block all
        record_failed_message(conn, account, state.uidvalidity, message, exc, listed=listed)
        counts.fetched += 1
        counts.failed += 1
        return
    record = store.MessageRecord(
        account=account.name,
        mailbox=account.mailbox,
        uidvalidity=state.uidvalidity,
        uid=message.uid,
        key=key,
        payload=None if old else payload,
        server_size=listed.size,
        internal_date=listed.internal_date,
    )
    try:
        new, item_id, closed = store.record_message(conn, record)
    except DatabaseUnavailable:
        raise
    except Exception as exc:
        if refused_for_its_content(exc):
            record_failed_message(conn, account, state.uidvalidity, message, exc, listed=listed)
            counts.fetched += 1
            counts.failed += 1
            return
        # Not skipped: a refusal such as a missing privilege would otherwise skip every message.
        raise MessageNotRecorded(
            f"UID {message.uid} (UIDVALIDITY {state.uidvalidity}) could not be recorded:"
            f" {type(exc).__name__}: {exc}; the check stops before it"
        ) from exc
    counts.fetched += 1
    if not new:
        counts.duplicates += 1
    elif old:
        counts.seen_without_triage += 1
    else:
        counts.enqueued += 1
    for failure_id, triaged_as in closed:
        log.info(
            "email_failure_closed",
            account=account.name,
            mailbox=account.mailbox,
            uid=message.uid,
            failure_id=failure_id,
            item_id=triaged_as,
        )
    log.debug(
        "email_message_recorded",
        account=account.name,
        uid=message.uid,
        new=new,
        triaged=item_id is not None,
        item_id=item_id,
        size=message.size,
        notes=len(payload["notes"]),
    )


def check_account(
    conn: store.Connection,
    account: EmailAccountConfig,
    checkpoint: store.Checkpoint | None,
    *,
    lookback_s: float,
    now: datetime,
    timeout: float,
    deadline: float | None = None,
    sessions: OpenSessions | None = None,
) -> AccountReport:
    """One account's check; raises :class:`ImapError` (after committing what it could).

    ``deadline`` bounds the whole IMAP session; ``sessions`` lets a stopping worker cut it.
    """
    counts = _Counts()
    with ImapSession(account, timeout=timeout, deadline=deadline, sessions=sessions) as session:
        state = session.examine()
        last_uid, reset = start_uid(conn, account, checkpoint, state)
        cutoff = lookback_cutoff(conn, account, checkpoint, lookback_s=lookback_s, now=now)
        refs, at_or_below = session.refs_from(last_uid)
        if (
            reset is None
            and last_uid > 0
            and reused_at(
                conn,
                session,
                account,
                state,
                last_uid=last_uid,
                at_or_below=at_or_below,
                above=refs,
            )
        ):
            store.reset_checkpoint(conn, account.name, account.mailbox, state.uidvalidity)
            last_uid, reset = 0, "uids_reused"
            refs, _ = session.refs_from(0)
        refs = session.with_unlisted(last_uid, refs)
        by_uid = {ref.uid: ref for ref in refs}
        refused_uid = checkpoint.refused_uid if checkpoint else None
        for message, old in _messages(session, refs, cutoff):
            if isinstance(message, Refused):
                _refused(conn, account, state, by_uid[message.uid], message)
                counts.failed += 1
                continue
            if message.uid == refused_uid:
                # Returned this time, so its refusals are no longer consecutive, whatever
                # becomes of its record.
                store.forget_refusal(conn, account.name, account.mailbox, message.uid)
            listed = _as_listed(by_uid[message.uid], message)
            _record(conn, account, state, message, listed=listed, old=old, counts=counts)
    store.finish_check(conn, account.name, account.mailbox, state.uidvalidity, now)
    return AccountReport(
        name=account.name,
        checked=True,
        fetched=counts.fetched,
        enqueued=counts.enqueued,
        seen_without_triage=counts.seen_without_triage,
        duplicates=counts.duplicates,
        failed=counts.failed,
        uidvalidity_reset=reset == "uidvalidity",
        uids_reused=reset == "uids_reused",
    )


_ACCOUNT_HINT = (
    "no mail is lost: the next check starts where the last good one ended; if this repeats,"
    " check the account's host, port, security and password ('sokratos-worker check' tries them)"
)
# What a failure after the login gets unless _HINTS names its kind: the settings are past.
_NEUTRAL_HINT = (
    "no mail is lost: the next check starts where the last good one ended; see the error for"
    " what failed (after the login, so not the account's settings): if it repeats at every"
    " check, see the server's log or ask its operator"
)
_CRASH_HINT = (
    "no mail is lost: the next check starts where the last good one ended; the check itself"
    " failed, not the account's settings: the traceback is logged just before"
    " (email_check_crashed); if it repeats, report it with that traceback"
)
_REFUSED_HINT = (
    "no mail is lost: the mail before the refused message is recorded, and the next check tries"
    f" it again; {REPAIR_HINT}; after {REFUSALS_BEFORE_PASSING} consecutive refusals it is"
    " recorded in failed_operations and passed (the account's settings are not the cause)"
)
_SERVER_STATE_HINT = (
    "no mail is lost: the next check tries again; the server answered with its own state (busy,"
    " in use, over a limit or quota, shutting down), which no setting of the account changes:"
    " if it lasts, see the server's log or ask its operator"
)
# The error already says when to raise the deadline (status shows it): not repeated here.
_DEADLINE_HINT = (
    "no mail is lost: what was recorded before the deadline stays, and the next check resumes"
    " there; the error says when to raise SOKRATOS_EMAIL_CHECK_DEADLINE"
)
_UIDVALIDITY_HINT = (
    "no mail is lost: the server rebuilt the mailbox (a new UIDVALIDITY) while this check read"
    " it; the next check reads it again from its first message, and mail already seen is not"
    " triaged again: nothing to set; if it recurs at every check, ask the server's operator"
)
_NOT_RETURNED_HINT = (
    "no mail is lost: the mail before the message left out is recorded, and the next check"
    " asks for it again; the server lists it but sent no body, which no setting of the"
    f" account explains: {REPAIR_HINT}; after {REFUSALS_BEFORE_PASSING} consecutive checks"
    " leaving it out it is recorded in failed_operations and passed"
)
_NONE_RETURNED_HINT = (
    "no mail is lost, and the check is counted against no message: the server returned no"
    " message at all, not even one it returned before (a mail store outage, or an answer this"
    " client cannot read), so the next check asks again: see the server's log or ask its"
    " operator if it lasts"
)
# The hint of each kind of IMAP failure with its own advice (checked in order).
_HINTS: tuple[tuple[type[ImapError], str], ...] = (
    (ConnectionFailed, _ACCOUNT_HINT),
    (MessageRefused, _REFUSED_HINT),
    (ImapServerState, _SERVER_STATE_HINT),
    (ImapDeadlineExceeded, _DEADLINE_HINT),
    (UidvalidityChangedWhileReading, _UIDVALIDITY_HINT),
    (MessageNotReturned, _NOT_RETURNED_HINT),
    (MessagesNotReturned, _NONE_RETURNED_HINT),
)
_NOT_RECORDED_HINT = (
    "no mail is lost: the next check starts again at this message; fix what the database said"
    " (a missing privilege: apply sql/roles.sql; 'sokratos-worker check' lists what is missing)"
)


def _mailbox_hint(account: EmailAccountConfig) -> str:
    """What to do when the server will not open the configured mailbox (renamed, say)."""
    return (
        f"the server would not open mailbox {account.mailbox!r} (its answer is in the error):"
        f" check the mailbox of account {account.name!r} in SOKRATOS_EMAIL_ACCOUNTS against the"
        " server's folder names. If the folder was renamed, set its new name: a new name starts"
        " a fresh checkpoint, whose first check triages only mail that arrived within"
        " SOKRATOS_EMAIL_INITIAL_LOOKBACK and records older mail as seen without triage, so"
        " raise that for the first check to cover the time since this mailbox's last complete"
        " check (docs/email.md, 'A renamed mailbox')"
    )


def _imap_hint(exc: ImapError, account: EmailAccountConfig) -> str:
    """The hint for an IMAP failure: the account's settings only for what they can cause (a
    connection, TLS or login failure), never for a message, the mailbox or the server's state."""
    if isinstance(exc, MailboxNotOpened):
        return _SERVER_STATE_HINT if server_state(exc.answer) else _mailbox_hint(account)
    return next((hint for kind, hint in _HINTS if isinstance(exc, kind)), _NEUTRAL_HINT)


def _failed(
    conn: store.Connection,
    account: EmailAccountConfig,
    error: str,
    now: datetime,
    *,
    hint: str,
) -> AccountReport:
    error = clean_text(error)  # an exception may quote mail bytes; last_error must be storable
    error = _without_password(account, error)
    store.record_error(conn, account.name, account.mailbox, error, now)
    log.warning("email_check_failed", account=account.name, error=error, hint=hint)
    return AccountReport(name=account.name, error=error)


def _without_password(account: EmailAccountConfig, text: str) -> str:
    """``text`` with the account's password masked: a server or proxy may quote the LOGIN
    command it refused, and the text is stored (last_error) and printed (status, check)."""
    if account.password is None:
        return text
    return mask_secrets(
        text, maskable(passwords=as_echoed_by_imap(account.password.get_secret_value()))
    )


# The pid of the lock holder last named, per account: a vanished session holds the lock for
# up to two hours, and naming it again at every tick (each minute) would bury the log.
_LOCK_HOLDER_SAID: dict[str, int | None] = {}


def _last_check_long_ago(
    checkpoint: store.Checkpoint | None, settings: Settings, now: datetime
) -> datetime | None:
    """The account's last check (or failure) once no check could still be running under a
    lock taken since (past the deadline, twice the interval without one), else None."""
    if checkpoint is None:
        return None  # (never checked: a first check may run long)
    stamps = [t for t in (checkpoint.checked_at, checkpoint.last_error_at) if t is not None]
    quiet_s = 2 * settings.email_check_interval + settings.email_check_deadline
    if not stamps or max(stamps) > now - timedelta(seconds=quiet_s):
        return None
    return max(stamps)


def _said_before(account: str, holder: dict[str, Any] | None) -> bool:
    """Whether this holder of the account's lock was named already; remembers it if not."""
    pid = holder["pid"] if holder else None
    if account in _LOCK_HOLDER_SAID and _LOCK_HOLDER_SAID[account] == pid:
        return True
    _LOCK_HOLDER_SAID[account] = pid
    return False


def _say_if_held_too_long(
    conn: store.Connection,
    account: EmailAccountConfig,
    checkpoint: store.Checkpoint | None,
    settings: Settings,
    now: datetime,
) -> None:
    """Name the session holding the account's lock once no check could still be running
    under it, once per holder: a session whose host vanished keeps it until the server's
    TCP keepalive ends the session (two hours with the kernel's default), and the account
    was skipped without a word meanwhile."""
    last_check = _last_check_long_ago(checkpoint, settings, now)
    if last_check is None:
        _LOCK_HOLDER_SAID.pop(account.name, None)  # a check ran since: a later hold is news
        return
    holder = store.lock_holder(conn, account.name)
    if _said_before(account.name, holder):
        return
    log.warning(
        "email_account_lock_held",
        account=account.name,
        last_check=last_check.isoformat(),
        holder=holder,
        hint="another session holds this account's lock far past any check's deadline (a"
        " worker whose host vanished: the server ends its session when its TCP keepalive"
        " gives up, by default after two hours); if no worker of yours is that session,"
        f" SELECT pg_terminate_backend({holder['pid'] if holder else 'PID'}) frees it",
    )


def _check_one(
    conn: store.Connection,
    account: EmailAccountConfig,
    settings: Settings,
    now: datetime,
    sessions: OpenSessions | None,
) -> AccountReport:
    checkpoint = store.load_checkpoint(conn, account.name, account.mailbox)
    if not is_due(checkpoint, settings.email_check_interval, now):
        return AccountReport(name=account.name, skipped_reason="not due")
    if not store.advisory_lock(conn, account.name):
        _say_if_held_too_long(conn, account, checkpoint, settings, now)
        return AccountReport(name=account.name, skipped_reason="checked by another worker")
    _LOCK_HOLDER_SAID.pop(account.name, None)  # released: whoever takes it next is named anew
    try:
        # Read again under the lock: another worker may have just finished this account.
        checkpoint = store.load_checkpoint(conn, account.name, account.mailbox)
        if not is_due(checkpoint, settings.email_check_interval, now):
            return AccountReport(name=account.name, skipped_reason="not due")
        report = check_account(
            conn,
            account,
            checkpoint,
            lookback_s=settings.email_initial_lookback,
            now=now,
            timeout=IMAP_TIMEOUT_S,
            deadline=settings.email_check_deadline,
            sessions=sessions,
        )
    except ImapAborted as exc:
        log.info("email_check_aborted", account=account.name, error=str(exc))
        return AccountReport(name=account.name, error=str(exc))
    except ImapError as exc:
        return _failed(conn, account, str(exc), now, hint=_imap_hint(exc, account))
    except MessageNotRecorded as exc:  # the database's refusal, not a crash nor the account's
        return _failed(conn, account, str(exc), now, hint=_NOT_RECORDED_HINT)
    except DatabaseUnavailable:
        raise
    except Exception as exc:  # one account's surprise never stops the others
        log.exception("email_check_crashed", account=account.name)
        return _failed(conn, account, f"{type(exc).__name__}: {exc}", now, hint=_CRASH_HINT)
    finally:
        store.release_lock(conn, account.name)
    log.info(
        "email_check_finished",
        account=account.name,
        fetched=report.fetched,
        enqueued=report.enqueued,
        seen_without_triage=report.seen_without_triage,
        duplicates=report.duplicates,
        failed=report.failed,
        uidvalidity_reset=report.uidvalidity_reset,
        uids_reused=report.uids_reused,
    )
    return report


def check_due_accounts(
    settings: Settings,
    conninfo: str,
    *,
    now: datetime | None = None,
    sessions: OpenSessions | None = None,
) -> list[AccountReport]:
    """Check every configured account that is due; one report per account, in config order.

    An account is due when its last check (or last failure) is older than
    ``settings.email_check_interval``; an interval of 0 disables checks (returns ``[]``).
    IMAP failures (connection, TLS, login, protocol) are logged with the account's name,
    stored in ``email_checkpoints.last_error`` and returned in the report: they never raise
    and never stop the other accounts. What was committed before a failure stays committed.
    Raises :class:`sokratos_worker.errors.DatabaseUnavailable` only when PostgreSQL cannot
    be reached. ``now`` (aware) is injectable for tests. Each account's IMAP session ends
    within ``settings.email_check_deadline``; ``sessions`` (the worker's) lets a stop cut the
    one in progress, after which the remaining accounts are skipped.
    """
    if settings.email_check_interval <= 0 or not settings.email_accounts:
        return []
    reports: list[AccountReport] = []
    with store.connect(conninfo, worker_settings=True) as conn:  # run's own (see connect)
        # The database's clock, as the checkpoints' stamps are compared with it next time:
        # the host's stepped back an hour (NTP) would make every account wait that hour.
        current = now or store.database_now(conn)
        for account in settings.email_accounts:
            if sessions is not None and sessions.stopping:
                reports.append(
                    AccountReport(name=account.name, skipped_reason="the worker is stopping")
                )
                continue
            reports.append(_check_one(conn, account, settings, current, sessions))
    return reports


def probe_accounts(settings: Settings, *, timeout: float = 15.0) -> list[CheckLine]:
    """Log in and EXAMINE each account (changes nothing); one line per account for ``check``."""
    lines: list[CheckLine] = []
    for account in settings.email_accounts:
        component = f"email account {account.name}"
        try:
            with ImapSession(account, timeout=timeout) as session:
                state = session.examine()
        except ImapError as exc:
            detail = _without_password(account, str(exc))
            lines.append(CheckLine(component, ok=False, detail=detail))
            continue
        lines.append(
            CheckLine(
                component,
                ok=True,
                detail=f"{account.host}:{account.imap_port} {account.mailbox}: "
                f"{state.exists} messages, UIDVALIDITY {state.uidvalidity}",
            )
        )
    return lines


def account_statuses(
    conn: store.Connection, accounts: Sequence[tuple[str, str]] | None = None
) -> list[dict[str, Any]]:
    """``status``'s ``email_accounts``: ``{"name", "last_check_at", "last_error"}`` per account.

    Also ``mailbox`` and ``last_error_at``; timestamps are ISO-8601 strings or None. With
    ``accounts`` (the configured ``(name, mailbox)`` pairs), each account shows the row of
    its configured mailbox (a row left by a mailbox configured before is not shown), accounts
    never checked are listed too, and rows of accounts no longer configured are left out.
    Without it, every row is listed.
    """
    rows = {(row["account"], row["mailbox"]): row for row in store.account_rows(conn)}
    wanted = list(accounts) if accounts is not None else list(rows)
    out: list[dict[str, Any]] = []
    for name, mailbox in wanted:
        row = rows.get((name, mailbox), {})
        checked, failed = row.get("checked_at"), row.get("last_error_at")
        out.append(
            {
                "name": name,
                "mailbox": mailbox,
                "last_check_at": checked.isoformat() if checked else None,
                "last_error": row.get("last_error"),
                "last_error_at": failed.isoformat() if failed else None,
            }
        )
    return out
