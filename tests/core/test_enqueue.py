"""Producing work from Python as the documented producer role."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from sokratos_worker.client import enqueue_distillation, enqueue_triage
from sokratos_worker.errors import InvalidPayload
from tests.support.db import count

ROLES_SQL = (Path(__file__).resolve().parents[2] / "sql" / "roles.sql").read_text("utf-8")


@pytest.fixture
def producer_url(db: psycopg.Connection, database_url: str) -> str:
    """A login as sokratos_producer, which may call only the two public enqueue functions."""
    db.execute(ROLES_SQL)
    db.execute("ALTER ROLE sokratos_producer PASSWORD 'test-only-password'")
    info = psycopg.conninfo.conninfo_to_dict(database_url)
    info.update(user="sokratos_producer", password="test-only-password")
    url = psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})
    try:
        psycopg.connect(url).close()
    except psycopg.OperationalError as exc:  # e.g. pg_hba allows only the superuser
        pytest.skip(f"the server refuses other logins: {exc}")
    return url


def test_the_producer_role_enqueues_through_the_client(
    db: psycopg.Connection, producer_url: str
) -> None:
    triage = enqueue_triage(producer_url, "user: I moved to Lisbon\nassistant: noted", key="p1")
    again = enqueue_triage(producer_url, "user: other\nassistant: ok", key="p1")
    archive = enqueue_distillation(producer_url, {"archive_text": "user: hi"}, key="p2")
    assert triage.item_id is not None and again.item_id == triage.item_id
    assert archive.item_id is not None
    assert count(db, "SELECT count(*) FROM pending_triage WHERE id = %s", triage.item_id) == 1
    assert count(db, "SELECT count(*) FROM pending_distillation WHERE id = %s", archive.item_id)
    with pytest.raises(InvalidPayload, match=r"payload\.messages"):
        enqueue_distillation(producer_url, {"messages": "not a list"})
