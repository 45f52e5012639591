"""`failed list --limit N` on a large backlog holds one row at a time: it fetched all N rows
into a list before printing the first (200,000 rows peaked at 319 MB, ~1.3 kB a row, so
`failed list --limit 1000000 | grep 'HTTP 401'` took over a gigabyte)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
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
        peak_kb = 0
        while proc.poll() is None:  # its own high-water mark, read while it runs
            peak_kb = max(peak_kb, _high_water_kb(proc.pid))
            time.sleep(0.02)
        assert proc.stderr is not None
        assert proc.returncode == 0, proc.stderr.read().decode()
        out.seek(0)
        assert out.read().count(b"\n") == ROWS
    peak_mb = peak_kb / 1024
    # About 65 MB streamed; all rows held at once took about 65 + 130 MB.
    assert 0 < peak_mb < 120, f"peak RSS {peak_mb:.0f} MB for {ROWS:,} lines"


def _high_water_kb(pid: int) -> int:
    """VmHWM, the process's peak RSS since its exec (the rusage of a child counts the forked
    parent's pages too: a late test in a long run read pytest's own 160 MB)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # it ended meanwhile
        return 0
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0
