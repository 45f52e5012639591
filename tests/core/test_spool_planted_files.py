"""What another local user can plant in a spool shared with producers (a directory the
operator made group-writable so a Python producer under its own user can spool there): a
symbolic link to a file only the worker may read, a FIFO. The import must neither follow the
link (copying the file it names into failed_operations) nor block on the FIFO (the import runs
in the tick, and at start in the main thread).

Real files, a real second user (``nobody``, through ``runuser``), real PostgreSQL.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from sokratos_worker.model import Queue
from sokratos_worker.spool import import_spool, pending_elsewhere, pending_files, spool_enqueue
from sokratos_worker.store.connection import Database
from tests.support.db import count

SECRET = "postgresql://sokratos_worker:Tr0ub4dor-and-3@db.example.org/sokratos"

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("runuser") is None, reason="needs root and runuser"
)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory holding a spool writable by the group ``nogroup`` (not sticky: the
    kernel's protected_symlinks would not apply) and a credential only root can read."""
    top = Path(tempfile.mkdtemp(prefix="sokratos-shared-spool-", dir="/tmp"))
    try:
        top.chmod(0o755)
        spool = top / "spool"
        spool.mkdir()
        os.chown(spool, 0, 65534)
        spool.chmod(0o770)
        credential = top / "SOKRATOS_DATABASE_URL"
        credential.write_text(SECRET)
        credential.chmod(0o600)
        yield top
    finally:
        shutil.rmtree(top)


def _as_nobody(*command: str) -> None:
    subprocess.run(["runuser", "-u", "nobody", "--", *command], check=True, timeout=30)


@needs_root
def test_a_symlink_planted_by_another_user_is_not_followed(
    db: psycopg.Connection, database_url: str, shared: Path
) -> None:
    spool, credential = shared / "spool", shared / "SOKRATOS_DATABASE_URL"
    # The other user cannot read the credential itself...
    denied = subprocess.run(
        ["runuser", "-u", "nobody", "--", "cat", str(credential)],
        check=False,
        capture_output=True,
        timeout=30,
    )
    assert denied.returncode != 0
    # ...so it links to it from the spool, for the worker to read.
    _as_nobody("ln", "-s", str(credential), str(spool / "20260101T000000000000-aaaaaaaa.json"))
    database = Database(database_url, size=2)
    try:
        import_spool(spool, database)
    finally:
        database.close()
    rows = db.execute(
        "SELECT error_message, context_data::text FROM failed_operations"
        " WHERE op_type = 'spool_import'"
    ).fetchall()
    assert rows, "the planted link is recorded as a failure"
    assert all("Tr0ub4dor" not in f"{error} {context}" for error, context in rows), rows
    assert "symbolic link" in rows[0][0]
    assert credential.read_text() == SECRET  # the file it named is left as it was
    assert pending_files(spool) == 0  # (set aside: not tried again at every tick)


@needs_root
def test_a_symlink_to_a_spool_record_elsewhere_is_not_enqueued(
    db: psycopg.Connection, database_url: str, shared: Path
) -> None:
    """A record the worker's user may read outside the spool is not imported through a link."""
    spool = shared / "spool"
    outside = spool_enqueue(
        shared / "private", Queue.TRIAGE, {"exchange": "user: x"}, idempotency_key="outside",
        source=None,
    )
    _as_nobody("ln", "-s", str(outside), str(spool / "20260101T000000000000-bbbbbbbb.json"))
    database = Database(database_url, size=2)
    try:
        import_spool(spool, database)
    finally:
        database.close()
    assert count(db, "SELECT count(*) FROM pending_triage WHERE idempotency_key = 'outside'") == 0
    assert outside.exists()


def test_a_fifo_in_the_spool_does_not_block_the_import(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """Opening a FIFO for reading waits for a writer, for ever: the tick (or the start, in the
    main thread) hung on it, and every file after it waited."""
    spool = tmp_path / "spool"
    after = spool_enqueue(
        spool, Queue.TRIAGE, {"exchange": "user: hi\nassistant: hello"},
        idempotency_key="after-fifo", source=None,
    )
    fifo = spool / "20000101T000000000000-cccccccc.json"  # oldest: imported first
    os.mkfifo(fifo)
    database = Database(database_url, size=2)
    done: list[int] = []
    worker = threading.Thread(
        target=lambda: done.append(import_spool(spool, database, "embedded:/elsewhere")),
        daemon=True,
    )
    try:
        worker.start()
        worker.join(30)
        blocked = worker.is_alive()
        if blocked:  # let the old code's open() return, so the test ends
            with open(fifo, "w"):
                pass
            worker.join(30)
        assert not blocked, "import_spool blocked on a FIFO"
    finally:
        database.close()
    assert done == [1]
    assert not after.exists()
    assert count(db, "SELECT count(*) FROM pending_triage WHERE idempotency_key = 'after-fifo'") == 1
    [error] = db.execute(
        "SELECT error_message FROM failed_operations WHERE op_type = 'spool_import'"
    ).fetchone() or [None]
    assert error is not None and "not a regular file" in error
    assert fifo.with_name(fifo.name + ".unreadable").exists()  # set aside, not tried again


def test_status_does_not_block_on_a_fifo_in_the_spool(tmp_path: Path) -> None:
    """``status`` counts the files meant for another database by their first bytes."""
    spool = tmp_path / "spool"
    spool.mkdir()
    fifo = spool / "20000101T000000000000-dddddddd.json"
    os.mkfifo(fifo)
    found: list[dict[str, int]] = []
    status = threading.Thread(
        target=lambda: found.append(pending_elsewhere(spool, "embedded:/here")), daemon=True
    )
    status.start()
    status.join(30)
    blocked = status.is_alive()
    if blocked:
        with open(fifo, "w"):
            pass
        status.join(30)
    assert not blocked, "pending_elsewhere blocked on a FIFO"
    assert found == [{}]
