"""A migration the database refuses half-way (here: a table of the operator's own under a
name the worker's schema uses) is rolled back whole, and `migrate` and `run` say which one
failed and why, with exit 78. They said "this database lacks sokratos-worker's schema; run
'sokratos-worker migrate' first" (from `migrate` itself), named no migration, and exited 1,
which systemd restarts every 5 s into the same failure (found by an ingresshunt hunt)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psycopg

from sokratos_worker.store.migrations import load_migrations
from tests.support.operator import REPO, cli_env, run_cli


def _recorded(url: str) -> list[int]:
    with psycopg.connect(url, autocommit=True) as conn:
        return [r[0] for r in conn.execute("SELECT version FROM sokratos_worker_migrations")]


def _exists(url: str, table: str) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table,)).fetchone()
        return bool(row and row[0])


def test_a_failing_migration_is_rolled_back_and_named(
    tmp_path: Path, empty_database_url: str
) -> None:
    url = empty_database_url
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE work_outcomes (x int)")  # the operator's own table
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=url)

    for command in (["migrate"], ["run", "--once"]):
        done = run_cli(command, env)
        assert done.returncode == 78, (command, done.returncode, done.stderr)
        assert "Traceback" not in done.stderr
        assert "migration 0002_tables failed" in done.stderr, done.stderr
        assert 'column "decided_at" does not exist' in done.stderr, done.stderr
        assert "rolled back" in done.stderr, done.stderr
        assert "run 'sokratos-worker migrate' first" not in done.stderr, done.stderr
        # Told as the migration's failure, not as a wrong SOKRATOS_DATABASE_URL.
        assert done.stderr.startswith("sokratos-worker: migration 0002_tables failed"), done.stderr

    # 0001 committed before; nothing of 0002 stayed (its first table is not there).
    assert _recorded(url) == [1]
    assert not _exists(url, "failed_operations")
    assert not _exists(url, "pending_triage")

    # Once the table is out of the way, migrate finishes the job.
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ALTER TABLE work_outcomes RENAME TO my_own_outcomes")
    done = run_cli(["migrate"], env)
    assert done.returncode == 0, done.stderr
    assert sorted(_recorded(url)) == [m.version for m in load_migrations()]


def test_a_cancelled_migration_is_told_as_a_cancel_to_run_again(
    tmp_path: Path, database_url: str
) -> None:
    # A cancel is no fault of the migration's: exit 1 and "run it again", not the 78 of one
    # the database refuses for good (under systemd, 78 would keep the worker down).
    url = database_url
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DELETE FROM sokratos_worker_migrations WHERE version >= 47")
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=url)
    holder = psycopg.connect(url)
    holder.execute("LOCK pending_triage IN ROW EXCLUSIVE MODE")  # 0047's index waits for it
    migrating = subprocess.Popen(
        [sys.executable, "-m", "sokratos_worker", "migrate"],
        env=env,
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            deadline = time.monotonic() + 60
            cancelled = False
            while not cancelled and time.monotonic() < deadline:
                row = conn.execute(
                    "SELECT pg_cancel_backend(pid) FROM pg_locks"
                    " WHERE NOT granted AND relation = 'pending_triage'::regclass LIMIT 1"
                ).fetchone()
                cancelled = bool(row and row[0])
                time.sleep(0.05)
            assert cancelled, "the migration never waited for the lock"
        _, err = migrating.communicate(timeout=120)
    finally:
        holder.close()
        if migrating.poll() is None:
            migrating.kill()
            migrating.wait()
    assert migrating.returncode == 1, err
    assert "cancelled the command's statement" in err, err
    assert "Traceback" not in err, err
    assert 47 not in _recorded(url)
    assert run_cli(["migrate"], env).returncode == 0
    assert 50 in _recorded(url)


def test_a_migration_that_meets_another_session_creating_the_same_object_finishes(
    tmp_path: Path, empty_database_url: str
) -> None:
    """IF NOT EXISTS does not wait for a creation in flight: when Sokratos (or another
    installer) creates the pgvector extension on the same fresh database at the same moment,
    the catalog's unique index refuses ours (23505). That is no name taken for good: it exited
    78, which keeps a systemd worker down, though the next try adopts the extension (found by a
    review)."""
    url = empty_database_url
    env = cli_env(tmp_path, SOKRATOS_DATABASE_URL=url)
    other = psycopg.connect(url)
    other.execute("CREATE EXTENSION IF NOT EXISTS vector")  # not committed yet
    migrating = subprocess.Popen(
        [sys.executable, "-m", "sokratos_worker", "migrate"],
        env=env, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            deadline = time.monotonic() + 60
            waiting = False
            while not waiting and time.monotonic() < deadline:
                row = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND query ILIKE '%CREATE EXTENSION%' AND pid <> pg_backend_pid()"
                ).fetchone()
                waiting = bool(row and row[0])
                time.sleep(0.02)
            assert waiting, "the migration never waited for the other session's extension"
        other.commit()
        _, err = migrating.communicate(timeout=120)
    finally:
        other.close()
        if migrating.poll() is None:
            migrating.kill()
            migrating.wait()
    assert migrating.returncode == 0, err
    assert '"event": "migration_create_raced"' in err or "migration_create_raced" in err, err
    assert sorted(_recorded(url)) == [m.version for m in load_migrations()]
