"""sql/roles.sql on an existing Sokratos database whose tables live in a schema other than
public: PostgreSQL's secure schema pattern puts them in the owner's "$user" schema, `migrate` as
that owner creates the worker's tables and functions beside them, and roles.sql must find that
schema whoever runs it and put it on the two roles' search_path. Before, run by a superuser it
did not find the functions, and run by the owner it left the schema off the roles' path (the
worker saw "the database lacks migrations", the producer "function ... does not exist").
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from sokratos_worker.store.migrations import apply_migrations
from tests.support.operator import cli_env, run_cli, with_database

pytestmark = pytest.mark.postgres

ROLES_SQL = (Path(__file__).resolve().parents[2] / "sql" / "roles.sql").read_text("utf-8")

# Sokratos's schema (reference: db/schema.sql), created by its own role, so in its schema.
GO_SCHEMA = """
CREATE TABLE memories (
    id BIGSERIAL PRIMARY KEY, summary TEXT NOT NULL, embedding VECTOR(2560) NOT NULL,
    salience FLOAT DEFAULT 5, tags TEXT[], created_at TIMESTAMPTZ DEFAULT now(),
    last_accessed TIMESTAMPTZ DEFAULT now(), memory_type VARCHAR(20) DEFAULT 'general',
    entities TEXT[], confidence FLOAT DEFAULT 1.0, related_ids BIGINT[],
    superseded_by BIGINT REFERENCES memories(id), retrieval_count INT DEFAULT 0,
    last_retrieved_at TIMESTAMPTZ, usefulness_score FLOAT DEFAULT 0.5, source VARCHAR(50),
    source_date TIMESTAMPTZ, pipeline_id BIGINT,
    summary_tsv tsvector GENERATED ALWAYS AS (to_tsvector('english', summary)) STORED);
CREATE TABLE failed_operations (id BIGSERIAL PRIMARY KEY, op_type VARCHAR(50) NOT NULL,
    label TEXT NOT NULL, error_message TEXT NOT NULL, context_data JSONB NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now());
CREATE TABLE processed_emails (message_id VARCHAR(255) PRIMARY KEY,
    seen_at TIMESTAMPTZ DEFAULT now());
CREATE TABLE adaptive_params (key VARCHAR(100) PRIMARY KEY, value FLOAT NOT NULL,
    source VARCHAR(50) NOT NULL DEFAULT 'default', reason TEXT,
    updated_at TIMESTAMPTZ DEFAULT now());
INSERT INTO memories (summary, embedding)
    VALUES ('user lives in Lisbon', array_fill(0.01, ARRAY[2560])::vector);
