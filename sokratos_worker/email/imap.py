"""A read-only IMAP session with :mod:`imaplib`: connect, log in, EXAMINE, fetch by UID.

Nothing here can change a mailbox: the folder is opened with EXAMINE and bodies are fetched
with ``BODY.PEEK[]``, so a check never sets ``\\Seen``. Every imaplib, socket and TLS error
is translated into :class:`ImapError`, whose message never contains the password.

A session has a deadline besides the per-read timeout: a server that sends a byte every few
seconds never trips the timeout of one read, so a :class:`SessionWatch` shuts the socket down
when the session's time is up (or the worker stops, :class:`OpenSessions`) and the blocked read
returns at once.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import imaplib
import re
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any, Literal

import structlog

from sokratos_worker.config import EmailAccountConfig
from sokratos_worker.errors import WorkerError

log = structlog.get_logger(__name__)

DEFAULT_TIMEOUT_S = 30.0
# How often a name lookup in progress checks whether its session was cut.
LOOKUP_POLL_S = 0.1
# Without a deadline of its own, a session may last this many read timeouts in all.
DEFAULT_DEADLINE_READ_TIMEOUTS = 4
# Bounded batches: at most this many messages, or this many bytes, per UID FETCH.
BATCH_MESSAGES = 50
BATCH_BYTES = 20 * 1024 * 1024
# A message is read up to this many bytes (a partial FETCH): triage uses 2000 bytes of its
# text, and a 54 MB message read and parsed whole cost the worker about 240 MB of memory.
MESSAGE_BYTES_LIMIT = 16 * 1024 * 1024
# A header block read only to compute a message's key (the restore check's fallback for mail
# recorded without its size and arrival date) is read up to this many bytes.
HEADER_BYTES_LIMIT = 64 * 1024
# Without ESEARCH, the highest UID at or below a checkpoint is searched for in this many UIDs
# below it first, then in windows WINDOW_GROWTH times as wide: an answer lists at most the UIDs
# of one window, not every UID of the mailbox.
SEARCH_WINDOW = 1000
SEARCH_WINDOW_GROWTH = 16

# A plain-IMAP server greets at once; one silent this long is asked whether it speaks TLS
# (an implicit-TLS port never greets a client that does not start TLS first).
GREETING_PATIENCE_S = 3.0

# OpenSSL verify codes (X509_V_ERR_*): a trusted certificate for other names than the host,
# an issuer missing from the trust store, an expired certificate.
_NAME_MISMATCH = frozenset({62, 64})
_UNKNOWN_ISSUER = frozenset({2, 18, 19, 20, 21})
_EXPIRED = 10
# OpenSSL's reasons when a TLS client gets plain text back (a plain-IMAP greeting).
_NOT_TLS = frozenset(
    {"WRONG_VERSION_NUMBER", "UNKNOWN_PROTOCOL", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"}
)

_UID = re.compile(rb"\bUID (\d+)")
_SIZE = re.compile(rb"\bRFC822\.SIZE (\d+)")
_INTERNALDATE = re.compile(rb'\bINTERNALDATE "([^"]+)"')
_ESEARCH_MAX = re.compile(rb"\bMAX (\d+)", re.IGNORECASE)
# RFC 5530 response codes that describe the server's state, not one message's.
_TEMPORARY = re.compile(r"\[(UNAVAILABLE|INUSE|LIMIT|OVERQUOTA)\b", re.IGNORECASE)


class ImapError(WorkerError):
    """Connecting, TLS, logging in or talking to one account's server failed."""


class ImapRefused(ImapError):
    """The server refused a UID FETCH (NO, or BYE and a closed connection) without the network
    failing: a message it cannot return (a damaged mail store). ``answer`` is its reply."""

    def __init__(self, message: str, answer: str) -> None:
        super().__init__(message)
        self.answer = answer


class NoGreeting(TimeoutError):
    """The server accepted the connection but sent no IMAP greeting; the text says why."""


class ImapAborted(ImapError):
    """The worker is stopping: the session was cut short (the account's fault it is not)."""


CutReason = Literal["deadline", "stopping"]


def _shut_down(sock: socket.socket) -> None:
    """Shut the socket down so a read blocked on it in another thread returns at once."""
    # The plain socket's shutdown, not SSLSocket's, which also drops the TLS state under the
    # reading thread; a socket already closed or detached has nothing left to cut.
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


