"""An account whose lock another session holds far past any check's deadline is named, with
that session: a worker whose host vanished keeps its session (and the lock) until the
server's TCP keepalive ends it, two hours by default, and every check of the account was
skipped without a word meanwhile (found by a two-process hunt)."""

from __future__ import annotations

import psycopg
from structlog.testing import capture_logs

from sokratos_worker.config import EmailAccountConfig, Settings
from sokratos_worker.email.check import check_due_accounts

LOCK = "SELECT pg_advisory_lock(hashtext('sokratos-email'), hashtext('home'))"


def _settings() -> Settings:
    account = EmailAccountConfig(
        name="home", host="127.0.0.1", port=9, username="u", password="p", security="none"
    )
    return Settings(email_accounts=[account], email_check_interval=60)


def _checked(db: psycopg.Connection, ago: str) -> None:
    db.execute(
        "INSERT INTO email_checkpoints (account, mailbox, last_uid, checked_at)"
        f" VALUES ('home', 'INBOX', 0, now() - interval '{ago}')"
    )


def test_a_lock_held_past_any_deadline_is_named_with_its_session(
    db: psycopg.Connection, database_url: str
) -> None:
    _checked(db, "1 day")
    with psycopg.connect(database_url, autocommit=True, application_name="gone-host") as held:
        held.execute(LOCK)
        with capture_logs() as logs:
            (report,) = check_due_accounts(_settings(), database_url)
        pid = held.info.backend_pid
    assert report.skipped_reason == "checked by another worker"
    (said,) = [e for e in logs if e["event"] == "email_account_lock_held"]
    assert said["holder"]["pid"] == pid and said["holder"]["application"] == "gone-host"
    assert f"pg_terminate_backend({pid})" in said["hint"]


def test_a_lock_held_by_a_check_that_may_still_run_is_not_reported(
    db: psycopg.Connection, database_url: str
) -> None:
    _checked(db, "2 minutes")  # due (interval 60 s), but a check may still be running
    with psycopg.connect(database_url, autocommit=True) as held:
        held.execute(LOCK)
        with capture_logs() as logs:
            (report,) = check_due_accounts(_settings(), database_url)
    assert report.skipped_reason == "checked by another worker"
    assert [e for e in logs if e["event"] == "email_account_lock_held"] == []
