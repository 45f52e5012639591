"""A mail whose only content is a forwarded message is triaged with the forwarded message's
text, after a line "[forwarded message: <subject>]", and still lists it as an attachment.

Found by review (r6): a mail that was only a forwarded message ("Forward as attachment" with
no comment, or a message/rfc822 as the only part of a multipart/alternative) reached triage
with an empty body: the model saw only "From/To/Subject" and "[attachments: ...]".

Real parts: the mail is delivered to a real Dovecot and checked into a real PostgreSQL.
Expected: an attached message stays out of the body when the mail has text of its own; when
the mail has none, its body is the attached message's text.
"""

from __future__ import annotations

from datetime import UTC, datetime

import psycopg
import pytest
from dovecot import AccountFactory, Dovecot, make_settings

from sokratos_worker.email import check_due_accounts

pytestmark = [pytest.mark.imap, pytest.mark.postgres]

INNER = (
    "From: Carol <carol@example.org>\r\nTo: bob@example.org\r\n"
    "Subject: Contract renewal\r\nMessage-ID: <inner@example.org>\r\n\r\n"
    "Please sign the renewal by Friday, the 12th.\r\n"
)


def _mail(container: str) -> bytes:
    return (
        "From: Bob <bob@example.org>\r\nTo: alice@example.org\r\n"
        "Subject: Fwd: Contract renewal\r\nMessage-ID: <outer-" + container + "@example.org>\r\n"
        f"MIME-Version: 1.0\r\nContent-Type: multipart/{container}; boundary=BB\r\n\r\n"
        "--BB\r\nContent-Type: message/rfc822\r\nContent-Disposition: attachment\r\n\r\n"
        + INNER + "--BB--\r\n"
    ).encode()


@pytest.mark.parametrize("container", ["mixed", "alternative"])
def test_a_mail_that_is_only_a_forwarded_message_is_not_triaged_empty(
    *,
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
    container: str,
) -> None:
    dovecot.append(mailbox, _mail(container))
    [report] = check_due_accounts(make_settings(account()), database_url, now=datetime.now(UTC))
    assert report.ok and report.enqueued == 1, report
    [(text, notes)] = db.execute(
        "SELECT payload->>'text', payload->'notes' FROM pending_triage"
    ).fetchall()
    assert "[forwarded message: Contract renewal]\nPlease sign the renewal" in text, (
        f"the triage text has none of the mail's content:\n{text}\n{notes}"
    )
    assert "[attachments: Contract renewal (" in text, text