class SessionWatch:
    """Cuts one session's connection when its deadline passes or the worker stops."""

    def __init__(self, deadline_s: float) -> None:
        self.cut_reason: CutReason | None = None
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._timer = threading.Timer(deadline_s, self.cut, args=("deadline",))
        self._timer.daemon = True  # a timer left running never holds the process at exit

    def start(self) -> None:
        """Start counting down the deadline."""
        self._timer.start()

    def watch(self, sock: socket.socket) -> None:
        """The socket the session reads from now on; cut at once if the session already is."""
        with self._lock:
            self._socket = sock
            if self.cut_reason is not None:
                _shut_down(sock)

    def cut(self, reason: CutReason) -> None:
        """Shut the watched socket down (and any watched later); the first reason stays."""
        with self._lock:
            if self.cut_reason is None:
                self.cut_reason = reason
            if self._socket is not None:
                _shut_down(self._socket)

    def end(self) -> None:
        """The session is closed: stop the timer and forget the socket."""
        self._timer.cancel()
        with self._lock:
            self._socket = None

    def tls_socket_class(self) -> type[ssl.SSLSocket]:
        """An SSLSocket class that is watched from its handshake on (a server can trickle that)."""
        watch = self

        class WatchedSSLSocket(ssl.SSLSocket):
            def do_handshake(self, block: bool = False) -> None:
                # wrap_socket returns the socket only after the handshake: watch it from here.
                watch.watch(self)
                super().do_handshake(block)

        return WatchedSSLSocket


class OpenSessions:
    """The IMAP sessions open in one process, so that stopping it can cut them all at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watches: set[SessionWatch] = set()
        self._stopping = False

    @property
    def stopping(self) -> bool:
        """True once :meth:`cut_all` ran: every session opened after it is cut at once."""
        return self._stopping

    def add(self, watch: SessionWatch) -> None:
        """Track an opening session (cut at once when the process is stopping)."""
        with self._lock:
            self._watches.add(watch)
            stopping = self._stopping
        if stopping:
            watch.cut("stopping")

    def discard(self, watch: SessionWatch) -> None:
        """Forget a closed session."""
        with self._lock:
            self._watches.discard(watch)

    def cut_all(self) -> int:
        """Cut every open session, and every one opened later; returns how many were open."""
        with self._lock:
            self._stopping = True
            watches = list(self._watches)
        for watch in watches:
            watch.cut("stopping")
        return len(watches)


SocketOpener = Callable[[], socket.socket]


class _WatchedIMAP4(imaplib.IMAP4):
    """imaplib's plaintext client on a socket the session opened (and watches)."""

    def __init__(self, host: str, port: int, timeout: float, opener: SocketOpener) -> None:
        self._opener = opener
        super().__init__(host, port, timeout)

    def _create_socket(self, timeout: float | None) -> socket.socket:
        return self._opener()


class _WatchedIMAP4SSL(imaplib.IMAP4_SSL):
    """imaplib's implicit-TLS client on a socket the session opened (and watches)."""

    def __init__(
        self, host: str, port: int, context: ssl.SSLContext, timeout: float, opener: SocketOpener
    ) -> None:
        self._opener = opener
        super().__init__(host, port, ssl_context=context, timeout=timeout)

    def _create_socket(self, timeout: float | None) -> socket.socket:
        sock: socket.socket = self.ssl_context.wrap_socket(
            self._opener(), server_hostname=self.host
        )
        return sock


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
    """A message whose single UID FETCH the server refused; ``answer`` is the server's reply."""

    uid: int
    answer: str


