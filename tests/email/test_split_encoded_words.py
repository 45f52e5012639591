"""A character split across adjacent RFC 2047 encoded words (as many CJK mailers and some
webmailers write Subject and From) is decoded whole: adjacent words of one charset are joined
as bytes before decoding, as ``email.header.decode_header`` does.

Found by review (r2): each word was decoded alone, so '日本語のテスト' became
'日���語のテスト'.
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from typing import Any

import pytest
from dovecot import AccountFactory, Dovecot, make_settings

from sokratos_worker.email import check_due_accounts
from sokratos_worker.email.parse import parse_email


def _split_words(text: str, cut: int, charset: str = "UTF-8") -> str:
    data = text.encode("utf-8")
    words = [data[:cut], data[cut:]]
    return " ".join(f"=?{charset}?B?{base64.b64encode(w).decode()}?=" for w in words)


def _subject(value: str) -> tuple[str, tuple[str, ...]]:
    parsed = parse_email(f"Subject: {value}\r\n\r\nbody\r\n".encode())
    return parsed.subject, parsed.notes


@pytest.mark.imap
@pytest.mark.postgres
def test_a_character_split_across_encoded_words_is_decoded_whole(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    subject = "日本語のテスト"
    sender = "山田太郎"
    raw = (
        f"From: {_split_words(sender, 4)} <taro@example.jp>\r\n"
        "To: alice@example.org\r\n"
        f"Subject: {_split_words(subject, 4)}\r\n"
        "Date: Tue, 01 Dec 2026 09:30:00 +0900\r\n"
        "Message-ID: <split-words-1@example.jp>\r\n"
        "MIME-Version: 1.0\r\nContent-Type: text/plain; charset=utf-8\r\n"
        "Content-Transfer-Encoding: 8bit\r\n\r\n会議は木曜日です。\r\n"
    ).encode()
    dovecot.append(mailbox, raw)
    [report] = check_due_accounts(make_settings(account()), database_url, now=datetime.now(UTC))
    assert report.enqueued == 1, report
    [(payload,)] = db.execute("SELECT payload FROM pending_triage").fetchall()
    assert payload["subject"] == subject, payload["subject"]
    assert payload["from"] == f"{sender} <taro@example.jp>", payload["from"]
    assert f"Subject: {subject}" in payload["text"]
    assert payload["notes"] == []


def test_a_split_quoted_printable_character_is_decoded_whole() -> None:
    assert _subject("=?utf-8?Q?caf=C3?= =?UTF-8?Q?=A9_au_lait?=") == ("café au lait", ())


def test_words_of_different_charsets_are_decoded_each_on_their_own() -> None:
    value = "=?iso-8859-1?Q?caf=E9?= =?utf-8?B?w6k=?="
    assert _subject(value) == ("caféé", ())


def test_text_between_encoded_words_ends_a_run() -> None:
    value = f"{_split_words('日本', 3)} and {_split_words('語', 3)}"
    assert _subject(value) == ("日本 and 語", ())


def test_an_unknown_charset_still_says_so() -> None:
    subject, notes = _subject("=?x-unknown?Q?abc?= =?x-unknown?Q?def?=")
    assert subject == "abcdef"
    assert notes == ("unknown charset 'x-unknown': decoded as UTF-8 with replacement characters",)


def test_a_malformed_word_keeps_its_raw_form_between_decoded_ones() -> None:
    value = "=?utf-8?Q?a?= =?utf-8?B?!?= =?utf-8?Q?b?="
    subject, _ = _subject(value)
    assert subject.startswith("a") and subject.endswith("b")
