"""A mailbox restored from a backup keeps its UIDVALIDITY but hands out again the UIDs the
checkpoint already passed. The check notices it and reads the mailbox again from its first
message (processed_emails keeps seen mail from a second item):

- UIDNEXT at or below the checkpoint's last UID (review r2: new mail was never fetched,
  silently);
- more new mail before the next check than the restore went back by, so UIDNEXT is above the
  checkpoint again: the check lists ``last_uid:*`` and compares the message now at UID
  ``last_uid`` (or, if it was deleted, the highest UID below it, found by UID SEARCH) with the
  one processed_emails recorded there; another message means the UIDs were handed out again
  (review r6: the mail at the reused UIDs was lost);
- a server that leaves ``[UIDNEXT n]`` out of its EXAMINE answer (older or minimal servers,
  or a proxy in between): ``UID FETCH last_uid:*`` returns the mailbox's highest message even
  when its UID is below ``last_uid`` (RFC 3501 "n:*"), and the message at that UID, never
  recorded, shows the UIDs were handed out again (review r6: only UIDNEXT was looked at).

Real parts: a real Dovecot whose Maildir folder is copied away and back with ``cp -a`` (what
restoring a backup does; Dovecot.backup and Dovecot.restore), reached directly or through a
forwarder that drops the untagged ``* OK [UIDNEXT n]`` line, and a real PostgreSQL.
Expected: every mail delivered after the restore is triaged.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import mails
import psycopg
import pytest
from dovecot import AccountFactory, Dovecot, make_settings
from structlog.testing import capture_logs

from sokratos_worker.config import Settings
from sokratos_worker.email import AccountReport, check_due_accounts

pytestmark = [pytest.mark.imap, pytest.mark.postgres]

NOW = datetime.now(UTC)
_UIDNEXT_LINE = re.compile(rb"^\* OK \[UIDNEXT \d+\][^\n]*\n", re.MULTILINE)


def _subjects(db: psycopg.Connection) -> list[str]:
    rows = db.execute("SELECT payload->>'subject' FROM pending_triage ORDER BY id")
    return [row[0] for row in rows]


def _read_then_back_up_then_read_more(
    dovecot: Dovecot, mailbox: str, settings: Settings, database_url: str, backup: Path
) -> AccountReport:
    """Two mails read, the mailbox backed up to ``backup``, then two more (UIDs 3 and 4, which
    the restore loses) read; the second check's report."""
    for n in (1, 2):
        dovecot.append(mailbox, mails.plain(subject=f"before the backup {n}"))
    check_due_accounts(settings, database_url, now=NOW)

    dovecot.backup(mailbox, backup)

    for n in (3, 4):
        dovecot.append(mailbox, mails.plain(subject=f"lost with the disk {n}"))
    [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=10))
    return report


def test_new_mail_in_a_mailbox_restored_from_a_backup_is_triaged(
    *,
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
    tmp_path: Path,
) -> None:
    settings = make_settings(account(), email_initial_lookback=86400)
    backup = tmp_path / "backup"
    report = _read_then_back_up_then_read_more(dovecot, mailbox, settings, database_url, backup)
    validity = dovecot.uidvalidity(mailbox)
    assert report.enqueued == 2
    assert db.execute("SELECT last_uid FROM email_checkpoints").fetchone() == (4,)

    # The disk dies; the mail server is restored from last night's backup.
    dovecot.restore(mailbox, backup)
    assert dovecot.uidvalidity(mailbox) == validity  # same epoch: UIDs will be reused

    # New mail whose arrival date is older than the lookback is new all the same.
    dovecot.append(
        mailbox, mails.plain(subject="new mail after the restore"), when=NOW - timedelta(days=3)
    )
    with capture_logs() as logs:
        [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=20))
    assert report.ok, report.error
    assert report.uids_reused and not report.uidvalidity_reset
    assert (report.enqueued, report.duplicates, report.seen_without_triage) == (1, 2, 0), report
    assert _subjects(db) == [
        "before the backup 1",
        "before the backup 2",
        "lost with the disk 3",
        "lost with the disk 4",
        "new mail after the restore",
    ]
    [warning] = [e for e in logs if e["event"] == "email_uids_reused"]
    assert (warning["last_uid"], warning["uidnext"]) == (4, 4)  # UID 3 went to the new mail
    assert warning["log_level"] == "warning" and "backup" in warning["what_happened"]
    assert db.execute("SELECT uidvalidity, last_uid FROM email_checkpoints").fetchone() == (
        validity,
        3,
    )

    # The next check reads above UID 3 again, as usual.
    dovecot.append(mailbox, mails.plain(subject="the day after"))
    with capture_logs() as logs:
        [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=30))
    assert (report.enqueued, report.duplicates, report.uids_reused) == (1, 0, False), report
    assert not [e for e in logs if e["event"] == "email_uids_reused"]


