"""The pool opens what a drain needs at start and grows on demand, up to its size."""

from __future__ import annotations

from contextlib import ExitStack

import psycopg

from sokratos_worker.store.connection import Database


def _backends(database_url: str) -> int:
    """Connections to this test's database, not counting the one asking."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) - 1 FROM pg_stat_activity WHERE datname = current_database()"
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_keep_open_connections_are_opened_at_start(database_url: str) -> None:
    database = Database(database_url, size=6, keep_open=4)
    try:
        database.pool.wait(timeout=10)  # the pool opens them in the background
        assert _backends(database_url) == 4
    finally:
        database.close()
    assert _backends(database_url) == 0


def test_the_pool_grows_beyond_keep_open_up_to_its_size(database_url: str) -> None:
    database = Database(database_url, size=3, keep_open=1)
    try:
        database.pool.wait(timeout=10)
        assert _backends(database_url) == 1
        with ExitStack() as held:
            for _ in range(3):
                held.enter_context(database.connection())
            assert _backends(database_url) == 3
        assert _backends(database_url) == 3  # returned, they stay open (idle) until max_idle
    finally:
        database.close()
