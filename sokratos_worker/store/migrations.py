"""Numbered plain-SQL migrations from ``sql/``, each applied once, under an advisory lock."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import psycopg
import structlog

from sokratos_worker.errors import WorkerError
from sokratos_worker.store.connection import connect, translated

log = structlog.get_logger(__name__)

_MIGRATION_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")
# Any constant shared by every worker: two workers starting together take turns.
_LOCK_KEY = 0x50C_2A705


class MigrationError(WorkerError):
    """A migration failed or the recorded history disagrees with the files."""


@dataclass(frozen=True)
class Migration:
    """One ``sql/NNNN_name.sql`` file."""

    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        """SHA-256 of the file, recorded so that an edited, applied file is noticed."""
        return hashlib.sha256(self.sql.encode()).hexdigest()


def sql_directory() -> Path:
    """Where the migrations are: inside the wheel, or ``sql/`` of a source checkout."""
    packaged = Path(__file__).resolve().parent.parent / "sql"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "sql"


def load_migrations(directory: Path | None = None) -> list[Migration]:
    """The migrations in version order."""
    folder = directory or sql_directory()
    found = []
    for path in sorted(folder.glob("*.sql")):
        match = _MIGRATION_NAME.match(path.name)
        if match:
            found.append(Migration(int(match.group(1)), path.stem, path.read_text("utf-8")))
    return found


def apply_migrations(conninfo: str) -> list[str]:
    """Apply what is pending; returns the names applied (empty when up to date)."""
    applied: list[str] = []
    with connect(conninfo, autocommit=True) as conn, translated():
        conn.execute("SELECT pg_advisory_lock(%s)", (_LOCK_KEY,))
        try:
            # Up to date: read only, so a worker role that may not create tables starts too.
            if not pending_migrations(conn):
                return []
            _create_history_table(conn)
            done = {
                row[0]: row[1]
                for row in conn.execute("SELECT version, checksum FROM sokratos_worker_migrations")
            }
            for migration in load_migrations():
                if migration.version in done:
                    if done[migration.version] != migration.checksum:
                        log.warning(
                            "migration_checksum_changed",
                            migration=migration.name,
                            hint="an applied migration file was edited; it is not re-run",
                        )
                    continue
                _apply_one(conn, migration)
                applied.append(migration.name)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_LOCK_KEY,))
    if applied:
        log.info("migrations_applied", migrations=applied)
    return applied


def pending_migrations(conn: psycopg.Connection) -> list[str]:
    """The migrations this version has that the database has not recorded, in order."""
    table = conn.execute("SELECT to_regclass('sokratos_worker_migrations')").fetchone()
    done: set[int] = set()
    if table is not None and table[0] is not None:
        done = {row[0] for row in conn.execute("SELECT version FROM sokratos_worker_migrations")}
    return [m.name for m in load_migrations() if m.version not in done]


def _create_history_table(conn: psycopg.Connection) -> None:
    try:
        conn.execute(
            """CREATE TABLE IF NOT EXISTS sokratos_worker_migrations (
                   version int PRIMARY KEY,
                   name text NOT NULL,
                   checksum text NOT NULL,
                   applied_at timestamptz NOT NULL DEFAULT now())"""
        )
    except psycopg.errors.InsufficientPrivilege as exc:
        row = conn.execute("SELECT current_user").fetchone()
        user = row[0] if row else conn.info.user
        raise MigrationError(
            f"migrations are pending and the role {user!r} may not apply them:"
            f" {str(exc).splitlines()[0]}. Run 'sokratos-worker migrate' as the role that owns"
            " the tables, or let this role start without migrating"
            " (SOKRATOS_MIGRATE_ON_START=false or 'run --no-migrate'); see README, Upgrading."
        ) from exc


def _apply_one(conn: psycopg.Connection, migration: Migration) -> None:
    try:
        with conn.transaction():
            conn.execute(migration.sql.encode())
            conn.execute(
                "INSERT INTO sokratos_worker_migrations (version, name, checksum)"
                " VALUES (%s, %s, %s)",
                (migration.version, migration.name, migration.checksum),
            )
    except psycopg.errors.FeatureNotSupported as exc:
        raise MigrationError(_explain(migration, exc)) from exc
    except psycopg.errors.UndefinedFile as exc:
        raise MigrationError(_explain(migration, exc)) from exc
    except psycopg.errors.InsufficientPrivilege as exc:
        raise MigrationError(_explain(migration, exc)) from exc


def _explain(migration: Migration, exc: psycopg.Error) -> str:
    text = str(exc).splitlines()[0]
    if "vector" in text or "extension" in text:
        return (
            f"migration {migration.name} failed: {text}. The pgvector extension is required:"
            " install it on the PostgreSQL server (package postgresql-NN-pgvector) and run"
            " 'CREATE EXTENSION vector;' as a superuser, or leave SOKRATOS_DATABASE_URL unset"
            " to use the embedded PostgreSQL, which ships it."
        )
    return (
        f"migration {migration.name} failed: {text}. Run 'sokratos-worker migrate' as a role"
        " that owns the tables (see README, Upgrading)."
    )
