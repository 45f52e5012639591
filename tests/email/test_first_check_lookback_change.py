"""A resumed first check applies SOKRATOS_EMAIL_INITIAL_LOOKBACK as configured now, measured
from when its first attempt began (email_checkpoints.first_check_started_at, sql/0043).

Found by review (r6): sql/0043 stored the first check's lookback *cutoff* (a timestamp computed from the lookback
setting of the first attempt), not when the first check began. An operator who changes
SOKRATOS_EMAIL_INITIAL_LOOKBACK while a new account's first check has not completed (it was
killed, or keeps failing part-way on a large mailbox) is silently ignored: the resumed check
applies the old window and records mail inside the configured window as "seen without
triage", for good (such mail is never triaged later). Neither docs/email.md nor the
check's logs say that the setting no longer applies.

Real parts: a real Dovecot, a real PostgreSQL, the first check run in a subprocess and killed
with SIGKILL inside the transaction of UID 2 (tests/email/check_in_subprocess.py).
Correct behaviour: the resumed first check uses the configured lookback, measured from when
the first attempt began (store the start, e.g. ``first_check_started_at``, and compute
``started - lookback`` on each attempt), so a mail three days old is triaged under a 7-day
window.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import mails
import psycopg
import pytest
from dovecot import AccountFactory, Dovecot, make_settings
from test_email_crash import _settings_json, _wait_for_backends_to_go
from test_resumed_first_check import _kill_inside_uid

from sokratos_worker.email import check_due_accounts

pytestmark = [pytest.mark.imap, pytest.mark.postgres, pytest.mark.subprocess]

DAY = 86400


def test_a_resumed_first_check_uses_the_configured_lookback(
    *,
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
    tmp_path: Path,
) -> None:
    start = datetime.now(UTC)
    dovecot.append(mailbox, mails.plain(subject="an hour old 1"), when=start - timedelta(hours=1))
    dovecot.append(mailbox, mails.plain(subject="an hour old 2"), when=start - timedelta(hours=1))
    dovecot.append(mailbox, mails.plain(subject="three days old"), when=start - timedelta(days=3))
    acct = account()
    _kill_inside_uid(
        _settings_json(acct, email_initial_lookback=DAY), database_url, 2, tmp_path / "blocked"
    )
    _wait_for_backends_to_go(db)

    # The operator widens the first check's window to a week, and the worker comes back.
    settings = make_settings(acct, email_initial_lookback=7 * DAY)
    [report] = check_due_accounts(settings, database_url, now=start + timedelta(minutes=5))
    assert report.ok, report.error
    subjects = [r[0] for r in db.execute("SELECT payload->>'subject' FROM pending_triage")]
    assert "three days old" in subjects, (
        f"mail inside the configured 7-day lookback was recorded as seen without triage: {report}"
    )
