"""Old mail on a first check is fetched as headers only; its header fetch is bounded too.

The header block of a message is unbounded: a header section of many megabytes, or a
malformed message with no blank line (whose "header block" is the whole message), was read
whole by ``BODY.PEEK[HEADER]``, past the 16 MiB a full fetch of the same message reads, and
fifty such messages in one request (header batches are bounded by count only).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from dovecot import AccountFactory, Dovecot, make_settings

from sokratos_worker.email import check_due_accounts
from sokratos_worker.email.imap import HEADER_BYTES_LIMIT, MESSAGE_BYTES_LIMIT, ImapSession
from sokratos_worker.email.parse import message_key, parse_email

pytestmark = [pytest.mark.imap, pytest.mark.postgres]

NOW = datetime.now(UTC)


def _filler(total: int) -> bytes:
    """Header lines of about ``total`` bytes."""
    line = b"X-Filler: " + b"y" * 1014 + b"\r\n"
    return line * (total // len(line) + 1)


def test_a_huge_header_block_of_old_mail_is_not_read_past_the_message_limit(
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: Any,
    *,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    huge = (
        b"From: a@example.org\r\nSubject: huge\r\nMessage-ID: <huge@example.org>\r\n"
        + _filler(MESSAGE_BYTES_LIMIT + 1024 * 1024)
        + b"\r\nbody\r\n"
    )
    # No blank line at all: the whole message is its header block.
    unterminated = b"From: b@example.org\r\nSubject: no end\r\n" + _filler(200 * 1024)
    normal = (
        b"From: c@example.org\r\nSubject: normal\r\nMessage-ID: <normal@example.org>\r\n"
        b"\r\nhello\r\n"
    )
    for raw in (huge, unterminated, normal):
        dovecot.append(mailbox, raw, when=NOW - timedelta(days=30))
    read: list[tuple[bool, int]] = []
    fetch = ImapSession.fetch

    def measured(self: ImapSession, uids: list[int], *, headers_only: bool = False) -> Any:
        messages = fetch(self, uids, headers_only=headers_only)
        read.extend((headers_only, len(m.raw)) for m in messages)
        return messages

    monkeypatch.setattr(ImapSession, "fetch", measured)
    [report] = check_due_accounts(make_settings(account()), database_url, now=NOW)
    assert report.ok, report.error
    assert (report.seen_without_triage, report.enqueued, report.failed) == (3, 0, 0), report
    assert all(size <= HEADER_BYTES_LIMIT for only, size in read if only), read
    assert max(size for _, size in read) <= MESSAGE_BYTES_LIMIT, read
    keys = {row[0] for row in db.execute("SELECT message_id FROM processed_emails")}
    # Keyed as before: the Message-ID past the cut header fetch is read from the full one,
    # and the message without one hashes its body, fetched whole.
    assert keys == {
        "home:<huge@example.org>",
        "home:<normal@example.org>",
        message_key("home", parse_email(unterminated)),
    }
