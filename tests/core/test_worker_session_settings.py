"""What the daemon's sessions set over the role's defaults (store/connection.py worker_session):
the timeouts off, and commits durable. A role with ``synchronous_commit = off`` let a spool
import delete its file after a commit a server crash could still lose (review, 2026-12-05)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from sokratos_worker.store.connection import Database, connect


@pytest.fixture
def role_url(db: psycopg.Connection, database_url: str) -> Iterator[str]:
    role = "s_" + uuid.uuid4().hex[:8]
    db.execute(sql.SQL("CREATE ROLE {} LOGIN SUPERUSER").format(sql.Identifier(role)))
    for setting in (
        "statement_timeout = '50ms'",
        "lock_timeout = '50ms'",
        "idle_session_timeout = '1s'",
        "synchronous_commit = off",
    ):
        db.execute(sql.SQL("ALTER ROLE {} SET ").format(sql.Identifier(role)) + sql.SQL(setting))
    info = psycopg.conninfo.conninfo_to_dict(database_url)
    info["user"] = role
    yield psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items() if v})
    db.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


SHOWN = (
    "SELECT current_setting('statement_timeout'), current_setting('lock_timeout'),"
    " current_setting('idle_session_timeout'), current_setting('synchronous_commit')"
)


def test_the_daemons_connections_override_the_roles_settings(role_url: str) -> None:
    # A command's connection keeps the role's: a transaction pooler would hand the
    # session on to other clients (tests/core/test_pgbouncer.py).
    with connect(role_url) as plain:
        assert plain.execute(SHOWN).fetchone() == ("50ms", "50ms", "1s", "off")
    with connect(role_url, worker_settings=True) as conn:
        assert conn.execute(SHOWN).fetchone() == ("0", "0", "0", "on")
    # Kept past the set-up's own commit.
    with connect(role_url, autocommit=False, worker_settings=True) as conn:
        assert conn.execute(SHOWN).fetchone() == ("0", "0", "0", "on")
    database = Database(role_url, size=2)
    try:
        with database.connection() as conn:
            assert conn.execute(SHOWN).fetchone() == ("0", "0", "0", "on")
    finally:
        database.close()


@pytest.mark.parametrize("level", ["local", "remote_apply"])
def test_a_stronger_or_equal_synchronous_commit_is_kept(
    db: psycopg.Connection, role_url: str, level: str
) -> None:
    role = psycopg.conninfo.conninfo_to_dict(role_url)["user"]
    db.execute(
        sql.SQL("ALTER ROLE {} SET synchronous_commit = {}").format(
            sql.Identifier(str(role)), sql.SQL(level)
        )
    )
    with connect(role_url, worker_settings=True) as conn:
        assert conn.execute("SHOW synchronous_commit").fetchone() == (level,)
