"""The client's offline check (the spool) refuses what the SQL enqueue function refuses: a
distillation payload holding both messages and archive_text (sql/0046) was spooled, the
producer told it was accepted, and the import turned it into a spool_import failure that
`failed retry` refuses."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from sokratos_worker import client
from sokratos_worker.errors import InvalidPayload
from sokratos_worker.model import Queue
from sokratos_worker.spool import import_spool, pending_files
from sokratos_worker.store.connection import Database

DOWN = "postgresql://x@127.0.0.1:1/none"  # nothing listens there: the database is away
BOTH = {
    "messages": [{"role": "user", "content": "my sister moved to Porto"}],
    "archive_text": "user: my sister moved to Porto",
}


def test_both_forms_are_refused_offline_as_the_database_refuses_them(
    tmp_path: Path, database_url: str
) -> None:
    with pytest.raises(InvalidPayload) as online:
        client.enqueue(database_url, Queue.DISTILLATION, BOTH, key="conv-1")
    spool = tmp_path / "spool"
    with pytest.raises(InvalidPayload) as offline:
        client.enqueue(DOWN, Queue.DISTILLATION, BOTH, key="conv-1", spool_dir=spool)
    with pytest.raises(InvalidPayload) as spooled_directly:
        client.spool(spool, Queue.DISTILLATION, BOTH, key="conv-2")
    assert str(offline.value) == str(online.value)
    assert str(spooled_directly.value) == str(online.value)
    assert offline.value.field == "payload.messages"
    assert pending_files(spool) == 0
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM pending_distillation").fetchone() == (0,)


def test_a_form_sent_as_null_counts_as_absent_offline_too(
    tmp_path: Path, database_url: str
) -> None:
    spool = tmp_path / "spool"
    payload = {**BOTH, "archive_text": None}
    done = client.enqueue(DOWN, Queue.DISTILLATION, payload, key="conv-1", spool_dir=spool)
    assert done.spooled is not None
    database = Database(database_url, size=2)
    try:
        assert import_spool(spool, database) == 1
    finally:
        database.close()
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert conn.execute(
            "SELECT count(*) FROM pending_distillation WHERE idempotency_key = 'conv-1'"
        ).fetchone() == (1,)
        assert conn.execute("SELECT count(*) FROM failed_operations").fetchone() == (0,)
