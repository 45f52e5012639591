"""Parsing: every kind of mail gives a clear result and never an exception (no IMAP, no DB)."""

from __future__ import annotations

from datetime import UTC, datetime

import mails
import pytest

from sokratos_worker.email.parse import (
    BODY_LIMIT_BYTES,
    format_email_summary,
    message_key,
    parse_email,
    truncate_bytes,
)


def test_plain_message_fields_and_summary_format() -> None:
    parsed = parse_email(mails.plain(message_id="<m1@example.org>", extra_headers="Cc: c@x.org"))
    assert parsed.message_id == "<m1@example.org>"
    assert parsed.from_ == "Bob Example <bob@example.org>"
    assert parsed.date == datetime(2026, 12, 1, 9, 30, tzinfo=UTC)
    local = parsed.date.astimezone().strftime("%Y-%m-%d %H:%M")
    assert format_email_summary(parsed) == (
        "From: Bob Example <bob@example.org>\nTo: alice@example.org\nCC: c@x.org\n"
        f"Subject: Lunch on Friday?\nDate: {local}\n\n"
        "Shall we meet at noon at the usual place?"
    )
    assert parsed.notes == ()
    assert message_key("home", parsed) == "home:<m1@example.org>"


def test_missing_to_and_unparsable_date() -> None:
    parsed = parse_email(mails.plain(to="", date="someday soon"))
    assert parsed.date is None
    summary = format_email_summary(parsed)
    assert "\nTo: (unknown)\n" in summary
    assert "\nDate: \n" in summary
    assert "unparsable Date header" in parsed.notes


def test_html_only_becomes_text() -> None:
    parsed = parse_email(mails.html_only())
    assert parsed.body == "Big news\n\nThe meeting moved to <Thursday>."
    assert "alert" not in parsed.body
    assert "color" not in parsed.body
    assert any("HTML-only" in n for n in parsed.notes)


def test_unknown_charset_is_decoded_with_replacement() -> None:
    parsed = parse_email(mails.unknown_charset())
    assert parsed.body.startswith("Hello \ufffd\ufffd world, café")
    assert any("unknown charset 'x-no-such-charset'" in n for n in parsed.notes)


def test_iso_8859_1_body_and_encoded_headers() -> None:
    parsed = parse_email(mails.latin1())
    assert parsed.body == "Schöne Grüße, bis Montag!"
    assert parsed.subject == "Grüße aus München"
    assert parsed.from_ == "Jürgen <juergen@example.de>"


@pytest.mark.parametrize("raw", [mails.malformed_mime(), mails.unclosed_multipart()])
def test_malformed_mime_gives_a_note_not_an_exception(raw: bytes) -> None:
    parsed = parse_email(raw)
    assert any(n.startswith("malformed MIME") for n in parsed.notes)
    assert format_email_summary(parsed).startswith("From: broken@example.org\n")


def test_malformed_mime_shows_the_raw_text() -> None:
    parsed = parse_email(mails.malformed_mime())
    assert "SGVsbG8gd29ybGQ=" in parsed.body
    assert parsed.date is None


@pytest.mark.parametrize(
    "raw",
    [b"", b"\x00\xff\xfe garbage", b"Subject: =?utf-8?q?broken", b"Content-Type: multipart/x\r\n"],
)
def test_garbage_never_raises(raw: bytes) -> None:
    parsed = parse_email(raw)
    assert isinstance(format_email_summary(parsed), str)
    assert "\x00" not in parsed.body
    assert message_key("home", parsed).startswith("home:sha256:")


def test_attachment_is_listed_not_stored() -> None:
    raw, size = mails.with_attachment()
    parsed = parse_email(raw)
    assert [(a.name, a.size) for a in parsed.attachments] == [("slides.pdf", size)]
    assert parsed.body == "Slides attached."
    summary = format_email_summary(parsed)
    assert summary.endswith(f"[attachments: slides.pdf ({size} bytes)]")
    assert len(summary) < 1000


def test_body_is_bounded_like_sokratos() -> None:
    parsed = parse_email(mails.plain(body="ä" * 5000))
    body = format_email_summary(parsed).split("\n\n", 1)[1]
    assert body.endswith("...")
    assert len(body.encode()) <= BODY_LIMIT_BYTES + 3
    assert truncate_bytes("aé", 2) == "a..."
    assert truncate_bytes("abc", 3) == "abc"


def test_key_without_message_id_is_a_stable_hash() -> None:
    raw = mails.plain(message_id=None)
    first, second = message_key("home", parse_email(raw)), message_key("home", parse_email(raw))
    assert first == second
    assert first.startswith("home:sha256:")
    assert len(first) == len("home:sha256:") + 64
    other = message_key("home", parse_email(mails.plain(message_id=None, body="different")))
    assert other != first


def test_overlong_message_id_is_hashed() -> None:
    parsed = parse_email(mails.plain(message_id="<" + "x" * 300 + "@example.org>"))
    assert message_key("home", parsed).startswith("home:sha256:")


def test_nul_bytes_are_removed_and_noted() -> None:
    parsed = parse_email(mails.plain(body="a\x00b"))
    assert parsed.body == "ab"
    assert "NUL bytes removed" in parsed.notes
