"""Raw RFC 5322 bytes → :class:`ParsedEmail`, and Sokratos's email summary format.

Parsing never raises: whatever a mail server hands over (broken MIME, unknown charsets, NUL
bytes, raw 8-bit headers, undecodable base64) becomes a best-effort text plus a note in
``notes`` saying what was wrong, so one bad message never stops a check (``durability.md``
"Bad input"). Every string that leaves the parser can be encoded as UTF-8 and stored by
PostgreSQL: no lone surrogates, no NUL.
"""

from __future__ import annotations

import email
import email.utils
import functools
import hashlib
import html
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from email.message import Message
from email.policy import EmailPolicy
from typing import Any

from sokratos_worker.email.headers import (
    decode_bytes,
    decode_header,
    header,
    legacy_decode_header,
    raw_values,
)
from sokratos_worker.store.sanitize import clean_text

# Sokratos truncates the body to 2000 bytes before triage (behaviour §4.3).
BODY_LIMIT_BYTES = 2000
# Address lists and subjects are bounded too, so one message cannot make a huge payload.
HEADER_LIMIT_BYTES = 2000
# The attachment list appended to the summary is bounded separately.
ATTACHMENTS_LIMIT_BYTES = 500
# processed_emails.message_id is varchar(255) in Sokratos's schema.
KEY_LIMIT = 255

_BLOCK_TAGS = frozenset(
    {"p", "div", "br", "tr", "li", "h1", "h2", "h3", "h4", "h5", "h6", "table", "ul", "ol"}
    | {"blockquote", "pre", "hr", "section", "article", "header", "footer"}
)
# A regular expression instead of html.parser, which is quadratic on unclosed tags (400 KB
# took minutes). Every alternative stops at the next "<" or runs to the end once, so one
# pass is linear: comments, skipped elements with their content, tags, other markup.
_HTML_TOKEN = re.compile(
    r"<!--.*?(?:-->|\Z)"
    r"|<(?P<skip>script|style|head|title)\b[^<>]*>.*?(?:</(?P=skip)\s*>|\Z)"
    r"|</?(?P<tag>[a-z][a-z0-9-]*)(?:[^<>\"']|\"[^\"<]*\"|'[^'<]*')*>?"
    r"|<[!?/][^<>]*>?",
    re.DOTALL | re.IGNORECASE,
)
# Only BODY_LIMIT_BYTES of text are used: the start of a huge HTML part is enough.
HTML_LIMIT_CHARS = 256 * 1024
# The email package parses structured headers (Content-Type, Content-Disposition) in time
# that grows faster than their length (100 KB took 9 s): longer values are cut first.
PARSED_HEADER_LIMIT = 4096
# One parameter of a structured header value: up to the next ";" outside a quoted string.
_PARAMETER = re.compile(r'(?:[^;"]|"(?:[^"\\]|\\.)*"?)+', re.DOTALL)
# What the MIME structure needs from a long value, moved before the cut so it survives it.
_STRUCTURE_PARAMETERS = frozenset({"boundary", "charset"})
# How much of a long value is searched for them: splitting a whole 15 MB value into its
# parameters, on each of the header's reads (nine per part), took 21 s.
STRUCTURE_SEARCH_LIMIT = 64 * 1024
# Parts that carry a whole message: listed as attachments; read for the body only when the
# outer message has no text of its own (a mail that is just a forwarded message).
_ATTACHED_MESSAGE_TYPES = frozenset({"message/rfc822", "message/global"})
# How many attached messages deep a mail that is only a forward of a forward is followed.
FORWARD_DEPTH_LIMIT = 4
# The headers the processed_emails key is made of (message_key).
_KEY_HEADERS = ("Message-ID", "Date", "From", "Subject")


@dataclass(frozen=True)
class Attachment:
    """An attachment's name and decoded size; its content is never stored."""

    name: str
    size: int


