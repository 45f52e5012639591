"""A command's transient database error the server answered with is not "is PostgreSQL
running?": a deadlock (class 40) says the transaction was ended and to run it again, a full
disk (class 53) to free the resource. Both still exit 75 (a try later may succeed). Before,
every one printed "database unavailable: deadlock detected. Check SOKRATOS_DATABASE_URL and
that PostgreSQL is running." Real parts: the deadlock is a real one, between two sessions of
the test's PostgreSQL, through the commands' own translation (store.connection.translated).
"""

from __future__ import annotations

import threading
from pathlib import Path

import psycopg
import pytest
from psycopg import errors as pg_errors

from sokratos_worker.cli import _reported_exit_code
from sokratos_worker.config import Settings
from sokratos_worker.errors import DatabaseUnavailable
from sokratos_worker.exit_codes import EXIT_TEMPFAIL
from sokratos_worker.store.connection import translated
from tests.core.test_cli import cli, env_for


def _real_deadlock(database_url: str) -> DatabaseUnavailable:
    """Two sessions lock two rows in opposite orders; the one the server picks is translated."""
    with psycopg.connect(database_url, autocommit=True) as setup:
        setup.execute("CREATE TABLE IF NOT EXISTS deadlock_rows (id int PRIMARY KEY)")
        setup.execute("INSERT INTO deadlock_rows VALUES (1), (2) ON CONFLICT DO NOTHING")
    first_locked, second_locked = threading.Event(), threading.Event()
    caught: list[DatabaseUnavailable] = []

    def session(mine: int, other: int, locked: threading.Event, wait: threading.Event) -> None:
        with psycopg.connect(database_url) as conn:
            try:
                with translated(), conn.transaction():
                    conn.execute("SET LOCAL lock_timeout = '20s'")
                    conn.execute("SELECT 1 FROM deadlock_rows WHERE id = %s FOR UPDATE", (mine,))
                    locked.set()
                    assert wait.wait(20)
                    conn.execute("SELECT 1 FROM deadlock_rows WHERE id = %s FOR UPDATE", (other,))
            except DatabaseUnavailable as exc:
                caught.append(exc)

    threads = [
        threading.Thread(target=session, args=(1, 2, first_locked, second_locked)),
        threading.Thread(target=session, args=(2, 1, second_locked, first_locked)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(caught) == 1, caught
    return caught[0]


def test_a_real_deadlock_says_run_it_again_not_is_postgresql_running(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    exc = _real_deadlock(database_url)
    settings = Settings(database_url=database_url)
    assert _reported_exit_code(exc, settings) == EXIT_TEMPFAIL
    said = capsys.readouterr().err
    assert said.startswith(
        "sokratos-worker: the database ended the command's transaction: deadlock detected"
        " (SQLSTATE 40P01); it conflicted with another session's"
    ), said
    assert "run it again" in said and "PostgreSQL is running" not in said, said


def test_a_full_disk_says_free_it(database_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(DatabaseUnavailable) as raised, translated():
        raise pg_errors.DiskFull("could not extend file: No space left on device")
    assert _reported_exit_code(raised.value, Settings(database_url=database_url)) == EXIT_TEMPFAIL
    said = capsys.readouterr().err
    assert "the database is short of a resource: could not extend file" in said, said
    assert "(SQLSTATE 53100); free some" in said and "PostgreSQL is running" not in said, said


def test_an_unreachable_server_still_says_where_to_look(capsys: pytest.CaptureFixture[str]) -> None:
    exc = DatabaseUnavailable("database unavailable: connection refused")
    settings = Settings(database_url="postgresql://u@127.0.0.1:1/db")
    assert _reported_exit_code(exc, settings) == EXIT_TEMPFAIL
    assert "Check SOKRATOS_DATABASE_URL and that PostgreSQL is running" in capsys.readouterr().err


def test_a_connection_limit_says_so_not_is_postgresql_running(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    """libpq gives a refusal for a limit without a SQLSTATE: ConnectionLimitReached."""
    role = "cli_limited_to_none"
    db.execute(f"DROP ROLE IF EXISTS {role}")
    db.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'test-only-password' CONNECTION LIMIT 0")
    try:
        info = psycopg.conninfo.conninfo_to_dict(database_url)
        info.update(user=role, password="test-only-password")
        url = psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})
        proc = cli("failed", "list", env=env_for(url, tmp_path))
    finally:
        db.execute(f"DROP ROLE IF EXISTS {role}")
    assert proc.returncode == 75, proc.stderr
    said = proc.stderr.strip()
    assert said.startswith("sokratos-worker: the database refuses new connections for a limit:")
    assert "too many connections for role" in said and "CONNECTION LIMIT" in said, said
    assert "PostgreSQL is running" not in said, said
