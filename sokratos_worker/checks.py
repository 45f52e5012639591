"""``sokratos-worker check``: configuration, database, backends, embeddings, mail."""

from __future__ import annotations

from dataclasses import dataclass

from sokratos_worker.command_database import database_url, unreachable_hint
from sokratos_worker.config import ConfigError, Settings, unknown_variables
from sokratos_worker.errors import DatabaseUnavailable, WorkerError
from sokratos_worker.model import CheckLine
from sokratos_worker.schema_check import embedding_mismatch, schema_problems
from sokratos_worker.store.connection import (
    READ_ONLY_SERVER,
    Connection,
    connect,
    is_read_only,
)
from sokratos_worker.store.migrations import encoding_problem, history_differences
from sokratos_worker.store.sessions import SessionsShared, shared_server_session


@dataclass(frozen=True)
class CheckReport:
    """The lines of ``check``; ``login_refused`` keeps a refused database login, which is a
    configuration error (exit 78, as for every command) rather than a failed check."""

    lines: list[CheckLine]
    login_refused: ConfigError | None = None


def run_checks(settings: Settings) -> CheckReport:
    """One line per check, in the order an operator would fix them.

    A database that cannot be used is one failed ``database`` line; the backends, the
    embedding model and the mailboxes are probed all the same.
    """
    unknown = unknown_variables(settings=settings)
    lines = [
        CheckLine("configuration", True, "valid")
        if not unknown
        else CheckLine(
            "configuration",
            False,
            f"unknown variables {', '.join(unknown)} (typos? every variable the worker reads is"
            " listed in deploy/sokratos-worker.env.example)",
        )
    ]
    refused: ConfigError | None = None
    try:
        _database_lines(settings, lines)
    except ConfigError as exc:  # DatabaseLoginRefused: the URL's user, password or database
        refused = exc
        lines.append(CheckLine("database", False, f"{exc.message} ({exc.variable})"))
    except DatabaseUnavailable as exc:
        lines.append(CheckLine("database", False, f"{exc}. {unreachable_hint(settings)}"))
    except WorkerError as exc:  # the embedded PostgreSQL could not start
        lines.append(CheckLine("database", False, str(exc)))
    lines.extend(_service_lines(settings))
    return CheckReport(lines, refused)


def _database_lines(settings: Settings, lines: list[CheckLine]) -> None:
    """The database, pgvector, connections and schema lines, appended as they are known."""
    with database_url(settings, wait=False) as url, connect(url) as conn:
        version = conn.execute("SHOW server_version").fetchone()
        if is_read_only(conn):
            raise DatabaseUnavailable(READ_ONLY_SERVER)
        vector = conn.execute(
            "SELECT extversion FROM pg_extension WHERE extname = 'vector'"
        ).fetchone()
        shown = f"PostgreSQL {version[0] if version else '?'}"
        encoding = encoding_problem(conn)  # (nothing can be migrated into such a database)
        if encoding is not None:
            lines.append(CheckLine("database", False, f"{shown}, but {encoding}"))
            return
        lines.append(CheckLine("database", True, shown))
        lines.append(
            CheckLine(
                "pgvector",
                vector is not None,
                f"version {vector[0]}" if vector else _pgvector_missing(settings, conn),
            )
        )
        lines.append(connections_line(settings, conn))
        lines.append(_sessions_line(url))
        if vector is not None:
            lines.append(_schema_line(settings, conn))


def _schema_line(settings: Settings, conn: Connection) -> CheckLine:
    """What would make ``run`` refuse, or else the warnings: a newer or edited migration
    history, memories the configured embedding model cannot compare with."""
    problems = schema_problems(settings, conn)
    if problems:
        # The line is already labelled "schema": a problem of that name is not prefixed twice.
        return CheckLine(
            "schema",
            False,
            "; ".join(p.message if p.variable == "schema" else str(p) for p in problems),
        )
    unreachable = embedding_mismatch(settings, conn)
    summary = (
        f"migrations applied; warning: {unreachable}"
        if unreachable
        else "migrations applied, fits the embedding configuration"
    )
    return CheckLine("schema", True, "; ".join([summary, *history_differences(conn)]))


