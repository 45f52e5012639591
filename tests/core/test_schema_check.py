"""`run` and `check` judge the database the same way: missing migrations, embedding column,
grants, typos."""

from __future__ import annotations

import uuid
from pathlib import Path

import psycopg
from psycopg import sql

from sokratos_worker.config import Settings
from sokratos_worker.schema_check import schema_problems
from tests.conftest import _with_database
from tests.core.test_cli import cli, env_for
from tests.support.db import count

ROLES_SQL = (Path(__file__).resolve().parents[2] / "sql" / "roles.sql").read_text("utf-8")


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


def _embeddings(dim: int) -> Settings:
    return Settings(embedding_url="http://127.0.0.1:1/v1", embedding_model="m", embedding_dim=dim)


def test_a_nullable_fixed_dimension_that_differs_is_refused(db: psycopg.Connection) -> None:
    # A pgvector index needs a fixed dimension: the column pinned, NOT NULL left off. Every
    # save of another dimension would fail ("expected 1024 dimensions, not 2560").
    db.execute("ALTER TABLE memories ALTER COLUMN embedding TYPE vector(1024)")
    db.execute(
        "INSERT INTO memories (summary, embedding) VALUES ('x', array_fill(0.1, ARRAY[1024])::vector)"
    )
    problems = schema_problems(_embeddings(2560), db)
    assert [p.variable for p in problems] == ["SOKRATOS_EMBEDDING_DIM"], problems
    assert "1024" in str(problems[0])


def test_a_nullable_fixed_dimension_that_matches_is_fine(db: psycopg.Connection) -> None:
    db.execute("ALTER TABLE memories ALTER COLUMN embedding TYPE vector(1024)")
    assert schema_problems(_embeddings(1024), db) == []
    assert schema_problems(Settings(), db) == []  # nullable: no embedding model needed


def _as_worker_role(url: str) -> str:
    info = psycopg.conninfo.conninfo_to_dict(url)
    info["options"] = "-c role=sokratos_worker"
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})


def test_a_table_the_worker_role_may_not_write_is_named_by_check_and_run(
    db: psycopg.Connection, database_url: str, tmp_path: Path
) -> None:
    # As after a migration that added a table, with roles.sql not run again.
    db.execute(ROLES_SQL)
    db.execute("REVOKE ALL ON work_outcomes FROM sokratos_worker")
    env = env_for(_as_worker_role(database_url), tmp_path)
    checked = cli("check", env=env)
    failing = [line for line in checked.stdout.splitlines() if line.startswith("FAIL")]
    assert any("work_outcomes" in line and "roles.sql" in line for line in failing), checked.stdout
    # The role cannot see the other sessions: the line says so rather than "-1 in use now".
    connections = next(line for line in checked.stdout.splitlines() if "connections" in line)
    assert "unknown to this role" in connections and "-1" not in connections, connections
    ran = cli("run", "--once", "--no-migrate", env=env)
    assert ran.returncode == 78, ran.stderr[-2000:]
    assert "work_outcomes" in ran.stderr and "roles.sql" in ran.stderr


def test_the_worker_role_with_every_grant_passes_the_schema_check(
    db: psycopg.Connection, database_url: str
) -> None:
    db.execute(ROLES_SQL)
    with psycopg.connect(_as_worker_role(database_url), autocommit=True) as conn:
        assert schema_problems(Settings(), conn) == []


def test_a_column_level_update_grant_on_memories_passes_the_schema_check(
    db: psycopg.Connection, database_url: str
) -> None:
    # The worker only runs `UPDATE memories SET superseded_by = ...`: a DBA's column grant is
    # all it needs, yet has_table_privilege(..., 'UPDATE') is false for it and run refused.
    db.execute(ROLES_SQL)
    db.execute("REVOKE UPDATE ON memories FROM sokratos_worker")
    db.execute("GRANT UPDATE (superseded_by) ON memories TO sokratos_worker")
    with psycopg.connect(_as_worker_role(database_url), autocommit=True) as conn:
        # What the worker does to memories works under this grant (memories.py: supersede).
        conn.execute("UPDATE memories SET superseded_by = NULL WHERE false")
        problems = schema_problems(Settings(), conn)
    assert problems == [], problems


def test_a_database_that_cannot_store_every_script_is_refused_by_check_and_run(
    pg_server: str, tmp_path: Path
) -> None:
    """A LATIN1 database refuses a Japanese subject (22P05): the email check stopped at the
    first such message for good, its dead letter refused for the same text; `migrate` stopped
    at a migration's own text with a traceback. Now `migrate`, `run` and `check` name the
    database's encoding and what to create instead."""
    name = f"latin1_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_server, autocommit=True) as admin:
        admin.execute(
            sql.SQL(
                "CREATE DATABASE {} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C'"
                " TEMPLATE template0"
            ).format(sql.Identifier(name))
        )
    try:
        url = _with_database(pg_server, name)
        env = env_for(url, tmp_path)
        with psycopg.connect(url, autocommit=True) as conn:
            (problem,) = schema_problems(Settings(), conn)
        assert problem.variable == "SOKRATOS_DATABASE_URL"
        assert "in LATIN1" in problem.message and "UTF8" in problem.message
        for args in (("migrate",), ("run", "--once"), ("check",)):
            refused = cli(*args, env=env)  # (migrate stopped at a migration's text, a traceback)
            assert refused.returncode in (1, 78), (args, refused.stderr[-2000:])
            assert "in LATIN1" in refused.stdout + refused.stderr, (args, refused.stderr[-2000:])
            assert "Traceback" not in refused.stderr, (args, refused.stderr[-2000:])
    finally:
        with psycopg.connect(pg_server, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
