"""One ordinary-sized mail costs a check seconds, not minutes: adjacent encoded words are
joined in linear time, and an attached message is sized without re-parsing its headers.

Found by review (r6): two parser regressions that made one mail cost tens of seconds of
CPU in the check (the design insists on linear time for untrusted input: docs/email.md on the
HTML conversion and on long MIME headers).

1. Adjacent encoded words are joined with ``self._data += data`` on a bytes attribute
   (headers.py ``_WordRun.add``): every word copies the whole run so far, quadratic in the number
   of words. A 14.7 MB Subject of encoded words (below MESSAGE_BYTES_LIMIT, 16 MB) takes
   ~60 s to parse instead of ~3 s before the commit; the 9 MB one here ~20 s instead of ~2 s.
2. An attached message/rfc822's size was taken from ``inner.as_bytes(policy=_WIRE)``
   with the bounded policy (parse.py ``_carried`` now writes it with headers as they came):
   the generator refolds every long header of the
   attached message through the email package's header parser, unbounded (the bounded
   policy only bounds ``header_fetch_parse``). A forwarded message with a 1 MB To header costs
   ~14 s; before the commit, 0 s.

Real parts: the mail is delivered to a real Dovecot and checked with check_due_accounts into a
real PostgreSQL. Correct behaviour: each check finishes in a few seconds (the pre-commit
parser needs ~2 s and ~0 s); fix 1 by collecting the run's bytes in a list (b"".join at
flush) or a bytearray; fix 2 by measuring the attached message's source bytes, or at least
writing it with ``refold_source="none"`` (no header re-parsing).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import psycopg
import pytest
from dovecot import AccountFactory, Dovecot, make_settings

from sokratos_worker.email import check_due_accounts

pytestmark = [pytest.mark.imap, pytest.mark.postgres]


def _timed_check(account: AccountFactory, database_url: str) -> tuple[float, object]:
    settings = make_settings(account(), email_initial_lookback=86400)
    started = time.monotonic()
    [report] = check_due_accounts(settings, database_url, now=datetime.now(UTC))
    return time.monotonic() - started, report


def test_a_subject_of_many_encoded_words_parses_in_linear_time(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str,
    db: psycopg.Connection,
) -> None:
    words = " ".join(["=?utf-8?q?abcdefghij?="] * 400_000)  # 9.2 MB, one header
    raw = (
        "From: a@example.org\r\nTo: b@example.org\r\nMessage-ID: <many-words@example.org>\r\n"
        f"Subject: {words}\r\n\r\nbody\r\n"
    ).encode()
    dovecot.append(mailbox, raw)
    elapsed, report = _timed_check(account, database_url)
    assert report.ok and report.enqueued == 1, report
    assert elapsed < 10, f"one 9 MB mail took {elapsed:.1f} s to check (quadratic word join)"


def test_an_attached_message_with_a_long_header_is_sized_in_linear_time(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str,
    db: psycopg.Connection,
) -> None:
    parts = []
    for n in range(4):
        to = ", ".join(f"Person {i} <p{i}@example.com>" for i in range(16_000))  # 540 kB
        parts.append(
            "--BB\r\nContent-Type: message/rfc822\r\n\r\n"
            f"From: c@example.org\r\nTo: {to}\r\nSubject: forwarded {n}\r\n\r\nhello\r\n"
        )
    raw = (
        "From: a@example.org\r\nTo: b@example.org\r\nSubject: four forwards\r\n"
        "Message-ID: <forwards@example.org>\r\nMIME-Version: 1.0\r\n"
        "Content-Type: multipart/mixed; boundary=BB\r\n\r\n"
        "--BB\r\nContent-Type: text/plain\r\n\r\nsee attached\r\n"
        + "".join(parts) + "--BB--\r\n"
    ).encode()  # 2.2 MB
    dovecot.append(mailbox, raw)
    elapsed, report = _timed_check(account, database_url)
    assert report.ok and report.enqueued == 1, report
    [(names,)] = db.execute(
        "SELECT payload->'attachments' FROM pending_triage"
    ).fetchall()
    assert [a["name"] for a in names] == [f"forwarded {n}" for n in range(4)]
    assert elapsed < 8, f"one 2.2 MB mail took {elapsed:.1f} s to check (as_bytes refolding)"
