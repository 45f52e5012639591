"""A spool file whose key was enqueued before says so at its import (spool_key_known, naming
the item that holds the key): it was logged spool_imported like a new item, and nothing said
that the file's payload was not enqueued. Real parts: the test's PostgreSQL, spool files on
disk, the worker's import.
"""

from __future__ import annotations

from pathlib import Path

import psycopg
from structlog.testing import capture_logs

from sokratos_worker.client import enqueue_triage
from sokratos_worker.model import Queue
from sokratos_worker.spool import import_spool, pending_files, spool_enqueue
from sokratos_worker.store.connection import Database
from tests.support.db import count


def test_a_known_key_is_named_and_its_payload_not_enqueued(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    first = enqueue_triage(database_url, "user: first words\nassistant: ok", key="k1")
    spool = tmp_path / "spool"
    for key, text in (("k1", "user: other words"), ("k2", "user: new words")):
        spool_enqueue(spool, Queue.TRIAGE, {"exchange": text}, idempotency_key=key, source="conversation")
    database = Database(database_url, size=1)
    try:
        with capture_logs() as logs:
            assert import_spool(spool, database) == 2
    finally:
        database.close()
    assert pending_files(spool) == 0
    said = {e["event"]: e for e in logs if e["event"] in ("spool_key_known", "spool_imported")}
    assert said["spool_key_known"]["item_id"] == first.item_id, logs
    assert "not enqueued again" in said["spool_key_known"]["hint"]
    assert said["spool_imported"]["item_id"] != first.item_id
    rows = db.execute("SELECT idempotency_key, payload->>'exchange' FROM pending_triage ORDER BY id").fetchall()
    assert rows == [("k1", "user: first words\nassistant: ok"), ("k2", "user: new words")]
    assert count(db, "SELECT count(*) FROM pending_triage") == 2
