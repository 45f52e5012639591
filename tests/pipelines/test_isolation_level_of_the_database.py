"""A database whose default isolation is REPEATABLE READ or SERIALIZABLE (set for another
client: ALTER DATABASE ... SET default_transaction_isolation) still keeps one memory per fact.

The settle's near-duplicate re-check runs under a lock, and must see what another settle
committed while it waited for that lock: under REPEATABLE READ its snapshot was taken before
(by the statement that deleted the queue row), and two slots each saved the fact. Each worker
session now sets READ COMMITTED for itself. Real parts: the runner and chat client, a scripted
LLM server, the test's PostgreSQL with the database-level setting.
"""

from __future__ import annotations

import json
import threading
import time

import psycopg
import pytest
from psycopg import sql

from sokratos_worker.store.memories import _DUPLICATE_WRITE_LOCK
from sokratos_worker.testing.scripted_llm import ScriptedLLM

from .conftest import drain, enqueue, memory_rows
from .test_end_to_end import SAVED_SUMMARY, respond

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.mark.parametrize("isolation", ["repeatable read", "serializable"])
def test_the_same_fact_from_many_slots_is_saved_once_whatever_the_default_isolation(
    db: psycopg.Connection, database_url: str, isolation: str
) -> None:
    name = db.info.dbname
    db.execute(
        sql.SQL("ALTER DATABASE {} SET default_transaction_isolation = {}").format(
            sql.Identifier(name), sql.Literal(isolation)
        )
    )
    exchange = "user: my daughter Mia started school in Graz today\nassistant: Congratulations!"
    ids = [
        enqueue(db, "SELECT sokratos_enqueue_triage(%s::jsonb)", json.dumps({"exchange": exchange}))
        for _ in range(8)  # (one per slot: no settle claims a next item, which would fail)
    ]
    # The settles' lock held until several wait for it, their snapshots taken: the race made sure.
    with psycopg.connect(database_url, autocommit=True) as lock:
        lock.execute("SELECT pg_advisory_lock(%s)", (_DUPLICATE_WRITE_LOCK,))
        holder = threading.Thread(target=_release_once_settles_wait, args=(database_url, lock))
        holder.start()
        with ScriptedLLM(chat=respond, latency=0.05) as server:
            drain(database_url, server, SOKRATOS_CONCURRENCY="8")
        holder.join(60)

    rows = db.execute(
        "SELECT item_id, outcome FROM work_outcomes WHERE queue = 'pending_triage'"
    ).fetchall()
    assert sorted(r[0] for r in rows) == sorted(ids)  # each item one outcome
    assert [m["summary"] for m in memory_rows(db)] == [SAVED_SUMMARY]
    assert [r[1] for r in rows].count("saved") == 1, rows


def _release_once_settles_wait(
    database_url: str, lock: psycopg.Connection, waiting: int = 3
) -> None:
    """Unlock once ``waiting`` sessions wait for the settles' advisory lock (30 s at most)."""
    with psycopg.connect(database_url, autocommit=True) as watch:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            row = watch.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            ).fetchone()
            if row is not None and row[0] >= waiting:
                break
            time.sleep(0.02)
    lock.execute("SELECT pg_advisory_unlock(%s)", (_DUPLICATE_WRITE_LOCK,))
