"""A message the worker passed without recording it (dead-lettered) is marked by a 'passed'
processed_emails row that pruning keeps, so the restore check recognises it at the
checkpoint's UID whatever the failed_operations retention (SOKRATOS_FAILED_OPS_TTL_DAYS,
``failed purge``).

Found by review (r8): only the failed_operations row told it apart; once retention deleted
it, the next check of the quiet mailbox took it for a restore, read the whole mailbox again
and dead-lettered every failed message a second time. Real parts: Dovecot, PostgreSQL
refusing the message's triage item for its content (a trigger raising SQLSTATE 22P05), and
the project's own failed_operations TTL prune.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import mails
import psycopg
import pytest
from dovecot import AccountFactory, Dovecot, make_settings

from sokratos_worker.email import check_due_accounts
from sokratos_worker.store.failures import purge_failures
from tests.support.db import refuse_triage

pytestmark = [pytest.mark.imap, pytest.mark.postgres]

NOW = datetime.now(UTC)


def test_pruning_old_failures_does_not_make_a_quiet_mailbox_read_again(
    *,
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
) -> None:
    refuse_triage(db, subject="poison")
    settings = make_settings(account(), email_initial_lookback=86400)
    for subject in ("one", "two", "poison"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    [report] = check_due_accounts(settings, database_url, now=NOW)
    assert report.ok and (report.enqueued, report.failed) == (2, 1), report
    [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=10))
    assert report.ok and not report.uids_reused and report.fetched == 0, report

    # Maintenance with SOKRATOS_FAILED_OPS_TTL_DAYS: the failure has aged past it.
    db.execute("UPDATE failed_operations SET created_at = now() - interval '31 days'")
    assert purge_failures(db, older_than_days=30) == 1

    [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=20))
    assert report.ok, report.error
    failures = db.execute("SELECT count(*) FROM failed_operations").fetchone()
    assert (report.uids_reused, report.fetched, failures) == (False, 0, (0,)), (
        f"a quiet mailbox was taken for a restored one and read again: {report};"
        f" failed_operations rows now: {failures}"
    )
