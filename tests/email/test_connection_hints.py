"""Account errors that say what went wrong and what to set, for the common mix-ups of host
name, port and security (found by review, r2).

Real parts: a real Dovecot (plain IMAP with STARTTLS on one port, implicit TLS on another, a
certificate for localhost and 127.0.0.1 signed by the test CA), a real PostgreSQL.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

import pytest
from dovecot import AccountFactory, Dovecot, make_settings

from sokratos_worker.config import EmailAccountConfig
from sokratos_worker.email import check_due_accounts

pytestmark = [pytest.mark.imap, pytest.mark.postgres]

# A forwarder on an address the certificate does not name, to one of Dovecot's ports.
Forward = Callable[[int], tuple[str, int]]


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


@pytest.fixture
def other_address() -> Iterator[Forward]:
    """127.0.0.2:port forwarding to a Dovecot port on 127.0.0.1 (a name the certificate lacks)."""
    servers: list[socket.socket] = []

    def forward(port: int) -> tuple[str, int]:
        server = socket.create_server(("127.0.0.2", 0))
        servers.append(server)

        def serve() -> None:
            while True:
                try:
                    client, _ = server.accept()
                except OSError:
                    return
                upstream = socket.create_connection(("127.0.0.1", port))
                threading.Thread(target=_pump, args=(client, upstream), daemon=True).start()
                threading.Thread(target=_pump, args=(upstream, client), daemon=True).start()

        threading.Thread(target=serve, daemon=True).start()
        return "127.0.0.2", server.getsockname()[1]

    yield forward
    for server in servers:
        server.close()


def _error(database_url: str, acct: EmailAccountConfig) -> str:
    [report] = check_due_accounts(make_settings(acct), database_url, now=datetime.now(UTC))
    assert report.error is not None
    return report.error


@pytest.mark.parametrize("security", ["tls", "starttls"])
def test_a_host_name_mismatch_names_the_certificates_names_not_the_ca_file(
    dovecot: Dovecot,
    account: AccountFactory,
    database_url: str,
    other_address: Forward,
    security: str,
) -> None:
    port = dovecot.imaps_port if security == "tls" else dovecot.imap_port
    host, forwarded = other_address(port)
    acct = account(host=host, port=forwarded, security=security, ca_file=str(dovecot.ca_file))
    error = _error(database_url, acct)
    assert "mismatch" in error
    assert "set the account's ca_file" not in error, error
    assert "only for localhost, 127.0.0.1, not 127.0.0.2" in error, error
    assert "set the account's host to a name the certificate covers" in error


def test_tls_against_a_plain_imap_port_says_to_use_starttls(
    dovecot: Dovecot, account: AccountFactory, database_url: str
) -> None:
    acct = account(port=dovecot.imap_port, security="tls", ca_file=str(dovecot.ca_file))
    error = _error(database_url, acct)
    assert f"port {dovecot.imap_port} probably speaks plain IMAP" in error, error
    assert 'set security "starttls" for this port, or use port 993 with "tls"' in error


@pytest.mark.parametrize("security", ["none", "starttls"])
def test_no_tls_against_an_implicit_tls_port_says_so_after_the_read_timeout(
    dovecot: Dovecot,
    account: AccountFactory,
    database_url: str,
    security: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The TLS probe's answer names the cause; the greeting is still waited for until the read
    timeout (a port shared by IMAP and IMAPS answers TLS and greets plain clients late)."""
    monkeypatch.setattr("sokratos_worker.email.check.IMAP_TIMEOUT_S", 4.0)
    started = time.monotonic()
    error = _error(database_url, account(port=dovecot.imaps_port, security=security))
    elapsed = time.monotonic() - started
    assert "no IMAP greeting within 4 s" in error, error
    assert "expects TLS at once (implicit TLS, usually port 993)" in error
    assert 'set the account\'s security to "tls"' in error
    assert 3.9 < elapsed < 8, f"took {elapsed:.1f} s"


def test_a_silent_server_that_speaks_no_tls_waits_its_read_timeout_and_says_so(
    account: AccountFactory, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sokratos_worker.email.check.IMAP_TIMEOUT_S", 1.0)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never greets
        port = silent.getsockname()[1]
        started = time.monotonic()
        error = _error(database_url, account(port=port))
        elapsed = time.monotonic() - started
    assert error.endswith(
        "failed: timed out: no IMAP greeting within 1 s; if port"
        f" {port} expects TLS at once (usually 993), set the account's"
        ' security to "tls", else ask the server\'s operator'
    ), error
    assert 0.9 < elapsed < 5


def test_a_slow_greeting_is_waited_for(
    dovecot: Dovecot, account: AccountFactory, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain server that greets after the patience is asked about TLS, then waited for."""
    monkeypatch.setattr("sokratos_worker.email.imap.GREETING_PATIENCE_S", 0.2)
    server = socket.create_server(("127.0.0.2", 0))

    def serve() -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            time.sleep(0.6)  # the greeting is late: after the patience and the TLS probe
            upstream = socket.create_connection(("127.0.0.1", dovecot.imap_port))
            threading.Thread(target=_pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=_pump, args=(upstream, client), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        acct = account(host="127.0.0.2", port=server.getsockname()[1])
        [report] = check_due_accounts(make_settings(acct), database_url, now=datetime.now(UTC))
    finally:
        server.close()
    assert report.ok, report.error
