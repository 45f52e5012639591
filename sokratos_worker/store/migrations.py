"""Numbered plain-SQL migrations from ``sql/``, each applied once, under an advisory lock."""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import structlog

from sokratos_worker.config import ConfigError
from sokratos_worker.errors import WorkerError
from sokratos_worker.store.connection import connect, is_transient, translated
from sokratos_worker.store.status import SESSION_COLUMNS, session

log = structlog.get_logger(__name__)

_MIGRATION_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")
# Any constant shared by every worker: two workers starting together take turns.
_LOCK_KEY = 0x50C_2A705
# A migration takes its table locks within this or steps back and tries again: waiting in the
# lock queue behind another session's long transaction would hold every claim behind it.
LOCK_TIMEOUT_MS = 2000
RETRY_MAX_S = 30.0
# Waiting for the advisory lock (another migrator): how often it is tried, and how often the
# wait is logged (the journal must explain a start that takes long).
LOCK_POLL_S = 0.5
LOCK_LOG_EVERY_S = 15.0


# Where an operator reads how migrations and least-privilege workers go together.
UPGRADING = "docs/production.md §7 Upgrading"


# What a slow start waits for, in one line for an operator (the daemon's systemd STATUS=).
Progress = Callable[[str], None]


def _nobody_listens(_: str) -> None:
    """The default ``on_progress``: without a status line to keep, the log lines say it all."""


class MigrationError(WorkerError):
    """A migration failed or the recorded history disagrees with the files."""


class MigrationRefused(MigrationError, ConfigError):
    """The server refused a migration for good (no pgvector, a role that may not create):
    only the operator can fix it, so it exits 78 and systemd does not restart it in a loop."""

    def __init__(self, message: str) -> None:
        ConfigError.__init__(self, "SOKRATOS_DATABASE_URL", message)


class MigrationFailedForGood(MigrationRefused):
    """A migration the database refused half-way as it would at every try: 78 as a refusal,
    but told as the migration's failure, not as something wrong with the URL."""

    heading = ""

    def __str__(self) -> str:
        return self.message


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


# The server encoding that stores text in any script. (Not SQL_ASCII either: its jsonb
# refuses the \uXXXX escapes of non-ASCII text, so a dead letter quoting one could not be
# written, and left() counts bytes there, splitting a character.)
_ANY_SCRIPT_ENCODINGS = frozenset({"UTF8"})


def encoding_problem(conn: psycopg.Connection) -> ConfigError | None:
    """A database in LATIN1 (say) refuses every memory and email in another script (22P05):
    an email check would stop at the first such message for good; the migrations themselves
    hold characters it refuses. ``migrate`` and ``run`` refuse it first, saying why."""
    row = conn.execute("SHOW server_encoding").fetchone()
    encoding = str(row[0]) if row else ""
    if encoding.upper() in _ANY_SCRIPT_ENCODINGS:
        return None
    return ConfigError(
        "SOKRATOS_DATABASE_URL",
        f"names a database in {encoding}, which cannot store text in other scripts (a"
        " Japanese subject, an emoji): the worker needs a UTF8 database (CREATE DATABASE ..."
        " ENCODING 'UTF8' TEMPLATE template0, then 'sokratos-worker migrate' into it)",
    )


def apply_migrations(conninfo: str, on_progress: Progress = _nobody_listens) -> list[str]:
    """Apply what is pending; returns the names applied (empty when up to date).

    Up to date (the common start): read only, no lock taken, nothing waited for. Otherwise the
    advisory lock is waited for until it is granted (another migrator finishing first), with a
    ``migration_lock_waiting`` line naming the holder every LOCK_LOG_EVERY_S. ``on_progress``
    hears the same waits, and each migration as it starts, as one line each.
    """
    applied: list[str] = []
    # (after refuse_shared_sessions, in `run` and `migrate`: a role's statement_timeout must
    # not cancel a migration)
    with connect(conninfo, autocommit=True, worker_settings=True) as conn, translated():
        if (encoding := encoding_problem(conn)) is not None:
            raise encoding
        # Read only, so a worker role that may not create tables starts too.
        if not pending_migrations(conn):
            return []
        _wait_for_migration_lock(conn, on_progress)
        try:
            if not pending_migrations(conn):  # applied by whoever held the lock
                return []
            _create_history_table(conn)
            # An edited applied file is reported by history_differences(), on every path.
            done = {
                row[0] for row in conn.execute("SELECT version FROM sokratos_worker_migrations")
            }
            migrations = load_migrations()
            pending = sum(1 for m in migrations if m.version not in done)
            for migration in migrations:
                if migration.version in done:
                    continue
                on_progress(
                    f"applying migration {migration.name} ({len(applied) + 1} of {pending})"
                )
                _apply_one(conn, migration, on_progress)
                applied.append(migration.name)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_LOCK_KEY,))
    if applied:
        log.info("migrations_applied", migrations=applied)
    return applied


