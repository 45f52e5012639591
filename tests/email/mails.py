"""Raw test messages, built by hand so that broken ones stay broken."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Callable


def plain(
    subject: str = "Lunch on Friday?",
    body: str = "Shall we meet at noon at the usual place?",
    *,
    message_id: str | None = "auto",
    sender: str = "Bob Example <bob@example.org>",
    to: str = "alice@example.org",
    date: str = "Tue, 01 Dec 2026 09:30:00 +0000",
    extra_headers: str = "",
) -> bytes:
    """A simple text/plain UTF-8 message; ``message_id=None`` leaves the header out."""
    mid = f"<{uuid.uuid4().hex}@example.org>" if message_id == "auto" else message_id
    headers = [f"From: {sender}", f"To: {to}", f"Subject: {subject}", f"Date: {date}"]
    if mid is not None:
        headers.append(f"Message-ID: {mid}")
    headers += ["MIME-Version: 1.0", "Content-Type: text/plain; charset=utf-8"]
    headers += ["Content-Transfer-Encoding: 8bit"]
    if extra_headers:
        headers.append(extra_headers)
    return ("\r\n".join(headers) + "\r\n\r\n" + body.replace("\n", "\r\n") + "\r\n").encode()


def html_only() -> bytes:
    return (
        b"From: news@example.org\r\nTo: alice@example.org\r\nSubject: Newsletter\r\n"
        b"Date: Tue, 01 Dec 2026 09:30:00 +0000\r\nMessage-ID: <html-1@example.org>\r\n"
        b"MIME-Version: 1.0\r\nContent-Type: text/html; charset=utf-8\r\n\r\n"
        b"<html><head><style>p {color: red}</style><script>alert('x')</script></head>"
        b"<body><h1>Big&nbsp;news</h1><p>The <b>meeting</b> moved to &lt;Thursday&gt;.</p>"
        b"</body></html>\r\n"
    )


def unknown_charset() -> bytes:
    return (
        b"From: odd@example.org\r\nTo: alice@example.org\r\nSubject: Strange charset\r\n"
        b"Date: Tue, 01 Dec 2026 09:30:00 +0000\r\nMessage-ID: <charset-1@example.org>\r\n"
        b"MIME-Version: 1.0\r\nContent-Type: text/plain; charset=x-no-such-charset\r\n"
        b"Content-Transfer-Encoding: 8bit\r\n\r\n"
        b"Hello \xff\xfe world, caf\xc3\xa9\r\n"
    )


def latin1() -> bytes:
    return (
        b"From: =?ISO-8859-1?Q?J=FCrgen?= <juergen@example.de>\r\nTo: alice@example.org\r\n"
        b"Subject: =?ISO-8859-1?Q?Gr=FC=DFe_aus_M=FCnchen?=\r\n"
        b"Date: Tue, 01 Dec 2026 09:30:00 +0100\r\nMessage-ID: <latin1-1@example.de>\r\n"
        b"MIME-Version: 1.0\r\nContent-Type: text/plain; charset=ISO-8859-1\r\n"
        b"Content-Transfer-Encoding: 8bit\r\n\r\n"
        b"Sch\xf6ne Gr\xfc\xdfe, bis Montag!\r\n"
    )


def raw_utf8_headers() -> bytes:
    """RFC 6532: UTF-8 straight in the headers (and the Message-ID), no encoded words."""
    return (
        b"From: J\xc3\xbcrgen <j@example.org>\r\nTo: Zo\xc3\xab <zoe@example.org>\r\n"
        b"Cc: Ren\xc3\xa9e <renee@example.org>\r\nSubject: Gr\xc3\xbc\xc3\x9fe\r\n"
        b"Date: Tue, 01 Dec 2026 09:30:00 +0100\r\n"
        b"Message-ID: <gr\xc3\xbc\xc3\x9fe-1@example.de>\r\n"
        b"MIME-Version: 1.0\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Content-Transfer-Encoding: 8bit\r\n\r\n"
        b"Sch\xc3\xb6ne Gr\xc3\xbc\xc3\x9fe aus M\xc3\xbcnchen\r\n"
    )


def raw_latin1_headers() -> bytes:
    """8-bit headers that are not UTF-8 (ISO-8859-1 bytes sent raw), next to an encoded word."""
    return (
        b"From: J\xfcrgen <j@example.org>\r\nTo: alice@example.org\r\n"
        b"Subject: Gr\xfc\xdfe =?utf-8?q?aus_M=C3=BCnchen?=\r\n"
        b"Date: Tue, 01 Dec 2026 09:30:00 +0100\r\nMessage-ID: <latin1-raw-1@example.de>\r\n"
        b"MIME-Version: 1.0\r\nContent-Type: text/plain; charset=utf-8\r\n\r\nHallo\r\n"
    )


def malformed_mime() -> bytes:
    """multipart/mixed that declares no boundary, with a broken base64 part after it."""
    return (
        b"From: broken@example.org\r\nTo: alice@example.org\r\nSubject: Broken MIME\r\n"
        b"Date: not a date at all\r\nMessage-ID: <broken-1@example.org>\r\n"
        b"MIME-Version: 1.0\r\nContent-Type: multipart/mixed\r\n\r\n"
        b"--nope\r\nContent-Type: text/plain\r\nContent-Transfer-Encoding: base64\r\n\r\n"
        b"SGVsbG8gd29ybGQ=!!!***\r\n--nope--\r\n"
    )


def unclosed_multipart() -> bytes:
    """A multipart whose boundary is never closed and whose part has a bad base64 body."""
    return (
        b"From: broken@example.org\r\nTo: alice@example.org\r\nSubject: Unclosed\r\n"
        b"Date: Tue, 01 Dec 2026 09:30:00 +0000\r\n"
        b'MIME-Version: 1.0\r\nContent-Type: multipart/alternative; boundary="BB"\r\n\r\n'
        b"--BB\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Content-Transfer-Encoding: base64\r\n\r\nSGVsbG8gdGhlcmU=\r\n"
        b"--BB\r\nContent-Type: text/html\r\nContent-Transfer-Encoding: base64\r\n\r\n"
        b"@@@not base64@@@\r\n"
    )


def with_attachment(size: int = 3 * 1024 * 1024) -> tuple[bytes, int]:
    """A text message with a ``size``-byte binary attachment (base64 in the message)."""
    data = bytes(range(256)) * (size // 256)
    encoded = base64.encodebytes(data).replace(b"\n", b"\r\n")
    raw = (
        b"From: bob@example.org\r\nTo: alice@example.org\r\nSubject: The slides\r\n"
        b"Date: Tue, 01 Dec 2026 09:30:00 +0000\r\nMessage-ID: <attach-1@example.org>\r\n"
        b'MIME-Version: 1.0\r\nContent-Type: multipart/mixed; boundary="XYZ"\r\n\r\n'
        b"--XYZ\r\nContent-Type: text/plain; charset=utf-8\r\n\r\nSlides attached.\r\n"
        b"--XYZ\r\nContent-Type: application/pdf\r\n"
        b'Content-Disposition: attachment; filename="slides.pdf"\r\n'
        b"Content-Transfer-Encoding: base64\r\n\r\n" + encoded + b"--XYZ--\r\n"
    )
    return raw, len(data)


def quoted_long_parameter(name: str) -> str:
    """A quoted value of 5000 characters whose ";" and "boundary=" are text, not parameters."""
    return f'{name}="' + "Quarterly report; boundary=wrong " * 150 + '.pdf"'


def rfc2231_long_parameter(name: str) -> str:
    """RFC 2231 continuations, one a line, as mailers split a long file name (5000 characters)."""
    return ";\r\n ".join(
        f"{name}*{i}*=" + ("utf-8''" if i == 0 else "") + "Bericht%20%C3%BCber%20das%20Quartal%20"
        for i in range(100)
    )


def long_content_type(long_parameter: Callable[[str], str]) -> bytes:
    """Multipart mail with a Content-Type parameter of thousands of characters (as some
    mailers make of a long RFC 2231 file name) before the boundary, and one before the
    charset of its text part; ``long_parameter(attribute)`` gives it."""
    return (
        b"From: bob@example.org\r\nTo: alice@example.org\r\nSubject: The report\r\n"
        b"Date: Tue, 01 Dec 2026 09:30:00 +0000\r\nMessage-ID: <long-type-1@example.org>\r\n"
        b"MIME-Version: 1.0\r\nContent-Type: multipart/mixed;\r\n "
        + long_parameter("name").encode()
        + b';\r\n boundary="=_part_1"\r\n\r\nThis is a multi-part message in MIME format.\r\n'
        b"--=_part_1\r\nContent-Type: text/plain;\r\n "
        + long_parameter("x-vendor-note").encode()
        + b";\r\n charset=ISO-8859-1\r\nContent-Transfer-Encoding: 8bit\r\n\r\n"
        b"Sch\xf6ne Gr\xfc\xdfe aus M\xfcnchen\r\n"
        b"--=_part_1\r\nContent-Type: application/pdf\r\n"
        b'Content-Disposition: attachment; filename="report.pdf"\r\n'
        b"Content-Transfer-Encoding: base64\r\n\r\nJVBERi0xLjQK\r\n--=_part_1--\r\n"
    )
