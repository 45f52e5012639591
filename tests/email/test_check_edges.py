"""Behaviour of the email check that a mutation review found no test pinning: each test kills
a hand-made mutant that every other email test let through (an off-by-one on a boundary, a
comparison flipped, a limit changed, a check skipped).

Real parts: Dovecot on 127.0.0.1 (conftest.py) and PostgreSQL; a test counts the IMAP
commands a check sends, or calls a pure function where the behaviour is that function's.
"""

from __future__ import annotations

import contextlib
import imaplib
import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import mails
import psycopg
import pytest
from dovecot import AccountFactory, Dovecot, make_settings
from refusing_proxy import ByeProxy, OmittingProxy, RefusingProxy
from structlog.testing import capture_logs

from sokratos_worker.email import (
    check_due_accounts,
    imap_answers,
    prune_processed_emails,
)
from sokratos_worker.email.failed import HEADERS_LIMIT, record_failed_message
from sokratos_worker.email.imap import ImapAborted, ImapSession, OpenSessions, SessionWatch
from sokratos_worker.email.imap_answers import FetchedMessage, fetched_messages
from sokratos_worker.email.parse import KEY_LIMIT, parse_email
from sokratos_worker.store import email as store
from tests.support.db import refuse_triage

pytestmark = [pytest.mark.imap, pytest.mark.postgres]

# Whole seconds, as INTERNALDATE has them: a boundary can be hit exactly.
NOW = datetime.now(UTC).replace(microsecond=0)


def _subjects(db: psycopg.Connection) -> list[str]:
    rows = db.execute("SELECT payload->>'subject' FROM pending_triage ORDER BY id").fetchall()
    return [row[0] for row in rows]


