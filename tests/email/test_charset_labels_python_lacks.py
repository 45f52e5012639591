"""Charset labels mailers send that Python's codecs do not know by that name.

Hebrew mail from Thunderbird and Outlook is labelled ``iso-8859-8-i`` (ISO-8859-8, logical
order), Thai mail from Outlook ``windows-874`` (Python's ``cp874``), Japanese mail from some
mailers ``windows-31j`` or ``x-sjis``. Each was taken for an unknown charset and decoded as
UTF-8: the text triage got was replacement characters, with a note blaming the mail.
Processed_emails keys keep their old decoding (a re-read must not triage mail again).
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from typing import Any

import pytest
from dovecot import AccountFactory, Dovecot, make_settings

from sokratos_worker.email import check_due_accounts
from sokratos_worker.email.parse import message_key, parse_email

pytestmark = [pytest.mark.imap, pytest.mark.postgres]

NOW = datetime.now(UTC)

HEBREW = "שלום עולם"
THAI = "สวัสดีครับ"
JAPANESE = "こんにちは"


def _mail(subject_word: str, charset: str, body: bytes, message_id: str | None) -> bytes:
    headers = [
        "From: someone@example.org",
        "To: alice@example.org",
        f"Subject: {subject_word}",
        "Date: Tue, 01 Dec 2026 09:30:00 +0000",
        *([f"Message-ID: {message_id}"] if message_id else []),
        "MIME-Version: 1.0",
        f"Content-Type: text/plain; charset={charset}",
        "Content-Transfer-Encoding: 8bit",
    ]
    return "\r\n".join(headers).encode() + b"\r\n\r\n" + body + b"\r\n"


def _word(text: str, charset: str, codec: str) -> str:
    return f"=?{charset}?B?{base64.b64encode(text.encode(codec)).decode()}?="


def test_mail_in_charset_labels_python_lacks_is_read_in_its_charset(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    mails = {
        HEBREW: _mail(
            _word(HEBREW, "iso-8859-8-i", "iso-8859-8"),
            "iso-8859-8-i",
            HEBREW.encode("iso-8859-8"),
            "<hebrew@example.org>",
        ),
        THAI: _mail(
            _word(THAI, "windows-874", "cp874"),
            '"windows-874"',
            THAI.encode("cp874"),
            "<thai@example.org>",
        ),
        JAPANESE: _mail(
            _word(JAPANESE, "windows-31j", "cp932"),
            "x-sjis",
            JAPANESE.encode("shift_jis"),
            "<japanese@example.org>",
        ),
    }
    for raw in mails.values():
        dovecot.append(mailbox, raw)
    [report] = check_due_accounts(make_settings(account()), database_url, now=NOW)
    assert (report.enqueued, report.failed) == (3, 0), report
    rows = db.execute("SELECT payload FROM pending_triage ORDER BY id").fetchall()
    for (payload,), text in zip(rows, mails, strict=True):
        assert payload["subject"] == text, payload["subject"]
        assert payload["text"].endswith(f"\n\n{text}"), payload["text"]
        assert not [n for n in payload["notes"] if "charset" in n], payload["notes"]


def test_the_hash_key_of_such_mail_is_the_one_recorded_before() -> None:
    """A mail without Message-ID is keyed by a hash of its decoded Date, From and Subject:
    that decoding stays as it was, or mail recorded before would be triaged again."""
    raw = _mail(
        _word(HEBREW, "iso-8859-8-i", "iso-8859-8"),
        "iso-8859-8-i",
        HEBREW.encode("iso-8859-8"),
        None,
    )
    parsed = parse_email(raw)
    assert parsed.subject == HEBREW
    assert message_key("home", parsed) == (
        "home:sha256:b99091764ece01a8e6050d68094a7492f86c1bfa39448cfce347861a735ac924"
    )


@pytest.mark.parametrize(
    ("label", "codec", "text"),
    [
        ("shift_jis", "cp932", "会議①"),  # NEC's circled digits, in every Japanese mailer
        ("x-sjis", "cp932", "会議①"),
        ("ks_c_5601-1987", "cp949", "똠방각하"),  # Outlook's label for Korean
        ("euc-kr", "cp949", "똠방각하"),
        ("gb2312", "gb18030", "镕基"),  # GBK's characters in mail labelled GB2312
        ("iso-8859-1", "cp1252", "“quoted” €5"),  # Windows' curly quotes in "Latin-1"
        ("us-ascii", "cp1252", "“quoted”"),
        # Other spellings of the same charsets (found by a review): Python's aliases, and
        # labels it lacks.
        ("ISO8859-1", "cp1252", "“quoted” €5"),
        ("l1", "cp1252", "“quoted”"),
        ("ANSI_X3.4-1968", "cp1252", "“quoted”"),  # glibc's ASCII: cron mail
        ("csShiftJIS", "cp932", "会議①"),
        ("ks_c_5601-1989", "cp949", "똠방각하"),
        ("gb_2312-80", "gb18030", "镕基"),
        # UTF-8 in mail labelled ASCII is read as UTF-8 (not "cafÃ©").
        ("us-ascii", "utf-8", "café “quoted”"),
    ],
)
def test_labels_are_read_as_the_vendor_superset_mail_clients_read(
    label: str, codec: str, text: str
) -> None:
    """Python's strict codecs for these labels lack the vendor extensions mail is written in:
    "会議①" read as shift_jis came out "会議�@", curly quotes in "Latin-1" as C1 controls."""
    raw = _mail(_word(text, label, codec), label, text.encode(codec), "<vendor@example.org>")
    parsed = parse_email(raw)
    assert parsed.subject == text
    assert parsed.body.strip() == text, parsed.body
    assert not [n for n in parsed.notes if "charset" in n], parsed.notes
    assert message_key("home", parsed) == "home:<vendor@example.org>"
