"""A failed check's hint names what to check for its kind of failure: the account's host, port,
security and password only for a connection or login failure, never for a refused message,
the server's own state, the deadline, a mailbox the server will not open (a renamed folder),
a mailbox rebuilt during the check or messages the server lists but does not return; a
failure none of these names (a server's internal error, a crash of the check) gets a neutral
hint, not the account's.

Found by an email hunt (2026-12-06): every IMAP failure got the account hint, which
contradicted the deadline's own advice and sent the operator of a renamed folder to the
password. Also pins what docs/email.md says about a renamed mailbox: its new name's first
check triages only the initial lookback, and raising the lookback for it triages the mail
that arrived while the old name failed, without triaging the rest again.
"""

from __future__ import annotations

import contextlib
import re
import socket
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import mails
import psycopg
import pytest
from dovecot import AccountFactory, Dovecot, make_settings
from refusing_proxy import RefusingProxy
from structlog.testing import capture_logs
from trickle import TricklingServer

from sokratos_worker.config import Settings
from sokratos_worker.email import AccountReport, check_due_accounts

pytestmark = [pytest.mark.imap, pytest.mark.postgres]

NOW = datetime.now(UTC)
DAY = timedelta(days=1)
ACCOUNT_HINT = "password"  # the account hint's mark: host, port, security and password
NEUTRAL_HINT = "see the error"  # the mark of the hint for what the account's settings do not cause
BODY_FETCH = re.compile(rb"^UID FETCH ([0-9,:]+) \(.*BODY\.PEEK\[\]", re.IGNORECASE)


class ScriptedProxy(RefusingProxy):
    """Relays to the test Dovecot, except the commands ``reply`` answers itself (``TAG`` in
    the answer becomes the command's tag); an answer starting ``* BYE`` ends the session."""

    def __init__(self, upstream_port: int, reply: Callable[[bytes], bytes | None]) -> None:
        super().__init__(upstream_port, refused=set())
        self._reply = reply

    def _commands(self, client: socket.socket, upstream: socket.socket) -> None:
        with contextlib.suppress(OSError, ValueError):
            for line in self._lines(client):
                tag, _, command = line.partition(b" ")
                answer = self._reply(command)
                if answer is None:
                    upstream.sendall(line)
                    continue
                client.sendall(answer.replace(b"TAG", tag))
                if answer.startswith(b"* BYE"):
                    for sock in (client, upstream):
                        with contextlib.suppress(OSError):
                            sock.shutdown(socket.SHUT_RDWR)
                    return


def body_fetch_of(uid: int, answer: bytes) -> Callable[[bytes], bytes | None]:
    """Answers the body FETCH of a batch holding ``uid`` with ``answer``."""

    def reply(command: bytes) -> bytes | None:
        match = BODY_FETCH.match(command)
        listed = {int(n) for n in match.group(1).split(b",")} if match else set()
        return answer if uid in listed else None

    return reply


def rename(dovecot: Dovecot, old: str, new: str) -> None:
    client = dovecot.client()
    try:
        assert client.rename(old, new)[0] == "OK"
    finally:
        client.logout()


def failed_check(
    settings: Settings, database_url: str, db: psycopg.Connection, *, now: datetime = NOW
) -> tuple[AccountReport, dict[str, Any]]:
    """One failed check: its report and its email_check_failed event (stored as last_error)."""
    with capture_logs() as logs:
        [report] = check_due_accounts(settings, database_url, now=now)
    [failed] = [e for e in logs if e["event"] == "email_check_failed"]
    assert not report.ok
    stored = db.execute(
        "SELECT last_error FROM email_checkpoints WHERE account = %s AND mailbox = %s",
        (report.name, settings.email_accounts[0].mailbox),
    ).fetchone()
    assert stored == (report.error,) and failed["error"] == report.error
    return report, failed


def test_a_login_failure_keeps_the_account_hint(
    account: AccountFactory, database_url: str, db: psycopg.Connection
) -> None:
    _, failed = failed_check(make_settings(account(password="wrong")), database_url, db)
    assert ACCOUNT_HINT in failed["hint"] and "no mail is lost" in failed["hint"]


@pytest.fixture
def closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on (a wrong port: the connection is refused)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        return int(server.getsockname()[1])


