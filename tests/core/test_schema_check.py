"""`run` and `check` judge the database the same way: missing migrations, embedding column, typos."""

from __future__ import annotations

from pathlib import Path

import psycopg

from tests.core.test_cli import cli, env_for
from tests.support.db import count


def test_run_no_migrate_on_an_unmigrated_database_exits_78_naming_migrate(
    empty_database_url: str, tmp_path: Path
) -> None:
    proc = cli("run", "--once", "--no-migrate", env=env_for(empty_database_url, tmp_path))
    assert proc.returncode == 78, proc.stderr[-2000:]
    assert "lacks migrations 0001_pgvector" in proc.stderr
    assert "sokratos-worker migrate" in proc.stderr and "Traceback" not in proc.stderr
    with psycopg.connect(empty_database_url, autocommit=True) as conn:  # and it changed nothing
        assert count(conn, "SELECT count(*) FROM pg_tables WHERE tablename = 'pending_triage'") == 0


def test_check_fails_where_run_would_refuse_a_not_null_embedding_column(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    # A Sokratos database: memories.embedding is NOT NULL, and no embedding model is set.
    db.execute("ALTER TABLE memories ALTER COLUMN embedding SET NOT NULL")
    env = env_for(database_url, tmp_path)
    check = cli("check", env=env)
    assert check.returncode == 1
    schema = [line for line in check.stdout.splitlines() if "schema" in line]
    assert len(schema) == 1 and schema[0].startswith("FAIL"), check.stdout
    assert "SOKRATOS_EMBEDDING_URL" in schema[0]
    run = cli("run", "--once", env=env)
    assert run.returncode == 78 and "SOKRATOS_EMBEDDING_URL" in run.stderr


def test_check_names_an_unknown_variable_and_run_warns(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    env = env_for(database_url, tmp_path, SOKRATOS_CONCURENCY="8")  # sic: a typo
    check = cli("check", env=env)
    assert check.returncode == 1
    config = [line for line in check.stdout.splitlines() if "configuration" in line]
    assert config and config[0].startswith("FAIL") and "SOKRATOS_CONCURENCY" in config[0]
    assert any(line.startswith("ok") and "schema" in line for line in check.stdout.splitlines())
    run = cli("run", "--once", env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert '"unknown_variables_ignored"' in run.stderr and "SOKRATOS_CONCURENCY" in run.stderr
