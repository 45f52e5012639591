"""Parsing: every kind of mail gives a clear result and never an exception (no IMAP, no DB)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import mails
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from sokratos_worker.email.parse import (
    BODY_LIMIT_BYTES,
    HTML_LIMIT_CHARS,
    PARSED_HEADER_LIMIT,
    Attachment,
    format_email_summary,
    html_to_text,
    message_key,
    parse_email,
    truncate_bytes,
)

ROOT = Path(__file__).resolve().parents[2]


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


def test_sent_mail_shows_its_bcc_line_after_cc() -> None:
    parsed = parse_email(
        mails.plain(extra_headers="Cc: c@x.org\r\nBcc: Secret Santa <santa@x.org>")
    )
    assert parsed.bcc == "Secret Santa <santa@x.org>"
    assert "\nCC: c@x.org\nBCC: Secret Santa <santa@x.org>\nSubject: " in format_email_summary(
        parsed
    )


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


def test_raw_utf8_headers_are_read_as_utf8() -> None:
    parsed = parse_email(mails.raw_utf8_headers())
    assert parsed.subject == "Grüße"
    assert parsed.from_ == "Jürgen <j@example.org>"
    assert parsed.to == "Zoë <zoe@example.org>"
    assert parsed.cc == "Renée <renee@example.org>"
    assert parsed.message_id == "<grüße-1@example.de>"
    assert message_key("home", parsed) == "home:<grüße-1@example.de>"
    assert parsed.body == "Schöne Grüße aus München"
    assert parsed.notes == ()
    assert "\nSubject: Grüße\n" in format_email_summary(parsed)


def test_raw_headers_that_are_not_utf8_get_replacement_characters() -> None:
    parsed = parse_email(mails.raw_latin1_headers())
    assert parsed.subject == "Gr\ufffd\ufffde aus München"
    assert parsed.from_ == "J\ufffdrgen <j@example.org>"
    assert any("8-bit header that is not UTF-8" in n for n in parsed.notes)


def test_words_between_encoded_words_keep_their_spaces() -> None:
    raw = b"Subject: Re: =?utf-8?q?Gr=C3=BC=C3=9Fe?= =?utf-8?q?_aus?= M\xc3\xbcnchen\r\n\r\n"
    assert parse_email(raw).subject == "Re: Grüße aus München"


@given(
    header=st.binary(max_size=60),
    charset=st.sampled_from(["utf-8", "utf-7", "raw-unicode-escape", "utf-16", "x-unknown"]),
    body=st.binary(max_size=60),
)
@example(header=b"Gr\xc3\xbc\xfc\x00", charset="raw-unicode-escape", body=b"\\ud800")
@example(header=b"=?utf-7?q?+2AA-?=", charset="utf-7", body=b"+2AA-")
def test_every_field_can_be_stored(header: bytes, charset: str, body: bytes) -> None:
    """Whatever the bytes, nothing leaves the parser that UTF-8 or PostgreSQL would refuse."""
    raw = (
        b"From: " + header + b"\r\nTo: " + header + b"\r\nCc: " + header
        + b"\r\nSubject: " + header + b"\r\nDate: " + header + b"\r\nMessage-ID: <" + header
        + b">\r\nContent-Type: text/plain; charset=" + charset.encode()
        + b'\r\nContent-Disposition: inline; filename="' + header + b'"\r\n\r\n' + body
    )  # fmt: skip
    parsed = parse_email(raw)
    texts = [parsed.from_, parsed.to, parsed.cc, parsed.subject, parsed.date_raw, parsed.body]
    texts += [parsed.message_id or "", *parsed.notes, *(a.name for a in parsed.attachments)]
    texts += [format_email_summary(parsed), message_key("home", parsed)]
    for text in texts:
        text.encode("utf-8")  # raises on a lone surrogate
        assert "\x00" not in text


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


def test_a_date_that_cannot_be_shown_in_local_time_is_unparsable() -> None:
    parsed = parse_email(mails.plain(date="Fri, 31 Dec 9999 23:30:00 -0100"))
    assert parsed.date is None
    assert "\nDate: \n" in format_email_summary(parsed)
    assert "unparsable Date header" in parsed.notes


def test_nul_bytes_are_removed_and_noted() -> None:
    parsed = parse_email(mails.plain(body="a\x00b"))
    assert parsed.body == "ab"
    assert "NUL bytes removed" in parsed.notes


@pytest.mark.parametrize(
    "subject", ["=?idna?q?hello?=", "=?undefined?q?hello?=", "=?punycode?q?caf=E9?="]
)
def test_an_odd_charset_in_a_header_gives_a_note_not_an_exception(subject: str) -> None:
    """Codecs that are not text encodings raise UnicodeError, not LookupError."""
    parsed = parse_email(mails.plain(subject=subject))
    assert parsed.from_ == "Bob Example <bob@example.org>"
    assert any("decoded as UTF-8" in n for n in parsed.notes)


def test_a_charset_name_with_nul_gives_a_note_not_an_exception() -> None:
    parsed = parse_email(mails.plain(subject="=?utf\x00-8?q?hello?="))
    assert parsed.subject == "hello"
    assert any("decoded as UTF-8" in n for n in parsed.notes)


def _parses_within(raw: bytes, tmp_path: Path, seconds: float) -> None:
    """parse_email of ``raw`` in a subprocess that must end within ``seconds``."""
    path = tmp_path / "mail.eml"
    path.write_bytes(raw)
    code = textwrap.dedent(
        f"""
        from pathlib import Path
        from sokratos_worker.email.parse import parse_email
        parse_email(Path({str(path)!r}).read_bytes())
        """
    )
    try:
        subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, timeout=seconds, check=True, capture_output=True
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"parse_email of a {len(raw)}-byte message took more than {seconds} s")


@pytest.mark.parametrize("markup", [b"<a", b"<a b=c ", b"<a x='", b"<!--", b"<script>"])
def test_html_only_message_with_unclosed_tags_parses_in_bounded_time(
    markup: bytes, tmp_path: Path
) -> None:
    """html.parser was quadratic on unclosed tags: 400 KB took more than 10 s."""
    body = markup * (400_000 // len(markup))
    raw = (
        b"From: spam@example.org\r\nTo: alice@example.org\r\nSubject: x\r\n"
        b"Message-ID: <quadratic@example.org>\r\nMIME-Version: 1.0\r\n"
        b"Content-Type: text/html; charset=utf-8\r\n\r\n" + body + b"\r\n"
    )
    _parses_within(raw, tmp_path, 10)
    parsed = parse_email(raw)  # in bounded time, and still read: the headers, and why it is short
    assert (parsed.message_id, parsed.subject) == ("<quadratic@example.org>", "x")
    assert any("HTML part cut" in note for note in parsed.notes), parsed.notes


def test_a_huge_content_type_header_parses_in_bounded_time(tmp_path: Path) -> None:
    """The email package's header parser took 9 s on a 100 KB Content-Type."""
    raw = (
        b"From: a@example.org\r\nContent-Type: text/plain; " + b"a=b; " * 20_000 + b"\r\n"
        b"Message-ID: <long-type@example.org>\r\n\r\nhello\r\n"
    )
    _parses_within(raw, tmp_path, 10)
    assert parse_email(raw).body == "hello"