def _last_uid(db: psycopg.Connection) -> int:
    row = db.execute("SELECT last_uid FROM email_checkpoints WHERE account = 'home'").fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def uid_commands(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The UID commands (FETCH, SEARCH) the worker sends, in order."""
    sent: list[str] = []
    command = imaplib.IMAP4._command

    def counting(self: imaplib.IMAP4, name: str, *args: Any) -> Any:
        if name == "UID":
            sent.append(str(args[0]).upper())
        return command(self, name, *args)

    monkeypatch.setattr(imaplib.IMAP4, "_command", counting)
    return sent


def test_a_check_after_a_failed_first_check_is_not_a_uidvalidity_change(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """A checkpoint row a failed first check left (no UIDVALIDITY yet) is not reported as a
    UIDVALIDITY change when the next check opens the mailbox."""
    dovecot.append(mailbox, mails.plain(subject="first"))
    [failed] = check_due_accounts(make_settings(account(password="wrong")), database_url, now=NOW)
    assert not failed.ok
    assert db.execute("SELECT uidvalidity FROM email_checkpoints").fetchone() == (None,)
    with capture_logs() as logs:
        [report] = check_due_accounts(
            make_settings(account()), database_url, now=NOW + timedelta(minutes=10)
        )
    assert report.ok, report.error
    assert report.enqueued == 1 and not report.uidvalidity_reset, report
    assert not [e for e in logs if e["event"] == "email_uidvalidity_changed"]


def test_uidnext_equal_to_the_last_uid_read_is_a_restore_whatever_the_mail_at_it_looks_like(
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: Any,
    *,
    tmp_path: Path,
) -> None:
    """UIDNEXT equal to the checkpoint's last UID means the server hands that UID out again:
    the mailbox is read again even when the new mail at the reused UID has the size and
    arrival date of the one recorded there (which the restore check alone cannot tell)."""
    settings = make_settings(account())
    for n in (1, 2):
        dovecot.append(mailbox, mails.plain(subject=f"before the backup {n}"))
    check_due_accounts(settings, database_url, now=NOW)
    backup = tmp_path / "backup"
    dovecot.backup(mailbox, backup)
    arrived = NOW - timedelta(hours=1)
    # Same length of Message-ID, same headers and body, same arrival: same size and date.
    dovecot.append(
        mailbox,
        mails.plain(subject="at UID 3", message_id="<lost@example.org>"),
        when=arrived,
    )
    dovecot.append(mailbox, mails.plain(subject="at UID 4"))
    check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=10))
    assert _last_uid(db) == 4

    dovecot.restore(mailbox, backup)
    dovecot.append(
        mailbox,
        mails.plain(subject="at UID 3", message_id="<anew@example.org>"),
        when=arrived,
    )
    with capture_logs() as logs:
        [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=20))
    assert report.ok, report.error
    assert report.uids_reused, report
    assert (report.enqueued, report.duplicates) == (1, 2), report
    [warning] = [e for e in logs if e["event"] == "email_uids_reused"]
    assert (warning["last_uid"], warning["uidnext"]) == (4, 4)
    [new] = db.execute(
        "SELECT payload->>'message_id' FROM pending_triage ORDER BY id DESC LIMIT 1"
    ).fetchall()
    assert new == ("<anew@example.org>",)


def test_mail_that_arrived_exactly_at_the_lookback_cutoff_is_triaged(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """A new account's first check sees without triage only mail that arrived before the
    cutoff (its start minus the lookback): mail that arrived at the cutoff itself is triaged."""
    dovecot.append(
        mailbox,
        mails.plain(subject="a second too old"),
        when=NOW - timedelta(days=1, seconds=1),
    )
    dovecot.append(mailbox, mails.plain(subject="at the cutoff"), when=NOW - timedelta(days=1))
    settings = make_settings(account(), email_initial_lookback=86400)
    [report] = check_due_accounts(settings, database_url, now=NOW)
    assert report.ok, report.error
    assert (report.enqueued, report.seen_without_triage) == (1, 1), report
    assert _subjects(db) == ["at the cutoff"]


def test_a_message_the_database_refuses_for_a_program_limit_is_recorded_and_passed(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """A record refused with a program-limit error (SQLSTATE class 54, such as an index row
    too large) is that message's fault: it is dead-lettered and passed, and the check goes on."""
    refuse_triage(db, sqlstate="54000", subject="poison")  # program_limit_exceeded
    for subject in ("before", "poison", "after"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    [report] = check_due_accounts(make_settings(account()), database_url, now=NOW)
    assert report.ok, report.error
    assert (report.fetched, report.enqueued, report.failed) == (3, 2, 1)
    assert _subjects(db) == ["before", "after"]
    assert _last_uid(db) == 3
    [(label, error)] = db.execute("SELECT label, error_message FROM failed_operations").fetchall()
    assert label == "home UID 2"
    assert "refused by the test" in error


def test_an_account_is_due_again_exactly_one_interval_after_its_last_check(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """An account checked at T is checked again at T plus the check interval, not later."""
    settings = make_settings(account(), email_check_interval=300)
    dovecot.append(mailbox, mails.plain(subject="first"))
    check_due_accounts(settings, database_url, now=NOW)
    dovecot.append(mailbox, mails.plain(subject="second"))
    [early] = check_due_accounts(settings, database_url, now=NOW + timedelta(seconds=299))
    assert early.skipped_reason == "not due"
    [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(seconds=300))
    assert report.skipped_reason is None and report.enqueued == 1, report
    assert _subjects(db) == ["first", "second"]


def test_new_mail_above_the_checkpoint_is_checked_for_a_restore_from_the_listing_alone(
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: Any,
    *,
    uid_commands: list[str],
) -> None:
    """With new mail above the checkpoint and the message at its UID still there, the restore
    check compares that message from the ``last_uid:*`` listing: one UID FETCH to list, one
    to fetch the new mail, and no other command (the listed UIDs have no gap, so no UID
    SEARCH for mail the listing left out either)."""
    settings = make_settings(account())
    for n in (1, 2):
        dovecot.append(mailbox, mails.plain(subject=f"old {n}"))
    check_due_accounts(settings, database_url, now=NOW)
    dovecot.append(mailbox, mails.plain(subject="new"))
    uid_commands.clear()
    [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=10))
    assert (report.enqueued, report.uids_reused) == (1, False), report
    assert uid_commands == ["FETCH", "FETCH"]


def test_a_message_the_server_leaves_out_of_its_answer_stops_the_check_before_it(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """A message still in the mailbox that a UID FETCH answer leaves out is never passed
    silently: the check records the mail before it and stops before it, and the next check
    fetches it (test_message_left_out.py: passed after three checks)."""
    for subject in ("one", "two", "three"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    with OmittingProxy(dovecot.imap_port, refused={2}) as proxy:
        [report] = check_due_accounts(
            make_settings(account(port=proxy.port)), database_url, now=NOW
        )
    assert report.error is not None and "UID 2 " in report.error, report
    assert _subjects(db) == ["one"]
    assert _last_uid(db) == 1
    [report] = check_due_accounts(
        make_settings(account()), database_url, now=NOW + timedelta(minutes=10)
    )
    assert report.ok, report.error
    assert _subjects(db) == ["one", "two", "three"]


def test_a_refused_message_expunged_meanwhile_is_skipped_not_counted_as_refused(
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: Any,
    *,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A message the server refuses (NO) after another client expunged it is gone, not
    refused: the check logs it as vanished and goes on, with no refusal counted."""
    for subject in ("one", "two", "three"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    listing = ImapSession.refs_from

    def list_then_another_client_expunges(self: ImapSession, last_uid: int) -> Any:
        refs = listing(self, last_uid)
        client = dovecot.client()
        try:
            assert client.select(mailbox)[0] == "OK"
            client.uid("STORE", "2", "+FLAGS", "(\\Deleted)")
            client.expunge()
        finally:
            with contextlib.suppress(Exception):
                client.logout()
        return refs

    monkeypatch.setattr(ImapSession, "refs_from", list_then_another_client_expunges)
    with RefusingProxy(dovecot.imap_port, refused={2}) as proxy, capture_logs() as logs:
        [report] = check_due_accounts(
            make_settings(account(port=proxy.port)), database_url, now=NOW
        )
    assert report.ok, report.error
    assert (report.enqueued, report.failed) == (2, 0), report
    assert _subjects(db) == ["one", "three"]
    assert [e["uid"] for e in logs if e["event"] == "email_message_vanished"] == [2]
    assert db.execute(
        "SELECT last_uid, refused_uid, refused_checks FROM email_checkpoints"
    ).fetchone() == (3, None, 0)


def test_a_first_check_fetches_at_most_batch_messages_per_uid_fetch(
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: Any,
    *,
    uid_commands: list[str],
) -> None:
    """BATCH_MESSAGES + 1 new messages take two body fetches after the listing: a batch holds
    at most BATCH_MESSAGES messages."""
    count = imap_answers.BATCH_MESSAGES + 1
    for n in range(count):
        dovecot.append(mailbox, mails.plain(subject=f"m{n}"))
    [report] = check_due_accounts(make_settings(account()), database_url, now=NOW)
    assert (report.fetched, report.enqueued) == (count, count), report
    assert uid_commands == ["FETCH", "FETCH", "FETCH"]


def test_every_batch_is_bounded_by_bytes_not_only_the_first(
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: Any,
    *,
    uid_commands: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With room for two messages per batch by bytes, five messages take three body fetches:
    each batch starts counting its bytes from zero."""
    for n in range(5):
        dovecot.append(mailbox, mails.plain(subject=f"m{n}", body="x" * 1000))
    monkeypatch.setattr(imap_answers, "BATCH_BYTES", 3000)  # two of these messages, not three
    [report] = check_due_accounts(make_settings(account()), database_url, now=NOW)
    assert report.enqueued == 5, report
    assert uid_commands == ["FETCH", "FETCH", "FETCH", "FETCH"]


@pytest.mark.parametrize("code", [b"INUSE", b"LIMIT", b"OVERQUOTA"])
def test_every_rfc_5530_state_code_on_a_fetch_is_the_servers_state(
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: Any,
    *,
    code: bytes,
) -> None:
    """NO [INUSE], [LIMIT] or [OVERQUOTA] on every FETCH, as NO [UNAVAILABLE]: the server's
    state for more than three checks, so no message is counted as refused nor passed."""
    dovecot.append(mailbox, mails.plain(subject="the only mail"))
    answer = b"[" + code + b"] try again later"
    with RefusingProxy(dovecot.imap_port, refused={1}, answer=answer) as proxy:
        settings = make_settings(account(port=proxy.port))
        for n in range(4):
            [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(hours=n))
            assert report.error is not None and "failed for now" in report.error, report
    assert db.execute(
        "SELECT last_uid, refused_uid, refused_checks FROM email_checkpoints"
    ).fetchone() == (0, None, 0)
    assert db.execute("SELECT count(*) FROM failed_operations").fetchone() == (0,)


@pytest.mark.usefixtures("poison_breaks_the_parser")
def test_a_dead_lettered_last_message_moves_the_checkpoint_past_it(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """The checkpoint passes a message that cannot be handled even when no mail follows it,
    so the next check neither fetches it again nor dead-letters it twice."""
    for subject in ("before", "poison"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    settings = make_settings(account())
    [report] = check_due_accounts(settings, database_url, now=NOW)
    assert (report.enqueued, report.failed) == (1, 1), report
    assert _last_uid(db) == 2
    [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=10))
    assert report.ok, report.error
    assert (report.fetched, report.failed) == (0, 0), report
    assert db.execute("SELECT count(*) FROM failed_operations").fetchone() == (1,)


@pytest.mark.usefixtures("poison_breaks_the_parser")
def test_a_dead_lettered_message_keeps_a_bounded_header_block(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """failed_operations keeps at most HEADERS_LIMIT characters of a message's header block."""
    long_header = "X-Long: " + "h" * 10_000
    dovecot.append(mailbox, mails.plain(subject="poison", extra_headers=long_header))
    [report] = check_due_accounts(make_settings(account()), database_url, now=NOW)
    assert report.failed == 1, report
    [headers] = db.execute("SELECT context_data->>'headers' FROM failed_operations").fetchone()
    assert headers.startswith("From: Bob Example") and len(headers) == HEADERS_LIMIT


def test_a_dead_lettered_message_keeps_its_header_block_up_to_the_first_blank_line(
    account: AccountFactory, db: Any
) -> None:
    """The header block kept in failed_operations ends at the first blank line (CRLF or bare
    LF): a bare-LF blank line later in the body does not carry the body in."""
    raw = b"From: bob@example.org\r\nSubject: poison\r\n\r\nfirst line\r\nsecret\n\nmore\n"
    message = FetchedMessage(uid=7, internal_date=None, raw=raw)
    failure_id = record_failed_message(db, account(), 1, message, RuntimeError("parser bug"))
    [headers] = db.execute(
        "SELECT context_data->>'headers' FROM failed_operations WHERE id = %s", (failure_id,)
    ).fetchone()
    assert headers == "From: bob@example.org\r\nSubject: poison"


def test_a_message_id_key_of_exactly_key_limit_characters_is_kept_and_one_more_is_hashed(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """processed_emails keys are varchar(255): ``home:<Message-ID>`` of exactly KEY_LIMIT
    characters is the key as it is, one character more and the message is keyed by hash;
    both are triaged."""

    def message_id(length: int) -> str:
        # len("home:") + len("<" + local + "@x>") == length
        return "<" + "a" * (length - len("home:") - len("<@x>")) + "@x>"

    fits, too_long = message_id(KEY_LIMIT), message_id(KEY_LIMIT + 1)
    dovecot.append(mailbox, mails.plain(subject="fits", message_id=fits))
    dovecot.append(mailbox, mails.plain(subject="too long", message_id=too_long))
    [report] = check_due_accounts(make_settings(account()), database_url, now=NOW)
    assert report.ok, report.error
    assert (report.enqueued, report.failed) == (2, 0), report
    keys = [row[0] for row in db.execute("SELECT message_id FROM processed_emails ORDER BY uid")]
    assert keys[0] == f"home:{fits}" and len(keys[0]) == KEY_LIMIT
    assert keys[1].startswith("home:sha256:")
    assert _subjects(db) == ["fits", "too long"]


def test_uid_and_internaldate_sent_after_the_literal_are_read() -> None:
    """Some servers put UID and INTERNALDATE after a message's literal in a FETCH answer:
    the message is found under its UID all the same."""
    data = [
        (b"1 FETCH (RFC822.SIZE 5 BODY[]<0> {5}", b"hello"),
        b' UID 7 INTERNALDATE "01-Dec-2026 09:30:00 +0000")',
    ]
    [(uid, message)] = fetched_messages(data).items()
    assert (uid, message.uid, message.raw, message.server_size) == (7, 7, b"hello", 5)
    assert message.internal_date == datetime(2026, 12, 1, 9, 30, tzinfo=UTC)


def test_old_mail_is_batched_by_its_header_fetches_not_by_its_full_size(
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: Any,
    *,
    uid_commands: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Mail older than the lookback is fetched as headers only, so its messages' full sizes
    do not split its batches: three old messages larger together than BATCH_BYTES take one
    header fetch."""
    for n in range(3):
        dovecot.append(
            mailbox,
            mails.plain(subject=f"old {n}", body="x" * 1000),
            when=NOW - timedelta(days=30),
        )
    monkeypatch.setattr(imap_answers, "BATCH_BYTES", 3000)  # two of these messages, not three
    [report] = check_due_accounts(make_settings(account()), database_url, now=NOW)
    assert report.seen_without_triage == 3, report
    assert uid_commands == ["FETCH", "FETCH"]


@pytest.mark.usefixtures("poison_breaks_the_parser")
def test_old_mail_the_parser_fails_on_is_dead_lettered_from_its_full_fetch(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """Old mail whose header block the parser fails on is fetched whole before it is
    dead-lettered: failed_operations records the message's size, not its header block's."""
    raw = mails.plain(subject="poison", body="x" * 5000)
    dovecot.append(mailbox, raw, when=NOW - timedelta(days=30))
    [report] = check_due_accounts(make_settings(account()), database_url, now=NOW)
    assert report.failed == 1, report
    [size] = db.execute("SELECT (context_data->>'size')::int FROM failed_operations").fetchone()
    assert size == len(raw)


def test_the_hash_of_a_message_without_message_id_starts_at_its_first_blank_line() -> None:
    """The body hashed for a key is everything after the header block's CRLF blank line, even
    when the body holds a bare-LF blank line (keys must not change between versions)."""
    raw = mails.plain(subject="no id", message_id=None, body="first") + b"a\n\nb\r\n"
    assert parse_email(raw).raw_body == b"first\r\na\n\nb\r\n"


def test_prune_keeps_an_old_epochs_rows_until_the_reread_after_a_reset_completes(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """After a UIDVALIDITY reset, rows of the old epoch are pruned only once a check of the
    new epoch completed (checked_at set), not while its re-read is under way."""
    for n in range(3):
        dovecot.append(mailbox, mails.plain(subject=f"m{n}"))
    check_due_accounts(make_settings(account()), database_url, now=NOW)
    db.execute("UPDATE processed_emails SET seen_at = now() - interval '100 days'")
    # A reset to a new epoch whose re-read has not completed (what reset_checkpoint leaves).
    db.execute(
        "UPDATE email_checkpoints SET uidvalidity = uidvalidity + 1, last_uid = 0,"
        " checked_at = NULL"
    )
    assert prune_processed_emails(db, 90) == 0
    db.execute("UPDATE email_checkpoints SET checked_at = now()")
    assert prune_processed_emails(db, 90) == 3


def test_the_checkpoint_never_moves_back_within_an_epoch(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """A record for a UID below the checkpoint (two overlapping checks of one account) leaves
    last_uid where it is: only a new UIDVALIDITY epoch starts it again."""
    for n in range(3):
        dovecot.append(mailbox, mails.plain(subject=f"m{n}"))
    check_due_accounts(make_settings(account()), database_url, now=NOW)
    validity = dovecot.uidvalidity(mailbox)
    behind = store.MessageRecord(
        account="home",
        mailbox=mailbox,
        uidvalidity=validity,
        uid=1,
        key="",
        payload=None,
    )
    store.advance_checkpoint(db, behind)
    assert _last_uid(db) == 3


class _RebuildingByeProxy(ByeProxy):
    """On the first body FETCH of a UID in ``refused``, the mailbox is rebuilt (a new
    UIDVALIDITY) and the session closed with ``* BYE``; later sessions are relayed as they are."""

    def __init__(self, upstream_port: int, refused: set[int], rebuild: Any) -> None:
        super().__init__(upstream_port, refused, answer=b"Internal error occurred.")
        self._rebuild = rebuild

    def _commands(self, client: socket.socket, upstream: socket.socket) -> None:
        with contextlib.suppress(OSError, ValueError):
            for line in self._lines(client):
                match = self.fetch.match(line)
                asked = {int(uid) for uid in match.group(2).split(b",")} if match else set()
                if match and asked & self.refused:
                    self.refused = set()
                    self._rebuild()
                    client.sendall(b"* BYE " + self.answer + b"\r\n")
                    for sock in (client, upstream):
                        with contextlib.suppress(OSError):
                            sock.shutdown(socket.SHUT_RDWR)
                    return
                upstream.sendall(line)


def test_a_reconnect_that_finds_another_uidvalidity_stops_the_check(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """When the server closes the session on a message (BYE) and the mailbox has a new
    UIDVALIDITY on the reconnect, the check stops: no UID of the new epoch is read as the old
    one's; the next check reads the mailbox in its new epoch."""
    raws = [mails.plain(subject=f"m{n}") for n in range(3)]
    for raw in raws:
        dovecot.append(mailbox, raw)
    old = dovecot.uidvalidity(mailbox)

    def rebuild() -> None:
        dovecot.delete_mailbox(mailbox)
        dovecot.create_mailbox(mailbox)
        for raw in raws:
            dovecot.append(mailbox, raw)

    with _RebuildingByeProxy(dovecot.imap_port, refused={2}, rebuild=rebuild) as proxy:
        [report] = check_due_accounts(
            make_settings(account(port=proxy.port)), database_url, now=NOW
        )
    assert dovecot.uidvalidity(mailbox) != old
    assert report.error is not None and "UIDVALIDITY changed" in report.error, report
    assert _subjects(db) == []
    [report] = check_due_accounts(
        make_settings(account()), database_url, now=NOW + timedelta(minutes=10)
    )
    assert report.ok, report.error
    assert _subjects(db) == ["m0", "m1", "m2"]


def test_a_session_opened_after_the_stop_began_never_connects(
    dovecot: Dovecot, account: AccountFactory
) -> None:
    """Once a stopping worker has cut its sessions, a session opened after that is cut at
    once: it never connects to the server."""
    sessions = OpenSessions()
    assert sessions.cut_all() == 0
    with RefusingProxy(dovecot.imap_port, refused=set()) as proxy:
        with (
            pytest.raises(ImapAborted, match="the worker is stopping"),
            ImapSession(account(port=proxy.port), sessions=sessions),
        ):
            pass
        assert proxy.connections == 0


def test_a_session_cut_for_a_stop_keeps_that_reason_when_its_deadline_passes() -> None:
    """The first reason a session was cut for stays: a stop followed by the deadline timer is
    still a stop, so the account is not blamed for it."""
    watch = SessionWatch(60)
    watch.cut("stopping")
    watch.cut("deadline")
    assert watch.cut_reason == "stopping"


def test_a_socket_watched_after_the_cut_is_shut_down_at_once() -> None:
    """A socket a session watches after it was cut (a connection opened as the stop came) is
    shut down at once, so no read on it can block."""
    watch = SessionWatch(60)
    watch.cut("stopping")
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.settimeout(5)
        watch.watch(ours)
        assert ours.recv(1) == b""  # shut down: end of stream at once, not a timeout
        watch.end()


def test_an_account_another_worker_just_checked_is_not_checked_again(
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: Any,
    *,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The checkpoint is read again once the account's lock is held: another worker that
    checked the account between the first read and the lock makes it not due."""
    for n in range(2):
        dovecot.append(mailbox, mails.plain(subject=f"m{n}"))
    settings = make_settings(account())
    lock = store.advisory_lock
    others: list[Any] = []

    def another_worker_checks_first(conn: psycopg.Connection, name: str) -> bool:
        if not others:
            others.append(None)  # the other worker's own lock is taken as usual
            others[0] = check_due_accounts(settings, database_url, now=NOW)
        return lock(conn, name)

    monkeypatch.setattr(store, "advisory_lock", another_worker_checks_first)
    [report] = check_due_accounts(settings, database_url, now=NOW)
    [[other]] = others
    assert other.ok and other.enqueued == 2, other
    assert report.skipped_reason == "not due", report
    assert _subjects(db) == ["m0", "m1"]
