"""A server that answers every body UID FETCH with OK but no message (a store outage, or an
answer the parser cannot read) is an outage, not a message left out: nothing is counted.

Found by a review (2026-12-06): after 2baeb77, such a server had each check count its first
message as left out, so that every third check passed one readable message into
failed_operations: with 4 messages and 8 checks, UIDs 1, 2 and 3 were failures and only the
fourth was triaged once the server was well again. Before 2baeb77 every check stopped ("no
body"), nothing was diverted, and the healthy check triaged all 4. Now a message left out is
counted only while the server is shown to return another one; otherwise the check stops with
an error that says so, and counts nothing.

Real parts: Dovecot on 127.0.0.1 behind a proxy that drops chosen UIDs from body FETCH
commands (and chosen lines from the listing's answer), and PostgreSQL.
"""

from __future__ import annotations

from typing import Any

import mails
import psycopg
import pytest
from dovecot import AccountFactory, Dovecot, make_settings
from refusing_proxy import UnlistingProxy
from structlog.testing import capture_logs
from test_message_left_out import later, subjects

from sokratos_worker.email import check_due_accounts

pytestmark = [pytest.mark.imap, pytest.mark.postgres]

SUBJECTS = ["one", "two", "three", "four"]




def failed_uids(db: psycopg.Connection) -> list[int]:
    rows = db.execute(
        "SELECT (context_data->>'uid')::int FROM failed_operations ORDER BY id"
    ).fetchall()
    return [row[0] for row in rows]


def refused_checks(db: psycopg.Connection) -> int:
    row = db.execute("SELECT coalesce(max(refused_checks), 0) FROM email_checkpoints").fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize(
    "unlisted",
    [set(), {1, 2}],
    ids=["every-message-listed", "two-left-out-of-the-listing-too"],
)
def test_a_server_returning_no_message_at_all_diverts_nothing_and_counts_nothing(
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: Any,
    *,
    unlisted: set[int],
) -> None:
    for subject in SUBJECTS:
        dovecot.append(mailbox, mails.plain(subject=subject))
    with UnlistingProxy(dovecot.imap_port, refused={1, 2, 3, 4}, unlisted=unlisted) as proxy:
        settings = make_settings(account(port=proxy.port))
        errors, hints, counted = [], [], []
        for n in range(8):
            with capture_logs() as logs:
                [report] = check_due_accounts(settings, database_url, now=later(10 * n))
            assert (n, failed_uids(db), subjects(db)) == (n, [], [])
            assert not report.ok
            errors.append(report.error or "")
            hints += [e["hint"] for e in logs if e["event"] == "email_check_failed"]
            counted += [e for e in logs if e["event"] == "email_message_refused"]
            counted += [refused_checks(db)] if refused_checks(db) else []
    assert counted == []
    assert all("returned no message at all" in error for error in errors), errors
    assert all("not counted against any message" in error for error in errors), errors
    assert len(hints) == 8 and all("counted against no message" in h for h in hints), hints
    # The server is well again: every message is triaged, once, and none was diverted.
    [report] = check_due_accounts(make_settings(account()), database_url, now=later(100))
    assert report.ok, report.error
    assert (report.enqueued, report.failed) == (4, 0), report
    assert subjects(db) == SUBJECTS
    assert failed_uids(db) == []
    items, keys = db.execute(
        "SELECT count(*), count(DISTINCT idempotency_key) FROM pending_triage"
    ).fetchone()
    assert (items, keys) == (4, 4)


def test_messages_left_out_while_the_server_returns_others_are_still_counted(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """The guard spares no message the server really cannot return: UIDs 2-4 are left out.
    UID 2 is counted while the server returns UID 1 (in the first check, then as the message
    at the checkpoint), and passed, and UID 3 counted once in that check; then nothing the
    check asks for comes back (UID 2, at the checkpoint, is the one passed): an outage for all
    it can tell, so nothing is counted.
    Once new mail comes back, UIDs 3 and 4 are counted and passed, and the new mail flows."""
    for subject in SUBJECTS:
        dovecot.append(mailbox, mails.plain(subject=subject))
    with UnlistingProxy(dovecot.imap_port, refused={2, 3, 4}, unlisted=set()) as proxy:
        settings = make_settings(account(port=proxy.port))
        for n in range(3):
            check_due_accounts(settings, database_url, now=later(10 * n))
        assert (subjects(db), failed_uids(db)) == (["one"], [2])
        # The third check went on past UID 2 and counted UID 3 (UID 1 was returned in it).
        assert refused_checks(db) == 1
        for n in range(3, 6):
            [report] = check_due_accounts(settings, database_url, now=later(10 * n))
            assert report.error is not None
            assert "returned no message at all" in report.error, report.error
            assert refused_checks(db) == 1  # neither counted nor reset
        assert (subjects(db), failed_uids(db)) == (["one"], [2])
        dovecot.append(mailbox, mails.plain(subject="five"))
        for n in range(6, 12):
            [report] = check_due_accounts(settings, database_url, now=later(10 * n))
    assert report.ok, report.error
    assert subjects(db) == ["one", "five"]
    assert failed_uids(db) == [2, 3, 4]
