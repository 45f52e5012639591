"""A new account's first check killed or failed part-way and resumed later: the initial
lookback window is the one fixed by its first attempt, so mail inside it, or delivered after
that attempt began, is triaged and never recorded as "seen without triage".

Found by review (r2): the cutoff was recomputed from each attempt's own time until the first
check completed. Real parts: a real Dovecot, a real PostgreSQL, a check in a subprocess killed
with SIGKILL inside the transaction of UID 2 (check_in_subprocess.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import mails
import psycopg
import pytest
from dovecot import AccountFactory, Dovecot, make_settings
from test_email_crash import ENV, SCRIPT, _settings_json, _wait_for_backends_to_go

from sokratos_worker.email import check_due_accounts

pytestmark = [pytest.mark.imap, pytest.mark.postgres]

DAY = 86400


def _subjects(db: psycopg.Connection) -> list[str]:
    rows = db.execute(
        "SELECT payload->>'subject' FROM pending_triage ORDER BY (payload->>'uid')::int"
    ).fetchall()
    return [row[0] for row in rows]


def _kill_inside_uid(settings_json: str, database_url: str, uid: int, marker: Path) -> None:
    """Run a check in a subprocess and SIGKILL it inside the transaction of ``uid``."""
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), settings_json, database_url, str(uid), str(marker)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"the check never reached UID {uid}"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.subprocess
def test_a_killed_first_check_then_a_late_restart_triages_the_new_mail(
    *,
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
    tmp_path: Path,
) -> None:
    start = datetime.now(UTC)
    for n, age in enumerate((timedelta(hours=3), timedelta(hours=2), timedelta(hours=1))):
        dovecot.append(mailbox, mails.plain(subject=f"recent {n + 1}"), when=start - age)
    acct = account()
    settings_json = _settings_json(acct, email_initial_lookback=DAY)
    _kill_inside_uid(settings_json, database_url, 2, tmp_path / "blocked")
    _wait_for_backends_to_go(db)
    assert db.execute("SELECT count(*) FROM pending_triage").fetchone() == (1,)
    [(began,)] = db.execute("SELECT first_check_started_at FROM email_checkpoints").fetchall()
    assert start - timedelta(minutes=1) < began < datetime.now(UTC)

    # Mail keeps arriving while the worker is down (six hours after the first check began).
    dovecot.append(
        mailbox,
        mails.plain(subject="arrived after the first check began"),
        when=start + timedelta(hours=6),
    )

    # The worker comes back two days later.
    settings = make_settings(acct, email_initial_lookback=DAY)
    [report] = check_due_accounts(settings, database_url, now=start + timedelta(days=2))
    assert report.ok, report.error
    assert (report.enqueued, report.seen_without_triage) == (3, 0), (report, _subjects(db))
    assert _subjects(db) == [
        "recent 1",
        "recent 2",
        "recent 3",
        "arrived after the first check began",
    ]


def test_a_first_check_resumed_after_an_upgrade_reuses_its_first_attempts_time(
    *,
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
) -> None:
    """The rows a first attempt made before cutoffs were stored leave, with no cutoff: its
    first recorded message dates the attempt, not the resumed check's own time."""
    now = datetime.now(UTC)
    for uid, age in enumerate((timedelta(days=10), timedelta(hours=3), timedelta(hours=2)), 1):
        mid = "<old@example.org>" if uid == 1 else "auto"
        dovecot.append(mailbox, mails.plain(subject=f"mail {uid}", message_id=mid), when=now - age)
    validity = dovecot.uidvalidity(mailbox)
    # What the old worker left: UID 1 recorded as seen, then it died, upgraded, two days on.
    db.execute(
        "INSERT INTO email_checkpoints (account, mailbox, uidvalidity, last_uid)"
        " VALUES ('home', %s, %s, 1)",
        (mailbox, validity),
    )
    db.execute(
        "INSERT INTO processed_emails (message_id, account, mailbox, uidvalidity, uid, seen_at)"
        " VALUES ('home:<old@example.org>', 'home', %s, %s, 1, %s)",
        (mailbox, validity, now),
    )
    settings = make_settings(account(), email_initial_lookback=DAY)
    [report] = check_due_accounts(settings, database_url, now=now + timedelta(days=2))
    assert (report.enqueued, report.seen_without_triage) == (2, 0), report
    assert _subjects(db) == ["mail 2", "mail 3"]


def test_a_first_attempt_that_never_opened_the_mailbox_fixes_no_cutoff(
    *,
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
) -> None:
    """A week of a wrong password is not part of the first check: its window starts when the
    mailbox is first opened, so a week-old backlog is not triaged once the password is fixed."""
    now = datetime.now(UTC)
    dovecot.append(mailbox, mails.plain(subject="two days old"), when=now - timedelta(days=2))
    dovecot.append(mailbox, mails.plain(subject="recent"), when=now - timedelta(hours=1))
    wrong = make_settings(account(password="wrong"), email_initial_lookback=DAY)
    [report] = check_due_accounts(wrong, database_url, now=now - timedelta(days=7))
    assert report.error is not None
    right = make_settings(account(), email_initial_lookback=DAY)
    [report] = check_due_accounts(right, database_url, now=now)
    assert (report.enqueued, report.seen_without_triage) == (1, 1), report
    assert _subjects(db) == ["recent"]
    assert db.execute("SELECT first_check_done FROM email_checkpoints").fetchone() == (True,)
