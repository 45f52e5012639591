"""A read-only IMAP session with :mod:`imaplib`: connect, log in, EXAMINE, fetch by UID.

Nothing here can change a mailbox: the folder is opened with EXAMINE and bodies are fetched
with ``BODY.PEEK[]``, so a check never sets ``\\Seen``. Every imaplib, socket and TLS error
is translated into :class:`ImapError`, whose message never contains the password.

A session has a deadline besides the per-read timeout: a server that sends a byte every few
seconds never trips the timeout of one read, so a :class:`SessionWatch` shuts the socket down
when the session's time is up (or the worker stops, :class:`OpenSessions`) and the blocked read
returns at once.

The session's helpers live beside it: :mod:`.imap_sessions` (the watches and open-session
tracking for shutdown), :mod:`.imap_hints` (what a connection failure means and what to set)
and :mod:`.imap_answers` (parsing server answers, UID sets and batches). Their public names are
re-exported here, for callers and tests that import them from this module.
"""

from __future__ import annotations

import contextlib
import imaplib
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

import structlog

from sokratos_worker.config import EmailAccountConfig
from sokratos_worker.email.imap_answers import (
    BATCH_BYTES,
    BATCH_MESSAGES,
    ESEARCH_MAX,
    MESSAGE_BYTES_LIMIT,
    FetchedMessage,
    MailboxState,
    MessageRef,
    Refused,
    answer_text,
    encode_mailbox,
    fetched_messages,
    format_uid_set,
    listed_refs,
    parse_internaldate,
    plan_batches,
    quote_mailbox,
    response_number,
    server_state,
)
from sokratos_worker.email.imap_hints import (
    NoGreeting,
    TlsProbe,
    certificate_names,
    describe,
    name_mismatch,
    next_step,
    peek,
)
from sokratos_worker.email.imap_sessions import (
    CutReason,
    OpenSessions,
    SessionWatch,
    WatchedIMAP4,
    WatchedIMAP4SSL,
)
from sokratos_worker.errors import WorkerError

__all__ = [
    "BATCH_BYTES",
    "BATCH_MESSAGES",
    "DEFAULT_DEADLINE_READ_TIMEOUTS",
    "DEFAULT_TIMEOUT_S",
    "GREETING_PATIENCE_S",
    "HEADER_BYTES_LIMIT",
    "LEFT_OUT_ANSWER",
    "LOOKUP_POLL_S",
    "MESSAGE_BYTES_LIMIT",
    "SEARCH_WINDOW",
    "SEARCH_WINDOW_GROWTH",
    "SERVED_TRIES",
    "ConnectionFailed",
    "CutReason",
    "FetchedMessage",
    "ImapAborted",
    "ImapDeadlineExceeded",
    "ImapError",
    "ImapRefused",
    "ImapServerState",
    "ImapSession",
    "MailboxNotOpened",
    "MailboxState",
    "MessageRef",
    "MessagesNotReturned",
    "NoGreeting",
    "OpenSessions",
    "Refused",
    "SessionWatch",
    "UidvalidityChangedWhileReading",
    "encode_mailbox",
    "parse_internaldate",
    "plan_batches",
    "quote_mailbox",
    "ssl_context",
]

log = structlog.get_logger(__name__)

DEFAULT_TIMEOUT_S = 30.0
# How often a name lookup in progress checks whether its session was cut.
LOOKUP_POLL_S = 0.1
# Without a deadline of its own, a session may last this many read timeouts in all.
DEFAULT_DEADLINE_READ_TIMEOUTS = 4
# A header block read only to compute a message's key (old mail on a first check, the restore
# check's fallback for mail recorded without its size and arrival date) is read up to this
# many bytes.
HEADER_BYTES_LIMIT = 64 * 1024
# Without ESEARCH, the highest UID at or below a checkpoint is searched for in this many UIDs
# below it first, then in windows WINDOW_GROWTH times as wide: an answer lists at most the UIDs
# of one window, not every UID of the mailbox.
SEARCH_WINDOW = 1000
# The gaps between listed UIDs one UID SEARCH asks about (a command line of a few kB), and
# the searches one check makes at most (each a round trip out of the check's deadline).
GAP_RANGES_PER_SEARCH = 200
MAX_GAP_SEARCHES = 10
SEARCH_WINDOW_GROWTH = 16

