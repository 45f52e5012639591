"""A mail passed unrecorded (an email_message failure) and fetched again once its cause is
fixed (the failure's ``what_to_do``) closes its failure in the transaction that records it.

Before, the mail was triaged but its failure stayed open for good: ``failed list`` showed it
unreplayed, and ``failed retry --all`` kept counting it among the failures to act on.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import mails
import pytest
from dovecot import AccountFactory, Dovecot, make_settings
from psycopg.types.json import Jsonb
from refusing_proxy import RefusingProxy
from structlog.testing import capture_logs

from sokratos_worker.email import check_due_accounts
from sokratos_worker.store.failures import retry_failure
from tests.support.operator import cli_env, run_cli

pytestmark = [pytest.mark.imap, pytest.mark.postgres]

NOW = datetime.now(UTC)


def later(minutes: int) -> datetime:
    return NOW + timedelta(minutes=minutes)


def open_failures(db: Any) -> list[int]:
    rows = db.execute(
        "SELECT id FROM failed_operations WHERE op_type = 'email_message' AND retried_at IS NULL"
        " ORDER BY id"
    ).fetchall()
    return [row[0] for row in rows]


def triaged(db: Any, subject: str) -> list[int]:
    rows = db.execute(
        "SELECT id FROM pending_triage WHERE payload->>'subject' = %s ORDER BY id", (subject,)
    ).fetchall()
    return [row[0] for row in rows]


def fetch_again(db: Any, failure_id: int) -> None:
    """Run the statement the failure's what_to_do gives the operator."""
    row = db.execute(
        "SELECT context_data->>'what_to_do' FROM failed_operations WHERE id = %s", (failure_id,)
    ).fetchone()
    statement = re.search(r"UPDATE email_checkpoints [^;]*", row[0])
    assert statement is not None, row[0]
    db.execute(statement.group(0))


def closed_events(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "email_failure_closed"]


@pytest.mark.usefixtures("poison_breaks_the_parser")
def test_a_failed_mail_fetched_again_closes_its_failure_and_is_triaged_once(
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: Any,
    *,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for subject in ("before", "poison", "after"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    settings = make_settings(account())
    [report] = check_due_accounts(settings, database_url, now=later(0))
    assert (report.enqueued, report.failed) == (2, 1), report
    [failure] = open_failures(db)
    # Another mailbox's failure at the same UID is not this message's: it stays open.
    other = db.execute(
        "INSERT INTO failed_operations (op_type, label, error_message, context_data)"
        " VALUES ('email_message', 'home UID 2', 'elsewhere', %s) RETURNING id",
        (
            Jsonb(
                {
                    "account": "home",
                    "mailbox": "Elsewhere",
                    "uidvalidity": dovecot.uidvalidity(mailbox),
                    "uid": 2,
                    "what_to_do": "read it there",
                }
            ),
        ),
    ).fetchone()[0]
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)
    retried = run_cli(["failed", "retry", "--all"], env)
    assert "(2 email_message)" in retried.stdout, retried.stdout

    monkeypatch.undo()  # the cause is fixed
    fetch_again(db, failure)
    with capture_logs() as logs:
        [report] = check_due_accounts(settings, database_url, now=later(10))
    assert report.ok, report.error
    assert (report.fetched, report.enqueued, report.duplicates) == (2, 1, 1)
    [item] = triaged(db, "poison")
    assert open_failures(db) == [other]
    row = db.execute(
        "SELECT retried_at IS NOT NULL, retried_as FROM failed_operations WHERE id = %s",
        (failure,),
    ).fetchone()
    assert row == (True, item)
    [event] = closed_events(logs)
    assert (event["account"], event["uid"], event["failure_id"], event["item_id"]) == (
        "home",
        2,
        failure,
        item,
    )

    # `failed retry` agrees: nothing more to do for it, and nothing triaged twice.
    again = retry_failure(db, failure)
    assert again.item_id == item and "already retried" in again.message, again.message
    retried = run_cli(["failed", "retry", "--all"], env)
    assert "(1 email_message)" in retried.stdout, retried.stdout
    listed = run_cli(["failed", "list"], env)
    [line] = [x for x in listed.stdout.splitlines() if x.lstrip().startswith(f"{failure} ")]
    assert line.endswith(f"retried as item {item}"), line

    # Fetched once more: a duplicate, no second item, nothing left to close.
    fetch_again(db, failure)
    with capture_logs() as logs:
        [report] = check_due_accounts(settings, database_url, now=later(20))
    assert (report.enqueued, report.duplicates) == (0, 2), report
    assert triaged(db, "poison") == [item]
    assert closed_events(logs) == []


@pytest.mark.usefixtures("poison_breaks_the_parser")
def test_a_failed_mail_found_already_triaged_closes_its_failure_as_that_item(
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: Any,
    *,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A copy of a mail already triaged (same Message-ID) fails, then is read again: a
    duplicate, whose failure names the item the first copy became."""
    dovecot.append(mailbox, mails.plain(subject="first copy", message_id="<twin@example.org>"))
    dovecot.append(mailbox, mails.plain(subject="poison", message_id="<twin@example.org>"))
    settings = make_settings(account())
    check_due_accounts(settings, database_url, now=later(0))
    [failure] = open_failures(db)
    [item] = triaged(db, "first copy")

    monkeypatch.undo()
    fetch_again(db, failure)
    with capture_logs() as logs:
        [report] = check_due_accounts(settings, database_url, now=later(10))
    assert (report.enqueued, report.duplicates) == (0, 1), report
    assert open_failures(db) == []
    assert db.execute(
        "SELECT retried_as FROM failed_operations WHERE id = %s", (failure,)
    ).fetchone() == (item,)
    assert [(e["failure_id"], e["item_id"]) for e in closed_events(logs)] == [(failure, item)]
    assert triaged(db, "poison") == []


def test_a_refused_mail_returned_after_the_repair_closes_its_failure(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    for subject in ("one", "two", "three"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    with RefusingProxy(dovecot.imap_port, refused={2}) as proxy:
        settings = make_settings(account(port=proxy.port))
        for n in range(3):
            check_due_accounts(settings, database_url, now=later(10 * n))
        [failure] = open_failures(db)
        assert triaged(db, "two") == []

        proxy.refused.clear()  # the mail store is repaired
        fetch_again(db, failure)
        with capture_logs() as logs:
            [report] = check_due_accounts(settings, database_url, now=later(30))
    assert report.ok, report.error
    [item] = triaged(db, "two")
    assert open_failures(db) == []
    assert [(e["failure_id"], e["item_id"]) for e in closed_events(logs)] == [(failure, item)]
