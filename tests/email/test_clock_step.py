"""Mail is still fetched after the host's wall clock steps back an hour.

A check stamped ``email_checkpoints.checked_at`` with the host's clock and compared it with the
host's clock again: after NTP stepped the clock back an hour every account read as checked
"in the future" and was not due for an hour plus its interval (review, 2026-12-05). The
stamps and the due test are on the database's clock now. Only the daemon's clock steps
(libfaketime, tests/support/faketime.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import mails
import psycopg
import pytest
from dovecot import PASSWORD, USER, Dovecot

from tests.faults.support import stop, tail
from tests.support.daemon import daemon_env, start_daemon, wait_until
from tests.support.faketime import stepped_env

pytestmark = [pytest.mark.subprocess, pytest.mark.postgres, pytest.mark.imap]


def _last_uid(db: psycopg.Connection) -> int:
    row = db.execute("SELECT max(last_uid) FROM email_checkpoints").fetchone()
    return int(row[0] or 0) if row else 0


def test_mail_is_fetched_after_the_wall_clock_steps_back(
    db: psycopg.Connection, database_url: str, tmp_path: Path, dovecot: Dovecot, mailbox: str
) -> None:
    dovecot.append(mailbox, mails.plain(subject="before the step"))
    account = {
        "name": "home",
        "host": "127.0.0.1",
        "port": dovecot.imap_port,
        "security": "none",
        "username": USER,
        "password": PASSWORD,
        "mailbox": mailbox,
    }
    env = daemon_env(
        database_url,
        tmp_path,
        SOKRATOS_EMAIL_ACCOUNTS=json.dumps([account]),
        SOKRATOS_EMAIL_CHECK_INTERVAL="30s",  # the shortest allowed
    )
    offset = tmp_path / "faketime"
    log = tmp_path / "daemon.log"
    proc = start_daemon(stepped_env(env, offset), log)
    try:
        assert wait_until(lambda: _last_uid(db) >= 1, timeout=60), tail(log)
        offset.write_text("-3600\n")
        time.sleep(1)
        dovecot.append(mailbox, mails.plain(subject="after the step"))
        # Due 30 s after the first check, and looked for every 30 s: well within 80 s.
        fetched = wait_until(lambda: _last_uid(db) >= 2, timeout=80, interval=0.5)
    finally:
        stop(proc)
    assert fetched, f"no mail fetched 80 s after the clock stepped back: {tail(log)}"
