"""A restored mailbox is noticed on a server that leaves ``[UIDNEXT n]`` out of its EXAMINE
answer (older or minimal servers, or a proxy in between): ``UID FETCH last_uid:*`` returns the
mailbox's highest message even when its UID is below ``last_uid`` (RFC 3501 "n:*"), and the
message at that UID, never recorded, shows the UIDs were handed out again.

Found by review (r6): only UIDNEXT was looked at; the mail after the restore was lost.

Real parts: a real Dovecot restored with ``cp -a`` as in tests/email/test_restored_mailbox.py,
reached through a forwarder that drops the untagged ``* OK [UIDNEXT n]`` line, and a real
PostgreSQL. Expected: as with UIDNEXT, the mail after the restore is triaged.
"""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import mails
import psycopg
import pytest
from dovecot import USER, AccountFactory, Dovecot, make_settings

from sokratos_worker.email import check_due_accounts

pytestmark = [pytest.mark.imap, pytest.mark.postgres]

NOW = datetime.now(UTC)
_UIDNEXT_LINE = re.compile(rb"^\* OK \[UIDNEXT \d+\][^\n]*\n", re.MULTILINE)


def _close(*socks: socket.socket) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)


def _up(client: socket.socket, upstream: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := client.recv(65536):
            upstream.sendall(data)
    _close(client, upstream)


def _down(upstream: socket.socket, client: socket.socket) -> None:
    pending = b""
    with contextlib.suppress(OSError):
        while data := upstream.recv(65536):
            pending += data
            cut = pending.rfind(b"\n") + 1  # forward whole lines only
            complete, pending = pending[:cut], pending[cut:]
            client.sendall(_UIDNEXT_LINE.sub(b"", complete))
        client.sendall(pending)
    _close(client, upstream)


@contextlib.contextmanager
def without_uidnext(port: int):
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", port))
            threading.Thread(target=_up, args=(client, upstream), daemon=True).start()
            threading.Thread(target=_down, args=(upstream, client), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


def test_a_restore_is_noticed_without_uidnext_in_the_examine_answer(
    *,
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
    tmp_path: Path,
) -> None:
    with without_uidnext(dovecot.imap_port) as port:
        settings = make_settings(account(port=port), email_initial_lookback=86400)
        for n in (1, 2):
            dovecot.append(mailbox, mails.plain(subject=f"before the backup {n}"))
        check_due_accounts(settings, database_url, now=NOW)

        folder = dovecot.root / "mail" / USER / "Maildir" / f".{mailbox}"
        backup = tmp_path / "backup"
        subprocess.run(["cp", "-a", str(folder), str(backup)], check=True)
        for n in (3, 4):
            dovecot.append(mailbox, mails.plain(subject=f"lost with the disk {n}"))
        [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=10))
        assert report.enqueued == 2, report

        subprocess.run(["rm", "-rf", str(folder)], check=True)
        subprocess.run(["cp", "-a", str(backup), str(folder)], check=True)
        dovecot.append(mailbox, mails.plain(subject="new mail after the restore"))  # UID 3

        [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=20))
    assert report.ok, report.error
    subjects = [r[0] for r in db.execute("SELECT payload->>'subject' FROM pending_triage")]
    assert "new mail after the restore" in subjects, (
        f"the mail delivered after the restore was never fetched: {report}"
    )
