"""``failed retry`` prints one line per failure, with what the enqueue function said when it
refused the payload. That refusal can quote what the failure holds: a triage item inserted
directly with a ``source`` the worker does not know is dead-lettered with that source, and its
replay is refused with ``source must be conversation or email, not <source>``. The line went
to the terminal raw (ESC sequences obeyed, a newline breaking the one line per failure), where
``list`` and ``show`` escape them (found by a failedhunt hunt, 2026-12-07)."""

from __future__ import annotations

from pathlib import Path

import psycopg

from sokratos_worker.model import Queue
from sokratos_worker.store import queue as store
from tests.support.operator import cli_env, run_cli

HOSTILE = "chat\x1b]0;owned\x07\n\u202eforged line\x9b2J"


def test_a_refusal_quoting_the_stored_source_is_printed_escaped_on_one_line(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    db.execute(
        "INSERT INTO pending_triage (payload, source)"
        " VALUES ('{\"exchange\": \"user: my sister moved to Porto\"}', %s)",
        (HOSTILE,),
    )
    (item,) = store.claim(db, Queue.TRIAGE, owner="w", limit=1, lease_s=60)
    assert store.dead_letter(db, item, owner="w", error="invalid payload: source").settled
    row = db.execute("SELECT id FROM failed_operations").fetchone()
    assert row is not None
    proc = run_cli(
        ["failed", "retry", str(row[0])], cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url)
    )
    assert proc.returncode == 1, proc.stderr
    assert db.execute("SELECT count(*) FROM pending_triage").fetchone() == (0,)
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout
    assert lines[0].startswith(f"{row[0]}: refused:"), proc.stdout
    assert "chat\\x1b]0;owned\\x07\\x0a\\u202eforged line\\x9b2J" in lines[0], proc.stdout
    for raw in ("\x1b", "\x07", "\u202e", "\x9b"):
        assert raw not in proc.stdout, (raw, proc.stdout)
