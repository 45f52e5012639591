"""A check of a mailbox without new mail stays cheap whatever its newest message: the restore
check compares the message at the checkpoint's UID by the RFC822.SIZE and INTERNALDATE the
check's ``UID FETCH last_uid:*`` listing returns anyway with what processed_emails recorded
(sql/0045). Nothing of the message itself is fetched; a row recorded before sql/0045 is
compared by its key from a header block of at most HEADER_BYTES_LIMIT bytes (and never the
body: a message without a Message-ID then "cannot tell").

Found by review (r8): a newest message without a Message-ID was fetched whole (up to 16 MB)
on every check, and ``BODY.PEEK[HEADER]`` had no byte limit. Real parts: Dovecot on
127.0.0.1 and PostgreSQL; the tests count the IMAP commands and the bytes read from the
socket (they change nothing).
"""

from __future__ import annotations

import imaplib
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import mails
import psycopg
import pytest
from dovecot import AccountFactory, Dovecot, make_settings

from sokratos_worker.email import check_due_accounts
from sokratos_worker.email.imap import HEADER_BYTES_LIMIT

pytestmark = [pytest.mark.imap, pytest.mark.postgres]

NOW = datetime.now(UTC)
BODY_BYTES = 6 * 1024 * 1024
# A quiet check: imaplib's CAPABILITY at the greeting, LOGIN, EXAMINE, the UID FETCH listing,
# LOGOUT -- and a few KB of answers.
QUIET_COMMANDS = ["CAPABILITY", "LOGIN", "EXAMINE", "UID", "LOGOUT"]
# ... and one bounded header fetch (UID FETCH n (BODY.PEEK[HEADER]<0.N>)) after the listing.
WITH_HEADER_FETCH = [*QUIET_COMMANDS[:4], "UID", "LOGOUT"]
QUIET_BYTES = 8 * 1024


@dataclass
class Wire:
    """The IMAP commands the worker sent and the bytes it read, per check."""

    commands: list[str] = field(default_factory=list)
    read: int = 0


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch) -> Wire:
    counted = Wire()
    command, read, readline = imaplib.IMAP4._command, imaplib.IMAP4.read, imaplib.IMAP4.readline

    def counting_command(self: imaplib.IMAP4, name: str, *args: Any) -> Any:
        counted.commands.append(name)
        return command(self, name, *args)

    def counting_read(self: imaplib.IMAP4, size: int) -> bytes:
        data = read(self, size)
        counted.read += len(data)
        return data

    def counting_readline(self: imaplib.IMAP4) -> bytes:
        data = readline(self)
        counted.read += len(data)
        return data

    monkeypatch.setattr(imaplib.IMAP4, "_command", counting_command)
    monkeypatch.setattr(imaplib.IMAP4, "read", counting_read)
    monkeypatch.setattr(imaplib.IMAP4, "readline", counting_readline)
    return counted


def _quiet_checks(settings: Any, database_url: str, wire: Wire) -> list[Wire]:
    """Three checks of a mailbox that got no new mail; what each sent and read."""
    per_check: list[Wire] = []
    for minutes in (10, 20, 30):
        wire.commands, wire.read = [], 0
        [report] = check_due_accounts(settings, database_url, now=NOW + timedelta(minutes=minutes))
        assert report.ok and report.fetched == 0 and not report.uids_reused, report
        per_check.append(Wire(list(wire.commands), wire.read))
    return per_check


def test_a_quiet_check_does_not_download_a_large_newest_message_without_message_id(
    *, dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, wire: Wire
) -> None:
    settings = make_settings(account(), email_initial_lookback=86400)
    dovecot.append(mailbox, mails.plain(subject="small"))
    line = "scanned page data " * 4 + "\n"
    body = line * (BODY_BYTES // len(line))
    dovecot.append(mailbox, mails.plain(subject="Scan from MFP", body=body, message_id=None))
    [report] = check_due_accounts(settings, database_url, now=NOW)
    assert report.ok and report.enqueued == 2, report

    for check in _quiet_checks(settings, database_url, wire):
        assert check.commands == QUIET_COMMANDS, check
        assert check.read < QUIET_BYTES, check


def test_a_quiet_check_does_not_download_a_huge_header_block(
    *, dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, wire: Wire
) -> None:
    """With a Message-ID and a 3 MB header block (a mass mailing with its whole recipient
    list in To:): the same few KB per check."""
    settings = make_settings(account(), email_initial_lookback=86400)
    to = ", ".join(f"user{n:06d}@example.org" for n in range(120_000))
    dovecot.append(mailbox, mails.plain(subject="To everyone", to=to))
    [report] = check_due_accounts(settings, database_url, now=NOW)
    assert report.ok and report.enqueued == 1, report

    for check in _quiet_checks(settings, database_url, wire):
        assert check.commands == QUIET_COMMANDS, check
        assert check.read < QUIET_BYTES, check


@pytest.mark.parametrize("message_id", ["auto", None])
def test_rows_recorded_before_0045_are_compared_by_a_bounded_header_fetch(
    *,
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
    wire: Wire,
    message_id: str | None,
) -> None:
    """A row without size and date: its key is compared from at most HEADER_BYTES_LIMIT bytes
    of header; a match stores the size and date (the next checks fetch nothing more). A
    message keyed by its body is never fetched whole for this: the check cannot tell, and
    goes on (not a restore)."""
    settings = make_settings(account(), email_initial_lookback=86400)
    line = "scanned page data " * 4 + "\n"
    body = line * (BODY_BYTES // len(line))
    dovecot.append(mailbox, mails.plain(subject="big", body=body, message_id=message_id))
    [report] = check_due_accounts(settings, database_url, now=NOW)
    assert report.ok and report.enqueued == 1, report
    db.execute("UPDATE processed_emails SET server_size = NULL, internal_date = NULL")

    checks = _quiet_checks(settings, database_url, wire)
    for check in checks:
        assert check.read < HEADER_BYTES_LIMIT + QUIET_BYTES, check
    stored = db.execute("SELECT server_size IS NOT NULL FROM processed_emails").fetchone()
    if message_id is None:
        assert all(c.commands == WITH_HEADER_FETCH for c in checks)
        assert stored == (False,)
    else:  # the first check confirms the key and stores the size: the others fetch nothing
        assert checks[0].commands == WITH_HEADER_FETCH, checks[0]
        assert all(c.commands == QUIET_COMMANDS for c in checks[1:]), checks
        assert stored == (True,)
