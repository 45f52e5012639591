"""A greeting that comes while the TLS probe (run after 3 s without a greeting) waits for its
answer wins at once: both connections are waited on together, the probe is dropped, and its
answer only names the cause when no greeting came within the read timeout.

Found by review (r6): the probe was synchronous, and the greeting that arrived meanwhile on
the first connection was not looked at:

1. A genuine plain-IMAP server whose greeting comes at 3.5 s (a loaded server, a slow
   reverse-DNS lookup before the banner) now costs every check ~6 s instead of 3.5 s, plus a
   second connection that sends the server a TLS ClientHello as IMAP.
2. A port shared by plain IMAP and IMAPS (an sslh-style protocol multiplexer, which waits for
   the client to speak first and falls back to plain IMAP after its timeout, here 4 s): the
   probe's ClientHello is routed to IMAPS and answered, so a correctly configured account
   (security "none") fails every check with 'set the account's security to "tls"', although
   the plain greeting arrives well inside the read timeout. Before 9306db4 the check worked.

Real parts: a real Dovecot behind a small delaying forwarder on 127.0.0.1, a real PostgreSQL.
Correct behaviour: the check succeeds in about the time the greeting takes; a greeting that
arrives while the probe runs wins (select on both sockets; abandon the probe when the first
connection becomes readable), and the probe's answer is only a hint for the final timeout
message, not a reason to fail a connection that is greeting.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from datetime import UTC, datetime

import pytest
from dovecot import AccountFactory, Dovecot, make_settings

from sokratos_worker.email import check_due_accounts

pytestmark = [pytest.mark.imap, pytest.mark.postgres]


def _pump(a: socket.socket, b: socket.socket) -> None:
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    finally:
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


class Forwarder:
    """Each connection: wait up to ``wait_s`` for the client's first byte; a TLS ClientHello
    (0x16) goes to ``tls_port`` at once (when set), else, after ``wait_s``, the connection
    goes to ``plain_port`` (whose greeting thus comes ``wait_s`` late)."""

    def __init__(self, plain_port: int, wait_s: float, tls_port: int | None = None) -> None:
        self.plain_port, self.tls_port, self.wait_s = plain_port, tls_port, wait_s
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.accepted = 0

    def __enter__(self) -> Forwarder:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._route, args=(client,), daemon=True).start()

    def _route(self, client: socket.socket) -> None:
        ready, _, _ = select.select([client], [], [], self.wait_s)
        first = b""
        if ready:
            with contextlib.suppress(OSError):
                first = client.recv(1, socket.MSG_PEEK)
        port = self.tls_port if first[:1] == b"\x16" and self.tls_port else self.plain_port
        if ready and port == self.plain_port:
            time.sleep(max(0.0, self.wait_s))  # a plain server that is slow to greet
        try:
            upstream = socket.create_connection(("127.0.0.1", port))
        except OSError:
            client.close()
            return
        threading.Thread(target=_pump, args=(client, upstream), daemon=True).start()
        threading.Thread(target=_pump, args=(upstream, client), daemon=True).start()


def _check(account: AccountFactory, port: int, database_url: str) -> tuple[float, object]:
    settings = make_settings(account(port=port, security="none"))
    started = time.monotonic()
    [report] = check_due_accounts(settings, database_url, now=datetime.now(UTC))
    return time.monotonic() - started, report


def test_a_greeting_at_3_5_s_costs_3_5_s_not_6(
    dovecot: Dovecot, account: AccountFactory, database_url: str
) -> None:
    with Forwarder(dovecot.imap_port, wait_s=3.5) as slow:
        elapsed, report = _check(account, slow.port, database_url)
    assert report.ok, report
    assert elapsed < 5.0, (
        f"a server greeting at 3.5 s took {elapsed:.1f} s to check: the greeting waited"
        " for the TLS probe"
    )


def test_a_multiplexed_port_greeting_at_4_s_is_not_told_to_use_tls(
    dovecot: Dovecot, account: AccountFactory, database_url: str
) -> None:
    with Forwarder(dovecot.imap_port, wait_s=4.0, tls_port=dovecot.imaps_port) as mux:
        elapsed, report = _check(account, mux.port, database_url)
    assert report.ok, (
        f"a plain-IMAP greeting that came at 4 s (read timeout 30 s) failed the check"
        f" after {elapsed:.1f} s: {report.error}"
    )
