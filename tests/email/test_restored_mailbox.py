"""A mailbox restored from a backup keeps its UIDVALIDITY but hands out UIDs the checkpoint
already passed: the check sees UIDNEXT at or below its last UID, says so, and reads the
mailbox again from its first message (processed_emails keeps seen mail from a second item).

Found by review (r2): new mail was never fetched, silently. Real parts: a real Dovecot whose
Maildir folder is copied away and back with ``cp -a`` (what restoring a backup does), a real
PostgreSQL.
"""

from __future__ import annotations

import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import mails
import psycopg
import pytest
from dovecot import USER, AccountFactory, Dovecot, make_settings
from structlog.testing import capture_logs

from sokratos_worker.email import check_due_accounts

pytestmark = [pytest.mark.imap, pytest.mark.postgres]

NOW = datetime.now(UTC)


def _folder(dovecot: Dovecot, mailbox: str) -> Path:
    path = dovecot.root / "mail" / USER / "Maildir" / f".{mailbox}"
    assert path.is_dir(), path
    return path


def _subjects(db: psycopg.Connection) -> list[str]:
    rows = db.execute("SELECT payload->>'subject' FROM pending_triage ORDER BY id")
    return [row[0] for row in rows]


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
    for n in (1, 2):
        dovecot.append(mailbox, mails.plain(subject=f"before the backup {n}"))
    check_due_accounts(settings, database_url, now=NOW)

    folder = _folder(dovecot, mailbox)
    backup = tmp_path / "backup"
    subprocess.run(["cp", "-a", str(folder), str(backup)], check=True)
    validity = dovecot.uidvalidity(mailbox)

    for n in (3, 4):
        dovecot.append(mailbox, mails.plain(subject=f"lost with the disk {n}"))
    [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=10))
    assert report.enqueued == 2
    assert db.execute("SELECT last_uid FROM email_checkpoints").fetchone() == (4,)

    # The disk dies; the mail server is restored from last night's backup.
    subprocess.run(["rm", "-rf", str(folder)], check=True)
    subprocess.run(["cp", "-a", str(backup), str(folder)], check=True)
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
