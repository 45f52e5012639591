"""The processed_emails key of a mail without Message-ID is the one the worker gave it before
adjacent encoded words were decoded together: keys hash Date, From and Subject decoded word by
word (headers.py ``legacy_decode_header``), so a re-read does not triage such mail again.

Found by review (r6): the key hashed the *decoded* Date, From and Subject. 9306db4 changes the decoding of adjacent encoded words that
split a character ("caf=C3" "=A9"): the pre-commit worker decoded them to "caf\ufffd\ufffd",
the new one to "café". So the same mail gets another key after the upgrade, and when the
mailbox is read again (the new UIDs-reused re-read, or a UIDVALIDITY change), mail the old
worker already triaged is not recognised and is enqueued a second time (contract: never
enqueue a mail twice; durability.md: processed_emails makes a re-fetch a no-op).

Real parts: a real Dovecot, a real PostgreSQL holding exactly what the pre-commit worker
recorded for the mail (its key computed here as that version did, its item enqueued through
sokratos_enqueue_triage). Correct behaviour: the re-read counts the mail as a duplicate; keys
must not depend on decoder improvements (hash the raw header values, or keep the legacy
per-word decoding for the key, or look the legacy key up too).
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from dovecot import AccountFactory, Dovecot, make_settings

from sokratos_worker.email import check_due_accounts

pytestmark = [pytest.mark.imap, pytest.mark.postgres]

RAW = (
    b"From: =?utf-8?q?Ren=C3?= =?utf-8?q?=A9e?= <renee@example.org>\r\n"
    b"To: alice@example.org\r\n"
    b"Subject: =?utf-8?q?caf=C3?= =?utf-8?q?=A9?=\r\n"
    b"Date: Mon, 02 Nov 2026 10:00:00 +0000\r\n"
    b"\r\n"
    b"no message id here\r\n"
)


def _legacy_key() -> str:
    """The key the worker before 9306db4 gave this mail (each encoded word decoded alone)."""
    digest = hashlib.sha256()
    for part in (
        "Mon, 02 Nov 2026 10:00:00 +0000",
        "Ren\ufffd\ufffde <renee@example.org>",
        "caf\ufffd\ufffd",
    ):
        digest.update(part.encode("utf-8") + b"\x00")
    digest.update(b"no message id here\r\n")
    return f"home:sha256:{digest.hexdigest()}"


def test_a_mail_triaged_before_the_upgrade_is_not_triaged_again_on_a_re_read(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str,
    db: psycopg.Connection,
) -> None:
    dovecot.append(mailbox, RAW)  # UID 1; UIDNEXT 2
    validity = dovecot.uidvalidity(mailbox)
    key = _legacy_key()
    # What the pre-commit worker committed when it triaged the mail (one transaction).
    [(item_id,)] = db.execute(
        "SELECT sokratos_enqueue_triage(%s::jsonb, %s, 'email')",
        ('{"subject": "caf\\ufffd\\ufffd", "uid": 1, "text": "Subject: caf\\ufffd\\ufffd"}',
         f"email:{key}"),
    ).fetchall()
    db.execute(
        "INSERT INTO processed_emails (message_id, account, mailbox, uidvalidity, uid, item_id)"
        " VALUES (%s, 'home', %s, %s, 1, %s)",
        (key, mailbox, validity, item_id),
    )
    # Its checkpoint, from before the server was restored from a backup (UIDNEXT now 2 <= 5).
    db.execute(
        "INSERT INTO email_checkpoints"
        " (account, mailbox, uidvalidity, last_uid, checked_at, first_check_done)"
        " VALUES ('home', %s, %s, 5, %s, true)",
        (mailbox, validity, datetime.now(UTC) - timedelta(hours=1)),
    )

    [report] = check_due_accounts(make_settings(account()), database_url, now=datetime.now(UTC))
    assert report.ok and report.uids_reused, report
    count = db.execute("SELECT count(*) FROM pending_triage").fetchone()
    assert count == (1,) and report.duplicates == 1, (
        f"the mail already triaged was enqueued again under a new key: {count[0]} items;"
        f" {report}"
    )
