"""A command whose statement the database cancels (pg_cancel_backend, a pooler's query
timeout) says so in one line, exit 1, instead of a traceback (review, 2026-12-05)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psycopg

from tests.support.daemon import ROOT
from tests.support.operator import cli_env


def test_a_cancelled_purge_says_so_in_one_line(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    db.execute(
        "INSERT INTO failed_operations (op_type, label, error_message, created_at)"
        " VALUES ('conversation_triage', 'x', 'e', now() - interval '40 days')"
    )
    with psycopg.connect(database_url) as holder:
        holder.execute("LOCK TABLE failed_operations IN ACCESS EXCLUSIVE MODE")
        purge = subprocess.Popen(
            [sys.executable, "-m", "sokratos_worker", "failed", "purge", "--older-than", "30"],
            env=cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        cancelled = False
        deadline = time.monotonic() + 4  # its own lock wait gives up after 5 s
        while not cancelled and time.monotonic() < deadline:
            row = db.execute(
                "SELECT pg_cancel_backend(pid) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND query LIKE 'DELETE FROM failed_operations%'"
            ).fetchone()
            cancelled = bool(row and row[0])
            time.sleep(0.05)
        _, stderr = purge.communicate(timeout=60)
    assert cancelled, stderr
    assert purge.returncode == 1, stderr
    assert "Traceback" not in stderr, stderr
    assert stderr.startswith("sokratos-worker: the database cancelled the command's statement"), stderr
    assert db.execute("SELECT count(*) FROM failed_operations").fetchone() == (1,)