def test_mail_at_reused_uids_is_triaged_when_more_mail_came_than_the_restore_went_back(
    *,
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
    tmp_path: Path,
) -> None:
    settings = make_settings(account(), email_initial_lookback=86400)
    backup = tmp_path / "backup"
    report = _read_then_back_up_then_read_more(dovecot, mailbox, settings, database_url, backup)
    assert report.enqueued == 2
    assert db.execute("SELECT last_uid FROM email_checkpoints").fetchone() == (4,)

    # The disk dies; the server is restored from the backup (UIDNEXT back to 3).
    dovecot.restore(mailbox, backup)

    # Three mails arrive (MTAs flush their queues after the outage): UIDs 3, 4, 5; UIDNEXT 6.
    for n in (1, 2, 3):
        dovecot.append(mailbox, mails.plain(subject=f"after the restore {n}"))

    [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=20))
    assert report.ok, report.error
    subjects = set(_subjects(db))
    missing = {f"after the restore {n}" for n in (1, 2, 3)} - subjects
    assert not missing, f"never triaged (lost): {sorted(missing)}; report {report}"


def _expunge(dovecot: Dovecot, mailbox: str, uid: int) -> None:
    client = dovecot.client()
    try:
        assert client.select(mailbox)[0] == "OK"
        client.uid("STORE", str(uid), "+FLAGS", "(\\Deleted)")
        client.expunge()
    finally:
        with contextlib.suppress(Exception):
            client.logout()


def test_deleting_the_last_mail_read_then_new_mail_is_not_taken_for_a_restore(
    *,
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
) -> None:
    """UID last_uid gone and newer mail above it: the highest UID below (found by UID SEARCH)
    still holds the message recorded there, so the mailbox is not read again."""
    settings = make_settings(account(), email_initial_lookback=86400)
    for n in (1, 2, 3):
        dovecot.append(mailbox, mails.plain(subject=f"mail {n}"))
    [report] = check_due_accounts(settings, database_url, now=NOW)
    assert report.enqueued == 3, report
    _expunge(dovecot, mailbox, 3)
    dovecot.append(mailbox, mails.plain(subject="after the deletion"))  # UID 4
    [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=10))
    assert report.ok, report.error
    assert (report.uids_reused, report.fetched, report.enqueued) == (False, 1, 1), report


def test_a_restore_is_noticed_when_the_last_uid_read_was_deleted_since(
    *,
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
    tmp_path: Path,
) -> None:
    """Restored to UIDNEXT 2 after UIDs 1..3 were read; four mails arrive (UIDs 2..5) and UID 3
    is deleted: UID SEARCH finds UID 2, which now holds a mail never recorded there."""
    settings = make_settings(account(), email_initial_lookback=86400)
    dovecot.append(mailbox, mails.plain(subject="before the backup"))
    check_due_accounts(settings, database_url, now=NOW)
    backup = tmp_path / "backup"
    dovecot.backup(mailbox, backup)
    for n in (2, 3):
        dovecot.append(mailbox, mails.plain(subject=f"lost with the disk {n}"))
    check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=10))
    assert db.execute("SELECT last_uid FROM email_checkpoints").fetchone() == (3,)
    dovecot.restore(mailbox, backup)
    for n in (1, 2, 3, 4):
        dovecot.append(mailbox, mails.plain(subject=f"after the restore {n}"))  # UIDs 2..5
    _expunge(dovecot, mailbox, 3)  # the message now at the checkpoint's UID is deleted
    [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=20))
    assert report.ok and report.uids_reused, report
    subjects = set(_subjects(db))
    assert {"after the restore 1", "after the restore 3", "after the restore 4"} <= subjects


# --- a server that leaves UIDNEXT out of its EXAMINE answer ---------------------------


def _close(*socks: socket.socket) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)


def _up(client: socket.socket, upstream: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := client.recv(65536):
            upstream.sendall(data)
    _close(client, upstream)


def _down(upstream: socket.socket, client: socket.socket) -> None:
    pending = b""
    with contextlib.suppress(OSError):
        while data := upstream.recv(65536):
            pending += data
            cut = pending.rfind(b"\n") + 1  # forward whole lines only
            complete, pending = pending[:cut], pending[cut:]
            client.sendall(_UIDNEXT_LINE.sub(b"", complete))
        client.sendall(pending)
    _close(client, upstream)


@contextlib.contextmanager
def without_uidnext(port: int):
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", port))
            threading.Thread(target=_up, args=(client, upstream), daemon=True).start()
            threading.Thread(target=_down, args=(upstream, client), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


def test_a_restore_is_noticed_without_uidnext_in_the_examine_answer(
    *,
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
    tmp_path: Path,
) -> None:
    with without_uidnext(dovecot.imap_port) as port:
        settings = make_settings(account(port=port), email_initial_lookback=86400)
        backup = tmp_path / "backup"
        report = _read_then_back_up_then_read_more(
            dovecot, mailbox, settings, database_url, backup
        )
        assert report.enqueued == 2, report

        dovecot.restore(mailbox, backup)
        dovecot.append(mailbox, mails.plain(subject="new mail after the restore"))  # UID 3

        [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=20))
    assert report.ok, report.error
    subjects = _subjects(db)
    assert "new mail after the restore" in subjects, (
        f"the mail delivered after the restore was never fetched: {report}"
    )
