"""A message the server leaves out of its UID FETCH answer while its mailbox still lists it.

Found by an email hunt (2026-12-06): such a message (a server bug, a message file it cannot
read) raised at once, so the mail fetched before it in its batch (up to 49 messages) was not
recorded either, and since every check did the same, the account was stuck for good. Now the
mail before it is recorded, and a message left out on 3 consecutive checks is passed with an
``email_message`` failure, as a refused one is; one left out once is triaged at the next check.

Real parts: Dovecot on 127.0.0.1 behind a proxy that drops chosen UIDs from body FETCH
commands (the server then answers OK without them), and PostgreSQL.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import mails
import psycopg
import pytest
from dovecot import AccountFactory, Dovecot, make_settings
from refusing_proxy import OmittingProxy
from structlog.testing import capture_logs

from sokratos_worker.email import check_due_accounts

pytestmark = [pytest.mark.imap, pytest.mark.postgres]

NOW = datetime.now(UTC)


def later(minutes: int) -> datetime:
    """A time when every account is due again (the interval is 5 minutes)."""
    return NOW + timedelta(minutes=minutes)


def subjects(db: psycopg.Connection) -> list[str]:
    rows = db.execute("SELECT payload->>'subject' FROM pending_triage ORDER BY id").fetchall()
    return [row[0] for row in rows]


def refusal(db: psycopg.Connection) -> tuple[int, int | None, int]:
    row = db.execute(
        "SELECT last_uid, refused_uid, refused_checks FROM email_checkpoints"
    ).fetchone()
    assert row is not None
    return row[0], row[1], row[2]


def failures(db: psycopg.Connection) -> list[tuple[str, str, str, dict[str, Any]]]:
    return db.execute(
        "SELECT op_type, label, error_message, context_data FROM failed_operations ORDER BY id"
    ).fetchall()


def assert_nothing_doubled(db: psycopg.Connection) -> None:
    """One triage item per message, and one processed mark per item."""
    items, keys = db.execute(
        "SELECT count(*), count(DISTINCT idempotency_key) FROM pending_triage"
    ).fetchone()
    triaged = db.execute(
        "SELECT count(*) FROM processed_emails WHERE item_id IS NOT NULL"
    ).fetchone()
    assert (items, keys) == (triaged[0], triaged[0])


def test_mail_before_a_left_out_message_in_its_batch_is_recorded(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """UID 30 of a 50-message batch is left out: the 29 before it are recorded at once, and
    the check stops before it, naming it (nothing after it is recorded yet)."""
    names = [f"m{n:02d}" for n in range(1, 61)]
    for name in names:
        dovecot.append(mailbox, mails.plain(subject=name))
    with OmittingProxy(dovecot.imap_port, refused={30}) as proxy:
        [report] = check_due_accounts(
            make_settings(account(port=proxy.port)), database_url, now=later(0)
        )
    assert subjects(db) == names[:29]
    assert not report.ok
    assert report.error is not None and "UID 30 " in report.error, report.error
    assert "on 1 consecutive check(s)" in report.error
    assert refusal(db) == (29, 30, 1)
    assert failures(db) == []
    assert_nothing_doubled(db)


def test_a_message_the_server_keeps_leaving_out_is_passed_after_three_checks(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """Left out on three consecutive checks: counted at each, then passed with an
    email_message failure naming what happened, and the mail after it flows; once the
    server returns it again, the statement in what_to_do fetches it, triaged once."""
    for subject in ("one", "two", "three", "four", "five"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    with OmittingProxy(dovecot.imap_port, refused={3}) as proxy:
        settings = make_settings(account(port=proxy.port))
        for n in range(2):
            with capture_logs() as logs:
                [report] = check_due_accounts(settings, database_url, now=later(10 * n))
            assert subjects(db) == ["one", "two"]
            assert refusal(db) == (2, 3, n + 1)
            assert report.error is not None and "UID 3 " in report.error, report.error
            assert f"on {n + 1} consecutive check(s)" in report.error
            [said] = [e for e in logs if e["event"] == "email_message_refused"]
            assert (said["uid"], said["refused_checks"]) == (3, n + 1)
            assert "UID SEARCH still lists it" in said["answer"], said
            assert "3 consecutive checks leaving it out" in said["what_to_do"], said
            assert failures(db) == []
        with capture_logs() as logs:
            [report] = check_due_accounts(settings, database_url, now=later(20))
        assert report.ok, report.error
        assert (report.enqueued, report.failed) == (2, 1), report
        assert subjects(db) == ["one", "two", "four", "five"]
        assert refusal(db) == (5, None, 0)
        [(op_type, label, error, context)] = failures(db)
        assert (op_type, label) == ("email_message", "home UID 3")
        assert "left out of the server's answers on 3 consecutive checks" in error, error
        assert "still lists it" in error, error
        validity = dovecot.uidvalidity(mailbox)
        assert {k: context[k] for k in ("account", "mailbox", "uidvalidity", "uid")} == {
            "account": "home",
            "mailbox": mailbox,
            "uidvalidity": validity,
            "uid": 3,
        }
        assert context["refused_checks"] == 3 and context["size"] > 0
        assert "UID SEARCH still lists it" in context["server_answer"]
        assert "UPDATE email_checkpoints SET last_uid = 2" in context["what_to_do"]
        [failed] = [e for e in logs if e["event"] == "email_message_failed"]
        assert (failed["uid"], failed["refused_checks"]) == (3, 3)

        # Later mail flows.
        dovecot.append(mailbox, mails.plain(subject="six"))
        [report] = check_due_accounts(settings, database_url, now=later(30))
        assert report.ok, report.error
        assert subjects(db) == ["one", "two", "four", "five", "six"]

    # The server is repaired: what_to_do fetches the message again, and only it is triaged.
    db.execute(context["what_to_do"].split("fetch it again with ", 1)[1].split(";")[0])
    [report] = check_due_accounts(make_settings(account()), database_url, now=later(40))
    assert report.ok, report.error
    assert subjects(db) == ["one", "two", "four", "five", "six", "three"]
    assert (report.enqueued, report.duplicates) == (1, 3), report
    assert db.execute("SELECT retried_at IS NOT NULL FROM failed_operations").fetchone() == (True,)
    assert_nothing_doubled(db)


def test_a_message_left_out_once_is_triaged_at_the_next_check_without_a_failure(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    for subject in ("one", "two", "three", "four"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    with OmittingProxy(dovecot.imap_port, refused={2}) as proxy:
        settings = make_settings(account(port=proxy.port))
        [report] = check_due_accounts(settings, database_url, now=later(0))
        assert subjects(db) == ["one"]
        assert report.error is not None and "UID 2 " in report.error, report.error
        proxy.refused.clear()  # the glitch is over
        [report] = check_due_accounts(settings, database_url, now=later(10))
    assert report.ok, report.error
    assert (report.enqueued, report.failed) == (3, 0), report
    assert subjects(db) == ["one", "two", "three", "four"]
    assert refusal(db) == (4, None, 0)
    assert failures(db) == []
    assert_nothing_doubled(db)


def test_a_message_left_out_of_its_batch_but_returned_alone_is_recorded_in_that_check(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """A server that leaves a message out of a batch's answer but returns it when asked for
    it alone: the check fetches it alone and goes on, with nothing counted against it."""
    for subject in ("one", "two", "three"):
        dovecot.append(mailbox, mails.plain(subject=subject))
    with OmittingProxy(dovecot.imap_port, refused={2}) as proxy:
        proxy.alone_too = False
        [report] = check_due_accounts(
            make_settings(account(port=proxy.port)), database_url, now=later(0)
        )
    assert report.ok, report.error
    assert (report.enqueued, report.failed) == (3, 0), report
    assert subjects(db) == ["one", "two", "three"]
    assert refusal(db) == (3, None, 0)
    assert failures(db) == []


def test_old_mail_left_out_of_its_header_fetch_is_passed_after_three_checks(
    dovecot: Dovecot, mailbox: str, account: AccountFactory, database_url: str, db: Any
) -> None:
    """On a first check, old mail is fetched as headers only; a message that fetch keeps
    leaving out is counted and passed the same way, and the old mail around it is seen."""
    for subject in ("one", "two", "three"):
        dovecot.append(mailbox, mails.plain(subject=subject), when=NOW - timedelta(days=30))
    with OmittingProxy(dovecot.imap_port, refused={2}) as proxy:
        settings = make_settings(account(port=proxy.port))
        for n in range(2):
            [report] = check_due_accounts(settings, database_url, now=later(10 * n))
            assert refusal(db) == (1, 2, n + 1)
            assert report.error is not None and "UID 2 " in report.error, report.error
        [report] = check_due_accounts(settings, database_url, now=later(20))
    assert report.ok, report.error
    assert (report.seen_without_triage, report.failed) == (1, 1), report
    assert subjects(db) == []
    seen = db.execute(
        "SELECT uid FROM processed_emails WHERE item_id IS NULL AND message_id LIKE 'home:%'"
        " ORDER BY uid"
    ).fetchall()
    assert seen == [(1,), (3,)]
    assert refusal(db) == (3, None, 0)
    [(_, label, _, _)] = failures(db)
    assert label == "home UID 2"
