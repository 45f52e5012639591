"""The database refusing a message's record for a reason that is not the message's content
(a missing privilege, a trigger) stops the check before that message, says so as a failed
check with a hint about the database, and loses nothing: once the cause is gone, the next
check records it.

Found by reading (2026-12-06): the refusal was logged as ``email_check_crashed`` with a
traceback, and its last_error began with the exception's class name.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import mails
import psycopg
import pytest
from dovecot import AccountFactory, Dovecot, make_settings

from sokratos_worker.email import check_due_accounts
from tests.core.test_item_log_context import json_lines

pytestmark = [pytest.mark.imap, pytest.mark.postgres]

NOW = datetime.now(UTC)
REFUSE = """
CREATE FUNCTION test_refuse_record() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'permission denied (scripted)' USING ERRCODE = '42501'; END $$;
CREATE TRIGGER test_refuse_record BEFORE INSERT ON processed_emails
    FOR EACH ROW EXECUTE FUNCTION test_refuse_record();
"""


def test_a_refused_record_is_a_failed_check_and_the_message_comes_later(
    *,
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
) -> None:
    settings = make_settings(account(), email_initial_lookback=86400)
    dovecot.append(mailbox, mails.plain(subject="kept for later"))
    db.execute(REFUSE)
    try:
        with json_lines() as lines:
            [report] = check_due_accounts(settings, database_url, now=NOW)
    finally:
        db.execute("DROP TRIGGER test_refuse_record ON processed_emails")
    assert not report.ok
    assert report.error and report.error.startswith("UID "), report.error
    assert "could not be recorded" in report.error and "permission denied" in report.error
    events = [line["event"] for line in lines]
    assert "email_check_crashed" not in events, events
    [failed] = [line for line in lines if line["event"] == "email_check_failed"]
    assert "sql/roles.sql" in failed["hint"] and "exception" not in failed
    stored = db.execute("SELECT last_error FROM email_checkpoints").fetchall()
    assert stored == [(report.error,)]
    assert db.execute("SELECT count(*) FROM pending_triage").fetchone() == (0,)

    [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=10))
    assert report.ok, report.error
    subjects = [r[0] for r in db.execute("SELECT payload->>'subject' FROM pending_triage")]
    assert subjects == ["kept for later"]
