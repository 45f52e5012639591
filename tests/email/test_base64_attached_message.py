"""A mail that is only a forwarded message whose message/rfc822 part carries a
Content-Transfer-Encoding: base64 (RFC 2046 forbids it, but clients and gateways send it).
Python's email package parses the base64 text itself as the inner message, so the part's
transfer encoding is checked first: the part is decoded, then parsed, and the forwarded
message's own text is triaged, under its Subject.

Found by review (r8): the triage text was the raw base64 of the forwarded message, the
attachment was "(unnamed message/rfc822)" and a misleading "malformed MIME" note came with it.
Real parts: the mail is delivered to a real Dovecot and checked into a real PostgreSQL.
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime

import psycopg
import pytest
from dovecot import AccountFactory, Dovecot, make_settings

from sokratos_worker.email import check_due_accounts

pytestmark = [pytest.mark.imap, pytest.mark.postgres]

INNER = (
    b"From: Carol <carol@example.org>\r\nTo: bob@example.org\r\n"
    b"Subject: Quarterly numbers\r\nDate: Tue, 01 Dec 2026 08:00:00 +0000\r\n"
    b"Message-ID: <inner-1@example.org>\r\nContent-Type: text/plain; charset=utf-8\r\n\r\n"
    b"The original text.\r\n"
)


def test_a_forward_only_mail_with_a_base64_attached_message_shows_its_text(
    *, dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str,
    db: psycopg.Connection,
) -> None:
    encoded = base64.encodebytes(INNER).replace(b"\n", b"\r\n")
    raw = (
        b"From: Bob <bob@example.org>\r\nTo: alice@example.org\r\nSubject: Fwd: Quarterly"
        b" numbers\r\nDate: Tue, 01 Dec 2026 09:00:00 +0000\r\nMessage-ID: <fwd-1@example.org>"
        b"\r\nMIME-Version: 1.0\r\nContent-Type: multipart/mixed; boundary=XYZ\r\n\r\n"
        b"--XYZ\r\nContent-Type: message/rfc822\r\nContent-Transfer-Encoding: base64\r\n"
        b"Content-Disposition: attachment\r\n\r\n" + encoded + b"\r\n--XYZ--\r\n"
    )
    dovecot.append(mailbox, raw)
    [report] = check_due_accounts(
        make_settings(account(), email_initial_lookback=10 * 365 * 86400),
        database_url,
        now=datetime.now(UTC),
    )
    assert report.ok and report.enqueued == 1, report
    [(text, attachments)] = db.execute(
        "SELECT payload->>'text', payload->'attachments' FROM pending_triage"
    ).fetchall()
    assert "The original text." in text, f"triage text: {text!r}"
    assert attachments[0]["name"] == "Quarterly numbers", attachments
