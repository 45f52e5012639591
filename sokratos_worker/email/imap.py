"""A read-only IMAP session with :mod:`imaplib`: connect, log in, EXAMINE, fetch by UID.

Nothing here can change a mailbox: the folder is opened with EXAMINE and bodies are fetched
with ``BODY.PEEK[]``, so a check never sets ``\\Seen``. Every imaplib, socket and TLS error
is translated into :class:`ImapError`, whose message never contains the password.
"""

from __future__ import annotations

import base64
import contextlib
import imaplib
import re
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType

from sokratos_worker.config import EmailAccountConfig
from sokratos_worker.errors import WorkerError

DEFAULT_TIMEOUT_S = 30.0
# Bounded batches: at most this many messages, or this many bytes, per UID FETCH.
BATCH_MESSAGES = 50
BATCH_BYTES = 20 * 1024 * 1024

_UID = re.compile(rb"\bUID (\d+)")
_SIZE = re.compile(rb"\bRFC822\.SIZE (\d+)")
_INTERNALDATE = re.compile(rb'\bINTERNALDATE "([^"]+)"')


class ImapError(WorkerError):
    """Connecting, TLS, logging in or talking to one account's server failed."""


@dataclass(frozen=True)
class MailboxState:
    """What EXAMINE reported: the UIDVALIDITY epoch and the number of messages."""

    uidvalidity: int
    exists: int


@dataclass(frozen=True)
class MessageRef:
    """A message above the checkpoint, before its body is fetched."""

    uid: int
    size: int
    internal_date: datetime | None = None


@dataclass(frozen=True)
class FetchedMessage:
    """One message's raw bytes and IMAP arrival date (INTERNALDATE)."""

    uid: int
    internal_date: datetime | None
    raw: bytes


def ssl_context(account: EmailAccountConfig) -> ssl.SSLContext:
    """System trust store, or ``ca_file``; ``tls_verify=false`` turns verification off."""
    context = ssl.create_default_context(cafile=account.ca_file)
    if not account.tls_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


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


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    if text.startswith(("b'", 'b"')):
        text = text[2:-1]
    # imaplib's own exception classes are all called "error": name them by what they are.
    name = "IMAP error" if isinstance(exc, imaplib.IMAP4.error) else type(exc).__name__
    return f"{name}: {text}" if text else name