def plan_batches(refs: list[MessageRef], *, headers_only: bool = False) -> Iterator[list[int]]:
    """The UIDs of ``refs`` in order, in batches bounded by count and by bytes."""
    batch: list[int] = []
    size = 0
    for ref in refs:
        if batch and (len(batch) >= BATCH_MESSAGES or size + ref.size > BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(ref.uid)
        size += 0 if headers_only else min(ref.size, MESSAGE_BYTES_LIMIT)
    if batch:
        yield batch


def _fetched(data: list[Any]) -> dict[int, FetchedMessage]:
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


def _listed(data: list[Any]) -> Iterator[MessageRef]:
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


def _answer(data: list[Any]) -> str:
    """A server's reply text (bytes joined and decoded)."""
    return b" ".join(d for d in data if isinstance(d, bytes)).decode("utf-8", "replace").strip()


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
    if isinstance(exc, NoGreeting):
        return text  # it says what happened in words: no class name needed
    # imaplib's own exception classes are all called "error": name them by what they are.
    name = "IMAP error" if isinstance(exc, imaplib.IMAP4.error) else type(exc).__name__
    return f"{name}: {text}" if text else name


def _certificate_step(
    exc: ssl.SSLCertVerificationError, account: EmailAccountConfig, names: tuple[str, ...]
) -> str:
    """What to do about a certificate the client refused, by OpenSSL's verify code."""
    code = exc.verify_code
    if code in _NAME_MISMATCH:
        covered = f"only for {', '.join(names)}" if names else "for other names"
        return (
            f" (the server's certificate is from a trusted issuer but {covered}, not"
            f" {account.host}: set the account's host to a name the certificate covers, or"
            f" have the server's certificate issued for {account.host}; ca_file is not the cause)"
        )
    if code == _EXPIRED:
        return " (the server's certificate has expired: ask the server's operator to renew it)"
    if code not in _UNKNOWN_ISSUER and code is not None:
        return ""
    if account.ca_file:
        return (
            f" (the account's ca_file {account.ca_file} does not hold the CA that issued the"
            " server's certificate: put that CA's certificate there, docs/email.md)"
        )
    return " (a self-signed or private CA? set the account's ca_file, docs/email.md)"


def _next_step(exc: BaseException, account: EmailAccountConfig, names: tuple[str, ...] = ()) -> str:
    """What an operator does about the common causes, appended to the error.

    ``names`` are the names the server's certificate covers, when a name mismatch was read.
    """
    if isinstance(exc, ssl.SSLCertVerificationError):
        return _certificate_step(exc, account, names)
    if isinstance(exc, ssl.SSLError) and account.security == "tls" and exc.reason in _NOT_TLS:
        return (
            f" (the server did not answer TLS: port {account.imap_port} probably speaks plain"
            ' IMAP; set security "starttls" for this port, or use port 993 with "tls")'
        )
    if isinstance(exc, imaplib.IMAP4.error) and "AUTHENTICATIONFAILED" in str(exc).upper():
        return " (check username and password; Gmail, Fastmail and iCloud need an app password)"
    return ""


def _certificate_names(cert: dict[str, Any]) -> tuple[str, ...]:
    """The DNS names and IP addresses a parsed certificate covers (its CN without them)."""
    alt = [value for kind, value in cert.get("subjectAltName", ()) if kind in ("DNS", "IP Address")]
    if alt:
        return tuple(alt)
    return tuple(v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName")


def _peek(sock: socket.socket, wait_s: float) -> bool:
    """True when the server sent something (or closed) within ``wait_s``; nothing is consumed."""
    sock.settimeout(max(wait_s, 0.001))
    try:
        sock.recv(1, socket.MSG_PEEK)
    except TimeoutError:
        return False
    except OSError:
        return True  # the read that follows reports it
    return True


class _TlsProbe:
    """Asks a second connection to ``address`` whether the port answers a TLS handshake,
    without blocking: the caller waits on :meth:`wants` together with other sockets and calls
    :meth:`step` when one of them is ready. ``answer`` is None until it is known."""

    def __init__(self, address: Any, family: int) -> None:
        self.answer: bool | None = None
        self._tls: ssl.SSLSocket | None = None
        self._raw = socket.socket(family, socket.SOCK_STREAM)
        self._raw.setblocking(False)
        self._connected = False
        self._want_write = True
        try:
            code = self._raw.connect_ex(address)
        except OSError:
            self._finish(False)
            return
        if code not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
            self._finish(False)

    def wants(self) -> tuple[list[socket.socket], list[socket.socket]]:
        """The sockets to wait on: ``(readable, writable)``; empty once the answer is known."""
        if self.answer is not None:
            return [], []
        sock = self._tls or self._raw  # wrapping takes the raw socket's descriptor over
        return ([], [sock]) if self._want_write else ([sock], [])

    def step(self) -> None:
        """Go on with connecting or the handshake as far as it goes without blocking."""
        if self.answer is not None:
            return
        try:
            if not self._connected:
                error = self._raw.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if error:
                    self._finish(False)
                    return
                self._connected = True
                context = ssl.create_default_context()
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE  # only whether TLS comes back matters
                self._tls = context.wrap_socket(self._raw, do_handshake_on_connect=False)
            assert self._tls is not None  # noqa: S101 - set on connecting
            self._tls.do_handshake()
            self._finish(True)
        except ssl.SSLWantReadError:
            self._want_write = False
        except ssl.SSLWantWriteError:
            self._want_write = True
        except ssl.SSLError as exc:
            # A TLS server refusing this client still speaks TLS.
            self._finish("ALERT" in (exc.reason or ""))
        except OSError:
            self._finish(False)

    def _finish(self, answer: bool) -> None:
        self.answer = answer
        self.close()

    def close(self) -> None:
        """Drop the probe's connection (its answer, if known, stays)."""
        for sock in (self._tls, self._raw):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()


class ImapSession:
    """One logged-in, read-only connection to an account's mailbox; use as a context manager.

    ``timeout`` bounds each socket read; ``deadline`` (default: a few read timeouts) bounds
    the whole session, from connecting to logging out. ``sessions`` tracks it so that a
    stopping worker can cut it.
    """

    def __init__(
        self,
        account: EmailAccountConfig,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        deadline: float | None = None,
        sessions: OpenSessions | None = None,
    ) -> None:
        self.account = account
        self.timeout = timeout
        self.deadline = deadline or DEFAULT_DEADLINE_READ_TIMEOUTS * timeout
        self._sessions = sessions if sessions is not None else OpenSessions()
        self._watch = SessionWatch(self.deadline)
        self._conn: imaplib.IMAP4 | None = None
        self._state: MailboxState | None = None
        self._logged_in_capabilities: frozenset[str] | None = None

    def __enter__(self) -> ImapSession:
        self._sessions.add(self._watch)
        self._watch.start()
        if self._watch.cut_reason is not None:
            self.close()
            raise ImapAborted(f"not connecting to {self._where()}: the worker is stopping")
        try:
            self._open()
        except ImapError:
            self.close()
            raise
        return self

    def _open(self) -> None:
        """Connect, upgrade to TLS when configured, and log in."""
        step = "connecting to"
        try:
            self._conn = self._connect()
            if self.account.security == "starttls":
                step = "STARTTLS with"
                self._conn.starttls(ssl_context=self._ssl_context())
            step = "login to"
            self._login(self._conn)
        except (imaplib.IMAP4.error, OSError, EOFError, ValueError) as exc:
            raise self._failure(f"{step} {self._where()} failed", exc) from None

    def _reopen(self) -> None:
        """A new connection after the server closed this one, on the same mailbox epoch."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._log_out(conn)
        epoch = self._state
        self._open()
        state = self.examine()
        if epoch is not None and state.uidvalidity != epoch.uidvalidity:
            raise ImapError(
                f"{self._where()}: UIDVALIDITY changed from {epoch.uidvalidity} to"
                f" {state.uidvalidity} while reconnecting; the next check reads the mailbox again"
            )

    def _failure(self, what: str, exc: BaseException) -> ImapError:
        """The error to raise for ``exc``; a cut session says why it was cut instead."""
        if self._watch.cut_reason == "stopping":
            return ImapAborted(f"{what}: cut short because the worker is stopping")
        if self._watch.cut_reason == "deadline":
            return ImapError(
                f"{what}: the server answered too slowly: deadline exceeded (connecting,"
                f" TLS, login and every command must end within {self.deadline:g} s; a server"
                " sending a byte at a time never trips the per-read timeout). If it is merely"
                " slow (a large first check over a slow link), raise"
                " SOKRATOS_EMAIL_CHECK_DEADLINE; else ask the server's operator"
            )
        names = self._certificate_names() if _name_mismatch(exc) else ()
        return ImapError(f"{what}: {_describe(exc)}{_next_step(exc, self.account, names)}")

    def _certificate_names(self) -> tuple[str, ...]:
        """The names the server's certificate covers, read over a second connection that checks
        all but the name; empty when that fails too."""
        context = ssl_context(self.account)
        context.check_hostname = False
        host, port = self.account.host, self.account.imap_port
        conn: imaplib.IMAP4 | None = None
        try:
            if self.account.security == "tls":
                conn = _WatchedIMAP4SSL(host, port, context, self.timeout, self._open_socket)
            else:
                conn = _WatchedIMAP4(host, port, self.timeout, self._open_socket)
                conn.starttls(ssl_context=context)
            cert = conn.sock.getpeercert() if isinstance(conn.sock, ssl.SSLSocket) else None
        except (imaplib.IMAP4.error, OSError, EOFError, ValueError):
            return ()
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.shutdown()
        return _certificate_names(cert) if cert else ()

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

    def _ssl_context(self) -> ssl.SSLContext:
        context = ssl_context(self.account)
        context.sslsocket_class = self._watch.tls_socket_class()
        return context

    def _connect(self) -> imaplib.IMAP4:
        """Connected and greeted; watched from the name lookup on."""
        host, port = self.account.host, self.account.imap_port
        if self.account.security == "tls":
            return _WatchedIMAP4SSL(
                host, port, self._ssl_context(), self.timeout, self._open_socket
            )
        return _WatchedIMAP4(host, port, self.timeout, self._open_greeted_socket)

    def _open_greeted_socket(self) -> socket.socket:
        """A TCP connection on which the server's greeting has begun to arrive."""
        sock = self._open_socket()
        try:
            self._await_greeting(sock)
        except BaseException:
            # Raised before imaplib holds the socket, so its cleanup cannot close it.
            sock.close()
            raise
        sock.settimeout(self.timeout)
        return sock

    def _await_greeting(self, sock: socket.socket) -> None:
        """Wait up to the read timeout for the greeting; raise :class:`NoGreeting` without it.

        A server silent past GREETING_PATIENCE_S is asked over a second connection whether it
        speaks TLS, while the first one is still waited on: a greeting that comes within the
        read timeout wins (a slow server, or a port shared by IMAP and IMAPS that answers TLS
        to a TLS client and greets plain-IMAP clients late), and the probe is dropped at once.
        Its answer only says, when no greeting came, that the port expects TLS.
        """
        started = time.monotonic()
        patience = min(GREETING_PATIENCE_S, self.timeout / 2)
        if _peek(sock, patience):
            return
        probe = None if self._watch.cut_reason else _TlsProbe(sock.getpeername(), sock.family)
        try:
            while (left := self.timeout - (time.monotonic() - started)) > 0:
                readable, writable = probe.wants() if probe else ([], [])
                try:
                    ready, ready_w, _ = select.select([sock, *readable], writable, [], left)
                except (OSError, ValueError):
                    if probe is None or sock.fileno() < 0:
                        return  # the socket was closed under us: the read that follows says so
                    probe.close()  # the probe's socket broke: wait for the greeting alone
                    probe = None
                    continue
                if sock in ready:
                    return
                if probe is not None and (ready or ready_w):
                    probe.step()
        finally:
            if probe is not None:
                probe.close()
        if probe is not None and probe.answer:
            raise NoGreeting(
                f"no IMAP greeting within {self.timeout:g} s, and port"
                f" {self.account.imap_port} answers a TLS handshake: it expects TLS at once"
                ' (implicit TLS, usually port 993); set the account\'s security to "tls"'
            )
        raise NoGreeting(
            f"timed out: no IMAP greeting within {self.timeout:g} s; if port"
            f" {self.account.imap_port} expects TLS at once (usually 993), set the account's"
            ' security to "tls", else ask the server\'s operator'
        )

    def _open_socket(self) -> socket.socket:
        """A TCP connection to the account's server, tried address by address; the session's
        watch can cut it from before ``connect`` on."""
        last: OSError | None = None
        for family, kind, proto, _, address in self._look_up():
            sock = socket.socket(family, kind, proto)
            sock.settimeout(self.timeout)
            self._watch.watch(sock)
            try:
                sock.connect(address)
                return sock
            except OSError as exc:
                sock.close()
                last = exc
        raise last or OSError(f"{self.account.host} has no address")

    def _look_up(self) -> list[tuple[Any, ...]]:
        """``getaddrinfo`` on a thread of its own: a resolver that never answers cannot hold
        the check past its read timeout, nor a stop (the lookup is left to end by itself)."""
        host, port = self.account.host, self.account.imap_port
        answer: list[tuple[Any, ...]] = []
        failure: list[Exception] = []
        done = threading.Event()

        def look_up() -> None:
            try:
                answer.extend(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
            except (OSError, ValueError) as exc:  # (ValueError: a name IDNA cannot encode)
                failure.append(exc)
            finally:
                done.set()

        threading.Thread(target=look_up, name="imap-dns", daemon=True).start()
        give_up = time.monotonic() + self.timeout
        while not done.wait(LOOKUP_POLL_S):
            if self._watch.cut_reason is not None:
                raise OSError(f"looking up {host} was cut short")  # (_failure says why)
            if time.monotonic() >= give_up:
                raise TimeoutError(
                    f"looking up {host} (DNS) got no answer within {self.timeout:g} s;"
                    " check the host name and the machine's resolver (/etc/resolv.conf)"
                )
        if failure:
            raise failure[0]
        return answer

    @property
    def conn(self) -> imaplib.IMAP4:
        """The imaplib connection; only valid inside ``with``."""
        if self._conn is None:
            raise ImapError("IMAP session is not open")
        return self._conn

    def close(self) -> None:
        """Log out, ignoring errors: the connection may already be gone."""
        conn, self._conn = self._conn, None
        try:
            if conn is not None:
                self._log_out(conn)
        finally:
            self._watch.end()
            self._sessions.discard(self._watch)

    def _log_out(self, conn: imaplib.IMAP4) -> None:
        # Logging out of a broken connection fails; that cannot matter to the check. A cut one
        # cannot answer, and LOGOUT leaves the socket open when it fails: close it either way.
        if self._watch.cut_reason is None:
            with contextlib.suppress(Exception):
                conn.logout()
        with contextlib.suppress(Exception):
            conn.shutdown()

    def _check(self, typ: str, data: list[object], what: str) -> None:
        if typ != "OK":
            raise ImapError(f"{what} on {self._where()} failed: {typ} {_answer(data)}".strip())

    def _bye(self) -> str | None:
        """The server's BYE text when it closed the connection itself (not a cut session)."""
        if self._watch.cut_reason is not None or self._conn is None:
            return None
        bye = self._conn.untagged_responses.get("BYE")
        return _answer(list(bye)) if bye else None

    def examine(self) -> MailboxState:
        """Open the account's mailbox read-only and read its UIDVALIDITY."""
        try:
            typ, data = self.conn.select(quote_mailbox(self.account.mailbox), readonly=True)
            self._check(typ, list(data), f"EXAMINE {self.account.mailbox!r}")
            _, validity = self.conn.response("UIDVALIDITY")
            _, uidnext = self.conn.response("UIDNEXT")
        except (imaplib.IMAP4.error, OSError, EOFError) as exc:
            raise self._failure(f"EXAMINE on {self._where()} failed", exc) from None
        if not validity or not isinstance(validity[0], bytes):
            raise ImapError(f"{self._where()} reported no UIDVALIDITY")
        exists = data[0] if data and isinstance(data[0], bytes) else b"0"
        self._state = MailboxState(
            uidvalidity=int(validity[0]),
            exists=int(exists or b"0"),
            uidnext=_number(uidnext),
        )
        return self._state

    def refs_from(self, last_uid: int) -> tuple[list[MessageRef], MessageRef | None]:
        """Every message with a UID above ``last_uid`` (in UID order), and the message with the
        highest UID at or below it that the same answer showed (None when it showed none),
        with its RFC822.SIZE and INTERNALDATE.

        One ``UID FETCH last_uid:*``: it returns UID ``last_uid`` when it is still there, and
        the mailbox's highest message even when its UID is below ``last_uid`` (RFC 3501 "n:*"),
        so the check can tell whether the UIDs it already read hold other messages now.
        """
        try:
            typ, data = self.conn.uid(
                "FETCH", f"{max(last_uid, 1)}:*", "(UID RFC822.SIZE INTERNALDATE)"
            )
            self._check(typ, list(data), "UID FETCH")
        except (imaplib.IMAP4.error, OSError, EOFError) as exc:
            raise self._failure(f"UID FETCH on {self._where()} failed", exc) from None
        refs: dict[int, MessageRef] = {}
        at_or_below: MessageRef | None = None
        for ref in _listed(list(data)):
            if ref.uid > last_uid:
                refs[ref.uid] = ref
            elif at_or_below is None or ref.uid > at_or_below.uid:
                at_or_below = ref
        return [refs[uid] for uid in sorted(refs)], at_or_below

    def listed(self, uid: int) -> MessageRef | None:
        """UID ``uid``'s RFC822.SIZE and INTERNALDATE (one small UID FETCH), or None when it
        is not in the mailbox; raises :class:`ImapRefused` when the server refuses it."""
        data = self._uid_fetch([uid], "UID RFC822.SIZE INTERNALDATE")
        return next((ref for ref in _listed(data) if ref.uid == uid), None)

    def header_block(self, uid: int, limit: int = HEADER_BYTES_LIMIT) -> bytes | None:
        """The first ``limit`` bytes of UID ``uid``'s header block (``BODY.PEEK[HEADER]<0.N>``),
        or None when it is not in the mailbox; raises :class:`ImapRefused` when refused."""
        data = self._uid_fetch([uid], f"INTERNALDATE BODY.PEEK[HEADER]<0.{limit}>")
        found = _fetched(data).get(uid)
        return found.raw if found is not None else None

    def _capabilities(self) -> frozenset[str]:
        """The server's capabilities after login (asked once: the greeting's list, which
        imaplib keeps, is often shorter than the logged-in one)."""
        if self._logged_in_capabilities is None:
            try:
                typ, data = self.conn.capability()
                self._check(typ, list(data), "CAPABILITY")
            except (imaplib.IMAP4.error, OSError, EOFError) as exc:
                raise self._failure(f"CAPABILITY on {self._where()} failed", exc) from None
            words = b" ".join(d for d in data if isinstance(d, bytes)).upper().split()
            self._logged_in_capabilities = frozenset(w.decode("ascii", "replace") for w in words)
        return self._logged_in_capabilities

    def highest_uid_up_to(self, last_uid: int) -> int | None:
        """The highest UID at or below ``last_uid`` in the mailbox, or None.

        With ESEARCH (RFC 4731), one ``UID SEARCH RETURN (MAX)``: a single number comes back.
        Without it, UID SEARCH in windows below ``last_uid``, widening until one holds a
        message: an answer lists the UIDs of one window, never every UID of the mailbox.
        """
        if last_uid < 1:
            return None
        if "ESEARCH" in self._capabilities():
            return self._search_max(last_uid)
        top, width = last_uid, SEARCH_WINDOW
        while top >= 1:
            bottom = max(1, top - width + 1)
            found = [n for n in self._search_uids(f"{bottom}:{top}") if bottom <= n <= top]
            if found:
                return max(found)
            top, width = bottom - 1, width * SEARCH_WINDOW_GROWTH
        return None

    def _search_max(self, last_uid: int) -> int | None:
        """``UID SEARCH RETURN (MAX) UID 1:last_uid``: the answer is one ESEARCH line."""
        try:
            self.conn.untagged_responses.pop("ESEARCH", None)
            typ, data = self.conn.uid("SEARCH", "RETURN", "(MAX)", "UID", f"1:{last_uid}")
            self._check(typ, list(data), "UID SEARCH RETURN (MAX)")
            answer = self.conn.untagged_responses.pop("ESEARCH", [])
        except (imaplib.IMAP4.error, OSError, EOFError) as exc:
            raise self._failure(f"UID SEARCH on {self._where()} failed", exc) from None
        for line in answer:
            found = _ESEARCH_MAX.search(line) if isinstance(line, bytes) else None
            if found and int(found.group(1)) <= last_uid:
                return int(found.group(1))
        return None  # no MAX: no message in the range

    def _search_uids(self, uid_set: str) -> list[int]:
        try:
            typ, data = self.conn.uid("SEARCH", "UID", uid_set)
            self._check(typ, list(data), "UID SEARCH")
        except (imaplib.IMAP4.error, OSError, EOFError) as exc:
            raise self._failure(f"UID SEARCH on {self._where()} failed", exc) from None
        return [
            int(n) for line in data if isinstance(line, bytes) for n in line.split() if n.isdigit()
        ]

    def fetch(self, uids: list[int], *, headers_only: bool = False) -> list[FetchedMessage]:
        """Messages (``BODY.PEEK``, never marking them read) and INTERNALDATE of ``uids``.

        ``headers_only`` fetches just the header block (for mail that is only recorded as seen).
        A message expunged since the listing is left out (logged); one that exists but was
        not returned raises :class:`ImapError`, and a refused FETCH :class:`ImapRefused`.
        """
        if not uids:
            return []
        # A partial FETCH returns a smaller message whole (RFC 3501 6.4.5).
        section = (
            "BODY.PEEK[HEADER]"
            if headers_only
            else f"RFC822.SIZE BODY.PEEK[]<0.{MESSAGE_BYTES_LIMIT}>"
        )
        found = _fetched(self._uid_fetch(uids, f"UID INTERNALDATE {section}"))
        missing = [uid for uid in uids if uid not in found]
        if missing:
            self._skip_vanished(missing)
        return [found[uid] for uid in uids if uid in found]

    def _uid_fetch(self, uids: list[int], items: str) -> list[Any]:
        """The raw answer to one UID FETCH of ``items``; raises ImapRefused for a NO or a
        server's BYE."""
        where = f"UID FETCH {_uid_set(uids)} on {self._where()}"
        try:
            typ, data = self.conn.uid("FETCH", _uid_set(uids), f"({items})")
        except (imaplib.IMAP4.error, OSError, EOFError) as exc:
            bye = self._bye()
            if bye is None:
                raise self._failure(f"UID FETCH on {self._where()} failed", exc) from None
            self._reopen()  # the server closed the connection: later messages need a new one
            raise ImapRefused(f"{where} was refused: BYE {bye}", f"BYE {bye}") from None
        if typ == "NO":
            answer = f"NO {_answer(list(data))}".strip()
            if _TEMPORARY.search(answer):
                # The server's state, not this message's (RFC 5530): the check just stops.
                raise ImapError(f"{where} failed for now: {answer}")
            raise ImapRefused(f"{where} was refused: {answer}", answer)
        self._check(typ, list(data), "UID FETCH")
        return list(data)

    def _skip_vanished(self, missing: list[int]) -> None:
        """Log the UIDs expunged since the listing; raise for any the server still has."""
        present = self._existing(missing)
        for uid in missing:
            if uid not in present:
                log.info(
                    "email_message_vanished",
                    account=self.account.name,
                    mailbox=self.account.mailbox,
                    uid=uid,
                )
        unreturned = [uid for uid in missing if uid in present]
        if unreturned:
            # Never skip silently (Sokratos hazard 2): the check stops before these UIDs.
            raise ImapError(
                f"UID FETCH on {self._where()} returned no body for UIDs {unreturned},"
                " which are still in the mailbox"
            )

    def _existing(self, uids: list[int]) -> set[int]:
        """Which of ``uids`` are still in the mailbox (UID SEARCH)."""
        try:
            typ, data = self.conn.uid("SEARCH", "UID", _uid_set(uids))
            self._check(typ, list(data), "UID SEARCH")
        except (imaplib.IMAP4.error, OSError, EOFError) as exc:
            raise self._failure(f"UID SEARCH on {self._where()} failed", exc) from None
        found = {int(n) for line in data if isinstance(line, bytes) for n in line.split()}
        return found & set(uids)

    def fetch_each(
        self, uids: list[int], *, headers_only: bool = False
    ) -> Iterator[FetchedMessage | Refused]:
        """The messages of one batch in UID order; a refused batch is fetched one at a time.

        So one message the server cannot return does not hold back the others: each refused
        single UID is yielded as :class:`Refused` (unless it was expunged meanwhile).
        """
        try:
            messages = self.fetch(uids, headers_only=headers_only)
        except ImapRefused as exc:
            if len(uids) > 1:
                log.warning(
                    "email_batch_refused",
                    account=self.account.name,
                    uids=_uid_set(uids),
                    answer=exc.answer,
                    what_to_do="nothing: fetching its messages one at a time",
                )
                for uid in uids:
                    yield from self.fetch_each([uid], headers_only=headers_only)
            elif uids[0] in self._existing(uids):
                yield Refused(uid=uids[0], answer=exc.answer)
            else:
                self._skip_vanished(uids)
            return
        yield from messages


def _name_mismatch(exc: BaseException) -> bool:
    """A certificate refused only because it is for other names than the account's host."""
    return isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_code in _NAME_MISMATCH


def _number(data: list[Any]) -> int | None:
    """The number in an untagged response code such as ``[UIDNEXT 42]``, if one came."""
    value = data[0] if data else None
    return int(value) if isinstance(value, bytes) and value.strip().isdigit() else None


def _uid_set(uids: list[int]) -> str:
    """An IMAP sequence set of UIDs."""
    return ",".join(map(str, uids))