@dataclass(frozen=True)
class ParsedEmail:
    """What triage needs from one message; ``body`` is the full extracted text."""

    message_id: str | None
    from_: str
    to: str
    cc: str
    subject: str
    date: datetime | None
    date_raw: str
    body: str
    attachments: tuple[Attachment, ...] = ()
    bcc: str = ""  # present on mail the user sent (a Sent folder)
    notes: tuple[str, ...] = ()
    raw_body: bytes = field(default=b"", repr=False)
    # The raw values of _KEY_HEADERS, for message_key's legacy decoding.
    key_headers: tuple[tuple[str, ...], ...] = field(default=(), repr=False, compare=False)


def truncate_bytes(text: str, limit: int) -> str:
    """Sokratos's ``Truncate``: cut to ``limit`` UTF-8 bytes on a character boundary, add "..."."""
    encoded = text.encode("utf-8")
    if len(encoded) <= limit:
        return text
    return encoded[:limit].decode("utf-8", errors="ignore") + "..."


def _html_text(markup: str) -> str:
    """The data between tags and comments, entities decoded, block tags as line breaks."""
    parts: list[str] = []
    pos = 0
    for match in _HTML_TOKEN.finditer(markup):
        parts.append(html.unescape(markup[pos : match.start()]))
        tag = match.group("tag")
        if tag and tag.lower() in _BLOCK_TAGS:
            parts.append("\n")
        pos = match.end()
    parts.append(html.unescape(markup[pos:]))
    return "".join(parts)


