"""Reading IMAP server answers, and building what the session sends back.

The shapes a session hands on (:class:`MailboxState`, :class:`MessageRef`,
:class:`FetchedMessage`, :class:`Refused`), the parsing of UID FETCH, SEARCH and response-code
answers into them, UID sets and the batches a check fetches in (bounded by count and bytes),
and mailbox names in IMAP's modified UTF-7.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

# Bounded batches: at most this many messages, or this many bytes, per UID FETCH.
BATCH_MESSAGES = 50
BATCH_BYTES = 20 * 1024 * 1024
# A message is read up to this many bytes (a partial FETCH): triage uses 2000 bytes of its
# text, and a 54 MB message read and parsed whole cost the worker about 240 MB of memory.
MESSAGE_BYTES_LIMIT = 16 * 1024 * 1024

_UID = re.compile(rb"\bUID (\d+)")
_SIZE = re.compile(rb"\bRFC822\.SIZE (\d+)")
_INTERNALDATE = re.compile(rb'\bINTERNALDATE "([^"]+)"')
# The highest UID an ESEARCH answer reports (RFC 4731 RETURN (MAX)).
ESEARCH_MAX = re.compile(rb"\bMAX (\d+)", re.IGNORECASE)
# RFC 5530 response codes that describe the server's state, not one message's.
TEMPORARY_CODE = re.compile(r"\[(UNAVAILABLE|INUSE|LIMIT|OVERQUOTA)\b", re.IGNORECASE)
# A BYE that says the server is going away, not that it failed on a message (Dovecot's
# "* BYE Server shutting down." when it stops or restarts).
_SHUTTING_DOWN = re.compile(r"\bshutting down\b", re.IGNORECASE)


@dataclass(frozen=True)
class MailboxState:
    """What EXAMINE reported: the UIDVALIDITY epoch, the number of messages and UIDNEXT."""

    uidvalidity: int
    exists: int
    uidnext: int | None = None  # the UID the next message will get (None: not reported)


@dataclass(frozen=True)
class MessageRef:
    """A message above the checkpoint, before its body is fetched."""

    uid: int
    size: int
    internal_date: datetime | None = None
    # Left out of the listing while UID SEARCH finds it: its size and date are not known.
    unlisted: bool = False


@dataclass(frozen=True)
class FetchedMessage:
    """One message's raw bytes and IMAP arrival date (INTERNALDATE)."""

    uid: int
    internal_date: datetime | None
    raw: bytes
    server_size: int = 0  # RFC822.SIZE, when it was asked for

    @property
    def size(self) -> int:
        """The message's size on the server (at least what was read)."""
        return max(self.server_size, len(self.raw))

    @property
    def truncated(self) -> bool:
        """True when the message is larger than what was read (MESSAGE_BYTES_LIMIT)."""
        # Some servers report a size a few bytes off what they send: only a full read counts.
        return len(self.raw) >= MESSAGE_BYTES_LIMIT and self.server_size > len(self.raw)


@dataclass(frozen=True)
class Refused:
    """A message the server would not return: its single UID FETCH refused (``answer`` is the
    server's reply), or, ``left_out``, answered OK without it while the mailbox still holds it.
    """

    uid: int
    answer: str
    left_out: bool = False

    @property
    def what(self) -> str:
        """What the server did, for errors and the failure row."""
        if self.left_out:
            return "left out of the server's answers"
        return "refused by the server"