def _wait_for_migration_lock(conn: psycopg.Connection, on_progress: Progress) -> None:
    """Take the migrators' advisory lock, waiting as long as it takes, and saying so."""
    started = time.monotonic()
    next_log = started
    while True:
        row = conn.execute("SELECT pg_try_advisory_lock(%s)", (_LOCK_KEY,)).fetchone()
        if row is not None and row[0]:
            if next_log > started:  # a wait was logged: say that it ended
                log.info("migration_lock_taken", waited_s=round(time.monotonic() - started, 1))
            return
        now = time.monotonic()
        if now >= next_log:
            holders = _migration_lock_holders(conn)
            on_progress(
                f"waiting for the migration lock held by {_named(holders)},"
                f" {round(now - started)} s so far"
            )
            log.warning(
                "migration_lock_waiting",
                waiting_s=round(now - started),
                held_by=holders,
                hint="migrations are pending and another session applies them (another"
                " 'sokratos-worker migrate', or a worker starting); this one waits for it."
                " If that session is stuck (a migration waiting for a table lock, or a"
                " session left open), end it: SELECT pg_terminate_backend(PID)",
            )
            next_log = now + LOCK_LOG_EVERY_S
        time.sleep(LOCK_POLL_S)


def _migration_lock_holders(conn: psycopg.Connection) -> list[dict[str, Any]]:
    """The sessions holding the migrators' advisory lock in this database (pid, application…)."""
    rows = conn.execute(
        f"""SELECT l.pid, {SESSION_COLUMNS}
              FROM pg_locks l
              LEFT JOIN pg_stat_activity a ON a.pid = l.pid
             WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
               AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
               AND (l.classid::int8 << 32) | l.objid::int8 = %s
             ORDER BY l.pid""",
        (_LOCK_KEY,),
    ).fetchall()
    return [session(r) for r in rows]


def _named(holders: list[dict[str, Any]]) -> str:
    """``pid 4242 (sokratos-worker)``: who holds a lock, short enough for a status line."""
    if not holders:
        return "another session"  # it let go between the try and the look
    return ", ".join(
        f"pid {h['pid']} ({h['application'] or 'no application name'})" for h in holders
    )


def pending_migrations(conn: psycopg.Connection) -> list[str]:
    """The migrations this version has that the database has not recorded, in order.

    Raises ConfigError when the worker's tables exist only in schemas this session's
    ``search_path`` does not reach: migrating would build a second, empty set of queues
    that no producer sees, and "run migrate" would be the wrong advice.
    """
    table = conn.execute("SELECT to_regclass('sokratos_worker_migrations')").fetchone()
    done: set[int] = set()
    if table is not None and table[0] is not None:
        done = {row[0] for row in conn.execute("SELECT version FROM sokratos_worker_migrations")}
    else:
        _refuse_tables_out_of_reach(conn)
    return [m.name for m in load_migrations() if m.version not in done]


def _refuse_tables_out_of_reach(conn: psycopg.Connection) -> None:
    """ConfigError naming the schemas (this role may use) holding the worker's tables, if any;
    a schema the role may not use is another deployment's, not a missed search_path."""
    rows = conn.execute(
        """SELECT n.nspname, current_setting('search_path'), current_user, current_database(),
                  current_schema()
           FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
           WHERE c.relname = 'sokratos_worker_migrations' AND c.relkind IN ('r', 'p')
             AND has_schema_privilege(n.oid, 'USAGE')
             -- one the path reaches was created meanwhile (another migrator committed)
             AND n.nspname <> ALL (current_schemas(true))
           ORDER BY n.nspname"""
    ).fetchall()
    if not rows:
        return
    schemas = [str(r[0]) for r in rows]
    search_path, role, database, here = rows[0][1], rows[0][2], rows[0][3], rows[0][4]
    found = schemas[0]
    # (public too, where the vector extension usually lives)
    wanted = found if found == "public" else f"{found}, public"
    separate = (
        f"; or, for a separate deployment in schema {here} on purpose, create its history"
        f" table first: CREATE TABLE {here}.sokratos_worker_migrations"
        f" (LIKE {found}.sokratos_worker_migrations INCLUDING ALL), then migrate"
        if here
        else ""
    )
    raise ConfigError(
        "search_path",
        f"is {search_path!r} for role {role}, which does not reach the worker's tables in"
        f" schema {', '.join(schemas)}: if those are the queues producers use, set it with"
        f" ALTER ROLE {role} IN DATABASE {database} SET search_path = {wanted} (or add"
        f" options=-csearch_path%3D{found} to SOKRATOS_DATABASE_URL){separate}. Nothing was"
        " migrated: that would have built a second, empty set of queues no producer sees",
    )


