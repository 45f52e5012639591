"""`failed list --limit N` on a large backlog holds one row at a time: it fetched all N rows
into a list before printing the first (200,000 rows peaked at 319 MB, ~1.3 kB a row, so
`failed list --limit 1000000 | grep 'HTTP 401'` took over a gigabyte)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg

from tests.support.operator import REPO, cli_env

ROWS = 100_000


def test_a_long_list_is_printed_as_it_streams(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    db.execute(
        """INSERT INTO failed_operations (op_type, label, error_message, context_data,
                                          source_queue, item_id, idempotency_key, attempts)
           SELECT 'conversation_triage', 'pending_triage item ' || g,
                  'model said no: HTTP 500 from backend primary (attempt 3 of 3)',
                  jsonb_build_object('payload', jsonb_build_object('exchange', 'user: ' || g)),
                  'pending_triage', g, 'streamed-' || g, 3
           FROM generate_series(1, %s) g""",
        (ROWS,),
    )
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sokratos_worker", "failed", "list", "--limit", str(ROWS)],
            env=cli_env(tmp_path, SOKRATOS_DATABASE_URL=database_url),
            cwd=str(REPO),
            stdout=out,
            stderr=subprocess.PIPE,
        )
        _, status, usage = os.wait4(proc.pid, 0)  # the child's own peak RSS
        proc.returncode = os.waitstatus_to_exitcode(status)
        assert proc.stderr is not None
        assert proc.returncode == 0, proc.stderr.read().decode()
        out.seek(0)
        assert out.read().count(b"\n") == ROWS
    peak_mb = usage.ru_maxrss / 1024
    # About 65 MB streamed; all rows held at once took about 65 + 130 MB.
    assert peak_mb < 120, f"peak RSS {peak_mb:.0f} MB for {ROWS:,} lines"
