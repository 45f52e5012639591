"""A spool file another process holds a write lease on (a Samba oplock or an NFS delegation
on a shared spool: the same kernel leases) is left for the next tick, not set aside: the
import opens files without blocking (a planted FIFO must not hang it), so the open failed at
once with EWOULDBLOCK, and the file was renamed *.json.unreadable with a spool_import failure
and never imported (found by a review). Real parts: a real lease held by another process,
spool files on disk, the test's PostgreSQL.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psycopg
from structlog.testing import capture_logs

from sokratos_worker.model import Queue
from sokratos_worker.spool import import_spool, pending_files, spool_enqueue
from sokratos_worker.store.connection import Database
from tests.support.db import count

# A write lease: any other open, a reader's too, must wait for its holder to give it up.
HOLDER = """
import fcntl, os, signal, sys
signal.signal(signal.SIGIO, signal.SIG_IGN)  # (told of the break; gives it up when told to)
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
print("leased", flush=True)
sys.stdin.readline()
"""


def test_a_leased_spool_file_waits_for_the_next_tick(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    path = spool_enqueue(
        spool, Queue.TRIAGE, {"exchange": "user: hi"}, idempotency_key="leased", source="conversation"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    database = Database(database_url, size=1)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "leased"
        with capture_logs() as logs:
            first = import_spool(spool, database)
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(10)
        second = import_spool(spool, database)
    finally:
        database.close()
        if holder.poll() is None:
            holder.kill()
    assert (first, second) == (0, 1), logs
    assert [e["event"] for e in logs if e["event"].startswith("spool_file")] == ["spool_file_busy"]
    assert pending_files(spool) == 0 and not list(spool.glob("*.unreadable"))
    assert count(db, "SELECT count(*) FROM failed_operations") == 0
    assert count(db, "SELECT count(*) FROM pending_triage WHERE idempotency_key = 'leased'") == 1
