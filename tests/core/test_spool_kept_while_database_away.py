"""Mutation testing (session 29): a spool file is deleted only after its enqueue committed.

Kills: ``import_spool`` deleting the file when the database is unavailable (no test imported
a spool while PostgreSQL was down). Real PostgreSQL for the import that lands; the one that
cannot is pointed at a port where no server listens (PostgreSQL down).
"""

from __future__ import annotations

from pathlib import Path

import psycopg

from sokratos_worker.model import Queue
from sokratos_worker.spool import import_spool, pending_files, spool_enqueue
from sokratos_worker.store.connection import Database
from tests.support.db import count
from tests.support.ports import unused_port


def test_a_spool_file_outlives_an_import_while_the_database_is_down(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    spool_enqueue(
        spool, Queue.TRIAGE, {"exchange": "user: hi"}, idempotency_key="k1", source="conversation"
    )
    down = Database(f"postgresql://nobody@127.0.0.1:{unused_port()}/x?connect_timeout=2", size=1)
    try:
        assert import_spool(spool, down) == 0
    finally:
        down.close()
    assert pending_files(spool) == 1  # still there: nothing was enqueued
    database = Database(database_url, size=1)
    try:
        assert import_spool(spool, database) == 1
        assert import_spool(spool, database) == 0
    finally:
        database.close()
    assert pending_files(spool) == 0
    assert count(db, "SELECT count(*) FROM pending_triage WHERE idempotency_key = 'k1'") == 1
