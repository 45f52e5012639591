"""`status` says how many of the last 24 h's failures are closed since: a message passed
unread and recorded later, or a dead letter replayed by `failed retry` (`retried_at` set).
They were counted as plain failures, so an operator who had fixed the cause still read
"email_message 3" as three open problems. The count itself (`failures_24h`, the
`sokratos_failed_operations_24h` gauge) stays every failure created in the 24 h."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg

from sokratos_worker.store import status as status_store
from tests.support.operator import cli_env, run_cli


def _failures(db: psycopg.Connection) -> None:
    """Three email failures (one closed), an open dead letter, and a closed email failure two
    days old (outside the window)."""
    db.execute(
        """INSERT INTO failed_operations (op_type, label, error_message, created_at, retried_at)
           VALUES ('email_message', 'uid 1', 'refused', now() - interval '2 hours', now()),
                  ('email_message', 'uid 2', 'refused', now() - interval '1 hour', NULL),
                  ('email_message', 'uid 3', 'refused', now(), NULL),
                  ('conversation_triage', 'item 7', 'model said no', now(), NULL),
                  ('email_message', 'uid 0', 'refused', now() - interval '2 days', now())"""
    )


def test_status_says_how_many_failures_are_closed_since(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    _failures(db)
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)
    shown = run_cli(["status"], env)
    assert shown.returncode == 0, shown.stderr
    assert (
        "failures (24h): conversation_triage 1, email_message 3 (1 closed since)"
        in shown.stdout.splitlines()
    ), shown.stdout
    as_json = run_cli(["status", "--json"], env)
    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout)
    # The contract's key keeps counting every failure; the closed ones are a key of their own.
    assert report["failures_24h"] == {"conversation_triage": 1, "email_message": 3}
    assert report["failures_24h_closed"] == {"email_message": 1}
    # What the metric reads is that same count, as docs/production.md documents it.
    assert status_store.failures_24h(db) == report["failures_24h"]


def test_status_with_no_closed_failure_shows_the_counts_alone(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    db.execute(
        "INSERT INTO failed_operations (op_type, label, error_message)"
        " VALUES ('conversation_triage', 'item 7', 'model said no')"
    )
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)
    shown = run_cli(["status"], env)
    assert "failures (24h): conversation_triage 1" in shown.stdout.splitlines(), shown.stdout
    report = json.loads(run_cli(["status", "--json"], env).stdout)
    assert report["failures_24h_closed"] == {}
