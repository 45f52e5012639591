"""What an IMAP connection failure means, and what the operator should set about it.

Socket, TLS and imaplib errors are turned into one line of text plus a hint (a certificate for
other names, an unknown issuer, a plain-IMAP port asked for TLS, a refused login). A server that
greets no one is asked over a second connection (:class:`TlsProbe`) whether it speaks TLS,
so :class:`NoGreeting` can say the port expects implicit TLS.
"""

from __future__ import annotations

import contextlib
import errno
import imaplib
import re
import socket
import ssl
from typing import Any

from sokratos_worker.config import EmailAccountConfig

# OpenSSL verify codes (X509_V_ERR_*): a trusted certificate for other names than the host,
# an issuer missing from the trust store, an expired certificate.
_NAME_MISMATCH = frozenset({62, 64})
_UNKNOWN_ISSUER = frozenset({2, 18, 19, 20, 21})
_EXPIRED = 10
# OpenSSL's reasons when a TLS client gets plain text back (a plain-IMAP greeting).
_NOT_TLS = frozenset(
    {"WRONG_VERSION_NUMBER", "UNKNOWN_PROTOCOL", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"}
)


class NoGreeting(TimeoutError):
    """The server accepted the connection but sent no IMAP greeting; the text says why."""


_ANSWER_BYTES = re.compile(r"""\[b(['"])(.*?)\1\]""")


def describe(exc: BaseException) -> str:
    """One line for an error: what kind it is and its text (no bytes repr)."""
    text = str(exc).strip()
    if text.startswith(("b'", 'b"')):
        text = text[2:-1]
    # imaplib quotes a refused command's answer as a list of bytes: "BAD [b'...']".
    text = _ANSWER_BYTES.sub(r"\2", text)
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


def next_step(exc: BaseException, account: EmailAccountConfig, names: tuple[str, ...] = ()) -> str:
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


def certificate_names(cert: dict[str, Any]) -> tuple[str, ...]:
    """The DNS names and IP addresses a parsed certificate covers (its CN without them)."""
    alt = [value for kind, value in cert.get("subjectAltName", ()) if kind in ("DNS", "IP Address")]
    if alt:
        return tuple(alt)
    return tuple(v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName")


def peek(sock: socket.socket, wait_s: float) -> bool:
    """True when the server sent something (or closed) within ``wait_s``; nothing is consumed."""
    sock.settimeout(max(wait_s, 0.001))
    try:
        sock.recv(1, socket.MSG_PEEK)
    except TimeoutError:
        return False
    except OSError:
        return True  # the read that follows reports it
    return True


class TlsProbe:
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


def name_mismatch(exc: BaseException) -> bool:
    """A certificate refused only because it is for other names than the account's host."""
    return isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_code in _NAME_MISMATCH