# Messages tried, at most, to see whether a server answering one with its state (RFC 5530)
# returns others: the answer is then that message's.
SERVED_TRIES = 2

# What stands for the server's answer about a message its UID FETCH answer left out.
LEFT_OUT_ANSWER = "OK without it, though UID SEARCH still lists it in the mailbox"

# A plain-IMAP server greets at once; one silent this long is asked whether it speaks TLS
# (an implicit-TLS port never greets a client that does not start TLS first).
GREETING_PATIENCE_S = 3.0


class ImapError(WorkerError):
    """Connecting, TLS, logging in or talking to one account's server failed."""


class ConnectionFailed(ImapError):
    """Connecting, TLS or logging in failed: the account's host, port, security or password
    may be the cause (no other failure's can be)."""


class ImapRefused(ImapError):
    """The server refused a UID FETCH (NO, or BYE and a closed connection) without the network
    failing: a message it cannot return (a damaged mail store). ``answer`` is its reply."""

    def __init__(self, message: str, answer: str) -> None:
        super().__init__(message)
        self.answer = answer


class ImapServerState(ImapError):
    """A UID FETCH answered with the server's own state (an RFC 5530 code, shutting down);
    ``closed`` when it came as a ``BYE`` that closed the connection."""

    def __init__(self, message: str, answer: str, *, closed: bool) -> None:
        super().__init__(message)
        self.answer = answer
        self.closed = closed


class ImapAborted(ImapError):
    """The worker is stopping: the session was cut short (the account's fault it is not)."""


class ImapDeadlineExceeded(ImapError):
    """The session's deadline (SOKRATOS_EMAIL_CHECK_DEADLINE) passed before the server was done."""


class MailboxNotOpened(ImapError):
    """The server refused to EXAMINE the account's mailbox (a folder that does not exist, no
    permission, or its own state); ``answer`` is its reply."""

    def __init__(self, message: str, answer: str) -> None:
        super().__init__(message)
        self.answer = answer


class UidvalidityChangedWhileReading(ImapError):
    """The mailbox had another UIDVALIDITY on a reconnect within one check (it was rebuilt)."""


class MessagesNotReturned(ImapError):
    """A UID FETCH left out a message the mailbox still lists and the server returned no other
    message asked for to compare: its failure, not one message's (nothing is counted)."""


# The accounts whose unverified TLS this process has warned of.
_UNVERIFIED: set[str] = set()


def ssl_context(account: EmailAccountConfig) -> ssl.SSLContext:
    """System trust store, or ``ca_file``; ``tls_verify=false`` turns verification off."""
    context = ssl.create_default_context(cafile=account.ca_file)
    if not account.tls_verify and account.security != "none" and account.name not in _UNVERIFIED:
        _UNVERIFIED.add(account.name)  # said once per process, as for an LLM backend
        log.warning(
            "tls_verification_disabled",
            account=account.name,
            hint="tls_verify is false: the server's certificate is not checked, so the password"
            " goes to whoever answers; set a ca_file instead for a private CA",
        )
    if not account.tls_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def _gaps(last_uid: int, listed: list[int]) -> list[tuple[int, int]]:
    """The UID ranges above ``last_uid`` and below the highest of ``listed`` (ascending) that
    the listing did not show: where a message it left out can be."""
    gaps, previous = [], last_uid
    for uid in listed:
        if uid > previous + 1:
            gaps.append((previous + 1, uid - 1))
        previous = max(previous, uid)
    return gaps