def _service_lines(settings: Settings) -> list[CheckLine]:
    """The LLM backends, the embedding model and the mailboxes."""
    lines: list[CheckLine] = []
    if not settings.llm_backends and not settings.local_model:
        lines.append(
            CheckLine(
                "llm_backends",
                False,
                "none configured (SOKRATOS_LLM_BACKENDS): items wait in their queues",
            )
        )
        if settings.embeddings_enabled:  # probed with the backends otherwise
            from sokratos_worker.llm.probe import probe_embeddings  # noqa: PLC0415

            lines.append(probe_embeddings(settings))
    else:
        from sokratos_worker.llm.probe import probe_backends  # noqa: PLC0415

        lines.extend(probe_backends(settings))
    if not settings.embeddings_enabled:
        lines.append(
            CheckLine(
                "embeddings",
                True,
                "not configured: memories saved without embeddings,"
                " no coverage note or contradiction check",
            )
        )
    if settings.email_accounts and settings.email_check_interval <= 0:
        lines.extend(_email_checks_off(settings))
    elif settings.email_accounts:
        from sokratos_worker.email.check import probe_accounts  # noqa: PLC0415

        lines.extend(probe_accounts(settings))
    return lines


def _email_checks_off(settings: Settings) -> list[CheckLine]:
    """The accounts the worker never logs in to: an unreachable one is no failure then."""
    return [
        CheckLine(
            f"email account {account.name}",
            True,
            "not checked: SOKRATOS_EMAIL_CHECK_INTERVAL is 0, so the worker reads no mail (set"
            " an interval to turn email checks on; 'check' then logs in to the account)",
        )
        for account in settings.email_accounts
    ]


def _sessions_line(url: str) -> CheckLine:
    """Whether each connection gets its own server session (no transaction pooler)."""
    pid = shared_server_session(url)
    if pid is None:
        return CheckLine("sessions", True, "one server session per connection")
    return CheckLine("sessions", False, SessionsShared(pid).message)


def connections_line(settings: Settings, conn: Connection) -> CheckLine:
    """Whether the server, the role and the database allow a worker's whole pool."""
    row = conn.execute(
        """SELECT current_setting('max_connections')::int
                  - current_setting('superuser_reserved_connections')::int
                  - coalesce(current_setting('reserved_connections', true)::int, 0),
                  -- Neither limit holds a superuser back.
                  (SELECT CASE WHEN rolsuper THEN -1 ELSE rolconnlimit END
                   FROM pg_roles WHERE rolname = current_user),
                  (SELECT CASE WHEN (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
                               THEN -1 ELSE datconnlimit END
                   FROM pg_database WHERE datname = current_database()),
                  -- Other roles' sessions show a NULL backend_type without pg_read_all_stats.
                  (SELECT CASE WHEN bool_or(backend_type IS NULL) THEN NULL
                               ELSE count(*) FILTER (WHERE backend_type = 'client backend'
                                                     AND pid <> pg_backend_pid()) END
                   FROM pg_stat_activity),
                  current_user, current_database()"""
    ).fetchone()
    assert row is not None  # noqa: S101 - a SELECT without FROM returns one row
    server, role_limit, database_limit, in_use, role, database = row
    need = settings.connections_needed
    limits = [(f"max_connections (less reserved) is {server}", int(server))]
    if role_limit >= 0:
        limits.append((f"role {role} has CONNECTION LIMIT {role_limit}", int(role_limit)))
    if database_limit >= 0:
        limits.append(
            (f"database {database} has CONNECTION LIMIT {database_limit}", database_limit)
        )
    mail = " + 1 for email" if settings.email_accounts else ""
    wants = (
        f"a worker opens up to {need} (SOKRATOS_CONCURRENCY {settings.concurrency} + 4"
        f" + 1 for LISTEN{mail})"
    )
    short = [text for text, limit in limits if limit < need]
    if short:
        return CheckLine(
            "connections",
            False,
            f"{wants} but {'; '.join(short)}: lower SOKRATOS_CONCURRENCY or raise the limit"
            " (a worker short of connections runs, but far slower)",
        )
    now = (
        f"{in_use} in use now"
        if in_use is not None
        else "in use now: unknown to this role (it may not see other roles' sessions)"
    )
    return CheckLine("connections", True, f"{wants}; {limits[0][0]}, {now}")


def _pgvector_missing(settings: Settings, conn: Connection) -> str:
    """What to do when the database has no ``vector`` extension, by who can create it."""
    offered = conn.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'").fetchone()
    if offered is None:
        return "not installed on this server: install pgvector (docs/production.md)"
    if settings.uses_embedded_postgres:
        return "not created yet: 'sokratos-worker migrate' (or 'run') creates it"
    return (
        "not created in this database: 'sokratos-worker migrate' creates it when its role is"
        " allowed to, else a superuser runs 'CREATE EXTENSION vector;' first (docs/production.md)"
    )
