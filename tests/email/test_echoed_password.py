"""An IMAP server whose refusal quotes the command it was sent (the LOGIN line, password
included): the password is masked in what the check keeps (email_checkpoints.last_error,
which ``status`` prints) and reports, and in ``check``'s line, as in the log. Only the log
line was masked: the stored and printed error carried it as it came."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from datetime import UTC, datetime

import psycopg
import pytest

from sokratos_worker.config import EmailAccountConfig, Settings
from sokratos_worker.email import check_due_accounts
from sokratos_worker.email.check import probe_accounts

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(60)]

PASSWORD = "Imap-Secret-Pw-42"


class EchoingImap:
    """Greets, answers CAPABILITY, and refuses LOGIN quoting the whole command line."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._session, args=(conn,), daemon=True).start()

    def _session(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as lines:
            conn.sendall(b"* OK [CAPABILITY IMAP4rev1 AUTH=PLAIN] ready\r\n")
            for raw in lines:
                line = raw.rstrip(b"\r\n")
                tag, _, rest = line.partition(b" ")
                command = rest.split(b" ", 1)[0].upper()
                if command == b"CAPABILITY":
                    conn.sendall(b"* CAPABILITY IMAP4rev1 AUTH=PLAIN\r\n" + tag + b" OK done\r\n")
                elif command == b"LOGOUT":
                    conn.sendall(b"* BYE\r\n" + tag + b" OK bye\r\n")
                    return
                else:
                    conn.sendall(tag + b" NO [AUTHENTICATIONFAILED] refused: " + rest + b"\r\n")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def server() -> Iterator[EchoingImap]:
    imap = EchoingImap()
    try:
        yield imap
    finally:
        imap.close()


@pytest.mark.parametrize(
    "password",
    [PASSWORD, 'Imap-Secret"Pw-42', "Imap\\Secret-Pw-42"],
    ids=["plain", "quote", "backslash"],
)
def test_an_echoed_password_is_not_stored_or_reported(
    server: EchoingImap, database_url: str, password: str
) -> None:
    # (A quote or backslash is escaped in IMAP's quoted string, and doubled again in the
    # bytes repr the error quotes: the plain form alone was not found in the text.)
    account = EmailAccountConfig(
        name="home", host="127.0.0.1", port=server.port, username="me",
        password=password, security="none",
    )  # fmt: skip
    settings = Settings(email_accounts=[account], email_check_interval=300)
    [report] = check_due_accounts(settings, database_url, now=datetime.now(UTC))
    assert report.error is not None  # the login was refused
    with psycopg.connect(database_url) as conn:
        stored = [r[0] for r in conn.execute("SELECT last_error FROM email_checkpoints")]
    assert "Secret" not in report.error, report.error
    assert not any("Secret" in (s or "") for s in stored), stored
    [line] = probe_accounts(settings, timeout=10)
    assert not line.ok and "refused" in line.detail, line
    assert "Secret" not in line.detail, line.detail
