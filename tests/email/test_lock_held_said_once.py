"""A lock held far past any check's deadline is named once per holder, not at every email
tick: a vanished session holds it for up to two hours, and a warning each minute buried the
log (found by a review). A new holder, or the same one after the lock was released and taken
again, is named again."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from structlog.testing import capture_logs

from sokratos_worker.config import EmailAccountConfig, Settings
from sokratos_worker.email.check import check_due_accounts

LOCK = "SELECT pg_advisory_lock(hashtext('sokratos-email'), hashtext('home'))"
UNLOCK = "SELECT pg_advisory_unlock(hashtext('sokratos-email'), hashtext('home'))"


@pytest.fixture(autouse=True)
def nothing_said_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process has named no holder yet (another test's pid may come back)."""
    monkeypatch.setattr("sokratos_worker.email.check._LOCK_HOLDER_SAID", {}, raising=False)


def _settings() -> Settings:
    account = EmailAccountConfig(
        name="home", host="127.0.0.1", port=9, username="u", password="p", security="none"
    )
    return Settings(email_accounts=[account], email_check_interval=60)


def _checked_a_day_ago(db: psycopg.Connection) -> None:
    db.execute(
        "INSERT INTO email_checkpoints (account, mailbox, last_uid, checked_at)"
        " VALUES ('home', 'INBOX', 0, now() - interval '1 day')"
    )


def _ticks(database_url: str, *nows: datetime | None) -> list[dict[str, Any]]:
    """The email_account_lock_held events of one email tick at each of ``nows``."""
    with capture_logs() as logs:
        for now in nows:
            check_due_accounts(_settings(), database_url, now=now)
    return [e for e in logs if e["event"] == "email_account_lock_held"]


def test_the_same_holder_is_named_once_and_a_new_one_again(
    db: psycopg.Connection, database_url: str
) -> None:
    _checked_a_day_ago(db)
    with psycopg.connect(database_url, autocommit=True, application_name="gone-host") as first:
        first.execute(LOCK)
        said = _ticks(database_url, None, None)
        gone = first.info.backend_pid
    assert [e["holder"]["pid"] for e in said] == [gone]  # the second tick logs nothing new
    with psycopg.connect(database_url, autocommit=True, application_name="next-host") as second:
        second.execute(LOCK)
        said = _ticks(database_url, None, None)
        pid = second.info.backend_pid
    assert [(e["holder"]["pid"], e["holder"]["application"]) for e in said] == [(pid, "next-host")]
    assert f"pg_terminate_backend({pid})" in said[0]["hint"]


def test_the_same_holder_is_named_again_after_it_released_and_took_the_lock(
    db: psycopg.Connection, database_url: str
) -> None:
    _checked_a_day_ago(db)
    with psycopg.connect(database_url, autocommit=True) as holder:
        holder.execute(LOCK)
        first = _ticks(database_url, None)
        holder.execute(UNLOCK)
        assert _ticks(database_url, None) == []  # this worker checks (port 9 fails at once)
        holder.execute(LOCK)
        later = db.execute("SELECT now() + interval '1 day'").fetchone()
        assert later is not None
        again = _ticks(database_url, later[0], later[0] + timedelta(minutes=1))
        pid = holder.info.backend_pid
    assert [e["holder"]["pid"] for e in first] == [pid]
    assert [e["holder"]["pid"] for e in again] == [pid]