@pytest.mark.parametrize("mix_up", ["refused connection", "tls on a plain port"])
def test_a_connection_or_tls_failure_keeps_the_account_hint(
    dovecot: Dovecot,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
    *,
    closed_port: int,
    mix_up: str,
) -> None:
    if mix_up == "refused connection":
        settings = make_settings(account(port=closed_port))
    else:
        settings = make_settings(account(security="tls", ca_file=str(dovecot.ca_file)))
    report, failed = failed_check(settings, database_url, db)
    assert (report.error or "").startswith("connecting to"), report.error
    assert ACCOUNT_HINT in failed["hint"] and "no mail is lost" in failed["hint"]


def examined_without_uidvalidity(command: bytes) -> bytes | None:
    """Answers EXAMINE with no UIDVALIDITY (a server that does not keep UIDs)."""
    if not command.upper().startswith(b"EXAMINE"):
        return None
    return b"* 2 EXISTS\r\nTAG OK [READ-ONLY] EXAMINE completed\r\n"


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (body_fetch_of(2, b"TAG BAD [SERVERBUG] internal error\r\n"), "SERVERBUG"),
        (examined_without_uidvalidity, "reported no UIDVALIDITY"),
    ],
    ids=["bad answer to a fetch", "no uidvalidity"],
)
def test_a_failure_after_the_login_the_table_does_not_list_is_not_blamed_on_the_account(
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
    *,
    reply: Callable[[bytes], bytes | None],
    error: str,
) -> None:
    """Found by review (reviewC): every failure the hint table did not list got the account
    hint, sending the operator to the password for a server's internal error."""
    for subject in ("one", "two"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    with ScriptedProxy(dovecot.imap_port, reply) as proxy:
        report, failed = failed_check(make_settings(account(port=proxy.port)), database_url, db)
    assert error in (report.error or ""), report.error
    assert ACCOUNT_HINT not in failed["hint"], failed["hint"]
    assert "no mail is lost" in failed["hint"] and NEUTRAL_HINT in failed["hint"]


def test_a_crash_of_the_check_is_not_blamed_on_the_account(
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fault(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("a fault in the worker")

    monkeypatch.setattr("sokratos_worker.email.check.lookback_cutoff", fault)
    report, failed = failed_check(make_settings(account()), database_url, db)
    assert report.error == "RuntimeError: a fault in the worker"
    assert ACCOUNT_HINT not in failed["hint"], failed["hint"]
    assert "email_check_crashed" in failed["hint"] and "no mail is lost" in failed["hint"]


def test_a_refused_message_hints_at_the_servers_mail_store(
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
) -> None:
    for subject in ("one", "two", "three"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    with RefusingProxy(dovecot.imap_port, refused={2}) as proxy:
        report, failed = failed_check(make_settings(account(port=proxy.port)), database_url, db)
    assert "UID 2" in (report.error or "")
    assert ACCOUNT_HINT not in failed["hint"], failed["hint"]
    assert "doveadm force-resync" in failed["hint"] and "failed_operations" in failed["hint"]


def test_the_servers_own_state_is_not_blamed_on_the_account(
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
) -> None:
    dovecot.append(mailbox, mails.plain(subject="one"))
    busy = b"[UNAVAILABLE] busy"
    with RefusingProxy(dovecot.imap_port, refused={1}, answer=busy) as proxy:
        report, failed = failed_check(make_settings(account(port=proxy.port)), database_url, db)
    assert "UNAVAILABLE" in (report.error or "")
    assert ACCOUNT_HINT not in failed["hint"], failed["hint"]
    assert "its own state" in failed["hint"]


def test_an_examine_answered_with_the_servers_state_is_not_taken_for_a_renamed_folder(
    dovecot: Dovecot, account: AccountFactory, database_url: str, db: psycopg.Connection
) -> None:
    def busy(command: bytes) -> bytes | None:
        return b"TAG NO [UNAVAILABLE] busy\r\n" if command.upper().startswith(b"EXAMINE") else None

    with ScriptedProxy(dovecot.imap_port, busy) as proxy:
        _, failed = failed_check(make_settings(account(port=proxy.port)), database_url, db)
    assert ACCOUNT_HINT not in failed["hint"], failed["hint"]
    assert "its own state" in failed["hint"] and "renamed" not in failed["hint"]


def test_the_deadline_hint_agrees_with_the_error(
    database_url: str, db: psycopg.Connection, account: AccountFactory
) -> None:
    with TricklingServer("examine", gap_s=0.3) as server:
        settings = make_settings(account(port=server.port), email_check_deadline=1)
        report, failed = failed_check(settings, database_url, db)
    assert "deadline exceeded" in (report.error or "")
    assert ACCOUNT_HINT not in failed["hint"], failed["hint"]
    assert "raise SOKRATOS_EMAIL_CHECK_DEADLINE" in failed["hint"]
    # The error gives the deadline's advice (status shows it); the hint does not repeat it.
    assert "slow link" in (report.error or "") and "slow link" not in failed["hint"]


def test_a_mailbox_that_no_longer_exists_hints_at_the_configured_mailbox(
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
) -> None:
    rename(dovecot, mailbox, mailbox + "r")
    report, failed = failed_check(make_settings(account()), database_url, db)
    assert "EXAMINE" in (report.error or "")
    hint = failed["hint"]
    assert ACCOUNT_HINT not in hint, hint
    assert f"mailbox {mailbox!r}" in hint and "SOKRATOS_EMAIL_ACCOUNTS" in hint
    assert "renamed" in hint and "SOKRATOS_EMAIL_INITIAL_LOOKBACK" in hint


def test_a_mailbox_rebuilt_while_reconnecting_needs_nothing_set(
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
) -> None:
    raws = [mails.plain(subject=f"m{n}") for n in range(3)]
    for raw in raws:
        dovecot.append(mailbox, raw)
    rebuilt: list[bool] = []

    def rebuild_then_bye(command: bytes) -> bytes | None:
        if rebuilt or body_fetch_of(2, b"")(command) is None:
            return None
        dovecot.delete_mailbox(mailbox)
        dovecot.create_mailbox(mailbox)
        for raw in raws:
            dovecot.append(mailbox, raw)
        rebuilt.append(True)
        return b"* BYE Internal error occurred.\r\n"

    with ScriptedProxy(dovecot.imap_port, rebuild_then_bye) as proxy:
        report, failed = failed_check(make_settings(account(port=proxy.port)), database_url, db)
    assert "UIDVALIDITY changed" in (report.error or "")
    assert ACCOUNT_HINT not in failed["hint"], failed["hint"]
    assert "reads it again" in failed["hint"] and "nothing to set" in failed["hint"]


def test_messages_listed_but_not_returned_are_not_blamed_on_the_account(
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
) -> None:
    for subject in ("one", "two"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    with ScriptedProxy(dovecot.imap_port, body_fetch_of(2, b"TAG OK done\r\n")) as proxy:
        report, failed = failed_check(make_settings(account(port=proxy.port)), database_url, db)
    assert "left out of the server's answers" in (report.error or "")
    assert ACCOUNT_HINT not in failed["hint"], failed["hint"]
    assert "sent no body" in failed["hint"]


def subjects(db: psycopg.Connection) -> list[str]:
    rows = db.execute("SELECT payload->>'subject' FROM pending_triage ORDER BY id").fetchall()
    return [row[0] for row in rows]


@pytest.mark.parametrize(("lookback_days", "outage_triaged"), [(1, False), (4, True)])
def test_a_renamed_mailbox_triages_the_outage_mail_only_with_the_lookback_raised(
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
    *,
    lookback_days: int,
    outage_triaged: bool,
) -> None:
    """docs/email.md, "A renamed mailbox": the old name's last complete check was 3 days ago;
    a lookback of 4 days for the new name's first check triages the mail that arrived since,
    and the mail triaged under the old name is a duplicate, not triaged again."""
    dovecot.append(mailbox, mails.plain(subject="before"), when=NOW - 3 * DAY - timedelta(hours=1))
    [first] = check_due_accounts(make_settings(account()), database_url, now=NOW - 3 * DAY)
    assert first.enqueued == 1
    renamed = mailbox + "r"
    rename(dovecot, mailbox, renamed)
    dovecot.append(renamed, mails.plain(subject="outage"), when=NOW - 2 * DAY)
    failed_check(make_settings(account()), database_url, db, now=NOW - 2 * DAY)
    settings = make_settings(account(mailbox=renamed), email_initial_lookback=lookback_days * 86400)
    [report] = check_due_accounts(settings, database_url, now=NOW)
    assert report.ok, report.error
    assert report.duplicates == 1
    assert subjects(db) == (["before", "outage"] if outage_triaged else ["before"])
    assert report.seen_without_triage == (0 if outage_triaged else 1)
