"""A 'passed' processed_emails row (a message dead-lettered and passed at its UID) is never taken
for a real mail's record.

The passed row's key was once ``<account>:passed:<sha256(mailbox, UIDVALIDITY, UID)>``, in the
namespace of message_key() (``<account>:<Message-ID as is>``): a mail whose Message-ID header
was ``passed:<that hex>`` got exactly that key, _insert_processed's ON CONFLICT took it for one
already seen (never triaged: lost silently) and moved the 'passed' row to its UID. Now the
passed key is ``<account>/passed/<hex>``, which has no ``:`` (every message key starts
``<account>:``), and the insert of a message never updates a 'passed' row. Real parts: Dovecot
and PostgreSQL (a trigger refuses the first message's triage item for its content, so that
the worker passes it).
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta

import mails
import psycopg
import pytest
from dovecot import AccountFactory, Dovecot, make_settings

from sokratos_worker.email import check_due_accounts
from sokratos_worker.store import email as store
from tests.support.db import refuse_triage

pytestmark = [pytest.mark.imap, pytest.mark.postgres]

NOW = datetime.now(UTC)


def _passed_rows(db: psycopg.Connection) -> list[tuple[str, int]]:
    return db.execute(
        "SELECT message_id, uid FROM processed_emails WHERE status = 'passed'"
    ).fetchall()


@pytest.mark.parametrize("shape", ["old", "new"])
def test_a_mail_whose_message_id_looks_like_a_passed_key_is_still_triaged(
    *,
    shape: str,
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
) -> None:
    refuse_triage(db, subject="poison")
    settings = make_settings(account(), email_initial_lookback=86400)
    dovecot.append(mailbox, mails.plain(subject="poison"))  # UID 1, passed
    [report] = check_due_accounts(settings, database_url, now=NOW)
    assert report.ok and report.failed == 1, report
    uidvalidity = dovecot.uidvalidity(mailbox)
    hexdigest = hashlib.sha256(f"{mailbox}\x00{uidvalidity}\x001".encode()).hexdigest()
    assert _passed_rows(db) == [(f"home/passed/{hexdigest}", 1)]

    # The Message-ID that took the old shape's key, and one spelling the new shape after the
    # account's "home:" prefix: neither is the passed row's key.
    message_id = f"passed:{hexdigest}" if shape == "old" else f"home/passed/{hexdigest}"
    dovecot.append(mailbox, mails.plain(subject="real mail", message_id=message_id))

    [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=10))
    assert report.ok, report.error
    assert report.enqueued == 1, report
    assert db.execute("SELECT count(*) FROM pending_triage").fetchone() == (1,)
    assert db.execute(
        "SELECT uid FROM processed_emails WHERE message_id = %s", (f"home:{message_id}",)
    ).fetchall() == [(2,)]
    assert _passed_rows(db) == [(f"home/passed/{hexdigest}", 1)]  # not moved


def test_a_message_never_takes_over_a_passed_row(*, db: psycopg.Connection) -> None:
    """Should a message's key be a 'passed' row's (which passed_key rules out), recording it
    fails loudly instead of taking the mail for one seen and moving the marker."""
    db.execute(
        "INSERT INTO processed_emails (message_id, account, mailbox, uidvalidity, uid, status)"
        " VALUES ('home:taken', 'home', 'INBOX', 7, 1, 'passed')"
    )
    record = store.MessageRecord(
        account="home",
        mailbox="INBOX",
        uidvalidity=7,
        uid=2,
        key="home:taken",
        payload={"subject": "real mail"},
    )
    with pytest.raises(store.PassedKeyTaken):
        store.record_message(db, record)
    assert db.execute("SELECT uid, status FROM processed_emails").fetchall() == [(1, "passed")]
    assert db.execute("SELECT count(*) FROM pending_triage").fetchone() == (0,)