def test_a_content_type_as_long_as_a_whole_message_parses_in_bounded_time(
    tmp_path: Path,
) -> None:
    """Moving the boundary and charset before the cut split the whole value into parameters,
    on every read of the header (nine per part): a 15 MB Content-Type, which a 16 MiB message
    can carry, took 21 s where the cut alone took under one."""
    raw = (
        b"From: a@example.org\r\nContent-Type: multipart/mixed; " + b"a=b; " * 3_000_000
        + b'boundary="B"\r\nMessage-ID: <longest-type@example.org>\r\n\r\n--B\r\n'
        b"Content-Type: text/plain\r\n\r\nhello\r\n--B--\r\n"
    )  # fmt: skip
    _parses_within(raw, tmp_path, 10)
    parsed = parse_email(raw)  # the boundary lies past the cut: shown as raw text, not lost
    assert parsed.message_id == "<longest-type@example.org>"
    assert "hello" in parsed.body, parsed.body[:200]


def test_each_header_of_a_many_part_message_is_parsed_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The email package parses a header anew on each of its ~9 reads of a part: 2,000 parts
    with long Content-Types (a 10 MB message) took about 300 s to parse."""
    import email.headerregistry

    parses = 0
    parse_header = email.headerregistry.HeaderRegistry.__call__

    def counted(self: object, name: str, value: str) -> object:
        nonlocal parses
        parses += 1
        return parse_header(self, name, value)

    monkeypatch.setattr(email.headerregistry.HeaderRegistry, "__call__", counted)
    parts = 60
    long_type = "application/octet-stream" + "".join(f"; p{j}=v{j}" for j in range(600))
    raw = (
        "From: a@example.org\r\nMessage-ID: <many-parts@example.org>\r\n"
        "Content-Type: multipart/mixed; boundary=B\r\n\r\n"
        + "".join(
            f'--B\r\nContent-Type: {long_type}; name="part{n}.bin"\r\n\r\nQUJD\r\n'
            for n in range(parts)
        )
        + "--B--\r\n"
    ).encode()
    parsed = parse_email(raw)
    assert len(parsed.attachments) == parts
    assert parses < 2 * parts, f"{parses} header parses for {parts} parts"


@pytest.mark.parametrize(
    "long_parameter",
    [mails.quoted_long_parameter, mails.rfc2231_long_parameter],
    ids=["quoted", "rfc2231"],
)
def test_a_long_parameter_before_the_boundary_and_charset_keeps_them(
    long_parameter: Callable[[str], str],
) -> None:
    """Content-Types are cut to PARSED_HEADER_LIMIT for parsing: this one's boundary and
    charset came after the cut, so its raw MIME (boundaries, part headers, base64) was the body."""
    assert len(long_parameter("name")) > PARSED_HEADER_LIMIT
    parsed = parse_email(mails.long_content_type(long_parameter))
    assert parsed.body == "Schöne Grüße aus München"
    assert parsed.attachments == (Attachment("report.pdf", 9),)
    assert parsed.notes == ()


def test_a_huge_html_part_is_cut_with_a_note() -> None:
    markup = "<p>start</p>" + "x" * HTML_LIMIT_CHARS + "<p>end</p>"
    parsed = parse_email(
        b"From: a@example.org\r\nMIME-Version: 1.0\r\n"
        b"Content-Type: text/html; charset=utf-8\r\n\r\n" + markup.encode()
    )
    assert parsed.body.startswith("start") and "end" not in parsed.body
    assert any("HTML part cut" in n for n in parsed.notes)


def test_html_text_keeps_text_and_drops_markup() -> None:
    markup = (
        "<p title='a>b'>Hi &amp; <b>bye</b></p><!-- hidden --><div>x<br/>y</div>"
        " a < b <SCRIPT type=x>var a = '<p>';</script >z <style>p {}</style>"
    )
    assert html_to_text(markup) == "Hi & bye\n\nx\ny\na < b z"


def test_only_a_read_cut_at_the_limit_counts_as_truncated() -> None:
    """Some servers report an RFC822.SIZE a few bytes off what they send: a small message
    must not get the "only its first N bytes were read" note for that."""
    from sokratos_worker.email.imap import MESSAGE_BYTES_LIMIT, FetchedMessage

    small = FetchedMessage(uid=1, internal_date=None, raw=b"x" * 100, server_size=104)
    assert not small.truncated and small.size == 104
    cut = FetchedMessage(
        uid=2, internal_date=None, raw=b"x" * MESSAGE_BYTES_LIMIT, server_size=MESSAGE_BYTES_LIMIT + 9
    )
    assert cut.truncated and cut.size == MESSAGE_BYTES_LIMIT + 9