def plan_batches(refs: list[MessageRef], *, headers_only: bool = False) -> Iterator[list[int]]:
    """The UIDs of ``refs`` in order, in batches bounded by count and by bytes."""
    batch: list[int] = []
    size = 0
    for ref in refs:
        # A message whose size is not known may be as large as what is read of one.
        listed_size = MESSAGE_BYTES_LIMIT if ref.unlisted else ref.size
        if batch and (len(batch) >= BATCH_MESSAGES or size + listed_size > BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(ref.uid)
        size += 0 if headers_only else min(listed_size, MESSAGE_BYTES_LIMIT)
    if batch:
        yield batch


def fetched_messages(data: list[Any]) -> dict[int, FetchedMessage]:
    """The messages in a UID FETCH answer, by UID."""
    found: dict[int, FetchedMessage] = {}
    for index, item in enumerate(data):
        if not isinstance(item, tuple):
            continue
        prefix, raw = item[0], item[1]
        following = data[index + 1] if index + 1 < len(data) else b""
        # Some servers send UID or INTERNALDATE after the literal: look on both sides.
        meta = prefix + (following if isinstance(following, bytes) else b"")
        uid = _UID.search(meta)
        if uid is None:
            continue
        date = _INTERNALDATE.search(meta)
        size = _SIZE.search(meta)  # asked for with the whole message only
        found[int(uid.group(1))] = FetchedMessage(
            uid=int(uid.group(1)),
            internal_date=parse_internaldate(date.group(1)) if date else None,
            raw=raw,
            server_size=int(size.group(1)) if size else 0,
        )
    return found


def listed_refs(data: list[Any]) -> Iterator[MessageRef]:
    """The messages of a ``UID FETCH (UID RFC822.SIZE INTERNALDATE)`` answer."""
    for line in data:
        text = line[0] if isinstance(line, tuple) else line
        if not isinstance(text, bytes):
            continue
        uid, size, date = _UID.search(text), _SIZE.search(text), _INTERNALDATE.search(text)
        if uid is None:
            continue
        yield MessageRef(
            uid=int(uid.group(1)),
            size=int(size.group(1)) if size else 0,
            internal_date=parse_internaldate(date.group(1)) if date else None,
        )


def server_state(answer: str) -> bool:
    """True when a ``NO`` or ``BYE`` answer describes the server's state (an RFC 5530 code in
    TEMPORARY_CODE, or a server shutting down) rather than one message it cannot return."""
    return bool(TEMPORARY_CODE.search(answer) or _SHUTTING_DOWN.search(answer))


def answer_text(data: list[Any]) -> str:
    """A server's reply text (bytes joined and decoded)."""
    return b" ".join(d for d in data if isinstance(d, bytes)).decode("utf-8", "replace").strip()


def encode_mailbox(name: str) -> str:
    """IMAP's modified UTF-7 (RFC 3501 §5.1.3), so folder names like "Überweisungen" work."""
    out: list[str] = []
    pending: list[str] = []

    def flush() -> None:
        if pending:
            data = "".join(pending).encode("utf-16-be")
            out.append("&" + base64.b64encode(data).decode().rstrip("=").replace("/", ",") + "-")
            pending.clear()

    for char in name:
        if 0x20 <= ord(char) <= 0x7E:
            flush()
            out.append("&-" if char == "&" else char)
        else:
            pending.append(char)
    flush()
    return "".join(out)


def quote_mailbox(name: str) -> str:
    """An IMAP quoted string of the encoded name, so names with spaces work."""
    encoded = encode_mailbox(name)
    return '"' + encoded.replace("\\", "\\\\").replace('"', '\\"') + '"'


def parse_internaldate(value: bytes) -> datetime | None:
    """``"17-Jul-1996 02:44:25 -0700"`` → an aware datetime (None when malformed)."""
    try:
        return datetime.strptime(value.decode("ascii").strip(), "%d-%b-%Y %H:%M:%S %z")
    except (UnicodeDecodeError, ValueError):
        return None


def response_number(data: list[Any]) -> int | None:
    """The number in an untagged response code such as ``[UIDNEXT 42]``, if one came."""
    value = data[0] if data else None
    return int(value) if isinstance(value, bytes) and value.strip().isdigit() else None


def format_uid_set(uids: list[int]) -> str:
    """An IMAP sequence set of UIDs."""
    return ",".join(map(str, uids))
