"""A check killed with SIGKILL between fetch and commit, then restarted in a new process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import mails
import psycopg
import pytest
from dovecot import AccountFactory, Dovecot

pytestmark = [pytest.mark.imap, pytest.mark.postgres, pytest.mark.subprocess]

SCRIPT = Path(__file__).with_name("check_in_subprocess.py")
# The child imports sokratos_worker from this checkout, installed or not.
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}


def _settings_json(account: Any, **overrides: Any) -> str:
    config = account.model_dump(mode="json")
    config["password"] = account.password.get_secret_value()
    values = {"email_accounts": [config], **overrides}  # (the child makes every account due)
    return json.dumps(values)


def _run(settings_json: str, database_url: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), settings_json, database_url],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        check=True,
    )
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def _wait_for_backends_to_go(db: psycopg.Connection, timeout: float = 30.0) -> None:
    """The killed process's PostgreSQL session must end (rolling back) before the rerun."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        locks = db.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchone()
        idle = db.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND state LIKE 'idle in transaction%'"
        ).fetchone()
        if locks == (0,) and idle == (0,):
            return
        time.sleep(0.1)
    raise AssertionError("the killed check's session did not end")


def _counts(db: psycopg.Connection) -> tuple[int, int, int | None]:
    items = db.execute("SELECT count(*) FROM pending_triage").fetchone()
    seen = db.execute("SELECT count(*) FROM processed_emails").fetchone()
    last = db.execute("SELECT last_uid FROM email_checkpoints").fetchone()
    assert items is not None
    assert seen is not None
    return items[0], seen[0], last[0] if last else None


def test_kill_9_between_fetch_and_commit_then_restart(
    dovecot: Dovecot,
    mailbox: str,
    account: AccountFactory,
    database_url: str,
    db: psycopg.Connection,
    *,
    tmp_path: Path,
) -> None:
    for n in range(4):
        dovecot.append(mailbox, mails.plain(subject=f"crash test {n}"))
    settings_json = _settings_json(account())
    marker = tmp_path / "blocked"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), settings_json, database_url, "3", str(marker)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the check never reached message 3"
            time.sleep(0.05)
        # Message 3's processed mark and triage item are written but not committed.
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    _wait_for_backends_to_go(db)
    assert _counts(db) == (2, 2, 2)  # messages 1 and 2 committed, 3 rolled back

    # A new process re-fetches what was not committed: exactly one item per message.
    [report] = _run(settings_json, database_url)
    assert report["fetched"] == 2
    assert report["enqueued"] == 2
    assert _counts(db) == (4, 4, 4)
    # And another restart changes nothing, even when the checkpoint is re-read from zero.
    db.execute("UPDATE email_checkpoints SET last_uid = 0")
    [report] = _run(settings_json, database_url)
    assert (report["fetched"], report["enqueued"], report["duplicates"]) == (4, 0, 4)
    subjects = db.execute(
        "SELECT payload->>'subject' FROM pending_triage ORDER BY (payload->>'uid')::int"
    ).fetchall()
    assert [s[0] for s in subjects] == [f"crash test {n}" for n in range(4)]