"""


# roles.sql's first block (the roles are cluster-wide: another test may have made them).
CREATE_ROLES = ROLES_SQL[ROLES_SQL.index("DO $$") : ROLES_SQL.index("END $$;") + len("END $$;")]
assert "CREATE ROLE sokratos_producer" in CREATE_ROLES


@dataclass
class SchemaDatabase:
    superuser: str  # the database, as the server's superuser
    owner: str  # as Sokratos's role, which owns the tables (and the schema named after it)
    schema: str


@pytest.fixture
def sokratos_in_its_own_schema(pg_server: str) -> Iterator[SchemaDatabase]:
    suffix = uuid.uuid4().hex[:8]
    owner, dbname = f"sokratos_{suffix}", f"schema_db_{suffix}"
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(owner)))
        conn.execute(
            sql.SQL("CREATE DATABASE {} OWNER {}").format(
                sql.Identifier(dbname), sql.Identifier(owner)
            )
        )
    superuser = with_database(pg_server, dbname=dbname)
    with psycopg.connect(superuser, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")  # a superuser's job (docs §4)
        conn.execute(
            sql.SQL("CREATE SCHEMA {} AUTHORIZATION {}").format(
                sql.Identifier(owner), sql.Identifier(owner)
            )
        )
    owner_url = with_database(pg_server, dbname=dbname, user=owner)
    try:
        with psycopg.connect(owner_url, autocommit=True) as conn:
            conn.execute(GO_SCHEMA)
            where = conn.execute(
                "SELECT table_schema FROM information_schema.tables WHERE table_name = 'memories'"
            ).fetchall()
            assert where == [(owner,)]  # the "$user" schema, as PostgreSQL's docs recommend
        apply_migrations(owner_url)  # `sokratos-worker migrate` as the owner: succeeds
        yield SchemaDatabase(superuser, owner_url, owner)
    finally:
        with psycopg.connect(pg_server, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname))
            )
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(owner)))


def _login(url: str, role: str) -> str:
    """``url`` logging in as ``role`` itself (role settings apply to the login role)."""
    as_role = with_database(url, user=role)
    try:
        psycopg.connect(as_role, connect_timeout=5).close()
    except psycopg.OperationalError as exc:  # e.g. pg_hba allows only the superuser
        pytest.skip(f"the server refuses a login as {role}: {exc}")
    return as_role


def test_roles_sql_run_by_a_superuser_finds_the_tables_in_their_schema(
    sokratos_in_its_own_schema: SchemaDatabase,
) -> None:
    db = sokratos_in_its_own_schema
    with psycopg.connect(db.superuser, autocommit=True) as conn:
        conn.execute(ROLES_SQL)
        granted = conn.execute(
            "SELECT has_table_privilege('sokratos_worker', %s, 'INSERT'),"
            " has_function_privilege('sokratos_producer', %s, 'EXECUTE')",
            (
                f'"{db.schema}".pending_triage',
                f'"{db.schema}".sokratos_enqueue_triage(jsonb, text, text)',
            ),
        ).fetchone()
    assert granted == (True, True)


def test_the_worker_and_producer_roles_find_the_schema_roles_sql_granted(
    sokratos_in_its_own_schema: SchemaDatabase, tmp_path: Path
) -> None:
    db = sokratos_in_its_own_schema
    with psycopg.connect(db.superuser, autocommit=True) as conn:
        conn.execute(CREATE_ROLES)  # cluster-wide; the owner may not create roles
    with psycopg.connect(db.owner, autocommit=True) as conn:
        conn.execute(ROLES_SQL)  # as the owner of the tables: runs through

    producer = _login(db.owner, "sokratos_producer")
    enqueued = run_cli(
        ["enqueue", "triage", "--exchange", "user: I moved to Lisbon\nassistant: Noted."],
        cli_env(tmp_path, SOKRATOS_DATABASE_URL=producer),
    )
    assert enqueued.returncode == 0, enqueued.stderr[-1500:]
    assert enqueued.stdout.strip().isdigit(), enqueued.stdout

    worker = _login(db.owner, "sokratos_worker")
    ran = run_cli(
        ["run", "--once", "--no-migrate"],
        cli_env(
            tmp_path,
            SOKRATOS_DATABASE_URL=worker,
            SOKRATOS_EMBEDDING_URL="http://127.0.0.1:1/v1",
            SOKRATOS_EMBEDDING_MODEL="m",
            SOKRATOS_EMBEDDING_DIM="2560",
        ),
    )
    assert ran.returncode == 0, ran.stderr[-1500:]
    assert "lacks migrations" not in ran.stderr


def test_roles_sql_refuses_to_guess_between_two_schemas(
    sokratos_in_its_own_schema: SchemaDatabase,
) -> None:
    db = sokratos_in_its_own_schema
    with psycopg.connect(db.superuser, autocommit=True) as conn:
        conn.execute("CREATE TABLE public.sokratos_worker_migrations (version int)")  # a stray copy
        with pytest.raises(psycopg.errors.RaiseException, match="several schemas") as raised:
            conn.execute(ROLES_SQL)
    assert db.schema in str(raised.value) and "public" in str(raised.value)


def test_roles_sql_run_twice_by_the_database_owner_still_grants(
    sokratos_in_its_own_schema: SchemaDatabase,
) -> None:
    # The first run sets the database's search_path; the second, after an upgrade that added a
    # table, found that path (its own) and raised: nothing was granted any more.
    db = sokratos_in_its_own_schema
    with psycopg.connect(db.superuser, autocommit=True) as conn:
        conn.execute(CREATE_ROLES)  # cluster-wide; the owner may not create roles
    with psycopg.connect(db.owner, autocommit=True) as conn:
        conn.execute(ROLES_SQL)  # first run: fine
        # An upgrade adds a table the worker uses; docs: run roles.sql again.
        conn.execute(f'REVOKE ALL ON "{db.schema}".work_outcomes FROM sokratos_worker')
        try:
            conn.execute(ROLES_SQL)  # second run, as documented ("idempotent")
        except psycopg.Error as exc:
            pytest.fail(f"roles.sql run a second time by the owner failed: {exc}")
        granted = conn.execute(
            "SELECT has_table_privilege('sokratos_worker', %s, 'INSERT')",
            (f'"{db.schema}".work_outcomes',),
        ).fetchone()
    assert granted == (True,)


@pytest.fixture
def vector_in_extensions_schema(pg_server: str) -> Iterator[SchemaDatabase]:
    """Like sokratos_in_its_own_schema, but pgvector lives in schema "extensions" and the
    database's search_path names it (Supabase's layout)."""
    suffix = uuid.uuid4().hex[:8]
    owner, dbname = f"sokratos_{suffix}", f"ext_db_{suffix}"
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(owner)))
        conn.execute(
            sql.SQL("CREATE DATABASE {} OWNER {}").format(
                sql.Identifier(dbname), sql.Identifier(owner)
            )
        )
    superuser = with_database(pg_server, dbname=dbname)
    with psycopg.connect(superuser, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA extensions")
        conn.execute("GRANT USAGE ON SCHEMA extensions TO PUBLIC")
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector SCHEMA extensions")
        conn.execute(
            sql.SQL('ALTER DATABASE {} SET search_path = "$user", public, extensions').format(
                sql.Identifier(dbname)
            )
        )
        conn.execute(
            sql.SQL("CREATE SCHEMA {} AUTHORIZATION {}").format(
                sql.Identifier(owner), sql.Identifier(owner)
            )
        )
        conn.execute(CREATE_ROLES)
    owner_url = with_database(pg_server, dbname=dbname, user=owner)
    try:
        with psycopg.connect(owner_url, autocommit=True) as conn:
            conn.execute(GO_SCHEMA)
        apply_migrations(owner_url)
        yield SchemaDatabase(superuser, owner_url, owner)
    finally:
        with psycopg.connect(pg_server, autocommit=True) as conn:
            # The roles are cluster-wide, their settings in a dropped database go with it.
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname))
            )
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(owner)))


def test_roles_sql_as_superuser_keeps_the_databases_search_path_for_the_worker(
    vector_in_extensions_schema: SchemaDatabase,
) -> None:
    # roles.sql set "<schema>, public" for the roles, which replaced the database's path for
    # them: pgvector's schema disappeared and the worker could not see type vector.
    db = vector_in_extensions_schema
    worker = _login(db.owner, "sokratos_worker")
    with psycopg.connect(worker) as conn:  # before roles.sql: the database's path applies
        assert conn.execute("SELECT to_regtype('vector')").fetchone()[0] is not None
    with psycopg.connect(db.superuser, autocommit=True) as conn:
        conn.execute(ROLES_SQL)
        conn.execute(ROLES_SQL)  # again: the path, which names the schema, is left as it is
    with psycopg.connect(worker) as conn:
        path = conn.execute("SHOW search_path").fetchone()[0]
        # The worker's SQL casts to ::vector and uses <=> unqualified.
        vector = conn.execute("SELECT to_regtype('vector')").fetchone()[0]
        assert vector is not None, f"sokratos_worker cannot see type vector (search_path={path})"
        assert conn.execute("SELECT to_regclass('memories')").fetchone()[0] is not None
    # Ours first (the worker's unqualified names resolve to its tables), then the database's.
    assert path == f'{db.schema}, "$user", public, extensions'