def _quoted(text: str) -> str:
    """``text`` as an IMAP quoted string (RFC 3501: backslash and double quote escaped)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


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
        # The last UID returned in this session, by headers_only: proof the server serves.
        self._served: dict[bool, int] = {}
        # The message at or below the checkpoint the listing showed: returned by an earlier
        # check, so the proof the server serves when this one has returned none yet.
        self._read_before: int | None = None

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
            raise self._failure(f"{step} {self._where()} failed", exc, ConnectionFailed) from None

    def _reopen(self) -> None:
        """A new connection after the server closed this one, on the same mailbox epoch."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._log_out(conn)
        epoch = self._state
        self._open()
        state = self.examine()
        if epoch is not None and state.uidvalidity != epoch.uidvalidity:
            raise UidvalidityChangedWhileReading(
                f"{self._where()}: UIDVALIDITY changed from {epoch.uidvalidity} to"
                f" {state.uidvalidity} while reconnecting; the next check reads the mailbox again"
            )

    def _failure(
        self, what: str, exc: BaseException, kind: type[ImapError] = ImapError
    ) -> ImapError:
        """The error to raise for ``exc`` (a ``kind``); a cut session says why it was cut."""
        if self._watch.cut_reason == "stopping":
            return ImapAborted(f"{what}: cut short because the worker is stopping")
        if self._watch.cut_reason == "deadline":
            return ImapDeadlineExceeded(
                f"{what}: the server answered too slowly: deadline exceeded (connecting,"
                f" TLS, login and every command must end within {self.deadline:g} s; a server"
                " sending a byte at a time never trips the per-read timeout). If it is merely"
                " slow (a large first check over a slow link), raise"
                " SOKRATOS_EMAIL_CHECK_DEADLINE; else ask the server's operator"
            )
        names = self._certificate_names() if name_mismatch(exc) else ()
        return kind(f"{what}: {describe(exc)}{next_step(exc, self.account, names)}")

    def _certificate_names(self) -> tuple[str, ...]:
        """The names the server's certificate covers, read over a second connection that checks
        all but the name; empty when that fails too."""
        context = ssl_context(self.account)
        context.check_hostname = False
        host, port = self.account.host, self.account.imap_port
        conn: imaplib.IMAP4 | None = None
        try:
            if self.account.security == "tls":
                conn = WatchedIMAP4SSL(host, port, context, self.timeout, self._open_socket)
            else:
                conn = WatchedIMAP4(host, port, self.timeout, self._open_socket)
                conn.starttls(ssl_context=context)
            cert = conn.sock.getpeercert() if isinstance(conn.sock, ssl.SSLSocket) else None
        except (imaplib.IMAP4.error, OSError, EOFError, ValueError):
            return ()
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.shutdown()
        return certificate_names(cert) if cert else ()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None and not issubclass(exc_type, Exception):
            # A stop (SIGTERM, Ctrl-C) ends the command now: a LOGOUT to a server that stalled
            # would wait out the whole deadline first (60 s for `check`).
            self._watch.cut("stopping")
        self.close()

    def _login(self, conn: imaplib.IMAP4) -> None:
        user = self.account.username
        password = self.account.password.get_secret_value() if self.account.password else ""
        both = user + password
        if both.isascii() and not any(c in both for c in "\r\n\0"):
            # imaplib quotes the password only: a DOMAIN\user or a name with a space went bare.
            conn.login(_quoted(user), password)
            return
        # LOGIN is ASCII-only in imaplib, and a quoted string holds no line break; SASL PLAIN
        # carries UTF-8 credentials, line breaks included.
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
            return WatchedIMAP4SSL(host, port, self._ssl_context(), self.timeout, self._open_socket)
        return WatchedIMAP4(host, port, self.timeout, self._open_greeted_socket)

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
        if peek(sock, patience):
            return
        probe = None if self._watch.cut_reason else TlsProbe(sock.getpeername(), sock.family)
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
            raise ImapError(f"{what} on {self._where()} failed: {typ} {answer_text(data)}".strip())

    def _bye(self) -> str | None:
        """The server's BYE text when it closed the connection itself (not a cut session)."""
        if self._watch.cut_reason is not None or self._conn is None:
            return None
        bye = self._conn.untagged_responses.get("BYE")
        return answer_text(list(bye)) if bye else None

    def examine(self) -> MailboxState:
        """Open the account's mailbox read-only and read its UIDVALIDITY."""
        try:
            typ, data = self.conn.select(quote_mailbox(self.account.mailbox), readonly=True)
            self._check_examined(typ, list(data))
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
            uidnext=response_number(uidnext),
        )
        return self._state

    def _check_examined(self, typ: str, data: list[object]) -> None:
        """Raise :class:`MailboxNotOpened` with the server's answer when EXAMINE was refused."""
        if typ != "OK":
            answer = f"{typ} {answer_text(data)}".strip()
            raise MailboxNotOpened(
                f"EXAMINE {self.account.mailbox!r} on {self._where()} failed: {answer}", answer
            )

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
        for ref in listed_refs(list(data)):
            if ref.uid > last_uid:
                refs[ref.uid] = ref
            elif at_or_below is None or ref.uid > at_or_below.uid:
                at_or_below = ref
        self._read_before = at_or_below.uid if at_or_below is not None else None
        return [refs[uid] for uid in sorted(refs)], at_or_below

    def with_unlisted(self, last_uid: int, refs: list[MessageRef]) -> list[MessageRef]:
        """``refs`` and, in UID order among them, the messages the listing left out (below
        the highest UID it showed) while ``UID SEARCH`` finds them: fetched like the others
        (their own fetch's size and arrival date recorded), so none is passed in silence.

        Only the gaps between the listed UIDs are searched, so the answer names the messages
        left out and nothing else (an unbounded ``last_uid+1:*`` named every new UID on one
        line, past imaplib's 1 MB limit on a first check of ~160,000 messages); listed UIDs
        without gaps, or no new mail at all (a quiet check), cost no command. At most
        MAX_GAP_SEARCHES commands per check: the listed mail above the gaps left unsearched
        waits for the next check (the checkpoint never passes an unsearched gap). A message
        left out above the highest listed UID waits above the checkpoint for a listing that
        shows another.
        """
        found: set[int] = set()
        gaps = _gaps(last_uid, [ref.uid for ref in refs])
        for searches, start in enumerate(range(0, len(gaps), GAP_RANGES_PER_SEARCH)):
            if searches == MAX_GAP_SEARCHES:  # (a sparse mailbox's first check)
                refs = [ref for ref in refs if ref.uid < gaps[start][0]]
                break
            uid_set = ",".join(
                f"{lo}:{hi}" if lo < hi else str(lo)
                for lo, hi in gaps[start : start + GAP_RANGES_PER_SEARCH]
            )
            found.update(self._search_uids(uid_set))
        found = {uid for uid in found if last_uid < uid < refs[-1].uid} - {r.uid for r in refs}
        for uid in sorted(found):
            log.warning(
                "email_message_unlisted",
                account=self.account.name,
                mailbox=self.account.mailbox,
                uid=uid,
                what_to_do="nothing: the server's listing left it out while UID SEARCH finds"
                " it, so it is fetched with the others (if the server leaves it out of that"
                " answer too, it is counted as a message left out)",
            )
        # Of unknown size (batched as the largest) and date (its fetch's decides old from new).
        added = [MessageRef(uid=uid, size=0, unlisted=True) for uid in found]
        return sorted([*refs, *added], key=lambda ref: ref.uid)

    def listed(self, uid: int) -> MessageRef | None:
        """UID ``uid``'s RFC822.SIZE and INTERNALDATE (one small UID FETCH), or None when it
        is not in the mailbox; raises :class:`ImapRefused` when the server refuses it."""
        data = self._uid_fetch([uid], "UID RFC822.SIZE INTERNALDATE")
        return next((ref for ref in listed_refs(data) if ref.uid == uid), None)

    def header_block(self, uid: int, limit: int = HEADER_BYTES_LIMIT) -> bytes | None:
        """The first ``limit`` bytes of UID ``uid``'s header block (``BODY.PEEK[HEADER]<0.N>``),
        or None when it is not in the mailbox; raises :class:`ImapRefused` when refused."""
        data = self._uid_fetch([uid], f"INTERNALDATE BODY.PEEK[HEADER]<0.{limit}>")
        found = fetched_messages(data).get(uid)
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
            found = ESEARCH_MAX.search(line) if isinstance(line, bytes) else None
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
        """Messages (``BODY.PEEK``, never marking them read) and INTERNALDATE of ``uids``, in
        UID order: those the server returned (:meth:`fetch_each` tells a message left out from
        one expunged since the listing).

        ``headers_only`` fetches just the header block (for mail that is only recorded as seen),
        up to HEADER_BYTES_LIMIT bytes: a header block of that size was cut (the caller fetches
        the message whole instead). A refused FETCH raises :class:`ImapRefused`.
        """
        if not uids:
            return []
        # A partial FETCH returns a smaller message whole (RFC 3501 6.4.5). A header block has
        # no bound of its own: a malformed message without a blank line is all header block.
        section = (
            f"BODY.PEEK[HEADER]<0.{HEADER_BYTES_LIMIT}>"
            if headers_only
            else f"RFC822.SIZE BODY.PEEK[]<0.{MESSAGE_BYTES_LIMIT}>"
        )
        found = fetched_messages(self._uid_fetch(uids, f"UID INTERNALDATE {section}"))
        if found:
            self._served[headers_only] = max(found)
        return [found[uid] for uid in uids if uid in found]

    def _uid_fetch(self, uids: list[int], items: str) -> list[Any]:
        """The raw answer to one UID FETCH of ``items``; raises ImapRefused for a NO or a
        server's BYE, or plain ImapError when the answer is the server's state (server_state)."""
        where = f"UID FETCH {format_uid_set(uids)} on {self._where()}"
        try:
            typ, data = self.conn.uid("FETCH", format_uid_set(uids), f"({items})")
        except (imaplib.IMAP4.error, OSError, EOFError) as exc:
            bye = self._bye()
            if bye is None:
                raise self._failure(f"UID FETCH on {self._where()} failed", exc) from None
            if server_state(bye):
                # The server going away, or this message (fetch_each tells which).
                raise ImapServerState(
                    f"{where} failed for now: BYE {bye}", f"BYE {bye}", closed=True
                ) from None
            self._reopen()  # the server closed the connection: later messages need a new one
            raise ImapRefused(f"{where} was refused: BYE {bye}", f"BYE {bye}") from None
        if typ == "NO":
            answer = f"NO {answer_text(list(data))}".strip()
            if server_state(answer):
                # The server's state (RFC 5530), or this message (fetch_each tells which).
                raise ImapServerState(f"{where} failed for now: {answer}", answer, closed=False)
            raise ImapRefused(f"{where} was refused: {answer}", answer)
        self._check(typ, list(data), "UID FETCH")
        return list(data)

    def _still_there(self, missing: list[int]) -> list[int]:
        """Of ``missing``, those the server still has; logs those expunged since the listing."""
        present = self._existing(missing)
        for uid in missing:
            if uid not in present:
                log.info(
                    "email_message_vanished",
                    account=self.account.name,
                    mailbox=self.account.mailbox,
                    uid=uid,
                )
        return [uid for uid in missing if uid in present]

    def _existing(self, uids: list[int]) -> set[int]:
        """Which of ``uids`` are still in the mailbox (UID SEARCH)."""
        try:
            typ, data = self.conn.uid("SEARCH", "UID", format_uid_set(uids))
            self._check(typ, list(data), "UID SEARCH")
        except (imaplib.IMAP4.error, OSError, EOFError) as exc:
            raise self._failure(f"UID SEARCH on {self._where()} failed", exc) from None
        found = {int(n) for line in data if isinstance(line, bytes) for n in line.split()}
        return found & set(uids)

    def fetch_each(
        self, uids: list[int], *, headers_only: bool = False, later: Sequence[int] = ()
    ) -> Iterator[FetchedMessage | Refused]:
        """The messages of one batch in UID order; a refused batch is fetched one at a time.

        So one message the server cannot return does not hold back the others: each refused
        single UID is yielded as :class:`Refused` (unless it was expunged meanwhile). So is
        one answered with the server's state (``NO [UNAVAILABLE]``) while the server returns
        another message (:meth:`_serves_another`); when it returns none, the check stops.
        ``later`` are UIDs listed after ``uids`` (in this batch or the next ones): candidates
        for that comparison when no message was returned yet. A message the answer left out
        is asked for alone, and if left out again yielded in its place as :class:`Refused`
        (``left_out``), after the messages before it, while the server returns another
        message; when it returns none, the check stops (:class:`MessagesNotReturned`).
        """
        try:
            found = {
                message.uid: message for message in self.fetch(uids, headers_only=headers_only)
            }
        except ImapRefused as exc:
            if len(uids) > 1:
                log.warning(
                    "email_batch_refused",
                    account=self.account.name,
                    uids=format_uid_set(uids),
                    answer=exc.answer,
                    what_to_do="nothing: fetching its messages one at a time",
                )
                yield from self._one_at_a_time(uids, headers_only, later)
            elif self._still_there(uids):
                yield Refused(uid=uids[0], answer=exc.answer)
            return
        except ImapServerState as exc:
            yield from self._after_server_state(exc, uids, headers_only, later)
            return
        missing = [uid for uid in uids if uid not in found]
        left_out = self._still_there(missing) if missing else []
        yield from self._in_uid_order(uids, found, left_out, headers_only, later)

    def _in_uid_order(
        self,
        uids: list[int],
        found: dict[int, FetchedMessage],
        left_out: list[int],
        headers_only: bool,
        later: Sequence[int],
    ) -> Iterator[FetchedMessage | Refused]:
        """The messages returned, each UID left out in its place (a UID expunged is neither)."""
        for i, uid in enumerate(uids):
            if uid in found:
                yield found[uid]
            elif uid in left_out and len(uids) > 1:
                # A server may fail a message only within a batch: it is asked for it alone.
                yield from self.fetch_each(
                    [uid], headers_only=headers_only, later=[*uids[i + 1 :], *later]
                )
            elif uid in left_out:
                # Never skipped silently (Sokratos hazard 2): the check counts it as refused,
                # unless the server returns no message at all (an outage is no message's).
                served = self._serves_another(uid, later, headers_only)
                if served is None:
                    raise self._none_returned(uid, later, headers_only)
                answer = f"{LEFT_OUT_ANSWER} (while it returned UID {served})"
                yield Refused(uid=uid, answer=answer, left_out=True)

    def _none_returned(
        self, uid: int, later: Sequence[int], headers_only: bool
    ) -> MessagesNotReturned:
        """The error of a check whose server returned neither ``uid`` nor any message asked
        for to compare (:meth:`_serves_another`)."""
        tried = self._compared(uid, later, headers_only)
        others = (
            f"nor UIDs {format_uid_set(tried)}, asked for to compare"
            if tried
            else "and no other message of this check was there to ask for"
        )
        return MessagesNotReturned(
            f"UID FETCH on {self._where()} returned no message at all: not UID {uid}, which"
            f" UID SEARCH still lists, {others}; a failure of the server (its mail store, or an"
            " answer this client cannot read), not counted against any message: the check"
            " stops and the next one asks again"
        )

    def _one_at_a_time(
        self, uids: list[int], headers_only: bool, later: Sequence[int]
    ) -> Iterator[FetchedMessage | Refused]:
        for i, uid in enumerate(uids):
            yield from self.fetch_each(
                uids=[uid], headers_only=headers_only, later=[*uids[i + 1 :], *later]
            )

    def _after_server_state(
        self, exc: ImapServerState, uids: list[int], headers_only: bool, later: Sequence[int]
    ) -> Iterator[FetchedMessage | Refused]:
        """A server-state answer is the server's (the check stops: raises ``exc``) unless
        the server returns other messages meanwhile: then it is this message's, which would
        otherwise stop every check of its account for good."""
        if exc.closed:
            try:
                self._reopen()
            except ImapError:
                raise exc from None  # the server is really away: its own answer says why
        if len(uids) > 1:
            log.info(
                "email_batch_failed_for_now",
                account=self.account.name,
                uids=format_uid_set(uids),
                answer=exc.answer,
                what_to_do="nothing: fetching its messages one at a time, to tell the"
                " server's state from one message's",
            )
            yield from self._one_at_a_time(uids, headers_only, later)
            return
        uid = uids[0]
        served = self._serves_another(uid, later, headers_only)
        if served is None:
            raise exc
        if not self._still_there(uids):
            return
        yield Refused(uid=uid, answer=f"{exc.answer} (while it returned UID {served})")

    def _serves_another(self, uid: int, later: Sequence[int], headers_only: bool) -> int | None:
        """A UID other than ``uid`` the server returns now (fetched the same way), or None."""
        for candidate in self._compared(uid, later, headers_only):
            try:
                if self.fetch([candidate], headers_only=headers_only):
                    return candidate
            except ImapRefused:
                continue  # another message it cannot return: tells nothing of the server
            except ImapServerState:
                return None
        return None

    def _compared(self, uid: int, later: Sequence[int], headers_only: bool) -> list[int]:
        """The UIDs :meth:`_serves_another` asks for: the last one returned (in this check,
        else the one at the checkpoint), then the next ones listed (SERVED_TRIES at most)."""
        last = self._served.get(headers_only, self._read_before)
        return [c for c in (last, *later) if c is not None and c != uid][:SERVED_TRIES]
