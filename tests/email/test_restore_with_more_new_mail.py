"""A mailbox restored from a backup hands out UIDs again; when more new mail arrives before
the next check than the restore went back by, UIDNEXT is above the checkpoint again and the
"UIDNEXT <= last_uid" test does not fire. The check lists ``last_uid:*`` and compares the
message now at UID ``last_uid`` with the one processed_emails recorded there: another message
means the UIDs were handed out again, and the mailbox is read again.

Found by review (r6): the mail at the reused UIDs was never fetched (lost).

Real parts: a real Dovecot whose Maildir folder is restored with ``cp -a`` (as in
tests/email/test_restored_mailbox.py), a real PostgreSQL.

Expected: every mail delivered after the restore is triaged.
"""

from __future__ import annotations

import contextlib
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import mails
import psycopg
import pytest
from dovecot import USER, AccountFactory, Dovecot, make_settings

from sokratos_worker.email import check_due_accounts

pytestmark = [pytest.mark.imap, pytest.mark.postgres]

NOW = datetime.now(UTC)


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
    for n in (1, 2):
        dovecot.append(mailbox, mails.plain(subject=f"before the backup {n}"))
    check_due_accounts(settings, database_url, now=NOW)

    folder = dovecot.root / "mail" / USER / "Maildir" / f".{mailbox}"
    backup = tmp_path / "backup"
    subprocess.run(["cp", "-a", str(folder), str(backup)], check=True)

    for n in (3, 4):
        dovecot.append(mailbox, mails.plain(subject=f"lost with the disk {n}"))
    [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=10))
    assert report.enqueued == 2
    assert db.execute("SELECT last_uid FROM email_checkpoints").fetchone() == (4,)

    # The disk dies; the server is restored from the backup (UIDNEXT back to 3).
    subprocess.run(["rm", "-rf", str(folder)], check=True)
    subprocess.run(["cp", "-a", str(backup), str(folder)], check=True)

    # Three mails arrive (MTAs flush their queues after the outage): UIDs 3, 4, 5; UIDNEXT 6.
    for n in (1, 2, 3):
        dovecot.append(mailbox, mails.plain(subject=f"after the restore {n}"))

    [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=20))
    assert report.ok, report.error
    subjects = {
        row[0] for row in db.execute("SELECT payload->>'subject' FROM pending_triage")
    }
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
    folder = dovecot.root / "mail" / USER / "Maildir" / f".{mailbox}"
    backup = tmp_path / "backup"
    subprocess.run(["cp", "-a", str(folder), str(backup)], check=True)
    for n in (2, 3):
        dovecot.append(mailbox, mails.plain(subject=f"lost with the disk {n}"))
    check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=10))
    assert db.execute("SELECT last_uid FROM email_checkpoints").fetchone() == (3,)
    subprocess.run(["rm", "-rf", str(folder)], check=True)
    subprocess.run(["cp", "-a", str(backup), str(folder)], check=True)
    for n in (1, 2, 3, 4):
        dovecot.append(mailbox, mails.plain(subject=f"after the restore {n}"))  # UIDs 2..5
    _expunge(dovecot, mailbox, 3)  # the message now at the checkpoint's UID is deleted
    [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=20))
    assert report.ok and report.uids_reused, report
    subjects = {r[0] for r in db.execute("SELECT payload->>'subject' FROM pending_triage")}
    assert {"after the restore 1", "after the restore 3", "after the restore 4"} <= subjects