def _next_step(exc: BaseException) -> str:
    """What an operator does about the common causes, appended to the error."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return " (a self-signed or private CA? set the account's ca_file, docs/email.md)"
    if isinstance(exc, imaplib.IMAP4.error) and "AUTHENTICATIONFAILED" in str(exc).upper():
        return " (check username and password; Gmail, Fastmail and iCloud need an app password)"
    return ""


class ImapSession:
    """One logged-in, read-only connection to an account's mailbox; use as a context manager."""

    def __init__(self, account: EmailAccountConfig, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.account = account
        self.timeout = timeout
        self._conn: imaplib.IMAP4 | None = None

    def __enter__(self) -> ImapSession:
        step = "connecting to"
        try:
            self._conn = self._connect()
            step = "login to"
            self._login(self._conn)
        except (imaplib.IMAP4.error, OSError, EOFError, ValueError) as exc:
            self.close()
            raise ImapError(
                f"{step} {self._where()} failed: {_describe(exc)}{_next_step(exc)}"
            ) from None
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _login(self, conn: imaplib.IMAP4) -> None:
        user = self.account.username
        password = self.account.password.get_secret_value() if self.account.password else ""
        if (user + password).isascii():
            conn.login(user, password)
            return
        # LOGIN is ASCII-only in imaplib; SASL PLAIN carries UTF-8 credentials.
        credentials = f"\0{user}\0{password}".encode()
        conn.authenticate("PLAIN", lambda _challenge: credentials)

    def _where(self) -> str:
        return f"{self.account.host}:{self.account.imap_port} ({self.account.security})"

    def _connect(self) -> imaplib.IMAP4:
        host, port = self.account.host, self.account.imap_port
        if self.account.security == "tls":
            return imaplib.IMAP4_SSL(
                host, port, ssl_context=ssl_context(self.account), timeout=self.timeout
            )
        conn = imaplib.IMAP4(host, port, timeout=self.timeout)
        if self.account.security == "starttls":
            conn.starttls(ssl_context=ssl_context(self.account))
        return conn

    @property
    def conn(self) -> imaplib.IMAP4:
        """The imaplib connection; only valid inside ``with``."""
        if self._conn is None:
            raise ImapError("IMAP session is not open")
        return self._conn

    def close(self) -> None:
        """Log out, ignoring errors: the connection may already be gone."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        # Logging out of a broken connection fails; that cannot matter to the check.
        with contextlib.suppress(Exception):
            conn.logout()

    def _check(self, typ: str, data: list[object], what: str) -> None:
        if typ != "OK":
            detail = b" ".join(d for d in data if isinstance(d, bytes)).decode("utf-8", "replace")
            raise ImapError(f"{what} on {self._where()} failed: {typ} {detail}".strip())

    def examine(self) -> MailboxState:
        """Open the account's mailbox read-only and read its UIDVALIDITY."""
        try:
            typ, data = self.conn.select(quote_mailbox(self.account.mailbox), readonly=True)
            self._check(typ, list(data), f"EXAMINE {self.account.mailbox!r}")
            _, validity = self.conn.response("UIDVALIDITY")
        except (imaplib.IMAP4.error, OSError, EOFError) as exc:
            raise ImapError(f"EXAMINE on {self._where()} failed: {_describe(exc)}") from None
        if not validity or not isinstance(validity[0], bytes):
            raise ImapError(f"{self._where()} reported no UIDVALIDITY")
        exists = data[0] if data and isinstance(data[0], bytes) else b"0"
        return MailboxState(uidvalidity=int(validity[0]), exists=int(exists or b"0"))

    def refs_above(self, last_uid: int) -> list[MessageRef]:
        """UIDs and sizes of every message with a UID above ``last_uid``, in UID order."""
        try:
            typ, data = self.conn.uid(
                "FETCH", f"{last_uid + 1}:*", "(UID RFC822.SIZE INTERNALDATE)"
            )
            self._check(typ, list(data), "UID FETCH")
        except (imaplib.IMAP4.error, OSError, EOFError) as exc:
            raise ImapError(f"UID FETCH on {self._where()} failed: {_describe(exc)}") from None
        refs: dict[int, MessageRef] = {}
        for line in data:
            text = line[0] if isinstance(line, tuple) else line
            if not isinstance(text, bytes):
                continue
            uid, size, date = _UID.search(text), _SIZE.search(text), _INTERNALDATE.search(text)
            # "N:*" matches the highest message even when its UID is below N (RFC 3501).
            if uid and int(uid.group(1)) > last_uid:
                refs[int(uid.group(1))] = MessageRef(
                    uid=int(uid.group(1)),
                    size=int(size.group(1)) if size else 0,
                    internal_date=parse_internaldate(date.group(1)) if date else None,
                )
        return [refs[uid] for uid in sorted(refs)]

    def fetch(self, uids: list[int], *, headers_only: bool = False) -> list[FetchedMessage]:
        """Messages (``BODY.PEEK``, never marking them read) and INTERNALDATE of ``uids``.

        ``headers_only`` fetches just the header block (for mail that is only recorded as seen).
        """
        if not uids:
            return []
        section = "BODY.PEEK[HEADER]" if headers_only else "BODY.PEEK[]"
        try:
            typ, data = self.conn.uid(
                "FETCH", ",".join(map(str, uids)), f"(UID INTERNALDATE {section})"
            )
            self._check(typ, list(data), "UID FETCH")
        except (imaplib.IMAP4.error, OSError, EOFError) as exc:
            raise ImapError(f"UID FETCH on {self._where()} failed: {_describe(exc)}") from None
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
            found[int(uid.group(1))] = FetchedMessage(
                uid=int(uid.group(1)),
                internal_date=parse_internaldate(date.group(1)) if date else None,
                raw=raw,
            )
        missing = [uid for uid in uids if uid not in found]
        if missing:
            # Never skip silently (Sokratos hazard 2): the check stops before these UIDs.
            raise ImapError(f"UID FETCH on {self._where()} returned no body for UIDs {missing}")
        return [found[uid] for uid in uids]

    def batches(
        self, refs: list[MessageRef], *, headers_only: bool = False
    ) -> Iterator[list[FetchedMessage]]:
        """Fetch ``refs`` in order, in batches bounded by count and by bytes."""
        batch: list[int] = []
        size = 0
        for ref in refs:
            if batch and (len(batch) >= BATCH_MESSAGES or size + ref.size > BATCH_BYTES):
                yield self.fetch(batch, headers_only=headers_only)
                batch, size = [], 0
            batch.append(ref.uid)
            size += 0 if headers_only else ref.size
        if batch:
            yield self.fetch(batch, headers_only=headers_only)
