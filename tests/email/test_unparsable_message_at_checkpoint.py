"""A message the worker cannot handle (a parser failure) is dead-lettered and passed. When it
is the newest one read, every later check's restore check looks at it again: a message at
the checkpoint that cannot be keyed (unparsable, refused, gone) cannot be compared, so the
check "cannot tell" (not a restore, not a failure) and goes on.

Found by review (r8): the parser failure escaped ``check_account`` on every later check
(``email_check_crashed``), and no later mail was ever triaged. The parser failure is simulated
by the ``poison_breaks_the_parser`` fixture (tests/email/conftest.py); Dovecot and PostgreSQL
are real.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import mails
import psycopg
import pytest
from dovecot import AccountFactory, Dovecot, make_settings

from sokratos_worker.email import check_due_accounts

pytestmark = [pytest.mark.imap, pytest.mark.postgres]

NOW = datetime.now(UTC)


@pytest.mark.usefixtures("poison_breaks_the_parser")
def test_new_mail_is_triaged_after_the_newest_read_message_was_dead_lettered(
    *,
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
) -> None:
    settings = make_settings(account(), email_initial_lookback=86400)
    for subject in ("before", "poison"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    [report] = check_due_accounts(settings, database_url, now=NOW)
    assert report.ok, report.error
    assert (report.enqueued, report.failed) == (1, 1), report  # dead-lettered and passed

    dovecot.append(mailbox, mails.plain(subject="after the poison"))
    for minutes in (10, 20):
        [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=minutes))
        assert report.ok, f"check {minutes} min later failed: {report.error}"
    subjects = [r[0] for r in db.execute("SELECT payload->>'subject' FROM pending_triage")]
    assert "after the poison" in subjects, subjects