def html_to_text(markup: str) -> str:
    """Readable text from HTML: tags, comments, scripts and styles dropped; linear time."""
    text = _html_text(markup[:HTML_LIMIT_CHARS])
    lines = (re.sub(r"[ \t\r\f\v\xa0]+", " ", line).strip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _parameter_name(parameter: str) -> str:
    """``boundary`` for ``boundary="x"`` (and for an RFC 2231 ``boundary*0*=...``)."""
    return parameter.partition("=")[0].partition("*")[0].strip().lower()


def _structure_first(value: str) -> str:
    """``value`` with its boundary and charset parameters moved right after its type.

    Cutting the result loses the end of a long file name or vendor parameter, never the
    multipart structure or the charset of the text (a mailer may put them last). Linear time.
    """
    segments = _PARAMETER.findall(value)
    kind, parameters = segments[:1], segments[1:]
    structure = [p for p in parameters if _parameter_name(p) in _STRUCTURE_PARAMETERS]
    others = [p for p in parameters if _parameter_name(p) not in _STRUCTURE_PARAMETERS]
    return ";".join([*kind, *structure, *others])


class _BoundedPolicy(EmailPolicy):
    """``policy.default``, but a header value is cut to PARSED_HEADER_LIMIT before parsing.

    Its boundary and charset are kept (:func:`_structure_first`) when they are within its
    first STRUCTURE_SEARCH_LIMIT characters. Only the email package's parsed headers are cut
    (the MIME structure); the headers of the payload are read raw (:func:`header`), so keys
    and addresses are unchanged.
    """

    def header_fetch_parse(self, name: str, value: str) -> Any:
        if hasattr(value, "name"):
            return value  # parsed already
        if len(value) > PARSED_HEADER_LIMIT:
            value = _structure_first(value[:STRUCTURE_SEARCH_LIMIT])[:PARSED_HEADER_LIMIT]
        return _parsed_header(name, value)


@functools.lru_cache(maxsize=1024)
def _parsed_header(name: str, value: str) -> Any:
    """A header as ``policy.default`` parses it, once per bounded value: the email package
    parses a header anew on each of its ~9 reads of a part (a 2,000-part message with long
    Content-Types took minutes). Parsed headers are immutable, so sharing them is safe."""
    return EmailPolicy.header_fetch_parse(_POLICY, name, value)


_POLICY = _BoundedPolicy()
# Writes an attached message out to measure it: CRLF line ends as on the wire, and headers as
# they came (refold_source="none"): refolding re-parses each long header, unbounded (a
# forwarded message with a 1 MB To header took 14 s).
_WIRE = _POLICY.clone(linesep="\r\n", refold_source="none")


def _legacy_header(values: tuple[str, ...]) -> str:
    """:func:`header` with the legacy decoding, cleaned as the legacy parser cleaned it."""
    decoded = (legacy_decode_header(value) for value in values)
    return _clean(", ".join(v for v in decoded if v), [])


def _parse_date(value: str) -> datetime | None:
    """An RFC 5322 date, or None when unparsable (Sokratos wrote year 1; we write NULL)."""
    if not value:
        return None
    try:
        parsed = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if parsed.tzinfo is None:
        return None  # "-0000" means no zone information: not a usable instant
    try:
        parsed.astimezone()  # the summary shows local time: year 9999 -0100 cannot be shown
    except (OverflowError, ValueError):
        return None
    return parsed


def _payload_bytes(part: Message, notes: list[str]) -> bytes:
    """A part's decoded content; broken transfer encodings give their best effort."""
    try:
        data = part.get_payload(decode=True)
    except Exception as exc:  # a broken part becomes a note, not a crash
        notes.append(f"undecodable part {part.get_content_type()}: {type(exc).__name__}")
        return b""
    if isinstance(data, bytes):
        return data
    return b""


def _is_attachment(part: Message) -> bool:
    disposition = part.get_content_disposition()
    if disposition == "attachment":
        return True
    if part.get_filename():
        return True
    return part.get_content_maintype() not in {"text", "multipart", "message"}


def _filename(part: Message, notes: list[str]) -> str | None:
    try:
        name = part.get_filename()
    except Exception:  # RFC 2231 parameters can be malformed
        name = None
    return decode_header(name, notes) if name else None


def _attachment_name(part: Message, notes: list[str]) -> str:
    return _filename(part, notes) or f"(unnamed {part.get_content_type()})"


def _is_attached_message(part: Message) -> bool:
    """A message carried inside another (forwarded as an attachment, a bounce's original)."""
    return part.get_content_type() in _ATTACHED_MESSAGE_TYPES


def _attached_message_name(part: Message, inner: Message | None, notes: list[str]) -> str:
    """Its file name, else the Subject of the message it carries (``inner``)."""
    name = _filename(part, notes)
    if not name and inner is not None:
        name = header(inner, "Subject", notes)
    return name or f"(unnamed {part.get_content_type()})"


# Transfer encodings that leave the content as it is: an attached message under any other
# (base64, quoted-printable: RFC 2046 forbids them, but clients and gateways send them) is
# encoded text that must be decoded before it is parsed as a message.
_IDENTITY_ENCODINGS = frozenset({"", "7bit", "8bit", "binary"})


def _transfer_encoding(part: Message) -> str:
    try:
        return str(part.get("Content-Transfer-Encoding", "")).strip().lower()
    except Exception:  # a malformed header value counts as none
        return ""


def _encoded_content(part: Message, notes: list[str]) -> bytes | None:
    """The decoded content of an attached-message part under a transfer encoding (None when
    it has none). The email package parses such a part's encoded text as the inner message
    (no headers, the encoded text as its body) or, for quoted-printable, parses what looks
    like headers: it is written out again as it came and decoded."""
    encoding = _transfer_encoding(part)
    if encoding in _IDENTITY_ENCODINGS:
        return None
    payload = part.get_payload()
    if isinstance(payload, list):
        inner = payload[0] if payload else None
        if not isinstance(inner, Message):
            return b""
        body = inner.get_payload()
        if not inner.keys() and isinstance(body, str):
            text = body
        else:
            text = inner.as_bytes(policy=_WIRE).decode("ascii", errors="replace")
    elif isinstance(payload, str):
        text = payload
    else:
        return b""
    holder = Message()
    holder["Content-Transfer-Encoding"] = encoding
    holder.set_payload(text)
    return _payload_bytes(holder, notes)


@dataclass(frozen=True)
class _Carried:
    """What an attached-message part carries: the message (None when empty) and its size."""

    message: Message | None
    size: int


def _carried(part: Message, notes: list[str]) -> _Carried:
    """The message an attached-message part carries, decoded and parsed again when it was
    encoded, and its size in bytes (as the email package writes it out again, its headers
    as they came: linear time)."""
    data = _encoded_content(part, notes)
    if data is None and not part.is_multipart():
        data = _payload_bytes(part, notes)  # left unparsed by the email package
    if data is not None:
        decoded = email.message_from_bytes(data, policy=_POLICY) if data else None
        return _Carried(decoded, len(data))
    inner = part.get_payload(0)
    if not isinstance(inner, Message):
        return _Carried(None, 0)
    try:
        # Written with the CRLF line ends of the wire, to come close to its size there.
        return _Carried(inner, len(inner.as_bytes(policy=_WIRE)))
    except Exception as exc:  # a message too broken to write out is still listed
        notes.append(f"attached message of unknown size: {type(exc).__name__}")
        return _Carried(inner, 0)


def _parts(msg: Message) -> Iterator[Message]:
    """Every part depth first, as ``msg.walk()``, but an attached message is not entered: its
    text and attachments are its own, not the outer message's."""
    stack = [msg]
    while stack:
        part = stack.pop()
        yield part
        if part.is_multipart() and (part is msg or not _is_attached_message(part)):
            children = part.get_payload()
            if isinstance(children, list):
                stack.extend(c for c in reversed(children) if isinstance(c, Message))


def _defect_notes(msg: Message) -> list[str]:
    """The MIME defects of every part, as ``msg.walk()`` finds them, but not inside an
    attached message under a transfer encoding: the email package parsed its encoded text as
    a message, whose defects (no header block) say nothing about the mail."""
    found: set[str] = set()
    stack = [msg]
    while stack:
        part = stack.pop()
        found.update(type(d).__name__ for d in getattr(part, "defects", []))
        if _is_attached_message(part) and _transfer_encoding(part) not in _IDENTITY_ENCODINGS:
            continue
        children = part.get_payload() if part.is_multipart() else None
        if isinstance(children, list):
            stack.extend(c for c in children if isinstance(c, Message))
    names = sorted(found)
    return [f"malformed MIME: {', '.join(names)}"] if names else []


@dataclass
class _Walked:
    """What :func:`_walk` found in one message (an attached message is not entered)."""

    plain: str = ""
    html: str = ""
    attachments: list[Attachment] = field(default_factory=list)
    forwarded: Message | None = None  # the message the first attached-message part carries
    forwarded_name: str = ""  # that part's attachment name

    def text(self) -> str:
        """The message's own text: text/plain, else text made from text/html."""
        return self.plain.strip() or (html_to_text(self.html) if self.html else "")


def _walk(msg: Message, notes: list[str]) -> _Walked:
    """The first text/plain and text/html bodies and the attachments, depth first."""
    walked = _Walked()
    plain = html = ""
    attachments = walked.attachments
    for part in _parts(msg):
        if part is not msg and _is_attached_message(part):
            carried = _carried(part, notes)
            name = _attached_message_name(part, carried.message, notes)
            attachments.append(Attachment(name, carried.size))
            if not walked.forwarded_name:  # (never empty once set)
                walked.forwarded, walked.forwarded_name = carried.message, name
            continue
        if part.is_multipart():
            continue
        content_type = part.get_content_type()
        if part.get_content_maintype() == "multipart":
            # A multipart without a usable boundary: show its raw text rather than nothing.
            notes.append(f"malformed MIME: {content_type} without parts; showing the raw text")
            raw = part.get_payload()
            if not plain and isinstance(raw, str):
                plain = raw
            continue
        if _is_attachment(part):
            data = _payload_bytes(part, notes)
            attachments.append(Attachment(_attachment_name(part, notes), len(data)))
            continue
        if content_type == "text/plain" and not plain:
            plain = decode_bytes(_payload_bytes(part, notes), part.get_content_charset(), notes)
        elif content_type == "text/html" and not html:
            html = decode_bytes(_payload_bytes(part, notes), part.get_content_charset(), notes)
    walked.plain, walked.html = plain, html
    return walked


def _forwarded_text(walked: _Walked, notes: list[str]) -> str:
    """The text of a mail that is only a forwarded message: the attached message's own text,
    after a line naming it; a forward of a forward is followed FORWARD_DEPTH_LIMIT deep."""
    labels: list[str] = []
    current = walked
    for _ in range(FORWARD_DEPTH_LIMIT):
        inner = current.forwarded
        if inner is None:
            break
        name = header(inner, "Subject", notes) or current.forwarded_name
        labels.append(f"[forwarded message: {truncate_bytes(name, HEADER_LIMIT_BYTES)}]")
        current = _walk(inner, notes)
        if text := current.text():
            return "\n".join(labels) + "\n" + text
    return ""


def _raw_body(raw: bytes) -> bytes:
    """Everything after the header block, for the hash of a message without Message-ID."""
    for separator in (b"\r\n\r\n", b"\n\n"):
        index = raw.find(separator)
        if index >= 0:
            return raw[index + len(separator) :]
    return b""


UNENCODABLE_NOTE = "characters UTF-8 cannot encode (lone surrogates) escaped as \\uXXXX"


def _clean(text: str, notes: list[str]) -> str:
    """Text PostgreSQL can store: NUL dropped, lone surrogates written as ``\\udXXX``
    (:func:`clean_text`), and noted.

    Surrogates can still come from odd charsets (``raw-unicode-escape``, ``utf-7``) after the
    headers were decoded; they would fail at the payload's UTF-8 encoding.
    """
    if "\x00" in text:
        notes.append("NUL bytes removed")
        text = text.replace("\x00", "")
    storable = clean_text(text)
    if storable != text:
        notes.append(UNENCODABLE_NOTE)
    return storable


def parse_email(raw: bytes) -> ParsedEmail:
    """Parse one message; never raises, records what was wrong in ``notes``."""
    notes: list[str] = []
    try:
        msg = email.message_from_bytes(raw, policy=_POLICY)
    except Exception as exc:  # the email package should not raise, but never crash
        text = raw.decode("utf-8", errors="replace")
        return ParsedEmail(
            message_id=None,
            from_="",
            to="",
            cc="",
            subject="",
            date=None,
            date_raw="",
            body=_clean(text, notes),
            notes=(f"unparsable message ({type(exc).__name__}): shown as raw text", *notes),
            raw_body=raw,
        )
    notes.extend(_defect_notes(msg))
    try:
        walked = _walk(msg, notes)
    except Exception as exc:  # deeply broken structure: fall back to raw text
        notes.append(f"malformed MIME ({type(exc).__name__}): body shown as raw text")
        walked = _Walked(plain=_raw_body(raw).decode("utf-8", errors="replace"))
    plain, html, attachments = walked.plain, walked.html, walked.attachments
    body = plain.strip()
    if not body and html:
        body = html_to_text(html)
        notes.append("HTML-only message: text made from text/html")
        if len(html) > HTML_LIMIT_CHARS:
            notes.append(f"HTML part cut to its first {HTML_LIMIT_CHARS} characters")
    if not body and walked.forwarded is not None:
        # Only a forwarded message ("forward as attachment" with no comment): its text is the
        # mail's whole content. It stays listed as an attachment too.
        try:
            body = _forwarded_text(walked, notes)
        except Exception as exc:  # a broken attached message leaves the body empty
            notes.append(f"attached message unreadable ({type(exc).__name__}): no body")
    message_id = header(msg, "Message-ID", notes).strip() or None
    date_raw = header(msg, "Date", notes)
    date = _parse_date(date_raw)
    if date_raw and date is None:
        notes.append("unparsable Date header")
    return ParsedEmail(
        message_id=_clean(message_id, notes) if message_id else None,
        from_=_clean(header(msg, "From", notes), notes),
        to=_clean(header(msg, "To", notes), notes),
        cc=_clean(header(msg, "Cc", notes), notes),
        bcc=_clean(header(msg, "Bcc", notes), notes),
        subject=_clean(header(msg, "Subject", notes), notes),
        date=date,
        date_raw=_clean(date_raw, notes),
        body=_clean(body, notes),
        attachments=tuple(Attachment(_clean(a.name, notes), a.size) for a in attachments),
        # Notes quote content types and charsets from the message: they must be storable too.
        notes=tuple(dict.fromkeys(clean_text(n) for n in notes)),
        raw_body=_raw_body(raw),
        key_headers=tuple(raw_values(msg, name) for name in _KEY_HEADERS),
    )


def _key_values(parsed: ParsedEmail) -> tuple[str | None, str, str, str]:
    """Message-ID, Date, From and Subject as the key hashes them: decoded as before adjacent
    encoded words were joined (:func:`legacy_decode_header` says why)."""
    if len(parsed.key_headers) != len(_KEY_HEADERS):  # an unparsable message
        return parsed.message_id, parsed.date_raw, parsed.from_, parsed.subject
    message_id, date_raw, from_, subject = (_legacy_header(v) for v in parsed.key_headers)
    return message_id.strip() or None, date_raw, from_, subject


def keyed_by_hash(account: str, parsed: ParsedEmail) -> bool:
    """True when the key hashes the message (no Message-ID, or a key over KEY_LIMIT)."""
    message_id = _key_values(parsed)[0]
    return not message_id or len(f"{account}:{message_id}") > KEY_LIMIT


def message_key(account: str, parsed: ParsedEmail) -> str:
    """The processed_emails key: ``<account>:<Message-ID>``, else ``<account>:sha256:<hex>``."""
    message_id, date_raw, from_, subject = _key_values(parsed)
    if message_id and len(f"{account}:{message_id}") <= KEY_LIMIT:
        return f"{account}:{message_id}"
    digest = hashlib.sha256()
    for part in (date_raw, from_, subject):
        digest.update(part.encode("utf-8", errors="replace") + b"\x00")
    digest.update(parsed.raw_body)
    return f"{account}:sha256:{digest.hexdigest()}"


def format_email_summary(parsed: ParsedEmail) -> str:
    """Sokratos's ``FormatEmailSummary`` (behaviour §4.3): headers, blank line, bounded body."""
    lines = [
        f"From: {truncate_bytes(parsed.from_, HEADER_LIMIT_BYTES)}",
        f"To: {truncate_bytes(parsed.to, HEADER_LIMIT_BYTES) or '(unknown)'}",
    ]
    if parsed.cc:
        lines.append(f"CC: {truncate_bytes(parsed.cc, HEADER_LIMIT_BYTES)}")
    if parsed.bcc:
        lines.append(f"BCC: {truncate_bytes(parsed.bcc, HEADER_LIMIT_BYTES)}")
    lines.append(f"Subject: {truncate_bytes(parsed.subject, HEADER_LIMIT_BYTES)}")
    lines.append(
        f"Date: {parsed.date.astimezone().strftime('%Y-%m-%d %H:%M') if parsed.date else ''}"
    )
    text = "\n".join(lines) + "\n\n" + truncate_bytes(parsed.body, BODY_LIMIT_BYTES)
    if parsed.attachments:
        # Not in Sokratos's format, but the model should know a file came with the mail.
        listed = ", ".join(f"{a.name} ({a.size} bytes)" for a in parsed.attachments)
        text += "\n\n" + truncate_bytes(f"[attachments: {listed}]", ATTACHMENTS_LIMIT_BYTES)
    return text
