"""A message carried inside another (message/rfc822: "forward as attachment", a bounce's
original) is listed as an attachment, by its file name or else its Subject, with its size;
the body is the outer message's own text, not the attached message's (unless the outer
message has no text at all: tests/email/test_forward_only_mail.py).

Found by review (r2): an HTML-only mail with an attached invoice.eml was triaged with the
invoice's text, and the PDF inside invoice.eml was listed as the outer mail's attachment.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from dovecot import AccountFactory, Dovecot, make_settings

from sokratos_worker.email import check_due_accounts
from sokratos_worker.email.parse import parse_email

INVOICE = (
    b"From: shop@example.com\r\nSubject: Your invoice\r\n"
    b'Content-Type: multipart/mixed; boundary="B"\r\n\r\n'
    b"--B\r\nContent-Type: text/plain\r\n\r\nInvoice 42: 100 EUR\r\n"
    b'--B\r\nContent-Type: application/pdf; name="inv.pdf"\r\n'
    b"Content-Transfer-Encoding: base64\r\n\r\nJVBERi0=\r\n--B--\r\n"
)


def forwarded(body_part: bytes, disposition: bytes = b"") -> bytes:
    """A message with ``body_part`` and then INVOICE attached as message/rfc822."""
    return (
        b"From: boss@example.org\r\nTo: alice@example.org\r\nSubject: Fwd: invoice\r\n"
        b"Date: Tue, 01 Dec 2026 09:30:00 +0000\r\nMessage-ID: <fwd-attached-1@example.org>\r\n"
        b'MIME-Version: 1.0\r\nContent-Type: multipart/mixed; boundary="A"\r\n\r\n'
        b"--A\r\n" + body_part + b"\r\n--A\r\nContent-Type: message/rfc822\r\n"
        + disposition + b"\r\n" + INVOICE + b"--A--\r\n"
    )


HTML_BODY = b"Content-Type: text/html; charset=utf-8\r\n\r\n<p>Please pay this by Friday.</p>"
ATTACHED = b'Content-Disposition: attachment; filename="invoice.eml"\r\n'


@pytest.mark.imap
@pytest.mark.postgres
def test_the_body_is_the_outer_messages_own_text_and_the_attached_mail_is_listed(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    dovecot.append(mailbox, forwarded(HTML_BODY, ATTACHED))
    [report] = check_due_accounts(make_settings(account()), database_url, now=datetime.now(UTC))
    assert report.enqueued == 1, report
    [(payload,)] = db.execute("SELECT payload FROM pending_triage").fetchall()
    assert "Please pay this by Friday." in payload["text"], payload["text"]
    assert "Invoice 42" not in payload["text"]
    assert payload["attachments"] == [{"name": "invoice.eml", "size": len(INVOICE)}]


def test_an_attached_message_without_a_file_name_is_named_by_its_subject() -> None:
    parsed = parse_email(forwarded(b"Content-Type: text/plain\r\n\r\nSee below."))
    assert parsed.body == "See below."
    assert [a.name for a in parsed.attachments] == ["Your invoice"]
    assert parsed.attachments[0].size == len(INVOICE)
    assert parsed.notes == ()


def test_a_bounce_shows_its_report_and_lists_the_returned_message() -> None:
    raw = (
        b"From: MAILER-DAEMON@example.org\r\nSubject: Undelivered Mail\r\nMIME-Version: 1.0\r\n"
        b'Content-Type: multipart/report; report-type=delivery-status; boundary="R"\r\n\r\n'
        b"--R\r\nContent-Type: text/plain\r\n\r\nYour message could not be delivered.\r\n"
        b"--R\r\nContent-Type: message/delivery-status\r\n\r\n"
        b"Reporting-MTA: dns; example.org\r\n\r\nFinal-Recipient: rfc822; bob@example.com\r\n"
        b"Action: failed\r\nStatus: 5.1.1\r\n\r\n"
        b"--R\r\nContent-Type: message/rfc822\r\n\r\n" + INVOICE + b"--R--\r\n"
    )
    parsed = parse_email(raw)
    assert parsed.body == "Your message could not be delivered."
    assert [a.name for a in parsed.attachments] == ["Your invoice"]


def test_a_message_with_no_text_of_its_own_shows_the_attached_messages_text() -> None:
    parsed = parse_email(forwarded(b"Content-Type: text/plain\r\n\r\n", ATTACHED))
    assert parsed.body == "[forwarded message: Your invoice]\nInvoice 42: 100 EUR"
    assert [a.name for a in parsed.attachments] == ["invoice.eml"]