# Applied migrations whose file was edited afterwards in its comments only: the checksums of
# their earlier texts, which run the same statements. Without them every migrate, check and
# start of a database migrated before the edit warned of a changed migration, for good.
SAME_STATEMENTS: dict[int, frozenset[str]] = {
    # 0045 as 17d582c (2026-12-05) applied it; ce9841e reworded its comments.
    45: frozenset({"1e8425090d7872f1148617c4fb5deeba4fe040c265516bf1cee1379c2c1b1b9f"}),
}


def history_differences(conn: psycopg.Connection) -> list[str]:
    """Where the recorded history disagrees with this version's files, one sentence each:
    migrations only a newer worker has (a rolling upgrade, or this code rolled back) and
    applied migrations whose file changed since. Warnings, never refusals: during a rolling
    upgrade the older workers keep running against the newer schema."""
    table = conn.execute("SELECT to_regclass('sokratos_worker_migrations')").fetchone()
    if table is None or table[0] is None:
        return []
    recorded = conn.execute(
        "SELECT version, name, checksum FROM sokratos_worker_migrations ORDER BY version"
    ).fetchall()
    files = {m.version: m for m in load_migrations()}
    unknown = [str(name) for version, name, _ in recorded if version not in files]
    # The number reused by another migration (a build from another branch), not an edit.
    other = [
        f"{name} (this version's {files[version].name})"
        for version, name, _ in recorded
        if version in files and name != files[version].name
    ]
    edited = [
        files[version].name
        for version, name, checksum in recorded
        if version in files
        and name == files[version].name
        and files[version].checksum != checksum
        and checksum not in SAME_STATEMENTS.get(version, frozenset())
    ]
    differences = []
    if unknown:
        differences.append(
            f"the database has migrations this version does not know: {', '.join(unknown)}"
            " (a newer sokratos-worker applied them; upgrade this one)"
        )
    if other:
        differences.append(
            f"applied migrations that are not this version's under their number: {', '.join(other)}"
            " (a build from another branch applied them; the database keeps what it applied:"
            " compare the two files, and apply what this version's adds by hand)"
        )
    if edited:
        differences.append(
            f"applied migrations whose file changed since: {', '.join(edited)} (not re-run;"
            " the database keeps what was applied then)"
        )
    return differences


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
        raise MigrationRefused(
            f"migrations are pending and the role {user!r} may not apply them:"
            f" {str(exc).splitlines()[0]}. Run 'sokratos-worker migrate' as the role that owns"
            f" the tables (not {user!r}), then start the worker again;"
            " SOKRATOS_MIGRATE_ON_START=false or 'run --no-migrate' would not help: no worker"
            f" runs on a database that lacks migrations ({UPGRADING})."
        ) from exc


def _apply_one(conn: psycopg.Connection, migration: Migration, on_progress: Progress) -> None:
    """Apply ``migration`` in one transaction, retried while its locks are not to be had."""
    started, delay = time.monotonic(), 1.0
    while not _applied_after_a_create_race(conn, migration):
        holders = _long_lock_holders(conn)
        on_progress(f"migration {migration.name} waits for tables held by {_named(holders)}")
        log.warning(
            "migration_waiting_for_lock",
            migration=migration.name,
            waiting_s=round(time.monotonic() - started),
            retry_in_s=delay,
            held_by=holders,
            hint="another session holds a table this migration changes (a long transaction?);"
            " it is not waited for in the lock queue, so the workers keep claiming; to end"
            " that session: SELECT pg_terminate_backend(PID)",
        )
        time.sleep(delay)
        delay = min(delay * 2, RETRY_MAX_S)


