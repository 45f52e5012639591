"""Scenario 6: an IMAP server that drops the connection in the middle of a FETCH."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from structlog.testing import capture_logs

from sokratos_worker.config import EmailAccountConfig
from sokratos_worker.email import check_due_accounts
from tests.faults.support import Figures, report

# tests/email is not a package (its modules import each other by bare name): reuse its
# Dovecot fixture code and its test messages the same way.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "email"))
import dovecot as dovecot_support
import mails

pytestmark = [pytest.mark.faults, pytest.mark.imap, pytest.mark.postgres]

MESSAGES = 60  # more than one FETCH batch (50), so a cut in the second leaves the first done
CUT_AT_BODY = 55  # drop the connection inside the 55th message body


class CuttingProxy:
    """127.0.0.1 TCP proxy in front of Dovecot; while ``cut_at`` is set, it closes both sides
    a few bytes into the ``cut_at``-th ``BODY[`` of the server's responses."""

    def __init__(self, upstream_port: int, cut_at: int | None) -> None:
        self.upstream_port = upstream_port
        self.cut_at = cut_at
        self.cuts = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=10)
            for sock in (client, upstream):
                sock.settimeout(30)
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, from_server: bool) -> None:
        seen = bytearray()
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if from_server and self.cut_at is not None:
                    start = len(seen)
                    seen += data
                    at = -1
                    for _ in range(self.cut_at):
                        at = seen.find(b"BODY[", at + 1)
                        if at < 0:
                            break
                    if at >= 0:  # the cut_at-th body started: send a few bytes of it, then drop
                        dst.sendall(bytes(seen[start : max(start, at + 40)]))
                        self.cuts += 1
                        break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


@pytest.fixture(scope="module")
def dovecot_server() -> Iterator[dovecot_support.Dovecot]:
    binary = dovecot_support.dovecot_binary()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("dovecot is not installed (apt-get install dovecot-imapd)")
        pytest.skip("dovecot is not installed (apt-get install dovecot-imapd)")
    server = dovecot_support.Dovecot.start(binary)
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.timeout(120)
def test_a_connection_dropped_mid_fetch_commits_what_was_complete(
    dovecot_server: dovecot_support.Dovecot, db: psycopg.Connection, database_url: str
) -> None:
    mailbox = f"t{uuid.uuid4().hex[:10]}"
    dovecot_server.create_mailbox(mailbox)
    for n in range(MESSAGES):
        dovecot_server.append(mailbox, mails.plain(subject=f"faults message {n}"))
    proxy = CuttingProxy(dovecot_server.imap_port, CUT_AT_BODY)
    account = EmailAccountConfig(
        name="faults",
        host="127.0.0.1",
        port=proxy.port,
        username=dovecot_support.USER,
        password=dovecot_support.PASSWORD,
        mailbox=mailbox,
        security="none",
    )
    settings = dovecot_support.make_settings(account)
    now = datetime.now(UTC)
    try:
        with capture_logs() as logs:
            [first] = check_due_accounts(settings, database_url, now=now)
        assert any(e["event"] == "email_check_failed" for e in logs)
        assert proxy.cuts == 1
        assert first.error, first
        row = db.execute(
            "SELECT last_uid, last_error FROM email_checkpoints WHERE account = 'faults'"
        ).fetchone()
        assert row is not None and row[1], row
        committed = db.execute("SELECT count(*) FROM pending_triage").fetchone()
        assert committed is not None
        assert 0 < committed[0] < MESSAGES, committed  # the first batch, not the cut one
        assert row[0] == committed[0]  # the checkpoint covers exactly what was enqueued
        proxy.cut_at = None  # the server behaves again
        started = time.monotonic()
        [second] = check_due_accounts(settings, database_url, now=now + timedelta(minutes=10))
        recover = time.monotonic() - started
        assert second.error is None, second
    finally:
        proxy.close()
    rows = db.execute(
        "SELECT payload ->> 'message_id', idempotency_key FROM pending_triage"
    ).fetchall()
    ids = [r[0] for r in rows]
    lost = MESSAGES - len(set(ids))
    dup = len(ids) - len(set(ids))
    assert (lost, dup) == (0, 0), (lost, dup)
    assert len({r[1] for r in rows}) == MESSAGES
    processed = db.execute("SELECT count(*) FROM processed_emails").fetchone()
    assert processed == (MESSAGES,)
    subjects = {s for (s,) in db.execute("SELECT payload ->> 'subject' FROM pending_triage")}
    assert subjects == {f"faults message {n}" for n in range(MESSAGES)}
    fig = Figures(
        items_in=MESSAGES,
        outcomes=len(set(ids)),
        lost=lost,
        dup_outcomes=dup,
        dup_origins=0,
        by_outcome={"enqueued_first_check": committed[0], "enqueued_second_check": second.enqueued},
        pending=0,
    )
    report("imap_drop_mid_fetch", fig, recover, error=repr(str(first.error)[:60]))