def _long_lock_holders(conn: psycopg.Connection) -> list[dict[str, Any]]:
    """Other sessions holding locks on this database's tables in transactions over 1 s old."""
    rows = conn.execute(
        f"""SELECT l.pid, {SESSION_COLUMNS}, string_agg(DISTINCT c.relname, ', ')
              FROM pg_locks l
              JOIN pg_class c ON c.oid = l.relation
              JOIN pg_stat_activity a ON a.pid = l.pid
             WHERE l.granted AND l.pid <> pg_backend_pid()
               AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
               AND c.relnamespace NOT IN ('pg_catalog'::regnamespace,
                                          'information_schema'::regnamespace)
               AND a.xact_start < now() - interval '1 second'
             GROUP BY 1, 2, 3, 4, 5, 6 ORDER BY 5 DESC NULLS LAST LIMIT 5"""
    ).fetchall()
    return [{**session(r), "tables": str(r[6])} for r in rows]


def _applied_after_a_create_race(conn: psycopg.Connection, migration: Migration) -> bool:
    """As _applied_within_lock_timeout, tried again at once when another session created one
    of its objects meanwhile (Sokratos starting on the same fresh database): IF NOT EXISTS
    does not wait for a creation in flight, so the catalog's unique index refused ours."""
    tries = 1
    while True:
        try:
            return _applied_within_lock_timeout(conn, migration)
        except psycopg.errors.UniqueViolation as exc:
            if exc.diag.schema_name != "pg_catalog" or tries >= CREATE_RACE_TRIES:
                raise MigrationFailedForGood(_failed(migration, exc)) from exc
            tries += 1
            log.info(
                "migration_create_raced",
                migration=migration.name,
                error=exc.diag.message_primary,
                hint="another session created the same object at the same moment; tried again",
            )


def _applied_within_lock_timeout(conn: psycopg.Connection, migration: Migration) -> bool:
    """True once applied and recorded; False when a lock was not granted in time."""
    try:
        with conn.transaction():
            conn.execute(f"SET LOCAL lock_timeout = {LOCK_TIMEOUT_MS}")
            conn.execute(migration.sql.encode())
            conn.execute(
                "INSERT INTO sokratos_worker_migrations (version, name, checksum)"
                " VALUES (%s, %s, %s)",
                (migration.version, migration.name, migration.checksum),
            )
        return True
    except psycopg.errors.LockNotAvailable:
        return False
    except (
        psycopg.errors.FeatureNotSupported,
        psycopg.errors.UndefinedFile,
        psycopg.errors.InsufficientPrivilege,
    ) as exc:
        raise MigrationRefused(_explain(migration, exc)) from exc
    except psycopg.Error as exc:
        if is_transient(exc) or isinstance(exc, psycopg.errors.QueryCanceled):
            raise  # (not the migration's own failure: the command says what happened)
        if isinstance(exc, psycopg.errors.UniqueViolation):
            raise  # (the caller tells a creation race from a name taken for good)
        # Read as "the schema is missing", it sent the operator to run the migrate that failed.
        if (exc.sqlstate or "")[:2] in _FAILS_AGAIN:
            raise MigrationFailedForGood(_failed(migration, exc)) from exc  # (78: no restart loop)
        raise MigrationError(_failed(migration, exc)) from exc


CREATE_RACE_TRIES = 3

# SQLSTATE classes a migration's statements meet again at every try, whatever the moment:
# wrong data, a constraint, a name taken or missing, a dependent object, a program limit.
_FAILS_AGAIN = frozenset({"22", "23", "2B", "42", "54"})


def _failed(migration: Migration, exc: psycopg.Error) -> str:
    """What a migration the database refused half-way did, and what the operator does."""
    text = exc.diag.message_primary or str(exc).strip().splitlines()[0]
    return (
        f"migration {migration.name} failed ({exc.sqlstate}): {text}. It was rolled back:"
        " nothing of it is applied, the migrations before it stay applied. Fix what the error"
        " names (an object of the same name in its way, an adopted table of another shape:"
        f" compare with sql/{migration.name}.sql), then run 'sokratos-worker migrate' again"
        f" ({UPGRADING})."
    )


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
        f"migration {migration.name} failed: {text}. Run 'sokratos-worker migrate' as the role"
        f" that owns the tables ({UPGRADING})."
    )
